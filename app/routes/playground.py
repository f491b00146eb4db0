"""GET /: the playground, one static page that chats with the served model through /v1/responses."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()

_PAGE = Path(__file__).resolve().parent.parent / "static" / "playground.html"


@cache
def _page() -> str:
    return _PAGE.read_text(encoding="utf-8")


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def playground() -> HTMLResponse:
    return HTMLResponse(_page(), headers={"Cache-Control": "no-cache"})
