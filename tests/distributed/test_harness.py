import os
import time

import pytest
import torch
import torch.distributed as dist


def _sum_of_ranks(rank, world_size, base):
    t = torch.tensor([rank + base])
    dist.all_reduce(t)
    return t.item()


def _rank_one_fails(rank, world_size):
    if rank == 1:
        raise ValueError("bad input on rank 1")
    return rank


def test_results_are_collected_by_rank(distributed):
    assert distributed(_sum_of_ranks, 3, 10) == [33, 33, 33]


def test_a_failing_rank_fails_the_run(distributed):
    with pytest.raises(RuntimeError, match="bad input on rank 1"):
        distributed(_rank_one_fails, 2)


def test_a_call_starts_once_every_rank_has_imported_it():
    """Rank 0 spends longer importing the function's module than a collective may wait; the call succeeds."""
    from harness import run_on_ranks
    from late_rank import COLLECTIVE_SECONDS, sum_of_ranks

    assert run_on_ranks(sum_of_ranks, 2, collective_timeout=COLLECTIVE_SECONDS) == [1, 1]


def _rank_one_stalls(rank, world_size):
    if rank == 1:
        time.sleep(120)  # stands for a hang: rank 1 never answers within the call's timeout
    return rank


def test_a_timed_out_call_says_where_the_silent_rank_is(distributed):
    with pytest.raises(TimeoutError) as raised:
        distributed(_rank_one_stalls, 2, timeout=5)
    message = str(raised.value)
    assert "ranks done: [0]" in message, message
    assert "--- rank 1 stacks ---" in message and "_rank_one_stalls" in message, message
    assert "--- rank 0 stacks ---" not in message, f"rank 0 had finished; its stacks are noise:\n{message}"


def _groups_and_threads(rank, world_size, new_groups):
    """(process groups torch holds, this process's threads) after creating ``new_groups`` groups."""
    for _ in range(new_groups):
        dist.all_reduce(torch.ones(1), group=dist.new_group(list(range(world_size))))
    return len(dist.distributed_c10d._world.pg_map), len(os.listdir("/proc/self/task"))


def test_a_call_leaves_no_process_group_behind(distributed):
    before = distributed(_groups_and_threads, 2, 0)
    created = distributed(_groups_and_threads, 2, 20)
    after = distributed(_groups_and_threads, 2, 0)
    for rank in range(2):
        assert created[rank][0] == before[rank][0] + 20, (before, created)
        assert after[rank][0] == 1, f"rank {rank} still holds {after[rank][0]} process groups (only the world's)"
        assert after[rank][1] < created[rank][1] - 20, f"rank {rank}: the groups' threads live on: {after}"


def _rank_zero_fails_rank_one_stalls(rank, world_size):
    if rank == 0:
        raise ValueError("rank 0 gave up")
    time.sleep(120)


def test_a_timed_out_call_names_the_failure_that_left_the_others_waiting(distributed):
    with pytest.raises(TimeoutError) as raised:
        distributed(_rank_zero_fails_rank_one_stalls, 2, timeout=5)
    message = str(raised.value)
    assert "--- rank 0 failed ---" in message and "rank 0 gave up" in message, message
    assert "--- rank 1 stacks ---" in message and "--- rank 0 stacks ---" not in message, message
