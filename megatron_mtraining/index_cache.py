"""Per-layer FIFO cache of what a recomputation replays (DESIGN.md §2.2 "Reuse"): the estimated index
and, with ``--mtraining-keep-attention-output``, the attention output and lse.

Megatron's selective (``core_attn``) and full recomputation run a layer's forward twice: once
inside ``tensor_parallel.checkpoint`` during the forward pass, and again inside autograd's backward.
The replay must not re-estimate the index (twice the collectives, and the pattern could change
between forward and backward). So:

* a forward inside a Megatron checkpoint that is *not* running inside a backward pushes its index
  (and its output when kept);
* a forward running inside a backward (the replay) pops the oldest entry;
* a plain forward (no recomputation) neither pushes nor pops.

Each attention module owns one cache, so there is one per layer and model chunk; 1F1B and
interleaved schedules replay micro-batches in forward order, hence FIFO. An entry carries the exact
key (N, b, Hq, layout) and a checksum of the rows that feed the estimation; the replay must match
the key exactly and the checksum within a loose relative tolerance, or it raises. The caches must be
empty after every training step (:func:`assert_index_caches_empty`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterable

import torch
from megatron.core.tensor_parallel.random import is_checkpointing

from mtraining_kernels.layout import Layout

PROBE_ROWS = 64  # the local rows summarised by the checksum (Q_L on its owner)
CHECKSUM_RTOL = 1e-3


class ForwardKind(Enum):
    PLAIN = "plain"  # no recomputation will follow
    CHECKPOINTED = "checkpointed"  # first pass inside a Megatron checkpoint: a replay will follow
    REPLAY = "replay"  # the recomputation, running inside autograd's backward


def in_autograd_backward() -> bool:
    """True while autograd's engine executes a backward pass on this thread.

    ``torch._C._current_graph_task_id()`` is −1 outside any graph task; Megatron's
    ``CheckpointFunction.backward`` (and torch's checkpoint) replay the forward inside one.
    """
    return torch._C._current_graph_task_id() != -1


def forward_kind() -> ForwardKind:
    """What kind of forward is running now (see the module docstring)."""
    if in_autograd_backward():
        return ForwardKind.REPLAY
    if is_checkpointing():
        return ForwardKind.CHECKPOINTED
    return ForwardKind.PLAIN


@dataclass(frozen=True)
class IndexKey:
    """What must match exactly between a forward and its replay."""

    seq_len: int
    batch: int
    heads: int
    layout: Layout


def probe_checksum(q: torch.Tensor) -> torch.Tensor:
    """fp64 ``[3, b, Hq]``: Σq, Σ|q|, Σq² per (sample, head) over the last 64 local rows of q ``[b, n, Hq, d]``.

    On the rank holding the last global positions these rows are Q_L itself (the last local rows of
    every layout's owner of block NB−1 are the last global rows); elsewhere they are an equally cheap
    fingerprint of the local queries. No communication.
    """
    rows = q.detach()[:, -PROBE_ROWS:].double()
    return torch.stack([rows.sum(dim=(1, 3)), rows.abs().sum(dim=(1, 3)), rows.square().sum(dim=(1, 3))])


def checksums_match(expected: torch.Tensor, actual: torch.Tensor, rtol: float = CHECKSUM_RTOL) -> bool:
    """Σq within ``rtol``·Σ|q|, and Σ|q|, Σq² within ``rtol`` relative."""
    if expected.shape != actual.shape:
        return False
    abs_sum, square_sum = expected[1], expected[2]
    scale = torch.stack([abs_sum, abs_sum, square_sum])  # Σq is measured against Σ|q|
    return bool(((actual - expected).abs() <= rtol * scale).all())


class IndexCache:
    """FIFO of (key, checksum, value) for one attention layer of one model chunk."""

    def __init__(self, owner: str, rtol: float = CHECKSUM_RTOL):
        self.owner = owner
        self.rtol = rtol
        self._entries: deque[tuple[IndexKey, torch.Tensor, Any]] = deque()

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, key: IndexKey, checksum: torch.Tensor, value: Any) -> None:
        self._entries.append((key, checksum, value))

    def pop(self, key: IndexKey, checksum: torch.Tensor) -> Any:
        """The oldest entry's value; raises ``RuntimeError`` if there is none or it does not match."""
        if not self._entries:
            raise RuntimeError(
                f"{self.owner}: a recomputation replayed the forward but nothing was cached; the first "
                "forward must run inside Megatron's tensor_parallel.checkpoint (selective core_attn or full "
                "recompute) so that its index (and output) is kept for the replay"
            )
        cached_key, cached_checksum, value = self._entries.popleft()
        if cached_key != key:
            raise RuntimeError(
                f"{self.owner}: the recomputation's input {key} differs from the cached "
                f"forward's {cached_key}; forward and replay order must match (FIFO)"
            )
        if not checksums_match(cached_checksum, checksum, self.rtol):
            raise RuntimeError(
                f"{self.owner}: the recomputed queries differ from the cached forward's "
                f"(checksum beyond rtol={self.rtol}); forward and replay order must match (FIFO)"
            )
        return value

    def clear(self) -> None:
        self._entries.clear()


def assert_index_caches_empty(modules: Iterable[torch.nn.Module]) -> None:
    """Raise ``RuntimeError`` if any ``index_cache`` inside ``modules`` (model chunks) still holds entries.

    Call it after each training step: a leftover entry means a forward was never replayed.
    """
    leftovers = [
        f"{cache.owner} ({len(cache)})"
        for model in modules
        for module in model.modules()
        if isinstance(cache := getattr(module, "index_cache", None), IndexCache) and len(cache)
    ]
    if leftovers:
        raise RuntimeError(
            f"index caches are not empty after the step: {', '.join(leftovers)}; every "
            "checkpointed forward must be replayed by its backward"
        )
