"""POST /v1/completions"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from sse_starlette import EventSourceResponse

from app.prompting import text_prompt_ids
from app.protocol import Completion, CompletionRequest
from app.state import ServerState, get_state
from app.streaming import Generation, event_stream

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def create_completion(
    body: CompletionRequest, state: ServerState = Depends(get_state)
) -> EventSourceResponse | Completion:
    state.check_model(body.model)
    prompt_ids = text_prompt_ids(state.loaded.tokenizer, body.single_prompt())
    params = body.to_sampling_params(len(prompt_ids), state.limits)
    generation = Generation.start(state.engine, "text", state.model_name, prompt_ids, params, body.include_usage)
    if not body.stream:
        return await generation.fold()
    events = state.streams.serve(generation, body.resumable)
    return event_stream(events, state.settings.keepalive_seconds)
