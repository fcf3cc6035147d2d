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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

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
        """The worst step's max_r / mean_r of cost (1.0 when every step is balanced)."""
        per_step = self.cost.amax(0) / self.cost.mean(0)
        return float(per_step.max())

    @property
    def critical_path_ratio(self) -> float:
        """Σ_t max_r cost[r, t] / (Σ cost / W): ring time over perfectly balanced time."""
        return float(self.cost.amax(0).sum() / (self.cost.sum() / self.layout.world_size))


def _check_pattern(v_idx: Tensor, s_idx: Tensor, layout: Layout, seq_len: int) -> None:
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a mtraining_kernels.Layout, got {type(layout).__name__}")
    layout.validate(seq_len, BLOCK_SIZE)
    for name, idx in (("v_idx", v_idx), ("s_idx", s_idx)):
        if idx.dim() != 3 or idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an int32 [b, Hq, width] tensor, got {idx.dtype} {tuple(idx.shape)}")
        if idx.numel() and bool(((idx < 0) | (idx > seq_len)).any()):
            raise ValueError(f"{name} holds values outside [0, {seq_len}]; unused slots hold the sentinel N")
    if v_idx.shape[:2] != s_idx.shape[:2]:
        raise ValueError(f"v_idx {tuple(v_idx.shape)} and s_idx {tuple(s_idx.shape)} disagree on [b, Hq]")


def source_work(v_idx: Tensor, s_idx: Tensor, layout: Layout, seq_len: int) -> tuple[Tensor, Tensor]:
    """Active blocks and bars per (query rank, source rank, b, Hq): two int64 ``[W, W, b, Hq]`` tensors.

    Equal to stacking ``count_work(convert_index(v_idx, s_idx, layout, r, seq_len))`` over ranks r.
    """
    _check_pattern(v_idx, s_idx, layout, seq_len)
    v_idx, s_idx = v_idx.cpu(), s_idx.cpu()
    batch, heads = v_idx.shape[:2]
    world = layout.world_size
    num_blocks = seq_len // BLOCK_SIZE
    owner, _ = layout.to_local(torch.arange(num_blocks) * BLOCK_SIZE, seq_len)
    owned = torch.nn.functional.one_hot(owner, world).T.double()  # [W, NB]: rank r owns block k

    # corr[bh, r, k] = Σ_δ hit[bh, δ]·owned[r, k + δ], a cross-correlation done by zero-padded FFT
    hit = slash_block_hits(s_idx, num_blocks, BLOCK_SIZE).view(batch * heads, num_blocks).double()
    fft_len = 2 * num_blocks
    spectrum = torch.fft.rfft(hit, fft_len).conj()[:, None, :] * torch.fft.rfft(owned, fft_len)[None]
    corr = torch.fft.irfft(spectrum, fft_len)[..., :num_blocks].round()  # [bh, W, NB]

    blocks = torch.einsum("zrk,wk->zrw", corr, owned)

    valid = (v_idx < seq_len).view(batch * heads, -1)
    column = v_idx.long().clamp(max=seq_len - 1).view(batch * heads, -1)
    vertical_block = column // BLOCK_SIZE  # [bh, V]
    owned_from = owned.flip(-1).cumsum(-1).flip(-1)  # [W, NB]: #qb ≥ k owned by r
    not_active = owned_from[:, vertical_block].permute(1, 0, 2) - corr.gather(
        -1, vertical_block[:, None, :].expand(-1, world, -1)
    )  # [bh, W(r), V]
    vertical_owner = torch.nn.functional.one_hot(layout.to_local(column, seq_len)[0], world).double()
    bars = torch.bmm(not_active * valid[:, None, :], vertical_owner * valid[..., None])  # [bh, W(r), W(w)]

    def per_rank_source(x: Tensor) -> Tensor:
        return x.round().long().view(batch, heads, world, world).permute(2, 3, 0, 1).contiguous()

    return per_rank_source(blocks), per_rank_source(bars)


def by_step(per_source: Tensor) -> Tensor:
    """Reorder ``[W(rank), W(source), ...]`` to ``[W(rank), W(step)]`` with source = (rank − step) mod W."""
    world = per_source.shape[0]
    ranks = torch.arange(world)[:, None]
    sources = (ranks - torch.arange(world)[None, :]) % world
    return per_source[ranks, sources]


def balance_report(v_idx: Tensor, s_idx: Tensor, layout: Layout, seq_len: int) -> BalanceReport:
    """Per-(rank, step) work of a flat sparse ring for the pattern ``(v_idx, s_idx)`` ``[b, Hq, ·]``."""
    blocks, bars = source_work(v_idx, s_idx, layout, seq_len)
    blocks, bars = by_step(blocks.sum((2, 3))), by_step(bars.sum((2, 3)))
    return BalanceReport(layout, seq_len, blocks, bars, blocks.double() + bars.double() * BAR_COST)
