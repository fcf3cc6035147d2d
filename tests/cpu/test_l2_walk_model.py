"""tools/l2_walk_model.py: the cache model's count on hand-worked walks, the programs' heads as the Gluon one pass
assigns them, and the refusals before any work."""

import pytest
import torch
from tool_modules import load_tool

l2_walk_model = load_tool("l2_walk_model")


def test_a_tile_read_by_the_slot_beside_in_the_same_tick_hits():
    walks = iter([["a", "b"], ["a", "b"]])  # two slots read a then b: the second read of each hits
    assert l2_walk_model.hit_rate(walks, slots=2, capacity=4) == 0.5


def test_the_least_recently_used_tile_is_the_one_evicted():
    # one slot: a b c a — with room for 2 tiles a is gone when it comes back, with room for 3 it hits
    assert l2_walk_model.hit_rate(iter([["a", "b", "c", "a"]]), slots=1, capacity=2) == 0.0
    assert l2_walk_model.hit_rate(iter([["a", "b", "c", "a"]]), slots=1, capacity=3) == 0.25


def test_a_freed_slot_takes_the_next_program_in_launch_order():
    # slot 0 finishes its program in one step and takes the third, whose tile c slot 1 then reads in the same tick
    walks = iter([["a"], ["b", "c"], ["c"]])
    assert l2_walk_model.hit_rate(walks, slots=2, capacity=8) == 0.25


def test_programs_take_consecutive_heads_of_their_group():
    heads, num_blocks = 4, 2
    key_ptr = torch.tensor([[0, 1, 2]] * heads)  # every head: key block 0 lists query block 5, key block 1 block 6
    key_qblock = torch.tensor([5, 6])
    walks = list(l2_walk_model.program_walks(key_ptr, key_qblock, kv_heads=2, members=1))
    assert len(walks) == heads * num_blocks
    assert [walk[0][0] for walk in walks[::num_blocks]] == [0, 1, 2, 3]
    whole_group = list(l2_walk_model.program_walks(key_ptr, key_qblock, kv_heads=2, members=2))
    assert whole_group[0] == [(0, 5), (1, 5)] and whole_group[3] == [(2, 6), (3, 6)]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seq-len", "1000"], "--seq-len 1000: give a positive multiple of 128"),
        (["--heads", "6", "--kv-heads", "4"], "--heads 6 --kv-heads 4: give query heads a multiple of KV heads"),
        (["--heads-per-program", "3"], "--heads-per-program 3: give divisors of the group size 8"),
        (["--capacity", "0"], "--capacity 0 --multiprocessors 132: give at least 1"),
    ],
)
def test_bad_arguments_are_refused_naming_the_value(argv, message):
    with pytest.raises(SystemExit, match=message):
        l2_walk_model.main(argv)


def test_fewer_heads_per_program_keep_the_dense_walk_in_step():
    """The dense mode's lists: programs of one head each read the same query blocks together, where programs of
    a whole group drift apart (at N = 4096, 4 programs at once, room for 8 tiles)."""
    key_ptr, key_qblock = l2_walk_model.pattern_lists("dense", 4096, 4, 0.95, 0)
    rates = {
        members: l2_walk_model.hit_rate(
            l2_walk_model.program_walks(key_ptr, key_qblock, 1, members), slots=4, capacity=8
        )
        for members in (1, 4)
    }
    assert rates[1] > rates[4] + 0.1, rates


def test_the_band_keeps_the_walk_in_l2_better_than_random_distances():
    """The same area as consecutive block distances: the programs running together share their query blocks (at
    N = 16384, 4 heads, 16 programs at once, room for 32 tiles; the measured gap is in docs/benchmarks.md)."""
    rates = {}
    for pattern in ("block_only", "block_band"):
        key_ptr, key_qblock = l2_walk_model.pattern_lists(pattern, 16384, 4, 0.95, 0)
        walks = l2_walk_model.program_walks(key_ptr, key_qblock, 1, 1)
        rates[pattern] = l2_walk_model.hit_rate(walks, slots=16, capacity=32)
    assert rates["block_band"] > rates["block_only"] + 0.2, rates
