"""Every sparse document's lists chosen at once (DESIGN.md §2.7, PACKED.md).

A document's own index ranks its candidates alone (:func:`mtraining_kernels.estimation.select_index` on the
document). Ranking one document length at a time costs a few sorts per length, each a dozen small
launches: at 512K tokens of 38 documents of 19 lengths that was most of the estimation's time. Here the
documents are ranked in rows of a power-of-two width, one sort for all documents that fit one width (a
document of c candidates in a row of 2^⌈log₂ c⌉, the rest padded with a key that ranks last), in the order
of :func:`~mtraining_kernels.estimation.rank_candidates`: forced entries first, then score descending, then
index ascending. Counts and lists then follow the one-document rules elementwise, so every list is bit for
bit the one the document alone gets.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .budget import StaticHeadBudgets, TopPBudget
from .estimation import (
    FORCED_KEY,
    INCOMPLETE_SCORE,
    block_diagonal_scores,
    forced_block_diagonals,
    list_widths,
)
from .host_copies import to_device
from .layout import BLOCK_SIZE


class ScoredGroup(NamedTuple):
    """The scores of sparse documents of one length L: ``parts`` (their ``SparseDocument`` s), int64
    ``vertical [g, Hq, L]`` (V of each key of the document) and ``slash [g, Hq, L]`` (S of each offset), or
    None for top-P over block diagonals, whose scores come from V alone."""

    parts: list
    vertical: torch.Tensor
    slash: torch.Tensor | None


class _Ranked(NamedTuple):
    """One kind of candidate ranked: the groups in row order (``order``), and for their parts in that order
    the ranked scores and candidate indices, int64 ``[P, Hq, K]`` (columns past a part's candidates are
    unspecified)."""

    order: list[int]
    scores: torch.Tensor
    index: torch.Tensor


def _ranked(scores: list[torch.Tensor], counts: list[int], forced: list[int], width: int) -> _Ranked:
    """Rank every group's candidates (``scores[i] [g_i, Hq, counts[i]]``, the first ``forced[i]`` forced),
    keeping K = min(``width``, widest row) per part. Each width's per-part (count, forced) travel in one copy."""
    rows_of_width: dict[int, list[int]] = {}
    for group, count in enumerate(counts):
        rows_of_width.setdefault(1 << (count - 1).bit_length(), []).append(group)
    order = [group for groups in rows_of_width.values() for group in groups]
    sizes = [scores[group].shape[0] for group in order]
    table = torch.tensor([(counts[group], forced[group]) for group, size in zip(order, sizes) for _ in range(size)])
    device = scores[0].device
    count_of_part, forced_of_part = to_device(table, device)[:, :, None, None].unbind(1)
    kept_all = min(width, max(rows_of_width))
    steps = torch.arange(max(rows_of_width), device=device)
    ranked_scores, ranked_index, first = [], [], 0
    for row_width, groups in rows_of_width.items():
        padded = [_widened(scores[group], row_width) for group in groups]
        rows = padded[0] if len(padded) == 1 else torch.cat(padded)
        last = first + rows.shape[0]
        keys = torch.where(steps[:row_width] < forced_of_part[first:last], FORCED_KEY, rows)
        if any(counts[group] < row_width for group in groups):  # padding gets the lowest key: it ranks last
            keys = torch.where(steps[:row_width] < count_of_part[first:last], keys, INCOMPLETE_SCORE)
        index = torch.argsort(-keys, dim=-1, stable=True)[..., :kept_all]  # ties keep index order
        ranked_scores.append(_widened(rows.gather(-1, index), kept_all))
        ranked_index.append(_widened(index, kept_all))
        first = last
    if len(ranked_index) == 1:
        return _Ranked(order, ranked_scores[0], ranked_index[0])
    return _Ranked(order, torch.cat(ranked_scores), torch.cat(ranked_index))


def _widened(ranked: torch.Tensor, width: int) -> torch.Tensor:
    """``ranked [..., k]`` padded with zeros to ``width`` columns (itself when k == width)."""
    return ranked if ranked.shape[-1] == width else F.pad(ranked, (0, width - ranked.shape[-1]))


