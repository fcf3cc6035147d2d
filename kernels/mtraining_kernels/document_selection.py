"""Every sparse document's lists chosen at once from whole-sequence score rows (DESIGN.md §2.7, PACKED.md).

A document's own index ranks its candidates alone (:func:`mtraining_kernels.estimation.select_index` on the
document). Ranking one document at a time costs a few sorts per document length, each a dozen small
launches: at 512K tokens of 38 documents that was most of the estimation's time. Here the documents are
ranked in rows of a power-of-two width, one sort per width for all documents that fit it (a document of c
candidates in a row of 2^⌈log₂ c⌉, the rest padded with a key that ranks last), in the order of
:func:`~mtraining_kernels.estimation.rank_candidates`: forced entries first, then score descending, then index
ascending. Counts and lists then follow the one-document rules elementwise, so every list is bit for bit the
one the document alone gets.

Score rows are int64 ``[b, Hq, N]`` in global coordinates: a sparse document that starts at o holds V(j) of
its key j at o + j and S(s) of its offset s at o + s; every other slot is ignored.
"""

from __future__ import annotations

import torch

from .budget import StaticHeadBudgets, TopPBudget
from .estimation import FORCED_KEY, INCOMPLETE_SCORE, forced_block_diagonals, list_widths
from .host_copies import to_device
from .layout import BLOCK_SIZE


def _row_widths(counts: list[int]) -> dict[int, list[int]]:
    """The parts (numbers) of each row width, the power of two at or above their candidate counts."""
    widths: dict[int, list[int]] = {}
    for number, count in enumerate(counts):
        widths.setdefault(1 << (count - 1).bit_length(), []).append(number)
    return widths


def _ranked(scores: torch.Tensor, parts, counts: list[int], forced: list[int], width: int, totals: bool = False):
    """(ranked scores, ranked candidate indices), int64 ``[P, Hq, width]``, of every part's first ``counts[p]``
    slots of ``scores [b, Hq, N]`` from its start, ``forced[p]`` of them forced; columns past a part's
    candidates are unspecified. With ``totals`` also each part's sum of its candidates' scores ``[P, Hq]``.
    The slots of every row width travel to the device in one copy."""
    heads, device, last_slot = scores.shape[1], scores.device, scores.shape[-1] - 1
    rows_by_width = _row_widths(counts)
    host = []  # per width: its parts' (number, sample, count, forced) rows, then their slots, flattened
    for row_width, numbers in rows_by_width.items():
        steps = torch.arange(row_width)
        host.append(torch.tensor([[n, parts[n].sample, counts[n], forced[n]] for n in numbers]).flatten())
        host.append((torch.tensor([parts[n].start for n in numbers])[:, None] + steps).clamp(max=last_slot).flatten())
    pieces = to_device(torch.cat(host), device).split([len(piece) for piece in host])
    ranked_scores = scores.new_zeros(len(parts), heads, width)
    ranked_index = torch.zeros_like(ranked_scores)
    sums = scores.new_empty(len(parts), heads) if totals else None
    steps = torch.arange(max(rows_by_width), device=device)
    for (row_width, numbers), table, slots in zip(rows_by_width.items(), pieces[0::2], pieces[1::2]):
        number, sample, count, first_forced = table.view(len(numbers), 4).unbind(1)
        rows = scores[sample[:, None], :, slots.view(len(numbers), row_width)].transpose(1, 2)  # [g, Hq, w]
        candidate = steps[:row_width] < count[:, None, None]
        if totals:
            sums[number] = torch.where(candidate, rows, 0).sum(dim=-1)
        keys = torch.where(steps[:row_width] < first_forced[:, None, None], FORCED_KEY, rows)
        keys = torch.where(candidate, keys, INCOMPLETE_SCORE)  # padding: the lowest key, after every candidate
        kept = min(row_width, width)
        order = torch.argsort(-keys, dim=-1, stable=True)[..., :kept]  # ties keep index order
        ranked_index[number, :, :kept] = order
        ranked_scores[number, :, :kept] = rows.gather(-1, order)
    return ranked_scores, ranked_index, sums


def _chosen(ranked_index: torch.Tensor, counts: torch.Tensor, most: int, seq_len: int) -> torch.Tensor:
    """The first ``counts [P, Hq]`` (at most ``most``) ranked indices, ascending, then ``seq_len``: int64
    ``[P, Hq, width]``. Only the first ``most`` columns are sorted (rows of up to 4096 sort in one kernel)."""
    most = min(most, ranked_index.shape[-1])
    steps = torch.arange(most, device=ranked_index.device)
    chosen = torch.full_like(ranked_index, seq_len)
    chosen[..., :most] = torch.where(steps < counts[..., None], ranked_index[..., :most], seq_len).sort(dim=-1).values
    return chosen


