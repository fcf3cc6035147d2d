"""Load-balance diagnostics of the sparse ring for a vertical-slash pattern (DESIGN.md §2.3).

For every query rank r and source rank w we count the work of the §2.6 lists: active 128×128
blocks and bars (a bar is one key column for one 128-row query block). A bar costs 1/128 of a
block, so ``cost = blocks + bars / 128``. In a flat ring, rank r meets source w at step
t = (r − w) mod W, which turns the [rank, source] matrix into a [rank, step] matrix.

The counts are analytic (one FFT correlation per head), so N = 512K with W = 32 takes a moment on
a CPU. They equal the counts of :func:`mtraining_kernels.index.convert_index`, which the tests check:

* blocks[r, w] = Σ_{kb owned by w} Σ_{δ ≥ 0} hit[δ]·[owner(kb + δ) == r] = Σ_{kb ∈ w} corr_r[kb]
* bars[r, w]   = Σ_{verticals v owned by w} #{qb ≥ kb(v) owned by r} − corr_r[kb(v)]

where ``corr_r[k] = Σ_{δ ≥ 0} hit[δ]·[owner(k + δ) == r]`` counts the active blocks of rank r in
key block column k (δ = 0 is the diagonal block, which always covers the vertical's own block).

Packed documents (DESIGN.md §2.7) use the same count per document, on the run of blocks the document
spans, with the diagonal tiles its neighbours share counted once (:func:`document_source_work`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mtraining_kernels.document_index import DocumentIndex
from mtraining_kernels.layout import BLOCK_SIZE, Layout
from mtraining_kernels.vertical_slash import slash_block_hits

BAR_COST = 1.0 / BLOCK_SIZE


@dataclass(frozen=True, eq=False)
class BalanceReport:
    """Ring work of one layout. Matrices are indexed [query rank, ring step] and summed over b and Hq."""

    layout: Layout
    seq_len: int
    blocks: Tensor  # int64 [W, W]: active 128×128 blocks
    bars: Tensor  # int64 [W, W]: (query block, vertical column) bars
    cost: Tensor  # float64 [W, W]: blocks + bars / 128

    @property
    def worker_imbalance(self) -> float:
        """max_r / mean_r of the per-rank total cost (summed over steps)."""
        per_rank = self.cost.sum(1)
        return float(per_rank.max() / per_rank.mean())

    @property
    def step_imbalance(self) -> float:
        """The worst step's max_r / mean_r of cost (1.0 when every step is balanced); steps where no rank
        works (packed documents, each inside one rank) are skipped."""
        busy = self.cost.sum(0) > 0
        per_step = self.cost.amax(0)[busy] / self.cost.mean(0)[busy]
        return float(per_step.max())

    @property
    def critical_path_ratio(self) -> float:
        """Σ_t max_r cost[r, t] / (Σ cost / W): ring time over perfectly balanced time."""
        return float(self.cost.amax(0).sum() / (self.cost.sum() / self.layout.world_size))


def _check_layout(layout: Layout, seq_len: int) -> None:
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a mtraining_kernels.Layout, got {type(layout).__name__}")
    layout.validate(seq_len, BLOCK_SIZE)


def _check_pattern(v_idx: Tensor, s_idx: Tensor, layout: Layout, seq_len: int) -> None:
    _check_layout(layout, seq_len)
    for name, idx in (("v_idx", v_idx), ("s_idx", s_idx)):
        if idx.dim() != 3 or idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an int32 [b, Hq, width] tensor, got {idx.dtype} {tuple(idx.shape)}")
        if idx.numel() and bool(((idx < 0) | (idx > seq_len)).any()):
            raise ValueError(f"{name} holds values outside [0, {seq_len}]; unused slots hold the sentinel N")
    if v_idx.shape[:2] != s_idx.shape[:2]:
        raise ValueError(f"v_idx {tuple(v_idx.shape)} and s_idx {tuple(s_idx.shape)} disagree on [b, Hq]")


def _block_ownership(layout: Layout, seq_len: int) -> Tensor:
    """float64 ``[W, NB]``: 1 where rank r owns global block k."""
    owner, _ = layout.to_local(torch.arange(seq_len // BLOCK_SIZE) * BLOCK_SIZE, seq_len)
    return torch.nn.functional.one_hot(owner, layout.world_size).T.double()


def _run_work(on: Tensor, owned: Tensor, vertical_block: Tensor, vertical_valid: Tensor) -> tuple[Tensor, Tensor]:
    """Blocks and bars of a run of n consecutive blocks whose tiles follow one Toeplitz rule.

    ``on`` float64 ``[Z, n]``: 1 where the distance δ = qb − kb is on (``on[:, 0] == 1``); ``owned`` ``[W, n]``:
    the owners of the run's blocks; ``vertical_block`` int64 ``[Z, V]``: each vertical's block within the run,
    ``vertical_valid`` bool ``[Z, V]``. Tiles and bars stay inside the run. Returns float64 ``[Z, W(r), W(w)]``
    each, diagonal tiles included.
    """
    world, num_blocks = owned.shape
    # corr[z, r, k] = Σ_δ on[z, δ]·owned[r, k + δ], a cross-correlation done by zero-padded FFT (a power of two
    # long, so that runs of many lengths share a few FFT plans)
    fft_len = 1 << (2 * num_blocks - 1).bit_length()
    spectrum = torch.fft.rfft(on, fft_len).conj()[:, None, :] * torch.fft.rfft(owned, fft_len)[None]
    corr = torch.fft.irfft(spectrum, fft_len)[..., :num_blocks].round()  # [Z, W, n]
    blocks = torch.einsum("zrk,wk->zrw", corr, owned)

    owned_from = owned.flip(-1).cumsum(-1).flip(-1)  # [W, n]: #qb ≥ k owned by r
    not_active = owned_from[:, vertical_block].permute(1, 0, 2) - corr.gather(
        -1, vertical_block[:, None, :].expand(-1, world, -1)
    )  # [Z, W(r), V]
    vertical_owner = owned.T[vertical_block]  # [Z, V, W(w)]
    bars = torch.bmm(not_active * vertical_valid[:, None, :], vertical_owner * vertical_valid[..., None])
    return blocks, bars


def _per_rank_source(x: Tensor) -> Tensor:
    """float64 ``[b, Hq, W(r), W(w)]`` → int64 ``[W(r), W(w), b, Hq]``."""
    return x.round().long().permute(2, 3, 0, 1).contiguous()


def source_work(v_idx: Tensor, s_idx: Tensor, layout: Layout, seq_len: int) -> tuple[Tensor, Tensor]:
    """Active blocks and bars per (query rank, source rank, b, Hq): two int64 ``[W, W, b, Hq]`` tensors.

    Equal to stacking ``count_work(convert_index(v_idx, s_idx, layout, r, seq_len))`` over ranks r.
    """
    _check_pattern(v_idx, s_idx, layout, seq_len)
    v_idx, s_idx = v_idx.cpu(), s_idx.cpu()
    batch, heads = v_idx.shape[:2]
    num_blocks = seq_len // BLOCK_SIZE
    hit = slash_block_hits(s_idx, num_blocks, BLOCK_SIZE).view(batch * heads, num_blocks).double()
    valid = (v_idx < seq_len).view(batch * heads, -1)
    vertical_block = v_idx.long().clamp(max=seq_len - 1).view(batch * heads, -1) // BLOCK_SIZE
    blocks, bars = _run_work(hit, _block_ownership(layout, seq_len), vertical_block, valid)
    world = layout.world_size
    return tuple(_per_rank_source(x.view(batch, heads, world, world)) for x in (blocks, bars))


def document_source_work(doc_index: DocumentIndex, layout: Layout) -> tuple[Tensor, Tensor]:
    """Listed blocks and bars of packed documents (DESIGN.md §2.7) per (query rank, source rank, b, Hq):
    two int64 ``[W, W, b, Hq]`` tensors.

    Document d spanning the blocks [b0, b1] is on at every tile of its triangle b0 ≤ kb ≤ qb ≤ b1 where
    δ = qb − kb is 0 or hit_d[δ] (every δ when d is dense): one Toeplitz run per document. An off-diagonal
    tile (kb < qb) holds at most one document (one present in both kb and qb covers every token between
    them), so only diagonal tiles can be shared: they are always listed, and counted once per block.
    Bars are the verticals of d in key block kb with kb < qb ≤ b1 and d off at (qb, kb).
    """
    if not isinstance(doc_index, DocumentIndex):
        raise ValueError(f"doc_index must be a mtraining_kernels DocumentIndex, got {type(doc_index).__name__}")
    documents = doc_index.documents
    seq_len = documents.seq_len
    _check_layout(layout, seq_len)
    starts, lengths = documents.starts.cpu(), documents.lengths.cpu()
    sparse, v_idx, s_idx = doc_index.sparse.cpu(), doc_index.v_idx.cpu(), doc_index.s_idx.cpu()
    heads, world = doc_index.num_heads, layout.world_size
    owned = _block_ownership(layout, seq_len)
    diagonal = torch.diag(owned.sum(-1))  # [W, W]: the diagonal tiles of rank r's blocks
    blocks = diagonal.expand(documents.batch_size, heads, world, world).clone()
    bars = torch.zeros_like(blocks)
    for sample, document in (lengths > 0).nonzero().tolist():
        start, length = int(starts[sample, document]), int(lengths[sample, document])
        first, end = start // BLOCK_SIZE, (start + length - 1) // BLOCK_SIZE + 1
        run_owned = owned[:, first:end]
        if sparse[sample, document]:
            on = slash_block_hits(s_idx[sample, document], end - first, BLOCK_SIZE).double()
            verticals = v_idx[sample, document].long()
            valid = verticals < seq_len
            vertical_block = torch.where(valid, verticals // BLOCK_SIZE - first, 0)
        else:
            on = torch.ones(heads, end - first, dtype=torch.float64)
            valid = torch.zeros(heads, 1, dtype=torch.bool)
            vertical_block = torch.zeros(heads, 1, dtype=torch.long)
        run_blocks, run_bars = _run_work(on, run_owned, vertical_block, valid)
        blocks[sample] += run_blocks - torch.diag(run_owned.sum(-1))
        bars[sample] += run_bars
    return _per_rank_source(blocks), _per_rank_source(bars)


def by_step(per_source: Tensor) -> Tensor:
    """Reorder ``[W(rank), W(source), ...]`` to ``[W(rank), W(step)]`` with source = (rank − step) mod W."""
    world = per_source.shape[0]
    ranks = torch.arange(world)[:, None]
    sources = (ranks - torch.arange(world)[None, :]) % world
    return per_source[ranks, sources]


def _report(blocks: Tensor, bars: Tensor, layout: Layout, seq_len: int) -> BalanceReport:
    blocks, bars = by_step(blocks.sum((2, 3))), by_step(bars.sum((2, 3)))
    return BalanceReport(layout, seq_len, blocks, bars, blocks.double() + bars.double() * BAR_COST)


def balance_report(v_idx: Tensor, s_idx: Tensor, layout: Layout, seq_len: int) -> BalanceReport:
    """Per-(rank, step) work of a flat sparse ring for the pattern ``(v_idx, s_idx)`` ``[b, Hq, ·]``."""
    return _report(*source_work(v_idx, s_idx, layout, seq_len), layout, seq_len)


def document_balance_report(doc_index: DocumentIndex, layout: Layout) -> BalanceReport:
    """Per-(rank, step) work of a flat sparse ring for packed documents (:func:`document_source_work`)."""
    return _report(*document_source_work(doc_index, layout), layout, doc_index.documents.seq_len)
