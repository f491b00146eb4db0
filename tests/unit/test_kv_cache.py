import pytest

from engine.kv_cache import BlockManager
from tests.unit.helpers import make_request


def test_allocate_grows_block_table_to_cover_tokens():
    manager = BlockManager(num_blocks=10, block_size=4)
    request = make_request(prompt_len=9)
    assert manager.num_blocks_needed(request, 9) == 3
    manager.allocate(request, 9)
    assert len(request.block_table) == 3
    assert manager.num_free == 7 and manager.num_used == 3
    request.num_computed_tokens = 9
    assert manager.num_blocks_needed(request, 3) == 0
    assert manager.num_blocks_needed(request, 4) == 1
    manager.check_integrity([request])


def test_deallocate_returns_every_block():
    manager = BlockManager(num_blocks=8, block_size=2)
    a, b = make_request(5), make_request(3)
    manager.allocate(a, 5)
    manager.allocate(b, 3)
    assert manager.num_used == 5
    manager.deallocate(a)
    assert manager.num_used == 2 and not a.block_table
    manager.deallocate(b)
    assert manager.num_free == manager.num_blocks
    manager.check_integrity([a, b])


def test_allocate_refuses_more_than_free():
    manager = BlockManager(num_blocks=2, block_size=4)
    request = make_request(9)
    assert not manager.can_allocate(manager.num_blocks_needed(request, 9))
    with pytest.raises(RuntimeError):
        manager.allocate(request, 9)
    assert manager.num_free == 2


def test_check_integrity_catches_a_lost_block():
    manager = BlockManager(num_blocks=4, block_size=4)
    request = make_request(4)
    manager.allocate(request, 4)
    del request.block_table[:]
    with pytest.raises(AssertionError):
        manager.check_integrity([request])