def _top_p_counts(ranked_masses, total_mass, p: float, first_forced, cap) -> torch.Tensor:
    """:func:`~mtraining_kernels.estimation.top_p_counts` with a forced count and a cap per part ``[P]``. Masses
    are ≥ 0, so the entries short of the mass are a prefix, and those past the cap only count after it."""
    needed = torch.ceil(total_mass.double() * p).long()
    short = (ranked_masses.cumsum(dim=-1) < needed[..., None]).sum(dim=-1)
    return torch.minimum(torch.maximum(short + 1, first_forced[:, None]), cap[:, None])


def _block_diagonal_sums(vertical_sums: torch.Tensor, documents, sparse: torch.Tensor) -> torch.Tensor:
    """Block-diagonal masses of every sparse document: diagonal δ of the document starting at o in slot o + δ,
    int64 ``[b, Hq, N]`` (:func:`~mtraining_kernels.estimation.block_diagonal_scores` of each document alone)."""
    batch, heads, seq_len = vertical_sums.shape
    doc_id = documents.doc_id.long()
    start, length = documents.starts.gather(1, doc_id), documents.lengths.gather(1, doc_id)
    index = torch.arange(seq_len, device=vertical_sums.device) - start
    slot = torch.where(sparse.gather(1, doc_id), start + (length - 1 - index) // BLOCK_SIZE, seq_len)
    sums = vertical_sums.new_zeros(batch, heads, seq_len + 1)  # slot N: the keys of dense documents
    return sums.scatter_add_(-1, slot[:, None, :].expand(batch, heads, seq_len), vertical_sums)[..., :seq_len]


def document_lists(
    documents,
    sparse: torch.Tensor,
    parts: list,
    vertical_sums: torch.Tensor,
    slash_sums: torch.Tensor | None,
    budget: StaticHeadBudgets | TopPBudget,
    sink_tokens: int,
    local_window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sparse document's (vertical list, slash list), int32 ``[P, Hq, Vmax]`` and ``[P, Hq, Smax]``.

    ``sparse`` bool ``[b, m_max]`` and ``parts`` (``SparseDocument`` s, in (sample, document) order) from
    ``document_index.sparse_documents``; ``budget`` the whole sequence's, resolved, which sets the widths
    ``list_widths(budget, N)`` (a document's static sizes are clamped to its length here). Verticals are
    global key positions, slashes offsets, both ascending and padded with N. ``vertical_sums``/``slash_sums``
    as in the module docstring; ``slash_sums`` is None for top-P over block diagonals, whose scores come from
    V alone.
    """
    seq_len, device = documents.seq_len, vertical_sums.device
    v_width, s_width = list_widths(budget, seq_len)
    lengths = [part.length for part in parts]
    top_p = isinstance(budget, TopPBudget)
    block_slashes = top_p and budget.block_slashes
    if block_slashes:
        slash_sums = _block_diagonal_sums(vertical_sums, documents, sparse)
        slash_counts = [-(-length // BLOCK_SIZE) for length in lengths]
        slash_forced = [min(forced_block_diagonals(local_window), count) for count in slash_counts]
    else:
        slash_counts, slash_forced = lengths, [local_window] * len(parts)

    total_mass, lists = None, []
    for scores, counts, forced, width, sizes in (
        (vertical_sums, lengths, [sink_tokens] * len(parts), v_width, None if top_p else budget.v_size),
        (slash_sums, slash_counts, slash_forced, s_width, None if top_p else budget.s_size),
    ):
        ranked_scores, ranked_index, sums = _ranked(scores, parts, counts, forced, width, totals=total_mass is None)
        total_mass = sums if total_mass is None else total_mass  # V's: each document's whole mass
        candidates, first_forced = to_device(torch.tensor([counts, forced]), device)
        if top_p:
            cap = candidates.clamp(max=budget.cap)
            chosen_counts = _top_p_counts(ranked_scores, total_mass, budget.p, first_forced, cap)
        else:
            chosen_counts = torch.minimum(to_device(sizes, device)[None, :], candidates[:, None])
        lists.append(_chosen(ranked_index, chosen_counts, max(counts), seq_len))
    vertical_list, slash_list = lists
    starts = to_device(torch.tensor([part.start for part in parts]), device)[:, None, None]
    vertical_list = torch.where(vertical_list < seq_len, vertical_list + starts, seq_len)
    if block_slashes:
        slash_list = torch.where(slash_list < seq_len, slash_list * BLOCK_SIZE, seq_len)
    return vertical_list.to(torch.int32), slash_list.to(torch.int32)
