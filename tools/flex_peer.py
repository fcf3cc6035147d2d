"""PyTorch FlexAttention as a peer of the Triton kernels, computing exactly the vertical-slash mask.

FlexAttention works on 128×128 blocks of a ``BlockMask``: a block it does not list is skipped, a listed
*full* block is computed whole (no ``mask_mod``), a listed *partial* block is computed with the ``mask_mod``.
For a vertical-slash index (``v_idx``, ``s_idx`` int ``[b, Hq, width]``, entries ≥ N are padding),
:func:`vertical_slash_block_mask` lists, per (b, query head, query block qb),

* full: the active blocks A[qb, kb] (``mtraining_kernels.vertical_slash.slash_block_hits``) with kb < qb;
* partial: the diagonal block, and every inactive block kb < qb that holds one of the head's verticals;

with ``mask_mod`` = (kv ≤ q) ∧ (A[qb(q), kb(kv)] ∨ kv is a vertical). That ``mask_mod`` alone is the mask M
of ``reference.vertical_slash_mask`` (DESIGN.md §2.1), everywhere; the lists only skip blocks where it is all
false and spare it where it is all true, so FlexAttention computes M exactly, compiled or eager.

Sizes: the ``mask_mod`` closes over bool ``[b, Hq, nb, nb]`` (A) and bool ``[b, Hq, N]`` (verticals); the
lists are int32 ``[b, Hq, nb, nb]`` (kv- and q-side, full and partial); nothing has N² entries (at N = 512K,
Hq = 16: 256 MiB, 8 MiB and 4 × 1 GiB).

Block-only patterns (:func:`block_only_pattern`) are slashes only: offset δ·128 switches on exactly the
block distance δ, and v_idx is all padding, so our kernels run them through ``convert_index`` (empty bar
lists) and :func:`block_only_block_mask` gives FlexAttention the same blocks.

Packed documents: :func:`document_causal_block_mask` is the dense document-causal mask (kv ≤ q in the same
document) as a BlockMask — the fastest dense document-causal attention this device has (no flash-attn varlen),
which skips every block pair that shares no document.

Tensors of ``flex_forward`` are heads-first ``[b, H, N, d]``; ``flex_fwd_bwd`` takes and returns our
layout ``[b, N, H, d]``.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_operator
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from mtraining_kernels.layout import BLOCK_SIZE
from mtraining_kernels.vertical_slash import mask_area, slash_block_hits, vertical_columns

# FlexAttention's generated kernels (and the mask_mod lookups they inline) may compute element offsets in int32
INT32_LIMIT = 2**31


def _check_addressable(name: str, tensor: Tensor) -> None:
    if tensor.numel() >= INT32_LIMIT:
        raise ValueError(
            f"{name} has {tensor.numel()} elements, past the int32 offsets FlexAttention's kernels "
            "may use; lower the batch or the number of heads"
        )


def active_blocks(s_idx: Tensor, seq_len: int) -> Tensor:
    """A[qb, kb] of DESIGN.md §2.1 (diagonal included, nothing above it): bool ``[b, Hq, nb, nb]``."""
    if seq_len % BLOCK_SIZE:
        raise ValueError(f"seq_len={seq_len} must be a multiple of {BLOCK_SIZE}")
    num_blocks = seq_len // BLOCK_SIZE
    hit = slash_block_hits(s_idx, num_blocks)  # [b, Hq, nb]
    blocks = torch.arange(num_blocks, device=s_idx.device)
    distance = blocks[:, None] - blocks[None, :]  # [nb, nb]
    active = hit[..., distance.clamp(min=0)] & (distance >= 0)
    _check_addressable("the block-active table [b, Hq, nb, nb]", active)
    return active


def _block_lists(listed: Tensor) -> tuple[Tensor, Tensor]:
    """Bool ``[b, H, nb, nb]`` (query block, key block) → FlexAttention's (num_blocks int32 ``[b, H, nb]``,
    indices int32 ``[b, H, nb, nb]``), each row's listed key blocks first, ascending."""
    indices = torch.argsort(listed, dim=-1, descending=True, stable=True).to(torch.int32)
    return listed.sum(-1, dtype=torch.int32), indices


def _block_mask(full: Tensor, partial: Tensor, mask_mod, seq_len: int) -> BlockMask:
    return BlockMask.from_kv_blocks(
        *_block_lists(partial),
        *_block_lists(full),
        BLOCK_SIZE=BLOCK_SIZE,
        mask_mod=mask_mod,
        seq_lengths=(seq_len, seq_len),
    )


def _below_and_on_diagonal(num_blocks: int, device) -> tuple[Tensor, Tensor]:
    """Bool ``[nb, nb]``: kb < qb, and kb == qb."""
    ones = torch.ones(num_blocks, num_blocks, dtype=torch.bool, device=device)
    return ones.tril(-1), torch.eye(num_blocks, dtype=torch.bool, device=device)


