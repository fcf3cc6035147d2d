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
