"""GET /health (200 while the engine serves, 503 otherwise) and the opt-in fault-injection hook."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from app.state import ServerState, get_state

router = APIRouter()
debug_router = APIRouter()


@router.get("/health")
async def health(state: ServerState = Depends(get_state)) -> JSONResponse:
    stats = state.engine.stats
    alive = state.engine.alive
    body = {
        "status": "ok" if alive else "unavailable",
        "model": state.model_name,
        "kv_blocks_used": stats.kv_blocks_used,
        "kv_blocks_total": stats.kv_blocks_total,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "num_paused": stats.num_paused,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "kv_blocks_cached": stats.kv_blocks_cached,
        "prefix_cache_query_tokens": stats.num_prefix_query_tokens,
        "prefix_cache_hit_tokens": stats.num_prefix_hit_tokens,
        "prefix_cache_hit_rate": round(stats.num_prefix_hit_tokens / max(1, stats.num_prefix_query_tokens), 4),
    }
    return JSONResponse(body, status_code=200 if alive else 503)


@debug_router.post("/debug/fault")
async def inject_fault(state: ServerState = Depends(get_state)) -> dict:
    state.engine.inject_fault()
    return {"injected": True}
