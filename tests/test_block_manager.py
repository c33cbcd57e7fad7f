"""BlockManager: free list, growing block tables, freeing, counts."""

import pytest

from lora_runner.core.block_manager import BlockManager


def test_allocate_grows_table_and_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.blocks_needed("a", 5) == 2
    first = bm.allocate("a", 5)  # returns the block ids it appended: the table's diff
    assert len(first) == 2 and bm.table("a") == first and bm.num_free_blocks == 6 and bm.num_used_blocks == 2
    assert bm.blocks_needed("a", 8) == 0  # the second block has room for tokens 5..7
    assert bm.allocate("a", 8) == [] and bm.table("a") == first
    third = bm.allocate("a", 9)  # token 8 starts a third block
    assert len(third) == 1 and bm.table("a") == first + third and bm.num_free_blocks == 5


def test_tables_are_disjoint_and_free_returns_all():
    bm = BlockManager(num_blocks=10, block_size=2)
    bm.allocate("a", 7)
    bm.allocate("b", 3)
    bm.allocate("c", 6)
    used = bm.table("a") + bm.table("b") + bm.table("c")
    assert len(used) == len(set(used)) == 9 and all(0 <= b < 10 for b in used)
    assert bm.free("b") == 2 and bm.free("b") == 0
    assert sorted(bm.holders()) == ["a", "c"]
    bm.allocate("d", 4)  # reuses b's blocks
    assert set(bm.table("d")) <= set(range(10)) - set(bm.table("a")) - set(bm.table("c"))
    for rid in ("a", "c", "d"):
        bm.free(rid)
    assert bm.num_free_blocks == 10 and bm.holders() == []


def test_allocate_refuses_when_full_without_side_effects():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", 8)
    assert not bm.can_allocate("b", 5) and bm.can_allocate("b", 4)
    with pytest.raises(RuntimeError, match="needs 2 KV blocks, only 1 free"):
        bm.allocate("b", 5)
    assert bm.num_free_blocks == 1 and bm.table("b") == []


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0)])
def test_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_freed_blocks_are_reused_first():
    """The blocks ever handed out stay as many as were ever held at once: untouched pages of the
    CPU cache are never committed."""
    manager = BlockManager(100, 16)
    ever_used = set()
    for i in range(50):
        ever_used |= set(manager.allocate(f"a{i}", 48)) | set(manager.allocate(f"b{i}", 16))
        manager.free(f"a{i}")
        manager.free(f"b{i}")
    assert len(ever_used) == 4
