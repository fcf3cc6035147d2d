"""Pure-PyTorch reference semantics of vertical-slash sparse attention (DESIGN.md §2.1).

Everything here is written for readability, not speed: it materialises the full N×N mask. Every
kernel and distributed path is tested against these functions.

Index format (per sample b and query head h):

* ``v_idx [b, Hq, Vmax]`` int — vertical key columns, ascending, distinct; unused slots hold N.
* ``s_idx [b, Hq, Smax]`` int — slash offsets (pairs (i, i−s)), ascending, distinct; unused = N.

Packed documents (PACKED.md) carry one such index per document, in global coordinates
(:class:`mtraining_kernels.document_index.DocumentIndex`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .layout import BLOCK_SIZE
from .vertical_slash import slash_block_hits, vertical_columns

if TYPE_CHECKING:
    from .document_index import DocumentIndex


def vertical_slash_mask(
    v_idx: torch.Tensor,
    s_idx: torch.Tensor,
    seq_len: int,
    block_size: int = BLOCK_SIZE,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
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
    hit = slash_block_hits(s_idx, num_blocks, block_size)  # [b, H, NB]
    qb = torch.arange(num_blocks, device=s_idx.device)
    delta = qb[:, None] - qb[None, :]  # [NB, NB]
    block = (delta >= 0) & hit[..., delta.clamp(min=0)]  # [b, H, NB, NB]
    query_rows = torch.arange(seq_len, device=s_idx.device) if rows is None else rows
    token = block[..., query_rows // block_size, :].repeat_interleave(block_size, -1)  # [b, H, r, N]
    token = token | vertical_columns(v_idx, seq_len)[..., None, :]
    causal = torch.arange(seq_len, device=s_idx.device)[None, :] <= query_rows[:, None]
    return token & causal


def packed_vertical_slash_mask(index: DocumentIndex, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """The mask of packed documents (PACKED.md): bool ``[b, Hq, N, N]`` (query i, key j).

    ``M[i, j] = doc(i) == doc(j) and (M_d[i, j] if document d = doc(i) is sparse else j ≤ i)``, where ``M_d`` is
    :func:`vertical_slash_mask` of document d's own index on the whole sequence (global blocks).
    """
    documents = index.documents
    seq_len = documents.seq_len
    if seq_len % block_size:
        raise ValueError(f"seq_len={seq_len} must be a multiple of block_size={block_size}")
    positions = torch.arange(seq_len, device=index.v_idx.device)
    causal = positions[None, :] <= positions[:, None]
    same_document = documents.doc_id[:, :, None] == documents.doc_id[:, None, :]  # [b, N, N]
    mask = (same_document & causal)[:, None].repeat(1, index.num_heads, 1, 1)
    for sample, document in index.sparse.nonzero().tolist():
        start = int(documents.starts[sample, document])
        rows = slice(start, start + int(documents.lengths[sample, document]))
        own = vertical_slash_mask(
            index.v_idx[sample : sample + 1, document],
            index.s_idx[sample : sample + 1, document],
            seq_len,
            block_size,
            rows=positions[rows],
        )
        mask[sample, :, rows] &= own[0]
    return mask


def sparsity(mask: torch.Tensor) -> torch.Tensor:
    """1 − |M| / (N(N+1)/2) per [b, Hq]."""
    n = mask.shape[-1]
    return 1.0 - mask.sum(dim=(-1, -2)).double() / (n * (n + 1) / 2)


def reference_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
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
    qf = q.to(dtype).transpose(1, 2)  # [b, Hq, N, d]
    kf = k.to(dtype).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    vf = v.to(dtype).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)  # 0 where masked
    total = weights.sum(dim=-1, keepdim=True)
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    out = (weights / safe_total) @ vf
    lse = torch.where(total > 0, row_max + torch.log(safe_total), torch.full_like(total, float("-inf")))
    return out.transpose(1, 2), lse.squeeze(-1)
