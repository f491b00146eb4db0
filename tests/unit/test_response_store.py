"""The store of responses: retention, deletion, and the pins it releases."""

import asyncio
from types import SimpleNamespace

from app.serving.responses import ResponseStore


class _Run:
    """What the store needs of a response: an id, whether it is stored, a run that ends."""

    def __init__(self, response_id: str, store: bool = True) -> None:
        self.id = response_id
        self.response = SimpleNamespace(store=store)
        self.done = False
        self.cancelled = False

    async def run(self) -> None:
        self.done = True

    def cancel(self) -> None:
        self.cancelled = True


async def test_stored_responses_expire_after_the_retention_and_release_their_pins():
    unpinned = []
    store = ResponseStore(retention_seconds=0.2, unpin=unpinned.append)
    first, second = _Run("resp_a"), _Run("resp_b")
    store.start(first)
    store.start(second)
    await asyncio.sleep(0)
    assert store.get("resp_a") is first and store.get("resp_b") is second
    await asyncio.sleep(0.3)
    assert store.get("resp_a") is None and store.get("resp_b") is None
    assert unpinned == ["resp_a", "resp_b"]


async def test_delete_cancels_and_releases_and_unstored_responses_leave_when_done():
    unpinned = []
    store = ResponseStore(retention_seconds=60, unpin=unpinned.append)
    kept, passing = _Run("resp_kept"), _Run("resp_passing", store=False)
    store.start(kept)
    store.start(passing)
    assert store.get("resp_passing") is passing  # while it runs, it can be cancelled
    await asyncio.sleep(0.01)
    assert store.get("resp_passing") is None
    assert store.delete("resp_kept") and kept.cancelled and unpinned == ["resp_kept"]
    assert not store.delete("resp_kept")
