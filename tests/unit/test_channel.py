"""StreamChannel's write-through: what a reader may take itself, and when, without reordering anything."""

import asyncio

from engine.channel import Outbox, StreamChannel
from engine.types import Chunk, FinishReason


def chunk(token: int, finish: FinishReason | None = None) -> Chunk:
    return Chunk(token_ids=(token,), text=f"<{token}>", finish_reason=finish)


class Taker:
    """A write-through that takes non-terminal chunks while `open`, as PlainStream does while its
    connection is writable, and records what it was offered."""

    def __init__(self) -> None:
        self.open = True
        self.offered: list[int] = []
        self.taken: list[int] = []

    def __call__(self, c: Chunk) -> bool:
        self.offered.append(c.token_ids[0])
        if not self.open or c.is_terminal:
            return False
        self.taken.append(c.token_ids[0])
        return True


async def read_all(channel: StreamChannel) -> list[Chunk]:
    return [c async for c in channel]


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_write_through_takes_chunks_only_while_the_reader_waits_with_nothing_pending():
    channel = StreamChannel(asyncio.get_running_loop())
    taker = Taker()
    channel.write_through = taker
    reader = asyncio.create_task(read_all(channel))
    await settle()

    for token in (1, 2):
        channel.accept(chunk(token))
        channel.deliver(chunk(token))
    assert taker.taken == [1, 2] and channel.read_tokens == 2 and channel.unread_tokens == 0

    # Refused: the reader is woken with it, and what comes before it runs is never offered, so a
    # chunk taken later cannot overtake the refused one.
    taker.open = False
    for token in (3, 4):
        channel.accept(chunk(token))
        channel.deliver(chunk(token))
    assert taker.offered == [1, 2, 3]
    await settle()

    # The reader has taken 3 and 4 and waits again: the next chunk may go through.
    taker.open = True
    channel.accept(chunk(5))
    channel.deliver(chunk(5))
    channel.accept(chunk(6, FinishReason.LENGTH))
    channel.deliver(chunk(6, FinishReason.LENGTH))
    read = await reader
    assert taker.taken == [1, 2, 5]
    assert [c.token_ids for c in read] == [(3, 4), (6,)] and read[-1].is_terminal
    assert channel.read_tokens == 6 and channel.unread_tokens == 0


async def test_a_step_delivered_through_the_outbox_keeps_each_streams_order():
    loop = asyncio.get_running_loop()
    channels = [StreamChannel(loop) for _ in range(3)]
    takers = [Taker() for _ in channels]
    for channel, taker in zip(channels, takers):
        channel.write_through = taker
    takers[1].open = False
    readers = [asyncio.create_task(read_all(c)) for c in channels]
    await settle()
    outbox = Outbox()
    for step in range(4):
        finish = FinishReason.STOP if step == 3 else None
        for channel in channels:
            outbox.stage(channel, chunk(step, finish))
        outbox.flush()
        await settle()
    results = await asyncio.gather(*readers)
    assert [t.taken for t in takers] == [[0, 1, 2], [], [0, 1, 2]]
    assert [[c.token_ids for c in r] for r in results] == [[(3,)], [(0,), (1,), (2,), (3,)], [(3,)]]


async def test_a_lagging_reader_gets_one_chunk_per_choice_but_no_reasoning_behind_text():
    """A chunk shows its reasoning before its text, so merging a reasoning that came after text (a harmony
    analysis after a preamble) into that text's chunk would reorder them: the merge starts again there."""
    channel = StreamChannel(asyncio.get_running_loop(), num_choices=2)
    delivered = [
        Chunk((1,), "", reasoning="think "),
        Chunk((2,), "pre"),
        Chunk((9,), "other", index=1, finish_reason=FinishReason.LENGTH),
        Chunk((3,), "amble"),
        Chunk((4,), "", reasoning="again"),
        Chunk((5,), "answer", reasoning="!", finish_reason=FinishReason.STOP),
    ]
    for c in delivered:
        channel.accept(c)
        channel.deliver(c)
    read = await read_all(channel)
    assert [(c.index, c.token_ids, c.reasoning, c.text, c.is_terminal) for c in read] == [
        (0, (1, 2, 3), "think ", "preamble", False),
        (0, (4, 5), "again!", "answer", True),
        (1, (9,), "", "other", True),
    ]
