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
    assert manager.num_used == 2 and a.block_table == []
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
    request.block_table.clear()
    with pytest.raises(AssertionError):
        manager.check_integrity([request])