def _chosen(ranked_index: torch.Tensor, counts: torch.Tensor, most: int, seq_len: int) -> torch.Tensor:
    """The first ``counts [P, Hq]`` (at most ``most``) ranked indices, ascending, then ``seq_len``: int64
    ``[P, Hq, min(most, K)]``; the list's later columns are ``seq_len`` too (rows up to 4096 sort in one kernel)."""
    most = min(most, ranked_index.shape[-1])
    steps = torch.arange(most, device=ranked_index.device)
    return torch.where(steps < counts[..., None], ranked_index[..., :most], seq_len).sort(dim=-1).values


def _top_p_counts(ranked_masses, total_mass, p: float, first_forced, cap) -> torch.Tensor:
    """:func:`~mtraining_kernels.estimation.top_p_counts` with a forced count and a cap per part ``[P]``. Masses
    are ≥ 0, so the entries short of the mass are a prefix, and those past the cap only count after it."""
    needed = torch.ceil(total_mass.double() * p).long()
    short = (ranked_masses.cumsum(dim=-1) < needed[..., None]).sum(dim=-1)
    return torch.minimum(torch.maximum(short + 1, first_forced[:, None]), cap[:, None])


def document_lists(
    groups: list[ScoredGroup],
    budget: StaticHeadBudgets | TopPBudget,
    seq_len: int,
    sink_tokens: int,
    local_window: int,
) -> list[tuple[list, torch.Tensor]]:
    """Every sparse document's lists: [(parts, verticals int32 ``[P, Hq, ≤ Vmax]``), (parts, slashes int32
    ``[P, Hq, ≤ Smax]``)], each kind with its parts in its own order; the columns up to Vmax (Smax) that are
    not there would all be N.

    ``budget`` is the whole sequence's, resolved, which sets the widths ``list_widths(budget, N)``; a document's
    static sizes are clamped to its length here. Verticals are global key positions, slashes offsets, both
    ascending and padded with N.
    """
    device = groups[0].vertical.device
    v_width, s_width = list_widths(budget, seq_len)
    lengths = [group.vertical.shape[-1] for group in groups]
    top_p = isinstance(budget, TopPBudget)
    block_slashes = top_p and budget.block_slashes
    if block_slashes:
        slash_scores = [
            block_diagonal_scores(group.vertical, torch.arange(length, device=device), length)
            for group, length in zip(groups, lengths)
        ]
        slash_counts = [scores.shape[-1] for scores in slash_scores]
        slash_forced = [min(forced_block_diagonals(local_window), count) for count in slash_counts]
    else:
        slash_scores, slash_counts, slash_forced = (
            [group.slash for group in groups],
            lengths,
            [local_window] * len(groups),
        )

    kinds = []
    for scores, counts, forced, width, sizes in (
        ([group.vertical for group in groups], lengths, [sink_tokens] * len(groups), v_width, "v_size"),
        (slash_scores, slash_counts, slash_forced, s_width, "s_size"),
    ):
        ranked = _ranked(scores, counts, forced, width)
        parts = [part for group in ranked.order for part in groups[group].parts]
        per_part = [(counts[group], forced[group]) for group in ranked.order for _ in groups[group].parts]
        candidates, first_forced = to_device(torch.tensor(per_part).T.contiguous(), device)
        if top_p:
            total_mass = torch.cat([groups[group].vertical.sum(dim=-1) for group in ranked.order])  # [P, Hq]
            cap = candidates.clamp(max=budget.cap)
            chosen_counts = _top_p_counts(ranked.scores, total_mass, budget.p, first_forced, cap)
        else:
            chosen_counts = torch.minimum(to_device(getattr(budget, sizes), device)[None, :], candidates[:, None])
        chosen = _chosen(ranked.index, chosen_counts, max(counts), seq_len)
        kinds.append((parts, chosen))

    (v_parts, verticals), (s_parts, slashes) = kinds
    starts = to_device(torch.tensor([part.start for part in v_parts]), device)[:, None, None]
    verticals = torch.where(verticals < seq_len, verticals + starts, seq_len)
    if block_slashes:
        slashes = torch.where(slashes < seq_len, slashes * BLOCK_SIZE, seq_len)
    return [(v_parts, verticals.to(torch.int32)), (s_parts, slashes.to(torch.int32))]
