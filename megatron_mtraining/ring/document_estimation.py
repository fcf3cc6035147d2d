"""Per-document vertical-slash indices of packed sequences estimated over a context-parallel group,
bit-identical to :func:`mtraining_kernels.document_index.estimate_document_index` on one device (PACKED.md).

Every rank knows the document boundaries of the whole sequence. A sparse document's estimation rows (its
last ``last_q`` positions) may live on several ranks, so every rank gathers all of them; each rank then
scores them against its own keys of the same document with the single-device estimator's fixed-point
functions (:mod:`mtraining_kernels.estimation`) and the ranks combine the integers exactly. Every rank
ends up with every document's complete scores and selects its lists exactly as the single-device
estimator does on the document alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtraining_kernels.budget import StaticBudget, StaticHeadBudgets, TopPBudget
from mtraining_kernels.document_index import (
    DocumentIndex,
    SparseDocument,
    assemble_document_index,
    check_document_estimation,
    same_length_groups,
    sparse_documents,
)
from mtraining_kernels.document_selection import ScoredGroup
from mtraining_kernels.documents import Documents
from mtraining_kernels.estimation import (
    estimation_logits,
    exp_fixed_point,
    probability_fixed_point,
    resolve_budget,
    slash_partial_sums,
    static_logit_fixed_point,
    vertical_scores,
)
from mtraining_kernels.layout import Layout

from .consensus import agree_on_inputs
from .estimation import check_group_inputs
from .estimation_comm import all_gather_last_dim

# every setting that changes what a per-document estimation sends or computes; the ranks agree on them exactly
_AGREED_FIELDS = (
    "b",
    "N_loc",
    "Hq",
    "Hkv",
    "d",
    "dtype",
    "k dtype",
    "layout",
    "last_q",
    "sink_tokens",
    "local_window",
    "softmax_scale",
    "min_sparse_length",
    "top-P",
    "p",
    "cap",
    "block_slashes",
    "v_size",
    "s_size",
    "document starts shape",
    "document starts",
)


def _checked_inputs(
    q_local,
    k_local,
    documents,
    budget,
    layout,
    group,
    min_sparse_length,
    softmax_scale,
    last_q,
    sink_tokens,
    local_window,
) -> tuple[int, StaticHeadBudgets | TopPBudget, list]:
    """The checks of :func:`estimate_document_index_distributed`, alike on every rank: (N, the resolved budget,
    this rank's values of :data:`_AGREED_FIELDS`)."""
    seq_len = check_group_inputs(q_local, k_local, layout, group, softmax_scale)
    batch, local_len, q_heads, dim = q_local.shape
    check_document_estimation(
        documents, batch, seq_len, q_local.device, min_sparse_length, last_q, sink_tokens, local_window
    )
    budget = resolve_budget(budget, q_heads, seq_len, sink_tokens, local_window)
    if isinstance(budget, TopPBudget):
        budget_values = [True, float(budget.p), budget.cap, budget.block_slashes, None, None]
    else:
        budget_values = [False, None, None, None, budget.v_size, budget.s_size]
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    values = [batch, local_len, q_heads, k_local.shape[2], dim, q_local.dtype, k_local.dtype, repr(layout), last_q]
    values += [sink_tokens, local_window, float(scale), min_sparse_length, *budget_values]
    return seq_len, budget, values + [tuple(documents.starts.shape), documents.starts]


def _gather_rows(
    q_local: torch.Tensor,
    row_samples: torch.Tensor,
    row_positions: torch.Tensor,
    layout: Layout,
    seq_len: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """The query rows at (``row_samples``, ``row_positions``) (int64 ``[R]`` on the host, global) on every
    rank: ``[R, Hq, d]`` in q's dtype, from one all-gather of each rank's own rows (padded to the most any
    rank holds).

    Every rank derives every rank's share from the layout on the host, so no sizes travel and the only
    transfer to the device is one copy of the gather indices.
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    owners, local_positions = layout.to_local(row_positions, seq_len)
    by_owner = owners[:, None] == torch.arange(world_size)  # [R, W]
    slot = by_owner.long().cumsum(dim=0).gather(1, owners[:, None]).flatten() - 1  # place in its owner's share
    mine = owners == rank
    mine_count, rows = int(mine.sum()), len(owners)
    indices = torch.cat([row_samples[mine], local_positions[mine], owners, slot]).to(q_local.device)
    mine_samples, mine_positions, owners, slot = indices.split([mine_count, mine_count, rows, rows])
    share = q_local.new_zeros(int(by_owner.sum(dim=0).max()), *q_local.shape[2:])
    share[:mine_count] = q_local[mine_samples, mine_positions]
    gathered = [torch.empty_like(share) for _ in range(world_size)]
    dist.all_gather(gathered, share, group=group)
    return torch.stack(gathered)[owners, slot]


def _score_terms(logits: list, top_p: bool, rows_shape: tuple[int, int], group: dist.ProcessGroup, device) -> list:
    """Per sparse document, (its int64 score terms, the columns with a masked entry or None), from its logits
    ``[1, Hq, L, n]`` against this rank's keys of the document (None for a document without keys here).

    Static terms are the clamped logits. Top-P terms are the masses P = exp(ℓ − m_i)/(L·Z_i), whose row
    maxima m_i and row sums Z_i (``rows_shape`` = (Hq, L) per document) cover every rank's keys of the
    document: one all-reduce each, ``[P, Hq, L]``. Entries of ``logits`` are released as they are used.
    """
    if not top_p:
        return [None if x is None else (static_logit_fixed_point(x), torch.isneginf(x).any(dim=-2)) for x in logits]
    present = [number for number, x in enumerate(logits) if x is not None]
    row_max = torch.full((len(logits), *rows_shape), float("-inf"), device=device)
    for number in present:
        row_max[number] = logits[number][0].amax(dim=-1)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    row_sums = torch.zeros(len(logits), *rows_shape, dtype=torch.int64, device=row_max.device)
    for number in present:
        logits[number] = exp_fixed_point(logits[number], row_max[number : number + 1])
        row_sums[number] = logits[number][0].sum(dim=-1)
    dist.all_reduce(row_sums, op=dist.ReduceOp.SUM, group=group)
    num_rows = rows_shape[1]
    for number in present:
        logits[number] = (probability_fixed_point(logits[number], row_sums[number : number + 1], num_rows), None)
    return logits


def _local_scores(
    q_rows: torch.Tensor,
    row_positions: torch.Tensor,
    k_local: torch.Tensor,
    documents: Documents,
    parts: list[SparseDocument],
    layout: Layout,
    top_p: bool,
    scale: float,
    group: dist.ProcessGroup,
    slashes: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's share of every sparse document's scores, int64: (V of its columns ``[b, Hq, N_loc]``, 0
    outside sparse documents; slash partial sums ``[b, Hq, N]``, offset s of a document starting at o in slot
    o + s, or None without ``slashes``).

    ``q_rows [P, L, Hq, d]`` are the estimation rows of the ``parts`` at ``row_positions [P, L]``; each
    document's rows meet this rank's keys of the same document only. A rank's key positions ascend in local
    order in every layout, so a document's keys here are one local range, found on the host (no device sync).
    """
    batch, local_len = k_local.shape[:2]
    q_heads, last_q = q_rows.shape[2], q_rows.shape[1]
    seq_len, device = documents.seq_len, k_local.device
    rank = dist.get_rank(group)
    k_positions = layout.global_positions(seq_len, rank, device=device)
    bounds = torch.tensor([(part.start, part.start + part.length) for part in parts])
    ranges = torch.searchsorted(layout.global_positions(seq_len, rank), bounds).tolist()  # [P, 2] on the host
    columns, logits = [], []
    for number, (part, (first, last)) in enumerate(zip(parts, ranges)):
        own = slice(first, last)
        keys = k_local[part.sample : part.sample + 1, own]
        rows = q_rows[number : number + 1]
        columns.append(own)
        logits.append(
            estimation_logits(rows, row_positions[number], keys, k_positions[own], scale) if last > first else None
        )

    terms = _score_terms(logits, top_p, (q_heads, last_q), group, device)
    local_verticals = torch.zeros(batch, q_heads, local_len, dtype=torch.int64, device=device)
    slash_sums = torch.zeros(batch, q_heads, seq_len, dtype=torch.int64, device=device) if slashes else None
    for number, part in enumerate(parts):
        if terms[number] is None:
            continue
        document_terms, incomplete = terms[number]
        terms[number] = None
        local_verticals[part.sample, :, columns[number]] = vertical_scores(document_terms, incomplete)[0]
        if slashes:
            slash_sums[part.sample, :, part.start : part.start + part.length] += slash_partial_sums(
                document_terms, row_positions[number], k_positions[columns[number]], part.length
            )[0]
    return local_verticals, slash_sums


def estimate_document_index_distributed(
    q_local: torch.Tensor,
    k_local: torch.Tensor,
    documents: Documents,
    budget: StaticBudget | StaticHeadBudgets | TopPBudget,
    layout: Layout,
    group: dist.ProcessGroup,
    *,
    min_sparse_length: int,
    softmax_scale: float | None = None,
    last_q: int = 64,
    sink_tokens: int = 30,
    local_window: int = 100,
) -> tuple[DocumentIndex, int]:
    """:func:`~mtraining_kernels.document_index.estimate_document_index` of the whole sequence from this rank's
    shard: the same (index, clamped documents), bit for bit, on every rank of ``group``.

    ``q_local [b, N_loc, Hq, d]`` and ``k_local [b, N_loc, Hkv, d]`` are this rank's tokens in ``layout``
    (whose ``world_size`` is the group's size; N = W·N_loc), on the group's device (cuda for nccl, cpu
    for gloo). ``documents`` are the boundaries of the whole sequence in global order, the same on every
    rank and on q's device. The other arguments are those of the single-device estimator. With P sparse
    documents, R = P·``last_q`` estimation rows and I = b·Hq·N, the collectives on ``group`` are:

    1. the input agreement (:func:`~megatron_mtraining.ring.consensus.agree_on_inputs`): every rank checks
       its inputs and the ranks agree on every setting, the document starts included, before any other
       collective, so a bad or inconsistent rank makes every rank raise a ``ValueError`` instead of hanging;
    2. one all-gather of each rank's own estimation rows of every sparse document, ``[R_r, Hq, d]`` in
       q's dtype (R_r the most rows any rank holds);
    3. top-P only: one all-reduce (MAX) of the fp32 row maxima ``[P, Hq, last_q]`` and one all-reduce
       (SUM) of the int64 row sums of the same shape;
    4. one all-gather of the int64 vertical scores of this rank's columns ``[b, Hq, N_loc]`` (a column's
       estimation rows all reach its owner, so its score is complete there);
    5. one all-reduce (SUM) of the int64 slash partial sums of every document, offset s of the document
       starting at o in slot o + s of one ``[b, Hq, N]`` buffer (documents do not overlap).

    Maxima are exact and int64 sums are associative, so every rank holds the integers the single-device
    estimator computes on each document alone and ranks them with the same
    :func:`~mtraining_kernels.document_selection.document_lists`. Nothing but the agreement runs when no document
    is sparse. Each rank receives at most W·R·Hq·d values of q and I int64 gathered, and all-reduces I int64.
    """
    values, error = None, None
    try:
        seq_len, budget, values = _checked_inputs(
            q_local,
            k_local,
            documents,
            budget,
            layout,
            group,
            min_sparse_length,
            softmax_scale,
            last_q,
            sink_tokens,
            local_window,
        )
    except ValueError as caught:
        error = caught
    agree_on_inputs("distributed per-document index estimation", _AGREED_FIELDS, values, error, group)

    q_heads, dim = q_local.shape[2:]
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    device = q_local.device
    sparse, parts, clamped_documents = sparse_documents(documents, min_sparse_length, budget)
    if not parts:
        return assemble_document_index(documents, sparse, [], budget, q_heads, sink_tokens, local_window), 0
    samples = torch.tensor([part.sample for part in parts])  # on the host, like the positions below
    ends = torch.tensor([part.start + part.length for part in parts])
    row_positions = (ends - last_q)[:, None] + torch.arange(last_q)  # [P, last_q]
    q_rows = _gather_rows(
        q_local, samples.repeat_interleave(last_q), row_positions.flatten(), layout, seq_len, group
    ).view(len(parts), last_q, q_heads, dim)
    row_positions = row_positions.to(device)

    top_p = isinstance(budget, TopPBudget)
    block_slashes = top_p and budget.block_slashes  # then V alone makes every score
    local_verticals, slash_sums = _local_scores(
        q_rows, row_positions, k_local, documents, parts, layout, top_p, scale, group, slashes=not block_slashes
    )
    (gathered_verticals,) = all_gather_last_dim([local_verticals], group)  # [b, Hq, W·N_loc] by rank
    if not block_slashes:
        dist.all_reduce(slash_sums, op=dist.ReduceOp.SUM, group=group)
    vertical_sums = layout.unshard(gathered_verticals.chunk(layout.world_size, dim=-1), dim=-1)  # [b, Hq, N]

    groups = []
    for group in same_length_groups(parts):  # each length's scores, cut from the whole-sequence rows
        columns = [(part.sample, slice(part.start, part.start + part.length)) for part in group]
        v_scores = torch.stack([vertical_sums[sample, :, span] for sample, span in columns])
        s_scores = None if block_slashes else torch.stack([slash_sums[sample, :, span] for sample, span in columns])
        groups.append(ScoredGroup(group, v_scores, s_scores))
    index = assemble_document_index(documents, sparse, groups, budget, q_heads, sink_tokens, local_window)
    return index, clamped_documents
