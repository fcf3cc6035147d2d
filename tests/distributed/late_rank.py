"""A module whose import on group rank 0 takes :data:`IMPORT_SECONDS`, longer than the collective timeout
:data:`COLLECTIVE_SECONDS` its caller gives the group (tests/distributed/test_harness.py): the harness must
start a call only when every rank has unpickled it, so that no rank waits inside a collective for a peer
that is still importing."""

import time

import torch
import torch.distributed as dist

COLLECTIVE_SECONDS = 4.0  # tight, yet generous for two ranks that start the call together
IMPORT_SECONDS = 2.5 * COLLECTIVE_SECONDS

if dist.is_initialized() and dist.get_rank() == 0:
    time.sleep(IMPORT_SECONDS)


def sum_of_ranks(rank, world_size):
    total = torch.tensor([rank])
    dist.all_reduce(total)
    return total.item()