def computed(manager, request, num_tokens):
    """Pretend a forward computed the request's first `num_tokens` tokens."""
    manager.allocate(request, num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = num_tokens
    manager.register(request)


def test_a_second_prompt_adopts_the_full_blocks_of_a_shared_prefix():
    manager = BlockManager(num_blocks=10, block_size=4)
    first, second = make_request(10), make_request(11)
    computed(manager, first, 10)
    assert manager.num_cached == 2  # tokens 1-8; the last block is not full
    hits = manager.cached_prefix(second)
    assert hits == list(first.block_table[:2])
    manager.adopt_prefix(second, hits)
    assert second.num_computed_tokens == 8 and second.num_cached_tokens == 8
    assert manager.num_used == 3  # the two shared blocks are counted once
    manager.allocate(second, 3)
    manager.check_integrity([first, second])
    assert (manager.num_prefix_queries, manager.num_prefix_hits) == (11, 8)


def test_the_last_prompt_token_is_always_computed():
    manager = BlockManager(num_blocks=10, block_size=4)
    first, again = make_request(8), make_request(8)
    computed(manager, first, 8)
    assert manager.num_cached == 2
    # Both blocks match, but the second holds the token whose logits the step needs.
    assert len(manager.cached_prefix(again)) == 1


def test_a_different_earlier_token_means_no_hit():
    manager = BlockManager(num_blocks=10, block_size=4)
    first = make_request(12)
    computed(manager, first, 12)
    other = make_request(12)
    other.token_ids[0] = 99  # same tokens 2-12, different first block: the chain differs throughout
    assert manager.cached_prefix(other) == []


def test_released_blocks_stay_cached_until_handed_out_again():
    manager = BlockManager(num_blocks=4, block_size=4)
    first = make_request(9)
    computed(manager, first, 9)
    manager.deallocate(first)
    assert manager.num_used == 0 and manager.num_free == 4 and manager.num_cached == 2
    again = make_request(9)
    manager.adopt_prefix(again, manager.cached_prefix(again))
    assert again.num_computed_tokens == 8 and manager.num_free == 2
    manager.deallocate(again)
    # A stranger needing every block evicts the cached ones, least recently released first.
    stranger = make_request(16, first_token=100)
    manager.allocate(stranger, 16)
    assert manager.num_cached == 0 and manager.cached_prefix(make_request(9)) == []
    manager.check_integrity([stranger])


def _one_after_another(manager, num_requests, first=0, prompt_len=9):
    """`num_requests` requests of distinct prompts (the `first`th on), each computed, registered and finished
    before the next."""
    requests = [make_request(prompt_len, first_token=1000 * (first + n + 1)) for n in range(num_requests)]
    for request in requests:
        computed(manager, request, prompt_len)
        manager.deallocate(request)
    manager.check_integrity([])
    return requests


def test_a_light_load_touches_a_small_part_of_the_pool():
    """Blocks never handed out come last: one request at a time (3 blocks, 2 of them cached as it ends) goes
    through blocks holding nothing first, then the idle cache past its bound of 4, so of 100 blocks 7 were
    ever used (3 held at once plus the 4 the idle cache keeps); the most recent prefixes still hit."""
    manager = BlockManager(num_blocks=100, block_size=4, max_idle_cached_blocks=4)
    requests = _one_after_another(manager, 50)
    assert manager.num_untouched == 100 - 7 and manager.num_free == 100
    assert len(manager.cached_prefix(make_request(9, first_token=requests[-1].prompt_token_ids[0]))) == 2
    assert manager.cached_prefix(make_request(9, first_token=requests[0].prompt_token_ids[0])) == []
    # Under load every block is there: a request takes the whole pool, evicting the cached ones.
    whole = make_request(400, first_token=1)
    manager.allocate(whole, 400)
    assert manager.num_free == 0 and manager.num_cached == 0
    manager.check_integrity([whole])


def test_without_a_bound_the_idle_cache_keeps_every_prefix_the_pool_can_hold():
    """No bound (a GPU's pool, allocated whole): a finished request's blocks stay cached while blocks never
    used remain; only the blocks holding nothing are reused at once."""
    manager = BlockManager(num_blocks=100, block_size=4)
    requests = _one_after_another(manager, 20)
    assert manager.num_cached == 40 and manager.num_untouched == 100 - 41
    for request in requests:
        assert len(manager.cached_prefix(make_request(9, first_token=request.prompt_token_ids[0]))) == 2
    # Once every block was used, the least recently released cached ones go first.
    _one_after_another(manager, 60, first=20)
    assert manager.num_untouched == 0
    assert manager.cached_prefix(make_request(9, first_token=requests[-1].prompt_token_ids[0])) == []


def test_disabled_prefix_caching_never_hits():
    manager = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    first = make_request(10)
    computed(manager, first, 10)
    assert manager.num_cached == 0 and manager.cached_prefix(make_request(10)) == []


def _computed(manager, prompt_len, first_token=1):
    """A request whose whole prompt is computed and registered."""
    request = make_request(prompt_len, first_token=first_token)
    manager.allocate(request, prompt_len)
    request.num_computed_tokens = prompt_len
    manager.register(request)
    return request


def test_a_pin_keeps_a_finished_requests_blocks_for_the_next_turn():
    manager = BlockManager(num_blocks=12, block_size=4, max_pinned_blocks=6)
    first = _computed(manager, 10)
    assert manager.pin("conv", first, deadline=100.0)
    pinned = list(first.block_table[:2])
    manager.deallocate(first)
    assert manager.num_pinned == 2 and manager.num_used == 2
    manager.check_integrity([])
    # Handing out every free block leaves the pinned ones in the cache.
    filler = make_request(40, first_token=500)
    manager.allocate(filler, 40)
    assert manager.num_free == 0
    follow_up = make_request(14)
    assert manager.cached_prefix(follow_up) == pinned
    manager.deallocate(filler)
    manager.check_integrity([])
    assert manager.expire_pins(now=99.0) == 0
    assert manager.expire_pins(now=100.0) == 1
    assert manager.num_pinned == 0 and manager.num_used == 0
    manager.check_integrity([])


def test_unpin_and_the_bound_release_the_oldest_pin_first():
    manager = BlockManager(num_blocks=16, block_size=4, max_pinned_blocks=4)
    a = _computed(manager, 8, first_token=1)
    b = _computed(manager, 8, first_token=100)
    assert manager.pin("a", a, 10.0) and manager.pin("b", b, 10.0)
    c = _computed(manager, 8, first_token=200)
    # A third pin would pass the bound: the oldest ("a") goes.
    assert manager.pin("c", c, 10.0)
    assert manager.num_pinned == 4
    for request in (a, b, c):
        manager.deallocate(request)
    manager.check_integrity([])
    assert not manager.unpin("a") and manager.unpin("b")
    assert manager.num_pinned == 2
    manager.extend_pin("c", 50.0)
    assert manager.expire_pins(20.0) == 0 and manager.expire_pins(50.0) == 1
    assert manager.num_used == 0
    manager.check_integrity([])
    too_big = _computed(manager, 24, first_token=300)
    assert not manager.pin("big", too_big, 10.0)
