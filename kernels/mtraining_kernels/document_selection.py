"""Every sparse document's lists chosen at once from whole-sequence score rows (DESIGN.md §2.7, PACKED.md).

A document's own index ranks its candidates alone (:func:`mtraining_kernels.estimation.select_index` on the
document). Ranking one document at a time costs a few sorts per document, each a dozen small launches: at
512K tokens of 38 documents that was most of the estimation's time. Here the candidates of every document
are ranked together in their sample's row, by one stable sort on the ranking key and one stable sort on the
document, so each document's candidates end up contiguous and in the order of
:func:`~mtraining_kernels.estimation.rank_candidates` (forced entries first, then score descending, then index
ascending). Counts and lists then follow the one-document rules elementwise, so every list is bit for bit
the one the document alone gets.

Score rows are int64 ``[b, Hq, N]`` in global coordinates: a sparse document that starts at o holds V(j) of
its key j at o + j and S(s) of its offset s at o + s; every other slot is ignored.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .budget import StaticHeadBudgets, TopPBudget
from .estimation import FORCED_KEY, forced_block_diagonals, list_widths
from .host_copies import to_device
from .layout import BLOCK_SIZE


class _Candidates(NamedTuple):
    """One kind of candidate (verticals, slashes or block diagonals) of P sparse documents, on the device.

    ``index [b, N]``: each slot's candidate index inside its document (slot − start); ``part [b, N]``: the
    slot's document number 0 … P−1, or P where the slot is no candidate; ``forced [b, N]``: how many of the
    slot's document's candidates are forced; ``gather [P, width]``: where the document's t-th ranked candidate
    lies in its sample's ranked row (past its last candidate, the last one again); per document, int64 ``[P]``:
    ``sample``, ``count`` (its candidates), ``first_forced`` (its forced count) and ``start`` (its first token).
    """

    index: torch.Tensor
    part: torch.Tensor
    forced: torch.Tensor
    gather: torch.Tensor
    sample: torch.Tensor
    count: torch.Tensor
    first_forced: torch.Tensor
    start: torch.Tensor


def _candidates(documents, parts, counts: list[int], forced: list[int], width: int) -> _Candidates:
    """The first ``counts[p]`` slots of every part (``SparseDocument`` s in (sample, document) order) as
    candidates, ``forced[p]`` of them forced. The part tables travel in one host-to-device copy."""
    num_parts, device = len(parts), documents.starts.device
    part_of_slot = torch.full((documents.batch_size, documents.max_documents), num_parts, dtype=torch.int64)
    rows, ranked_start, sample = [], 0, None
    for number, (part, count, first_forced) in enumerate(zip(parts, counts, forced)):
        part_of_slot[part.sample, part.document] = number
        ranked_start = 0 if part.sample != sample else ranked_start  # a sample's earlier parts rank first
        sample = part.sample
        rows.append([part.sample, count, first_forced, part.start, ranked_start])
        ranked_start += count
    table = torch.tensor(rows, dtype=torch.int64)
    steps = torch.arange(width)
    gather = table[:, 4:5] + torch.minimum(steps[None, :], table[:, 1:2] - 1)
    part_of_slot, table, gather = (to_device(t, device) for t in (part_of_slot, table, gather))
    doc_id = documents.doc_id.long()
    index = torch.arange(documents.seq_len, device=device) - documents.starts.gather(1, doc_id)
    part = part_of_slot.gather(1, doc_id)
    padded = torch.cat([table, table.new_zeros(1, table.shape[1])])  # row P: no candidates, none forced
    part = torch.where(index < padded[part, 1], part, num_parts)
    return _Candidates(index, part, padded[part, 2], gather, table[:, 0], table[:, 1], table[:, 2], table[:, 3])


def _ranked(scores: torch.Tensor, candidates: _Candidates) -> tuple[torch.Tensor, torch.Tensor]:
    """(ranked scores, ranked candidate indices), int64 ``[P, Hq, width]``: every part's candidates of
    ``scores [b, Hq, N]`` in :func:`~mtraining_kernels.estimation.rank_candidates` order."""
    batch, heads, seq_len = scores.shape
    keys = torch.where((candidates.index < candidates.forced)[:, None, :], FORCED_KEY, scores)
    order = torch.argsort(-keys, dim=-1, stable=True)  # ties keep slot order: index order inside a part
    part = candidates.part.to(torch.int32)[:, None, :].expand(batch, heads, seq_len).gather(-1, order)
    order = order.gather(-1, torch.argsort(part, dim=-1, stable=True))  # each part contiguous, still ranked
    rows = candidates.sample[:, None, None]
    slots = order[rows[..., 0], :, candidates.gather].transpose(1, 2)  # [P, Hq, width]
    head = torch.arange(heads, device=scores.device)[None, :, None]
    return scores[rows, head, slots], candidates.index[rows, slots]


def _chosen(ranked_index: torch.Tensor, counts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``counts [P, Hq]`` ranked indices, ascending, then ``seq_len``: int64 ``[P, Hq, width]``."""
    steps = torch.arange(ranked_index.shape[-1], device=ranked_index.device)
    return torch.where(steps < counts[..., None], ranked_index, seq_len).sort(dim=-1).values


