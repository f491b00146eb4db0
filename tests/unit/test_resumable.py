"""ResumableStream's life in the registry, without a server: the resume window counts from the start,
and a finished stream stays for a window after its last reader leaves."""

import asyncio

from app.serving.resumable import StreamRegistry
from tests.unit.test_plain_stream import events, renderer, text_chunks


async def test_a_stream_whose_response_never_read_it_expires_and_is_cancelled():
    registry = StreamRegistry(window_seconds=0.05)
    made = renderer(asyncio.get_running_loop())
    unread = registry.serve(made, resumable=True)
    assert registry.resumable(made.completion_id) is not None
    await asyncio.sleep(0.1)
    assert registry.resumable(made.completion_id) is None
    assert made.channel.cancelled
    await unread.aclose()


async def test_a_finished_stream_stays_for_the_window_after_its_last_reader_leaves():
    registry = StreamRegistry(window_seconds=0.3)
    made = renderer(asyncio.get_running_loop())
    first_read = registry.serve(made, resumable=True)
    for chunk in text_chunks(3):
        made.channel.accept(chunk)
        made.channel.deliver(chunk)
    received = [event async for event in first_read]
    assert events(received)[-1].data == "[DONE]"
    # The reader had every event written to it; it may not have received them all.
    await asyncio.sleep(0.15)
    stream = registry.resumable(made.completion_id)
    assert stream is not None and stream.finished
    assert [event async for event in stream.subscribe(after=2)] == received[2:]
    # The window counts again from that reader's leaving.
    await asyncio.sleep(0.15)
    assert registry.resumable(made.completion_id) is stream
    await asyncio.sleep(0.3)
    assert registry.resumable(made.completion_id) is None
