"""POST /v1/chat/completions"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from sse_starlette import EventSourceResponse

from app.operations.admission import admit, require_api_key
from app.serving.image_prompt import image_parts
from app.serving.payloads import ChatCompletion
from app.serving.protocol import ChatCompletionRequest
from app.serving.sse import STREAMED_200, event_stream
from app.serving.streaming import CompletionRenderer
from app.state import ServerState, get_state

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/chat/completions", response_model=None, responses=STREAMED_200, dependencies=[Depends(admit)])
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, state: ServerState = Depends(get_state)
) -> EventSourceResponse | ChatCompletion:
    state.check_model(body.model)
    tool_use = body.tool_use()
    prompt_ids, images = await state.chat_prompt(
        body.messages, tool_use, body.chat_template_kwargs, image_parts(body.messages)
    )
    grammar = await state.output_grammar(body.grammar(), tool_use)
    reasoning = state.reasoning_for(prompt_ids)
    params = body.to_sampling_params(len(prompt_ids), state.limits, grammar, reasoning)
    accounting = state.accounting_for(
        request,
        "/v1/chat/completions",
        body.stream,
        len(prompt_ids),
        params.n,
        lambda: [m.model_dump(exclude_none=True) for m in body.messages],
    )
    renderer = CompletionRenderer.start(
        state.engine,
        "chat",
        state.model_name,
        state.new_id("chatcmpl-"),
        prompt_ids,
        params,
        body.include_usage,
        accounting,
        parser=state.output_format.parser(tool_use),
        splits_reasoning=reasoning is not None,
        images=images,
    )
    if not body.stream:
        return await renderer.fold()
    events = state.streams.serve(renderer, body.resumable)
    return event_stream(events, state.settings.keepalive_seconds)
