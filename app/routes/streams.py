"""GET /v1/streams/{id} (resume a resumable stream after Last-Event-ID) and DELETE (cancel any stream)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Header
from sse_starlette import EventSourceResponse

from app.errors import OpenAIError
from app.operations.admission import require_api_key
from app.serving.sse import STREAMED_200, event_stream
from app.state import ServerState, get_state

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get("/v1/streams/{completion_id}", response_model=None, responses=STREAMED_200)
async def resume_stream(
    completion_id: str,
    state: ServerState = Depends(get_state),
    last_event_id: str | None = Header(None),
) -> EventSourceResponse:
    stream = state.streams.resumable(completion_id)
    if stream is None:
        raise OpenAIError(
            404,
            f"No resumable stream `{completion_id}`: it was never resumable, was deleted, or its resume window passed.",
            param="completion_id",
            code="stream_not_found",
        )
    try:
        after = int(last_event_id or 0)
    except ValueError:
        after = -1
    if not 0 <= after <= stream.num_events:
        raise OpenAIError(
            400,
            f"Last-Event-ID must be an event id between 0 and {stream.num_events}, got {last_event_id!r}",
            param="Last-Event-ID",
        )
    if stream.renderer.accounting is not None:
        stream.renderer.accounting.resumed()
    return event_stream(stream.subscribe(after), state.settings.keepalive_seconds)


@router.delete("/v1/streams/{completion_id}")
async def cancel_stream(completion_id: str, state: ServerState = Depends(get_state)) -> dict:
    if not state.streams.cancel(completion_id):
        raise OpenAIError(404, f"No live stream `{completion_id}`.", param="completion_id", code="stream_not_found")
    return {"id": completion_id, "object": "stream", "deleted": True}
