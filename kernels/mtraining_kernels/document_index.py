"""Per-document vertical-slash indices of packed sequences and their estimation on one device (PACKED.md).

A document at least ``min_sparse_length`` long gets its own index, estimated from its own last queries
against its own keys exactly as an unpacked sequence of its length would be (DESIGN.md §2.2), then moved
to global coordinates: verticals are global key positions inside the document, slashes stay offsets
i − j. Shorter documents are attended densely-causally. The mask is
:func:`mtraining_kernels.reference.packed_vertical_slash_mask`; the same index over a context-parallel
group is :func:`megatron_mtraining.ring.document_estimation.estimate_document_index_distributed`, built from
this module's checks, :func:`sparse_documents` and :func:`assemble_document_index`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .budget import StaticBudget, StaticHeadBudgets, TopPBudget
from .document_selection import ScoredGroup, document_lists
from .documents import Documents
from .estimation import (
    MAX_LAST_Q,
    check_forced_entries,
    check_int,
    check_query_key,
    list_widths,
    resolve_budget,
    scores_of_keys,
)
from .host_copies import to_device


def _list_violations(
    lists: torch.Tensor, low: torch.Tensor, high: torch.Tensor, sparse: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool masks of a list ``[b, m_max, Hq, width]``: entries outside [low, high) of their document (``low``/
    ``high`` ``[b, m_max]``), in a dense document, or padding other than ``seq_len``; and entries that do not
    ascend strictly (``[..., width − 1]``, only padding may follow padding)."""
    valid = lists < seq_len
    outside = valid & ((lists < low[..., None, None]) | (lists >= high[..., None, None]) | ~sparse[..., None, None])
    outside |= ~valid & (lists != seq_len)
    previous, following = lists[..., :-1], lists[..., 1:]
    return outside, (following <= previous) & (following < seq_len)


def _raise_outside(name: str, lists: torch.Tensor, outside: torch.Tensor, low, high, sparse, seq_len: int) -> None:
    where = tuple(int(x) for x in outside.nonzero()[0])
    sample, document = where[:2]
    if not sparse[sample, document]:
        allowed = f"document {document} of sample {sample} is dense (sparse=False), so its lists hold only N"
    else:
        allowed = (
            f"the entries of document {document} of sample {sample} lie in "
            f"[{int(low[sample, document])}, {int(high[sample, document])})"
        )
    raise ValueError(
        f"{name}{list(where)}={int(lists[where])} is not allowed: {allowed}; unused slots hold N={seq_len}"
    )


def _raise_disordered(name: str, lists: torch.Tensor, disordered: torch.Tensor, seq_len: int) -> None:
    where = tuple(int(x) for x in disordered.nonzero()[0])
    raise ValueError(
        f"{name}{list(where[:3])} = {lists[where[:3]].tolist()} is not strictly ascending at slot {where[3] + 1}; "
        f"list each entry once, ascending, then pad with N={seq_len}"
    )


