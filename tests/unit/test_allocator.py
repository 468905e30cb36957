"""Unit tests for router.core.allocator: which blocks of a pool are free, and who holds the rest (pure Python)."""
import pytest

from router.core.allocator import BlockAllocator, OutOfBlocks


def test_rejects_non_positive_sizes():
    with pytest.raises(ValueError):
        BlockAllocator(0, 16)
    with pytest.raises(ValueError):
        BlockAllocator(8, 0)


def test_starts_all_free():
    t = BlockAllocator(8, 16)
    assert t.num_free == 8
    assert t.num_used == 0


@pytest.mark.parametrize("tokens, blocks", [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_blocks_for_rounds_up(tokens, blocks):
    assert BlockAllocator(8, 16).blocks_for(tokens) == blocks


def test_extra_blocks():
    t = BlockAllocator(8, 4)
    assert t.extra_blocks(0, 0) == 0
    assert t.extra_blocks(0, 1) == 1
    assert t.extra_blocks(0, 9) == 3
    assert t.extra_blocks(2, 8) == 0   # the last block is exactly full
    assert t.extra_blocks(2, 9) == 1   # one token past it
    assert t.extra_blocks(3, 5) == 0   # never negative when more than enough is held


def test_allocate_hands_out_distinct_blocks_and_counts():
    t = BlockAllocator(6, 4)
    a = t.allocate(2)
    b = t.allocate(3)
    assert len(a) == 2 and len(b) == 3
    assert len(set(a) | set(b)) == 5
    assert set(a + b) <= set(range(6))
    assert t.num_free == 1 and t.num_used == 5
    assert t.allocate(0) == []
    assert t.num_free == 1


def test_free_returns_blocks_for_reuse():
    t = BlockAllocator(4, 4)
    a = t.allocate(4)
    assert t.num_free == 0
    t.free(a[:2])
    assert t.num_free == 2 and t.num_used == 2
    again = t.allocate(2)
    assert sorted(again) == sorted(a[:2])
    t.free(again)
    t.free(a[2:])
    assert t.num_free == 4
    assert sorted(t.allocate(4)) == [0, 1, 2, 3]


def test_out_of_blocks_changes_nothing():
    t = BlockAllocator(5, 4)
    held = t.allocate(3)
    with pytest.raises(OutOfBlocks):
        t.allocate(3)
    assert t.num_free == 2 and t.num_used == 3
    rest = t.allocate(2)            # exactly what is left still works
    assert set(rest).isdisjoint(held)
    assert sorted(held + rest) == [0, 1, 2, 3, 4]
    with pytest.raises(OutOfBlocks):
        t.allocate(1)
    assert t.num_free == 0


def test_out_of_blocks_on_fresh_table():
    t = BlockAllocator(2, 4)
    with pytest.raises(OutOfBlocks):
        t.allocate(3)
    assert t.num_free == 2
    assert sorted(t.allocate(2)) == [0, 1]
