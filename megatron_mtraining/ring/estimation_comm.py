"""Data movement of distributed vertical-slash estimation over a context-parallel group (DESIGN.md §2.2).

:func:`megatron_mtraining.ring.estimation.estimate_vertical_slash_distributed` computes the scores; this module
knows, from the layout formulas alone, where rows, columns and offsets live and moves them. Peers are
addressed by global rank (``dist.get_process_group_ranks``), so the group need not be the world.

**Who owns a slash.** With the L estimation rows i = N−L … N−1, the diagonal s covers the key columns
N−L−s … N−1−s. Offset s belongs to the owner of its *top column* N−1−s, so every rank owns exactly
N_loc offsets. A rank holding other columns of that window sends its partial sum of s to the owner.
Those are only offsets whose top column lies in the L−1 columns after the end of one of the sender's
runs of consecutive columns (the halo): the ring successor in the striped layout, the next rank in
the contiguous one, the ranks holding the chunks after each of its two chunks in the zigzag one.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.distributed as dist

from mtraining_kernels.layout import Layout


def last_rows_owner(layout: Layout, seq_len: int, span: int) -> tuple[int, int]:
    """(the rank holding position N−1, how many of the last ``span`` positions it holds without a gap)."""
    owners, _ = layout.to_local(torch.arange(seq_len - span, seq_len), seq_len)
    owner = int(owners[-1])
    foreign = (owners != owner).nonzero().flatten()
    held = span if len(foreign) == 0 else span - 1 - int(foreign[-1])
    return owner, held


def broadcast_last_rows(
    q_local: torch.Tensor, layout: Layout, seq_len: int, last_q: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """Q_L = q[:, N−L:] ``[b, L, Hq, d]`` in q's dtype on every rank, broadcast by the rank that holds it.

    ``q_local [b, N_loc, Hq, d]`` is this rank's shard; the owner must hold all L rows
    (see :func:`last_rows_owner`).
    """
    owners, local_positions = layout.to_local(torch.arange(seq_len - last_q, seq_len), seq_len)
    owner = int(owners[-1])
    batch, _, q_heads, dim = q_local.shape
    if dist.get_rank(group) == owner:
        rows = q_local.index_select(1, local_positions.to(q_local.device))
    else:
        rows = q_local.new_empty(batch, last_q, q_heads, dim)
    dist.broadcast(rows, src=dist.get_process_group_ranks(group)[owner], group=group)
    return rows


def owned_offsets(layout: Layout, seq_len: int, rank: int, device=None) -> torch.Tensor:
    """The slash offsets whose complete sums ``rank`` holds after :func:`complete_slash_sums`: int64 ``[N_loc]``."""
    return seq_len - 1 - layout.global_positions(seq_len, rank, device=device)


@functools.lru_cache(maxsize=256)
def _halo_sends(layout: Layout, seq_len: int, last_q: int, sender: int) -> tuple[tuple[int, torch.Tensor], ...]:
    """The offsets whose partial sums ``sender`` passes on: ((destination group rank, ascending int64
    offsets on the CPU), ...) by destination. Every rank computes every sender's plan the same way."""
    columns = layout.global_positions(seq_len, sender)
    following = columns + 1
    following = following[following < seq_len]
    run_ends = following[layout.to_local(following, seq_len)[0] != sender]  # first foreign column
    tops = (run_ends[:, None] + torch.arange(last_q - 1)).flatten()
    tops = tops[tops < seq_len].unique()
    owners = layout.to_local(tops, seq_len)[0]
    foreign = owners != sender
    tops, owners = tops[foreign], owners[foreign]
    return tuple((int(dest), (seq_len - 1 - tops[owners == dest]).sort().values) for dest in owners.unique())


def complete_slash_sums(
    partials: torch.Tensor, layout: Layout, seq_len: int, last_q: int, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Complete this rank's owned slash sums with the other ranks' halo partials.

    ``partials [b, Hq, N]`` int64 are this rank's partial S(s) over its own key columns (modified in
    place). Returns (complete S over the owned offsets ``[b, Hq, N_loc]``, those offsets ``[N_loc]``).
    Sends at most (runs of the rank) × (L−1) offsets of b·Hq int64 values each.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    members = dist.get_process_group_ranks(group)
    device = partials.device
    operations, received = [], []
    for dest, offsets in _halo_sends(layout, seq_len, last_q, rank):
        outgoing = partials.index_select(-1, offsets.to(device))
        operations.append(dist.P2POp(dist.isend, outgoing, members[dest], group))
    for sender in range(world_size):
        if sender == rank:
            continue
        for dest, offsets in _halo_sends(layout, seq_len, last_q, sender):
            if dest == rank:
                incoming = partials.new_empty(*partials.shape[:-1], len(offsets))
                operations.append(dist.P2POp(dist.irecv, incoming, members[sender], group))
                received.append((offsets.to(device), incoming))
    if operations:
        for work in dist.batch_isend_irecv(operations):
            work.wait()
    for offsets, incoming in received:
        partials.index_add_(-1, offsets, incoming)
    offsets = owned_offsets(layout, seq_len, rank, device)
    return partials.index_select(-1, offsets), offsets


def all_gather_last_dim(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank's ``tensors`` concatenated along the last dim in group-rank order, in one all-gather.

    The tensors may differ in dtype and last dim but must have the same shapes on every rank; they
    travel as one byte buffer. Returns tensors of shape ``[..., W·m]`` for inputs ``[..., m]``.
    """
    as_bytes = [t.contiguous().view(torch.uint8) for t in tensors]
    packed = torch.cat(as_bytes, dim=-1)
    gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, packed, group=group)
    stacked = torch.stack(gathered)  # [W, ..., bytes]
    results, start = [], 0
    for tensor, raw in zip(tensors, as_bytes):
        part = stacked[..., start : start + raw.shape[-1]].contiguous().view(tensor.dtype)  # [W, ..., m]
        results.append(part.movedim(0, -2).flatten(-2))
        start += raw.shape[-1]
    return results