@dataclass(frozen=True, eq=False)
class DocumentIndex:
    """Vertical-slash indices of the documents of packed sequences, in global coordinates.

    ``sparse`` bool ``[b, m_max]``: the documents with their own index; the others (and unused slots)
    are attended densely-causally and their rows hold only padding. ``v_idx`` int32
    ``[b, m_max, Hq, Vmax]``: global key positions inside the document, ascending, padded with N.
    ``s_idx`` int32 ``[b, m_max, Hq, Smax]``: offsets i − j below the document's length, ascending,
    padded with N. ``every_document_sparse`` (derived, read in the checks' one host read): no document is dense.
    """

    documents: Documents
    sparse: torch.Tensor
    v_idx: torch.Tensor
    s_idx: torch.Tensor
    every_document_sparse: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        documents = self.documents
        if not isinstance(documents, Documents):
            raise ValueError(f"documents must be a Documents, got {type(documents).__name__}")
        slots = (documents.batch_size, documents.max_documents)
        if not isinstance(self.sparse, torch.Tensor) or self.sparse.dtype != torch.bool:
            got = getattr(self.sparse, "dtype", type(self.sparse).__name__)
            raise ValueError(f"sparse must be a bool tensor [b, m_max], got {got}")
        if tuple(self.sparse.shape) != slots:
            raise ValueError(f"sparse has shape {tuple(self.sparse.shape)} but the documents have [b, m_max]={slots}")
        for name, lists in (("v_idx", self.v_idx), ("s_idx", self.s_idx)):
            if not isinstance(lists, torch.Tensor) or lists.dim() != 4 or lists.dtype != torch.int32:
                raise ValueError(
                    f"{name} must be an int32 tensor [b, m_max, Hq, width], got "
                    f"{tuple(getattr(lists, 'shape', ()))} {getattr(lists, 'dtype', type(lists).__name__)}"
                )
            if tuple(lists.shape[:2]) != slots or lists.shape[-1] == 0:
                raise ValueError(
                    f"{name} has shape {tuple(lists.shape)}; it needs [b, m_max]={slots} leading and a non-empty list"
                )
            if lists.device != documents.starts.device or self.sparse.device != documents.starts.device:
                raise ValueError(
                    f"{name} is on {lists.device}, sparse on {self.sparse.device} and the documents on "
                    f"{documents.starts.device}; put them on one device"
                )
        if self.v_idx.shape[2] != self.s_idx.shape[2]:
            raise ValueError(f"v_idx has Hq={self.v_idx.shape[2]} heads but s_idx has {self.s_idx.shape[2]}")
        starts, lengths, seq_len = documents.starts, documents.lengths, documents.seq_len
        unused_sparse = self.sparse & (lengths == 0)
        bounds = {"v_idx": (starts, starts + lengths), "s_idx": (torch.zeros_like(lengths), lengths)}  # keys, offsets
        masks = {
            name: _list_violations(lists, *bounds[name], self.sparse, seq_len)
            for name, lists in (("v_idx", self.v_idx), ("s_idx", self.s_idx))
        }
        # every condition in one host read: on a GPU the checks cost one sync, not five
        conditions = [unused_sparse.any()] + [mask.any() for pair in masks.values() for mask in pair]
        flags = torch.stack(conditions + [(self.sparse | (lengths == 0)).all()]).tolist()
        object.__setattr__(self, "every_document_sparse", bool(flags.pop()))
        if flags[0]:
            sample, slot = (int(x) for x in unused_sparse.nonzero()[0])
            raise ValueError(
                f"sparse[{sample}, {slot}] is True but sample {sample} has only "
                f"{int(documents.num_documents[sample])} documents; unused slots are not sparse"
            )
        for (name, (outside, disordered)), is_outside, is_disordered in zip(masks.items(), flags[1::2], flags[2::2]):
            lists = getattr(self, name)
            if is_outside:
                _raise_outside(name, lists, outside, *bounds[name], self.sparse, seq_len)
            if is_disordered:
                _raise_disordered(name, lists, disordered, seq_len)

    @property
    def num_heads(self) -> int:
        return self.v_idx.shape[2]

    @classmethod
    def dense(cls, documents: Documents, heads: int) -> DocumentIndex:
        """Every document attended densely-causally (no document sparse), on the documents' device."""
        slots = (documents.batch_size, documents.max_documents)
        device = documents.starts.device
        padding = torch.full((*slots, heads, 1), documents.seq_len, dtype=torch.int32, device=device)
        return cls(documents, torch.zeros(slots, dtype=torch.bool, device=device), padding, padding)