def vertical_slash_block_mask(v_idx: Tensor, s_idx: Tensor, seq_len: int) -> BlockMask:
    """The BlockMask of ``reference.vertical_slash_mask(v_idx, s_idx, seq_len)`` at 128 × 128 blocks, for
    ``[b, Hq, N, d]`` queries (see the module docstring for its full and partial blocks)."""
    active = active_blocks(s_idx, seq_len)  # [b, Hq, nb, nb]
    vertical = vertical_columns(v_idx, seq_len)  # [b, Hq, N]
    num_blocks = seq_len // BLOCK_SIZE
    below, diagonal = _below_and_on_diagonal(num_blocks, s_idx.device)
    holds_vertical = vertical.view(*vertical.shape[:-1], num_blocks, BLOCK_SIZE).any(-1)[..., None, :]
    full = active & below
    partial = diagonal | (below & holds_vertical & ~active)

    def vertical_slash(b, h, q_idx, kv_idx):
        block_on = active[b, h, q_idx // BLOCK_SIZE, kv_idx // BLOCK_SIZE]
        return (kv_idx <= q_idx) & (block_on | vertical[b, h, kv_idx])

    return _block_mask(full, partial, vertical_slash, seq_len)


def block_only_block_mask(s_idx: Tensor, seq_len: int) -> BlockMask:
    """The BlockMask of a pattern without verticals: full = the active blocks below the diagonal, partial =
    the diagonal blocks, ``mask_mod`` = (kv ≤ q) ∧ A[qb(q), kb(kv)], with no vertical table. The same mask
    as ``vertical_slash_block_mask`` with v_idx all padding."""
    active = active_blocks(s_idx, seq_len)
    below, diagonal = _below_and_on_diagonal(seq_len // BLOCK_SIZE, s_idx.device)

    def causal_blocks(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & active[b, h, q_idx // BLOCK_SIZE, kv_idx // BLOCK_SIZE]

    return _block_mask(active & below, diagonal.expand_as(active), causal_blocks, seq_len)


def document_causal_block_mask(doc_id: Tensor) -> BlockMask:
    """The dense document-causal mask of ``doc_id`` int ``[b, N]`` (ascending per sample; (q, kv) attended iff
    kv ≤ q and doc(kv) = doc(q)) as a BlockMask shared by every head: full = the block pairs kb < qb both inside
    one and the same document, partial = every other pair kb ≤ qb whose blocks share a document (the diagonal
    blocks among them), ``mask_mod`` = (kv ≤ q) ∧ doc(q) = doc(kv)."""
    batch, seq_len = doc_id.shape
    num_blocks = seq_len // BLOCK_SIZE
    per_block = doc_id.view(batch, num_blocks, BLOCK_SIZE)
    first, last = per_block[..., 0], per_block[..., -1]  # [b, nb]: the block's first and last document
    below, diagonal = _below_and_on_diagonal(num_blocks, doc_id.device)
    # ascending ids: the key block kb ≤ qb shares a document with qb iff its last document ≥ qb's first
    shares = (last[:, None, :] >= first[:, :, None]) & (below | diagonal)  # [b, qb, kb]
    whole = first == last
    full = shares & below & whole[:, :, None] & whole[:, None, :]
    partial = shares & ~full

    def document_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc_id[b, q_idx] == doc_id[b, kv_idx])

    return _block_mask(full[:, None], partial[:, None], document_causal, seq_len)


def block_only_pattern(target_area: Tensor, seq_len: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """A block-only pattern with, per [b, Hq], a mask area |M| just below ``target_area`` (int64 ``[b, Hq]``,
    e.g. ``vertical_slash.mask_area`` of a vertical-slash pattern): (v_idx int32 ``[b, Hq, 1]`` all N, s_idx int32
    ``[b, Hq, width]`` ascending, padded with N).

    Block distance δ adds nb − δ whole blocks. Each head takes distances 0 (the diagonal) and 1, then the
    distances 2 … nb−1 in a random order (``generator``, CPU) while they fit, then the unused distance that
    adds the most while still fitting, until none fits; it is stored as the slash offsets δ·128. The area
    falls short of the target by less than (1 + the smallest unused distance's nb − δ) blocks, and exceeds it
    only where the target is below the diagonal and distance 1 together.
    """
    num_blocks = seq_len // BLOCK_SIZE
    if num_blocks < 2:
        raise ValueError(f"seq_len={seq_len} needs at least two {BLOCK_SIZE}-token blocks")
    batch, heads = target_area.shape
    diagonal_area = num_blocks * BLOCK_SIZE * (BLOCK_SIZE + 1) // 2
    gain = num_blocks - torch.arange(num_blocks)  # blocks added by distance δ
    left = (target_area.reshape(-1).cpu() - diagonal_area) // BLOCK_SIZE**2 - gain[1]
    order = torch.stack([torch.randperm(num_blocks - 2, generator=generator) + 2 for _ in range(batch * heads)])
    taken = gain[order].cumsum(1) <= left[:, None]  # a prefix of the order
    chosen = torch.zeros(batch * heads, num_blocks, dtype=torch.bool)
    chosen.scatter_(1, order, taken)
    chosen[:, :2] = True
    left = left - (gain[2:] * chosen[:, 2:]).sum(1)
    while True:
        fits = ~chosen & (gain <= left[:, None])
        rows = fits.any(1).nonzero().squeeze(1)
        if rows.numel() == 0:
            break
        best = torch.where(fits[rows], gain, 0).argmax(1)
        chosen[rows, best] = True
        left[rows] -= gain[best]
    offsets = torch.where(chosen, torch.arange(num_blocks) * BLOCK_SIZE, seq_len)[:, 1:].sort(1).values
    width = int(chosen[:, 1:].sum(1).max())
    s_idx = offsets[:, :width].to(torch.int32).view(batch, heads, width)
    v_idx = torch.full((batch, heads, 1), seq_len, dtype=torch.int32)
    return v_idx.to(target_area.device), s_idx.to(target_area.device)


def block_band_pattern(target_area: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """The block band with, per [b, Hq], the least mask area |M| at or above ``target_area`` (int64 ``[b, Hq]``):
    the diagonal and the block distances 1 … w, as (v_idx, s_idx) in :func:`block_only_pattern`'s format.

    Its blocks are :func:`block_only_pattern`'s shape in consecutive order: the key blocks that a query block
    lists are neighbours, so the programs of a kernel that run together share their query blocks (the best case
    of L2 locality for the same kind of work; ``kernel_ab.py --patterns block_only block_band`` compares them).
    """
    num_blocks = seq_len // BLOCK_SIZE
    if num_blocks < 2:
        raise ValueError(f"seq_len={seq_len} needs at least two {BLOCK_SIZE}-token blocks")
    batch, heads = target_area.shape
    diagonal_area = num_blocks * BLOCK_SIZE * (BLOCK_SIZE + 1) // 2
    band_blocks = (num_blocks - torch.arange(1, num_blocks)).cumsum(0)  # blocks added by distances 1 … w
    needed = (target_area.reshape(-1, 1).cpu() - diagonal_area + BLOCK_SIZE**2 - 1) // BLOCK_SIZE**2
    width = ((band_blocks[None, :] < needed).sum(1) + 1).clamp(max=num_blocks - 1)  # [b·Hq]
    columns = torch.arange(int(width.max()))
    s_idx = torch.where(columns[None, :] < width[:, None], (columns + 1) * BLOCK_SIZE, seq_len)
    v_idx = torch.full((batch, heads, 1), seq_len, dtype=torch.int32)
    return v_idx.to(target_area.device), s_idx.to(torch.int32).view(batch, heads, -1).to(target_area.device)


def same_area_pattern(kind: str, v_idx: Tensor, s_idx: Tensor, seq_len: int, generator: torch.Generator):
    """The block pattern ``kind`` with each head's mask area of the vertical-slash pattern (v_idx, s_idx):
    ``block_only`` (:func:`block_only_pattern`, its distances drawn from ``generator``) or ``block_band``
    (:func:`block_band_pattern`, consecutive distances, the generator unused)."""
    area = mask_area(v_idx, s_idx, seq_len)
    if kind == "block_only":
        return block_only_pattern(area, seq_len, generator)
    if kind == "block_band":
        return block_band_pattern(area, seq_len)
    raise ValueError(f"pattern {kind!r}: give block_only or block_band")


# ---------------------------------------------------------------------------------------- running
@functools.cache
def _compiled_flex_attention():
    """``torch.compile(flex_attention, dynamic=False)``, made once. Every (N, shapes, mask_mod) is a graph of
    its own; past the recompile limit Dynamo would run the eager path, which materialises N × N scores, so
    the limit is raised and hitting it fails instead."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention, dynamic=False)


def _no_score_mod(score, b, h, q_idx, kv_idx):
    return score


def flex_forward(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, scale: float) -> Tensor:
    """FlexAttention of heads-first q ``[b, Hq, N, d]``, k/v ``[b, Hkv, N, d]`` → out ``[b, Hq, N, d]``, GQA as
    ours (query head h reads KV head h // (Hq/Hkv)), differentiable.

    CUDA: the compiled kernels. CPU (tests): the eager operator behind ``flex_attention`` — unfused math
    that evaluates the ``mask_mod`` everywhere and ignores the block lists; the public function refuses a
    backward on CPU.
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        _check_addressable(name, tensor)
    if q.is_cuda:
        return _compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
    out, _, _ = flex_attention_operator(q, k, v, _no_score_mod, block_mask.as_tuple(), scale, {})
    return out


def heads_first(x: Tensor) -> Tensor:
    """``[b, N, H, d]`` → a contiguous, detached ``[b, H, N, d]`` copy."""
    return x.detach().transpose(1, 2).contiguous()


def flex_fwd_bwd(
    q: Tensor, k: Tensor, v: Tensor, dout: Tensor, block_mask: BlockMask, scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """out, dq, dk, dv of :func:`flex_forward` for gradient ``dout``, all in our layout: q, dout, out, dq
    ``[b, N, Hq, d]``; k, v, dk, dv ``[b, N, Hkv, d]``."""
    inputs = [heads_first(x).requires_grad_() for x in (q, k, v)]
    out = flex_forward(*inputs, block_mask, scale)
    grads = torch.autograd.grad(out, inputs, heads_first(dout))
    return tuple(x.detach().transpose(1, 2) for x in (out, *grads))
