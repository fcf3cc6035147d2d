"""The geometry of a vertical-slash index (DESIGN.md §2.1), for the hot path and its bookkeeping.

Which 128-key blocks a slash list switches on, which key columns are verticals, the index of the full causal
pattern, and the mask area |M| counted without building the mask. Index format (per sample b and query
head h): ``v_idx [b, Hq, Vmax]`` key columns and ``s_idx [b, Hq, Smax]`` slash offsets (pairs (i, i − s)),
ascending and distinct, unused slots holding N. The mask itself, N × N, is the test oracle's
(:func:`mtraining_kernels.reference.vertical_slash_mask`).
"""

from __future__ import annotations

import torch

from .layout import BLOCK_SIZE


def slash_block_hits(s_idx: torch.Tensor, num_blocks: int, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Which block distances δ = qb − kb a slash list switches on: bool ``[b, Hq, num_blocks]``, contiguous.

    ``hit[0]`` (the diagonal block) is always true. For δ ≥ 1, ``hit[δ]`` is true iff some valid
    offset s satisfies (δ−1)·B < s < (δ+1)·B, i.e. δ = ⌊s/B⌋ or δ = ⌈s/B⌉.
    """
    seq_len = num_blocks * block_size
    # invalid slots become offset 0, whose distance 0 is on anyway
    s = torch.where((s_idx >= 0) & (s_idx < seq_len), s_idx, 0).long()
    hit = torch.zeros(*s_idx.shape[:-1], num_blocks, dtype=torch.bool, device=s_idx.device)
    hit.scatter_(-1, s // block_size, True)
    # ⌈s/B⌉ = NB only for s in the last block, whose ⌊s/B⌋ = NB − 1 is already on
    hit.scatter_(-1, ((s + block_size - 1) // block_size).clamp_(max=num_blocks - 1), True)
    hit[..., 0] = True
    return hit


def vertical_columns(v_idx: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Bool ``[b, Hq, N]``: key column j is a valid vertical."""
    valid = (v_idx >= 0) & (v_idx < seq_len)
    cols = torch.zeros(*v_idx.shape[:-1], seq_len + 1, dtype=torch.bool, device=v_idx.device)
    cols.scatter_(-1, torch.where(valid, v_idx.long(), seq_len), True)
    return cols[..., :seq_len]


def full_index(batch: int, heads: int, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """An index whose mask is the whole causal triangle: every offset is a slash, no verticals."""
    s_idx = torch.arange(seq_len, dtype=torch.int32, device=device).expand(batch, heads, seq_len)
    v_idx = torch.full((batch, heads, 1), seq_len, dtype=torch.int32, device=device)
    return v_idx.contiguous(), s_idx.contiguous()


def mask_area(v_idx: torch.Tensor, s_idx: torch.Tensor, seq_len: int, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """|M| of :func:`vertical_slash_mask` per [b, Hq] (int64), counted without building the mask.

    |M| = NB·B(B+1)/2 (diagonal blocks) + B²·Σ_{δ≥1} hit[δ]·(NB−δ) (active blocks) + B·Σ_v #{δ in
    1 … NB−1−kb(v) : not hit[δ]} (each vertical v adds one column to every later query block in which
    its key block is not already active).
    """
    num_blocks = seq_len // block_size
    hit = slash_block_hits(s_idx, num_blocks, block_size)  # [b, Hq, NB]
    distance = torch.arange(num_blocks, device=hit.device)
    active_blocks = (hit[..., 1:].long() * (num_blocks - distance[1:])).sum(-1)
    misses_up_to = (~hit).long().cumsum(-1)  # Σ_{δ≤m} (not hit[δ]); hit[0] is on
    valid = v_idx < seq_len
    key_block = v_idx.long().clamp(max=seq_len - 1) // block_size
    bar_blocks = torch.where(valid, misses_up_to.gather(-1, num_blocks - 1 - key_block), 0).sum(-1)
    return (
        num_blocks * block_size * (block_size + 1) // 2
        + block_size * block_size * active_blocks
        + block_size * bar_blocks
    )
