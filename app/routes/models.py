"""GET /v1/models"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from app.operations.admission import require_api_key
from app.serving.payloads import ModelCard, ModelList
from app.state import ServerState, get_state

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get("/v1/models")
async def list_models(state: ServerState = Depends(get_state)) -> ModelList:
    return ModelList(data=[ModelCard(id=state.model_name, max_model_len=state.limits.max_model_len)])
