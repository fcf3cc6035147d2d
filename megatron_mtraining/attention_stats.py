"""Statistics of :class:`~megatron_mtraining.attention.MTrainingAttention` forwards: mask density,
estimation time and ring balance per layer, read lazily by the step metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache

import torch

from mtraining_kernels.document_index import DocumentIndex
from mtraining_kernels.layout import Layout
from mtraining_kernels.vertical_slash import full_index, mask_area

from .balance import BAR_COST, BalanceReport, balance_report, document_balance_report, document_source_work


def mask_density(v_idx: torch.Tensor, s_idx: torch.Tensor, seq_len: int) -> torch.Tensor:
    """|M| / (N(N+1)/2) of the §2.1 mask, per (b, Hq): fp64 ``[b, Hq]``, without building the mask."""
    return mask_area(v_idx, s_idx, seq_len).double() / (seq_len * (seq_len + 1) / 2)


class Stopwatch:
    """Wall time of a region: CUDA events on a GPU (read lazily), ``perf_counter`` on a CPU."""

    def __init__(self, device: torch.device):
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._start = time.perf_counter()
        self._seconds = 0.0

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._seconds = time.perf_counter() - self._start

    @property
    def seconds(self) -> float:
        if self._events is None:
            return self._seconds
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1e3


@lru_cache(maxsize=4)
def _full_pattern_balance(layout: Layout, seq_len: int) -> BalanceReport:
    """The full pattern's ring work for one head, computed once per shape (0.2 s at 512K)."""
    return balance_report(*full_index(1, 1, seq_len), layout, seq_len)


def document_work_density(doc_index: DocumentIndex, layout: Layout) -> float:
    """Packed documents: the ring work of their listed tiles and bars (``document_source_work``, bars at
    ``BAR_COST`` of a tile) over that of the same documents all attended densely-causally."""
    dense = DocumentIndex.dense(doc_index.documents, doc_index.num_heads)

    def work(index: DocumentIndex) -> float:
        blocks, bars = document_source_work(index, layout)
        return float(blocks.double().sum() + BAR_COST * bars.double().sum())

    return work(doc_index) / work(dense)


@dataclass(eq=False)
class AttentionStats:
    """One training forward of one layer: its global index and the estimation time.

    The numbers are computed when read (``density``, ``estimation_seconds`` and ``balance()`` may
    synchronise with the GPU), so recording them costs nothing on steps that do not log. Layers on an
    SDPA dense_impl have no index (``v_idx``/``s_idx`` None): density 1.0 and the full pattern's balance.
    Packed layers carry their ``documents`` (the per-document index; ``v_idx``/``s_idx`` None) and the
    number of documents whose static budget was clamped to their length.
    """

    layer_number: int
    dense: bool
    v_idx: torch.Tensor | None  # int32 [b, Hq, Vmax], global (identical on every CP rank)
    s_idx: torch.Tensor | None  # int32 [b, Hq, Smax]
    layout: Layout
    seq_len: int
    estimation: Stopwatch | None  # None for dense layers
    documents: DocumentIndex | None = None
    clamped_documents: int = 0

    @property
    def density(self) -> float:
        """|M| / causal area, averaged over samples and this rank's query heads; packed: the listed work over
        that of every document dense (:func:`document_work_density`)."""
        if self.documents is not None:
            return document_work_density(self.documents, self.layout)
        if self.v_idx is None:
            return 1.0
        return float(mask_density(self.v_idx, self.s_idx, self.seq_len).mean())

    @property
    def documents_per_sequence(self) -> float | None:
        """Mean number of documents per packed sequence (None unpacked)."""
        if self.documents is None:
            return None
        return float(self.documents.documents.num_documents.double().mean())

    @property
    def estimation_seconds(self) -> float:
        return 0.0 if self.estimation is None else self.estimation.seconds

    def balance(self) -> BalanceReport:
        """Per-(rank, ring step) work of this index in this layout (flat-ring step order); without an index,
        that of the full pattern for one head (the SDPA dense ring does the same work per step)."""
        if self.documents is not None:
            return document_balance_report(self.documents, self.layout)
        if self.v_idx is None:
            return _full_pattern_balance(self.layout, self.seq_len)
        return balance_report(self.v_idx, self.s_idx, self.layout, self.seq_len)


def collect_stats(modules) -> list[AttentionStats]:
    """The latest :class:`AttentionStats` of every MTraining attention inside ``modules`` (model chunks)."""
    return [
        module.last_stats
        for model in modules
        for module in model.modules()
        if isinstance(getattr(module, "last_stats", None), AttentionStats)
    ]