def check_min_sparse_length(min_sparse_length, last_q: int, sink_tokens: int, local_window: int) -> None:
    """Raise unless a document of ``min_sparse_length`` tokens holds its estimation rows and forced entries."""
    shortest = max(last_q, sink_tokens, local_window, 1)
    if isinstance(min_sparse_length, bool) or not isinstance(min_sparse_length, int) or min_sparse_length < shortest:
        raise ValueError(
            f"min_sparse_length={min_sparse_length!r} must be an integer >= max(last_q={last_q}, "
            f"sink_tokens={sink_tokens}, local_window={local_window}, 1) = {shortest}: a document with its own "
            f"index must hold its last_q estimation queries, its sink_tokens sinks and its local_window offsets"
        )


def check_document_estimation(
    documents, batch: int, seq_len: int, device, min_sparse_length, last_q, sink_tokens, local_window
) -> None:
    """The checks of a per-document estimation of ``batch`` sequences of ``seq_len`` tokens on ``device``
    (q/k and the budget are checked apart)."""
    if not isinstance(documents, Documents):
        raise ValueError(f"documents must be a mtraining_kernels.documents.Documents, got {type(documents).__name__}")
    if (batch, seq_len) != (documents.batch_size, documents.seq_len):
        raise ValueError(
            f"q has [b, N]={(batch, seq_len)} but the documents describe "
            f"{(documents.batch_size, documents.seq_len)}; build them from this batch"
        )
    if documents.starts.device != device:
        raise ValueError(f"the documents are on {documents.starts.device} but q on {device}; put both on one device")
    check_int("last_q", last_q, 1, min(MAX_LAST_Q, seq_len), f"at most N={seq_len} and one {MAX_LAST_Q}-row tile")
    check_forced_entries(sink_tokens, local_window, seq_len)
    check_min_sparse_length(min_sparse_length, last_q, sink_tokens, local_window)


class SparseDocument(NamedTuple):
    """A document with its own index: its slot (sample, document) and its tokens start … start + length − 1."""

    sample: int
    document: int
    start: int
    length: int


def sparse_documents(
    documents: Documents, min_sparse_length: int, budget: StaticHeadBudgets | TopPBudget
) -> tuple[torch.Tensor, list[SparseDocument], int]:
    """(``sparse`` bool ``[b, m_max]``, the sparse documents in (sample, document) order, how many have a
    static size clamped to their length) for documents of at least ``min_sparse_length`` tokens and a
    resolved budget."""
    sparse = documents.lengths >= min_sparse_length
    spans = documents.host_spans  # on the CPU: the loop below syncs nothing
    chosen = []
    for sample, document in (spans[..., 1] >= min_sparse_length).nonzero().tolist():
        start, length = spans[sample, document].tolist()
        chosen.append(SparseDocument(sample, document, start, length))
    if isinstance(budget, TopPBudget) or not chosen:  # a top-P cap is a ceiling, never clamped
        return sparse, chosen, 0
    largest = max(int(budget.v_size.max()), int(budget.s_size.max()))  # the selection clamps the sizes itself
    return sparse, chosen, sum(part.length < largest for part in chosen)


def same_length_groups(parts: list[SparseDocument]) -> list[list[SparseDocument]]:
    """``parts`` grouped by length, in order of first appearance: one batched score pass per length."""
    groups: dict[int, list[SparseDocument]] = {}
    for part in parts:
        groups.setdefault(part.length, []).append(part)
    return list(groups.values())


def assemble_document_index(
    documents: Documents,
    sparse: torch.Tensor,
    groups: list[ScoredGroup],
    budget: StaticHeadBudgets | TopPBudget,
    q_heads: int,
    sink_tokens: int,
    local_window: int,
) -> DocumentIndex:
    """The :class:`DocumentIndex` of the sparse documents from their scores, one :class:`ScoredGroup` per
    length. Every list is as wide as the whole sequence's budget, ``list_widths(budget, N)``, whatever the
    documents."""
    seq_len = documents.seq_len
    v_width, s_width = list_widths(budget, seq_len)
    slots = (documents.batch_size, documents.max_documents, q_heads)
    device = documents.starts.device
    v_idx = torch.full((*slots, v_width), seq_len, dtype=torch.int32, device=device)
    s_idx = torch.full((*slots, s_width), seq_len, dtype=torch.int32, device=device)
    if groups:
        kinds = document_lists(groups, budget, seq_len, sink_tokens, local_window)
        for target, (parts, lists) in zip((v_idx, s_idx), kinds):
            slots_of_parts = torch.tensor([(part.sample, part.document) for part in parts])
            samples, members = to_device(slots_of_parts, device).unbind(1)
            target[samples, members, :, : lists.shape[-1]] = lists  # the later columns stay N
    return DocumentIndex(documents, sparse, v_idx, s_idx)


