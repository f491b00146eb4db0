"""POST /v1/responses, GET / DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel"""

from __future__ import annotations

import time
from dataclasses import replace

from fastapi import APIRouter, Depends, Query, Request
from sse_starlette import EventSourceResponse

from app.errors import OpenAIError
from app.operations.admission import admit, require_api_key
from app.serving.image_prompt import image_parts
from app.serving.prompting import continuation_ids
from app.serving.responses import Conversation, ResponseRun
from app.serving.responses_protocol import DeletedResponse, NamedFunctionChoice, ResponseObject, ResponsesRequest
from app.serving.sse import STREAMED_200, event_stream
from app.serving.streaming import CompletionRenderer
from app.state import ServerState, get_state
from engine.images import ImageInput

router = APIRouter(dependencies=[Depends(require_api_key)])


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"Response with id '{response_id}' not found: it was never stored, was deleted, or has expired.",
        param="response_id",
        code="response_not_found",
    )


@router.post("/v1/responses", response_model=None, responses=STREAMED_200, dependencies=[Depends(admit)])
async def create_response(
    body: ResponsesRequest, request: Request, state: ServerState = Depends(get_state)
) -> EventSourceResponse | ResponseObject:
    state.check_model(body.model)
    body.check()
    tool_use = body.tool_use()
    conversation, images = await _conversation(body, state, tool_use)
    grammar = await state.output_grammar(body.grammar(), tool_use)
    response_id = state.new_id("resp_")
    reasoning = state.reasoning_for(conversation.prompt_ids)
    params = body.to_sampling_params(len(conversation.prompt_ids), state.limits, grammar, reasoning)
    params = replace(params, keep_kv_as=response_id if body.store else None, continues=body.previous_response_id)
    accounting = state.accounting_for(
        request,
        "/v1/responses",
        body.stream,
        len(conversation.prompt_ids),
        1,
        lambda: [m.model_dump(exclude_none=True) for m in conversation.messages],
    )
    renderer = CompletionRenderer.start(
        state.engine,
        "chat",
        state.model_name,
        response_id,
        conversation.prompt_ids,
        params,
        include_usage=False,
        accounting=accounting,
        images=images,
    )
    response = ResponseObject(
        id=response_id,
        created_at=int(time.time()),
        status="in_progress",
        model=state.model_name,
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        previous_response_id=body.previous_response_id,
        store=body.store,
        metadata=body.metadata or {},
        text=body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {"format": {"type": "text"}},
        tools=[t.model_dump(exclude_none=True) for t in body.tools or []],
        tool_choice=(
            body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunctionChoice) else body.tool_choice
        )
        or "auto",
        parallel_tool_calls=body.parallel_tool_calls,
    )
    parser = state.output_format.parser(tool_use)
    run = ResponseRun(response, renderer.channel, renderer.accounting, conversation, parser() if parser else None)
    state.responses.start(run)
    if not body.stream:
        return await run.wait()
    return event_stream(_events(run, after=-1, cancel_on_leave=not body.store), state.settings.keepalive_seconds)


async def _conversation(
    body: ResponsesRequest, state: ServerState, tool_use
) -> tuple[Conversation, tuple[ImageInput, ...]]:
    """The turn's messages, prompt ids and images: a new conversation, or one continued from a stored response
    (its own token ids plus the new input when the template allows and it has no images, else the whole
    history re-rendered, its images read again)."""
    tokenizer = state.loaded.tokenizer
    instructions = body.instruction_messages()
    new = body.input_messages()
    parts = body.image_parts()
    if body.previous_response_id is None:
        prompt_ids, images = await state.chat_prompt([*instructions, *new], tool_use, None, parts)
        return Conversation(body.instructions, tool_use, new, prompt_ids), images
    previous = state.responses.get(body.previous_response_id)
    if previous is None or not previous.response.store:
        raise _not_found(body.previous_response_id)
    if not previous.done:
        raise OpenAIError(400, "previous_response_id names a response still in progress", param="previous_response_id")
    earlier = previous.conversation
    history = earlier.with_reply()
    # Images the earlier turns sent are read again, named by the response that holds them.
    parts = [replace(part, param="previous_response_id") for part in image_parts(history)] + parts
    if earlier.instructions == body.instructions and earlier.tool_use == tool_use and not parts:
        prompt_ids = continuation_ids(
            tokenizer, earlier.prompt_ids, earlier.output_ids, [*instructions, *history], new, tool_use
        )
        if prompt_ids is not None:
            return Conversation(body.instructions, tool_use, [*history, *new], prompt_ids), ()
    prompt_ids, images = await state.chat_prompt([*instructions, *history, *new], tool_use, None, parts)
    return Conversation(body.instructions, tool_use, [*history, *new], prompt_ids), images


async def _events(run: ResponseRun, after: int, cancel_on_leave: bool):
    try:
        async for event in run.events(after):
            yield event
    finally:
        if cancel_on_leave and not run.done:
            run.cancel()


@router.get("/v1/responses/{response_id}", response_model=None, responses=STREAMED_200)
async def get_response(
    response_id: str,
    state: ServerState = Depends(get_state),
    stream: bool = False,
    starting_after: int | None = Query(None, ge=-1),
) -> EventSourceResponse | ResponseObject:
    run = state.responses.get(response_id)
    if run is None or not run.response.store:
        raise _not_found(response_id)
    if not stream:
        return run.response
    after = -1 if starting_after is None else starting_after
    if after >= run.num_events and run.done:
        raise OpenAIError(
            400,
            f"starting_after must be below {run.num_events}, the number of events of this response",
            param="starting_after",
        )
    return event_stream(_events(run, after, cancel_on_leave=False), state.settings.keepalive_seconds)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, state: ServerState = Depends(get_state)) -> DeletedResponse:
    if not state.responses.delete(response_id):
        raise _not_found(response_id)
    return DeletedResponse(id=response_id)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, state: ServerState = Depends(get_state)) -> ResponseObject:
    """Stop a response in progress (its KV is freed at the engine's next step); a finished one is
    returned as it is."""
    run = state.responses.get(response_id)
    if run is None:
        raise _not_found(response_id)
    run.cancel()
    return await run.wait()
