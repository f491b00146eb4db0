"""POST /v1/completions"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from sse_starlette import EventSourceResponse

from app.operations.admission import admit, require_api_key
from app.serving.payloads import Completion
from app.serving.prompting import text_prompt_ids
from app.serving.protocol import CompletionRequest
from app.serving.sse import STREAMED_200, event_stream
from app.serving.streaming import CompletionRenderer
from app.state import ServerState, get_state

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/completions", response_model=None, responses=STREAMED_200, dependencies=[Depends(admit)])
async def create_completion(
    body: CompletionRequest, request: Request, state: ServerState = Depends(get_state)
) -> EventSourceResponse | Completion:
    state.check_model(body.model)
    prompt = body.single_prompt()
    prompt_ids = text_prompt_ids(state.loaded.tokenizer, prompt)
    grammar = await state.output_grammar(body.grammar())
    params = body.to_sampling_params(len(prompt_ids), state.limits, grammar)
    accounting = state.accounting_for(
        request, "/v1/completions", body.stream, len(prompt_ids), params.n, lambda: prompt
    )
    renderer = CompletionRenderer.start(
        state.engine,
        "text",
        state.model_name,
        state.new_id("cmpl-"),
        prompt_ids,
        params,
        body.include_usage,
        accounting,
    )
    if not body.stream:
        return await renderer.fold()
    events = state.streams.serve(renderer, body.resumable)
    return event_stream(events, state.settings.keepalive_seconds)