def _document_rows(q: torch.Tensor, k: torch.Tensor, group: list[SparseDocument], last_q: int):
    """(last queries ``[g, last_q, Hq, d]``, keys ``[g, L, Hkv, d]``) of one length group: views of q and k for
    one document, one gather each for several (any strides: Megatron hands q and k as permuted views)."""
    length = group[0].length
    if len(group) == 1:
        sample, start = group[0].sample, group[0].start
        stop = start + length
        return q[sample : sample + 1, stop - last_q : stop], k[sample : sample + 1, start:stop]
    spans = to_device(torch.tensor([(part.sample, part.start) for part in group]), q.device)
    samples, columns = spans[:, :1], spans[:, 1:] + torch.arange(length, device=q.device)  # [g, 1], [g, L]
    return q[samples, columns[:, length - last_q :]], k[samples, columns]


def estimate_document_index(
    q: torch.Tensor,
    k: torch.Tensor,
    documents: Documents,
    budget: StaticBudget | StaticHeadBudgets | TopPBudget,
    *,
    min_sparse_length: int,
    softmax_scale: float | None = None,
    last_q: int = 64,
    sink_tokens: int = 30,
    local_window: int = 100,
) -> tuple[DocumentIndex, int]:
    """Estimate every long document's own index from post-RoPE ``q [b, N, Hq, d]``, ``k [b, N, Hkv, d]``.

    A document of L ≥ ``min_sparse_length`` tokens starting at o gets the index
    :func:`mtraining_kernels.estimation.estimate_vertical_slash` finds on ``q[:, o : o + L]``, ``k[:, o : o + L]``
    with static sizes clamped to L, its verticals shifted by o. Its scores come from one batched pass per
    document length (only the last ``last_q`` queries are copied for it; each batch row's integers are its
    own); every document is then ranked at once (:mod:`mtraining_kernels.document_selection`), the same bits.
    The budget must fit the whole sequence (as unpacked), and the lists are as wide as the whole sequence's
    (``list_widths(budget, N)``), so their shapes do not depend on the documents. Returns the index and the
    number of documents whose static budget was clamped.
    """
    check_query_key(q, k, softmax_scale)
    batch, seq_len, q_heads = q.shape[:3]
    check_document_estimation(documents, batch, seq_len, q.device, min_sparse_length, last_q, sink_tokens, local_window)
    budget = resolve_budget(budget, q_heads, seq_len, sink_tokens, local_window)

    sparse, parts, clamped_documents = sparse_documents(documents, min_sparse_length, budget)
    top_p = isinstance(budget, TopPBudget)
    block_slashes = top_p and budget.block_slashes  # then V alone makes every score
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    groups = []
    for group in same_length_groups(parts):
        q_rows, keys = _document_rows(q, k, group, last_q)
        length = group[0].length
        v_scores, s_scores = scores_of_keys(  # only the rows the estimation reads: no copy of the other queries
            q_rows,
            torch.arange(length - last_q, length, device=q.device),
            keys,
            torch.arange(length, device=q.device),
            scale,
            top_p,
            length,
            slashes=not block_slashes,
            consecutive_key_run=length,  # both position lists are aranges
        )
        groups.append(ScoredGroup(group, v_scores, s_scores))
    index = assemble_document_index(documents, sparse, groups, budget, q_heads, sink_tokens, local_window)
    return index, clamped_documents
