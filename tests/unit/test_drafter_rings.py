"""DrafterRings (worker/drafter_rings.py): ring sizes, slots and block tables, ring assignment and release."""
import numpy as np
import pytest

from voltllm.worker.drafter_rings import DrafterRings


def test_sizes_cover_the_window_and_the_block():
    r = DrafterRings(window=2048, max_drafts=15, block_size=16, max_seqs=4)
    assert r.blocks == 129 and r.capacity == 2064 >= 2048 + 15 + 1
    assert r.num_blocks == 4 * 129 and r.recompute_tail == 2048
    assert DrafterRings(8, 3, 4, 2).capacity == 12


def test_slots_and_tables_address_the_same_places():
    """Position p of ring 1 sits at slot C + p mod C, which the block table's entry for p's logical block, at p's
    offset, names too; any C consecutive positions take distinct slots; a write longer than C keeps its last C."""
    r = DrafterRings(8, 3, 4, 3)
    c = r.capacity
    pos = np.arange(37, 37 + c)
    slots = r.slots(1, pos)
    assert sorted(slots.tolist()) == list(range(c, 2 * c))
    table = r.table(1, 20)
    assert (table[pos // 4] * 4 + pos % 4 == slots).all()
    long = r.slots(2, np.arange(5, 5 + c + 7))
    assert (long[:7] == -1).all() and sorted(long[7:].tolist()) == list(range(2 * c, 3 * c))
    out = np.zeros(25, dtype=np.int32)
    assert r.table(0, 20, out=out) is out and (out[:20] == r.table(0, 20)).all()
    # a row at position 41 (window 8) reads from position 34 on: block 8; the blocks before stay unfilled
    assert r.first_block(41) == 8 and r.first_block(3) == 0
    part = r.table(2, 20, first=8)
    assert (part[:8] == 0).all() and (part[8:] == r.table(2, 20)[8:]).all()


def test_rings_are_assigned_once_and_reused():
    r = DrafterRings(8, 3, 4, 2)
    a, b = r.ring("a"), r.ring("b")
    assert {a, b} == {0, 1} and r.ring("a") == a and r.in_use == 2
    with pytest.raises(RuntimeError, match="no ring free"):
        r.ring("c")
    r.release("a")
    r.release("a")  # (twice: nothing)
    assert r.ring("c") == a and r.in_use == 2
