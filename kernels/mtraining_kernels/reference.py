"""Pure-PyTorch reference semantics of vertical-slash sparse attention (DESIGN.md §2.1).

Everything here is written for readability, not speed: it materialises the full N×N mask. Every
kernel and distributed path is tested against these functions.

Index format (per sample b and query head h):

* ``v_idx [b, Hq, Vmax]`` int — vertical key columns, ascending, distinct; unused slots hold N.
* ``s_idx [b, Hq, Smax]`` int — slash offsets (pairs (i, i−s)), ascending, distinct; unused = N.
"""

from __future__ import annotations

import torch

from .layout import BLOCK_SIZE


def slash_block_hits(s_idx: torch.Tensor, num_blocks: int, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Which block distances δ = qb − kb a slash list switches on: bool ``[b, Hq, num_blocks]``.

    ``hit[0]`` (the diagonal block) is always true. For δ ≥ 1, ``hit[δ]`` is true iff some valid
    offset s satisfies (δ−1)·B < s < (δ+1)·B, i.e. s = a·B + t hits δ = a and, when t > 0, a + 1.
    """
    seq_len = num_blocks * block_size
    valid = (s_idx >= 0) & (s_idx < seq_len)
    s = torch.where(valid, s_idx.long(), 0)
    a, t = s // block_size, s % block_size
    hit = torch.zeros(*s_idx.shape[:-1], num_blocks + 1, dtype=torch.bool, device=s_idx.device)
    # invalid slots point at the spare column num_blocks, which is cut off at the end
    spare = torch.full_like(a, num_blocks)
    hit.scatter_(-1, torch.where(valid, a, spare), True)
    hit.scatter_(-1, torch.where(valid & (t > 0), torch.clamp(a + 1, max=num_blocks), spare), True)
    hit = hit[..., :num_blocks]
    hit[..., 0] = True
    return hit


def vertical_columns(v_idx: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Bool ``[b, Hq, N]``: key column j is a valid vertical."""
    valid = (v_idx >= 0) & (v_idx < seq_len)
    cols = torch.zeros(*v_idx.shape[:-1], seq_len + 1, dtype=torch.bool, device=v_idx.device)
    cols.scatter_(-1, torch.where(valid, v_idx.long(), seq_len), True)
    return cols[..., :seq_len]


def vertical_slash_mask(v_idx: torch.Tensor, s_idx: torch.Tensor, seq_len: int,
                        block_size: int = BLOCK_SIZE, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The exact causal mask M of DESIGN.md §2.1: bool ``[b, Hq, N, N]`` (query i, key j), or only the query
    rows ``rows [r]`` (int, on s_idx's device): ``[b, Hq, r, N]``.

    ``M[i, j] = j ≤ i and (A[qb(i), kb(j)] or j ∈ v_idx)`` with the Toeplitz block mask
    ``A[qb, kb] = kb == qb or (kb < qb and hit[qb − kb])``.
    """
    if seq_len % block_size:
        raise ValueError(f"seq_len={seq_len} must be a multiple of block_size={block_size}")
    if v_idx.shape[:-1] != s_idx.shape[:-1]:
        raise ValueError(f"v_idx {tuple(v_idx.shape)} and s_idx {tuple(s_idx.shape)} disagree on [b, Hq]")
    num_blocks = seq_len // block_size
    hit = slash_block_hits(s_idx, num_blocks, block_size)                  # [b, H, NB]
    qb = torch.arange(num_blocks, device=s_idx.device)
    delta = qb[:, None] - qb[None, :]                                        # [NB, NB]
    block = (delta >= 0) & hit[..., delta.clamp(min=0)]                      # [b, H, NB, NB]
    query_rows = torch.arange(seq_len, device=s_idx.device) if rows is None else rows
    token = block[..., query_rows // block_size, :].repeat_interleave(block_size, -1)   # [b, H, r, N]
    token = token | vertical_columns(v_idx, seq_len)[..., None, :]
    causal = torch.arange(seq_len, device=s_idx.device)[None, :] <= query_rows[:, None]
    return token & causal


def full_index(batch: int, heads: int, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """An index whose mask is the whole causal triangle: every offset is a slash, no verticals."""
    s_idx = torch.arange(seq_len, dtype=torch.int32, device=device).expand(batch, heads, seq_len)
    v_idx = torch.full((batch, heads, 1), seq_len, dtype=torch.int32, device=device)
    return v_idx.contiguous(), s_idx.contiguous()


def mask_area(v_idx: torch.Tensor, s_idx: torch.Tensor, seq_len: int,
              block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """|M| of :func:`vertical_slash_mask` per [b, Hq] (int64), counted without building the mask.

    |M| = NB·B(B+1)/2 (diagonal blocks) + B²·Σ_{δ≥1} hit[δ]·(NB−δ) (active blocks) + B·Σ_v #{δ in
    1 … NB−1−kb(v) : not hit[δ]} (each vertical v adds one column to every later query block in which
    its key block is not already active).
    """
    num_blocks = seq_len // block_size
    hit = slash_block_hits(s_idx, num_blocks, block_size)                  # [b, Hq, NB]
    distance = torch.arange(num_blocks, device=hit.device)
    active_blocks = (hit[..., 1:].long() * (num_blocks - distance[1:])).sum(-1)
    misses_up_to = (~hit).long().cumsum(-1)                                  # Σ_{δ≤m} (not hit[δ]); hit[0] is on
    valid = v_idx < seq_len
    key_block = v_idx.long().clamp(max=seq_len - 1) // block_size
    bar_blocks = torch.where(valid, misses_up_to.gather(-1, num_blocks - 1 - key_block), 0).sum(-1)
    return (num_blocks * block_size * (block_size + 1) // 2 + block_size * block_size * active_blocks
            + block_size * bar_blocks)


def sparsity(mask: torch.Tensor) -> torch.Tensor:
    """1 − |M| / (N(N+1)/2) per [b, Hq]."""
    n = mask.shape[-1]
    return 1.0 - mask.sum(dim=(-1, -2)).double() / (n * (n + 1) / 2)


def reference_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                               softmax_scale: float | None = None,
                               compute_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention, differentiable.

    q ``[b, N, Hq, d]``; k, v ``[b, N, Hkv, d]`` with Hq % Hkv == 0 (GQA: query head h reads KV
    head h // (Hq/Hkv)); mask bool ``[b, Hq, N, N]`` (broadcastable). Computes in ``compute_dtype``
    (fp32, or fp64 when the inputs are fp64). Returns ``out [b, N, Hq, d]`` in that dtype and
    ``lse [b, Hq, N]``. A row with no visible key gets out = 0 and lse = −inf, with finite gradients.
    """
    hq, hkv = q.shape[2], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not divisible by KV heads {hkv}")
    dtype = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    qf = q.to(dtype).transpose(1, 2)                                         # [b, Hq, N, d]
    kf = k.to(dtype).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    vf = v.to(dtype).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)                                    # 0 where masked
    total = weights.sum(dim=-1, keepdim=True)
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    out = (weights / safe_total) @ vf
    lse = torch.where(total > 0, row_max + torch.log(safe_total), torch.full_like(total, float("-inf")))
    return out.transpose(1, 2), lse.squeeze(-1)


def merge_attention(out0: torch.Tensor, lse0: torch.Tensor, out1: torch.Tensor,
                    lse1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial softmax results over disjoint key sets (DESIGN.md §2.4).

    out ``[b, N, H, d]`` fp32, lse ``[b, H, N]`` fp32. Returns new tensors. A side with lse = −inf
    contributes nothing, whatever its out holds (even NaN); rows where both are −inf stay (out0, −inf).
    A NaN or +inf lse (from NaN/Inf logits) is not "nothing": it makes the merged row NaN, so a poisoned
    input reaches the output instead of vanishing.
    """
    hi = torch.maximum(lse0, lse1)                    # NaN if either side is NaN
    lo = torch.minimum(lse0, lse1)
    empty = hi == float("-inf")                       # both sides empty
    safe_hi = torch.where(empty, 0.0, hi)
    tail = torch.exp(lo - safe_hi)                    # 0 on empty rows instead of exp(−inf + inf) = NaN
    lse = torch.where(empty, lse0, hi + torch.log1p(tail))

    def weighted(out_side, lse_side):
        # exp(lse_side − lse) without rounding lse first: at |lse| ~ 1e4 its fp32 ulp (1e-3) would scale even
        # the dominant side by 1 ± 5e-4, which dq amplifies for rows that attend to one key
        weight = (torch.exp(lse_side - safe_hi) / (1.0 + tail)).transpose(1, 2)[..., None]
        present = (lse_side != float("-inf")).transpose(1, 2)[..., None]
        return torch.where(present, weight * out_side, 0.0)

    merged = weighted(out0, lse0) + weighted(out1, lse1)
    return torch.where(empty.transpose(1, 2)[..., None], out0, merged), lse
