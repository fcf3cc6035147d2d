"""Merging two partial softmax results over disjoint key sets (DESIGN.md §2.4)."""

from __future__ import annotations

import torch


def merge_attention(
    out0: torch.Tensor, lse0: torch.Tensor, out1: torch.Tensor, lse1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial softmax results over disjoint key sets (DESIGN.md §2.4).

    out ``[b, N, H, d]`` fp32, lse ``[b, H, N]`` fp32. Returns new tensors. A side with lse = −inf
    contributes nothing, whatever its out holds (even NaN); rows where both are −inf stay (out0, −inf).
    A NaN or +inf lse (from NaN/Inf logits) is not "nothing": it makes the merged row NaN, so a poisoned
    input reaches the output instead of vanishing.
    """
    hi = torch.maximum(lse0, lse1)  # NaN if either side is NaN
    lo = torch.minimum(lse0, lse1)
    empty = hi == float("-inf")  # both sides empty
    safe_hi = torch.where(empty, 0.0, hi)
    tail = torch.exp(lo - safe_hi)  # 0 on empty rows instead of exp(−inf + inf) = NaN
    lse = torch.where(empty, lse0, hi + torch.log1p(tail))

    def weighted(out_side, lse_side):
        # exp(lse_side − lse) without rounding lse first: at |lse| ~ 1e4 its fp32 ulp (1e-3) would scale even
        # the dominant side by 1 ± 5e-4, which dq amplifies for rows that attend to one key
        weight = (torch.exp(lse_side - safe_hi) / (1.0 + tail)).transpose(1, 2)[..., None]
        present = (lse_side != float("-inf")).transpose(1, 2)[..., None]
        return torch.where(present, weight * out_side, 0.0)

    merged = weighted(out0, lse0) + weighted(out1, lse1)
    return torch.where(empty.transpose(1, 2)[..., None], out0, merged), lse