def _top_p_counts(ranked_masses, total_mass, p: float, first_forced, cap) -> torch.Tensor:
    """:func:`~mtraining_kernels.estimation.top_p_counts` with a forced count and a cap per part ``[P]``. Masses
    are ≥ 0, so the entries short of the mass are a prefix, and those past the cap only count after it."""
    needed = torch.ceil(total_mass.double() * p).long()
    short = (ranked_masses.cumsum(dim=-1) < needed[..., None]).sum(dim=-1)
    return torch.minimum(torch.maximum(short + 1, first_forced[:, None]), cap[:, None])


def _block_diagonal_sums(vertical_sums: torch.Tensor, documents, verticals: _Candidates) -> torch.Tensor:
    """Block-diagonal masses of every part: diagonal δ of the document starting at o in slot o + δ, int64
    ``[b, Hq, N]`` (:func:`~mtraining_kernels.estimation.block_diagonal_scores` of each document alone)."""
    batch, heads, seq_len = vertical_sums.shape
    doc_id = documents.doc_id.long()
    start, length = documents.starts.gather(1, doc_id), documents.lengths.gather(1, doc_id)
    slot = start + (length - 1 - verticals.index) // BLOCK_SIZE
    slot = torch.where(verticals.part < len(verticals.sample), slot, seq_len)  # no candidate: the spare slot
    sums = vertical_sums.new_zeros(batch, heads, seq_len + 1)
    return sums.scatter_add_(-1, slot[:, None, :].expand(batch, heads, seq_len), vertical_sums)[..., :seq_len]


def document_lists(
    documents,
    parts: list,
    vertical_sums: torch.Tensor,
    slash_sums: torch.Tensor | None,
    budget: StaticHeadBudgets | TopPBudget,
    sink_tokens: int,
    local_window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sparse document's (vertical list, slash list), int32 ``[P, Hq, Vmax]`` and ``[P, Hq, Smax]``.

    ``parts``: the ``SparseDocument`` s, in (sample, document) order, each with its budget clamped to its
    length (``document_index.sparse_documents``); ``budget`` the whole sequence's, resolved, which sets the
    widths ``list_widths(budget, N)``. Verticals are global key positions, slashes offsets, both ascending
    and padded with N. ``vertical_sums``/``slash_sums`` as in the module docstring; ``slash_sums`` is None
    for top-P over block diagonals, whose scores come from V alone.
    """
    seq_len = documents.seq_len
    device = vertical_sums.device
    v_width, s_width = list_widths(budget, seq_len)
    lengths = [part.length for part in parts]
    verticals = _candidates(documents, parts, lengths, [sink_tokens] * len(parts), v_width)
    top_p = isinstance(budget, TopPBudget)
    block_slashes = top_p and budget.block_slashes
    if block_slashes:
        diagonals = [-(-length // BLOCK_SIZE) for length in lengths]
        forced = [min(forced_block_diagonals(local_window), count) for count in diagonals]
        slashes = _candidates(documents, parts, diagonals, forced, s_width)
        slash_sums = _block_diagonal_sums(vertical_sums, documents, verticals)
    else:
        slashes = _candidates(documents, parts, lengths, [local_window] * len(parts), s_width)

    if top_p:
        batch, heads, _ = vertical_sums.shape
        totals = vertical_sums.new_zeros(batch, heads, len(parts) + 1)
        totals.scatter_add_(-1, verticals.part[:, None, :].expand_as(vertical_sums), vertical_sums)
        total_mass = totals[verticals.sample, :, torch.arange(len(parts), device=device)]  # [P, Hq]
    lists = []
    for candidates, scores, sizes in (
        (verticals, vertical_sums, None if top_p else budget.v_size),
        (slashes, slash_sums, None if top_p else budget.s_size),
    ):
        ranked_scores, ranked_index = _ranked(scores, candidates)
        if top_p:
            cap = candidates.count.clamp(max=budget.cap)
            counts = _top_p_counts(ranked_scores, total_mass, budget.p, candidates.first_forced, cap)
        else:
            counts = torch.minimum(to_device(sizes, device)[None, :], candidates.count[:, None])
        lists.append(_chosen(ranked_index, counts, seq_len))
    vertical_list, slash_list = lists
    starts = verticals.start[:, None, None]
    vertical_list = torch.where(vertical_list < seq_len, vertical_list + starts, seq_len)
    if block_slashes:
        slash_list = torch.where(slash_list < seq_len, slash_list * BLOCK_SIZE, seq_len)
    return vertical_list.to(torch.int32), slash_list.to(torch.int32)
