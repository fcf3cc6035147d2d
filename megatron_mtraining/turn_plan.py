"""Turns of the skewed layout planned from packed documents (DESIGN.md §2.3; PACKED.md, balance).

The skewed layout turns round j of W runs by ``turns[j]`` ranks. :func:`plan_turns` picks the turns one round
after the other: each round takes the turn that keeps the ring's expected critical path Σ_t max_r work[r, t]
smallest given the rounds before it (step t: query rank r meets the key blocks of rank (r − t) mod W). The
expected work is known from the document lengths and the budget alone, before any pattern is estimated, in
128 × 128 tiles (§2.6's lists; a bar is 1/128 of a tile):

* a dense document (shorter than ``min_sparse_length``): every tile of its causal triangle;
* a sparse document of n blocks: its diagonal and local-window tiles (block distance ≤ ⌈window / 128⌉) and,
  further out, each tile with the probability 1 − (1 − min(1, 2/n))^S that one of its S far slashes covers it
  (a slash crosses about two block diagonals); its V far verticals spread evenly over its blocks and its sink
  tokens in its first block, as bars wherever their tile is off.

The work of all samples adds up (one ring serves the batch). The arithmetic is exact integers after one
rounding of each document's probabilities (IEEE products only), so every CP rank plans the same turns from
the same boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mtraining_kernels.documents import Documents
from mtraining_kernels.layout import BLOCK_SIZE, Layout

UNIT = 1 << 20  # one tile of expected work, in integer units


def _power(base: float, exponent: int) -> float:
    """base ** exponent by squaring: IEEE products only, the same on every machine."""
    result = 1.0
    while exponent:
        if exponent & 1:
            result *= base
        base *= base
        exponent >>= 1
    return result


@dataclass
class _DocumentWork:
    """Expected work of one document spanning blocks [first, end): every tile at block distance 1 … ``near`` is
    on (``UNIT``); a farther tile whose key is block kb costs ``far[kb − first]`` (the slash probability plus the
    bars of kb where the tile is off); ``by_owner[r]`` sums ``far`` over the key blocks already dealt to rank r."""

    first: int
    end: int
    near: int
    far: np.ndarray
    by_owner: np.ndarray


def _document_work(
    first: int,
    end: int,
    sparse: bool,
    far_verticals: int,
    far_slashes: int,
    sink_tokens: int,
    local_window: int,
    world_size: int,
) -> _DocumentWork:
    """The expected work of a document spanning blocks [first, end); a dense one has every tile on."""
    blocks = end - first
    by_owner = np.zeros(world_size, dtype=np.int64)
    if not sparse:
        return _DocumentWork(first, end, blocks, np.full(blocks, UNIT, dtype=np.int64), by_owner)
    missed = _power(1.0 - min(1.0, 2.0 / blocks), far_slashes)
    slash = round((1.0 - missed) * UNIT)
    bars = np.full(blocks, far_verticals * UNIT // (BLOCK_SIZE * blocks), dtype=np.int64)
    bars[0] += sink_tokens * UNIT // BLOCK_SIZE
    return _DocumentWork(first, end, -(-local_window // BLOCK_SIZE), slash + bars * (UNIT - slash) // UNIT, by_owner)


def _check(documents, world_size, far_verticals, far_slashes, min_sparse_length) -> None:
    if not isinstance(documents, Documents):
        raise ValueError(f"documents must be a mtraining_kernels Documents, got {type(documents).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer (the CP size)")
    if documents.seq_len % (world_size * BLOCK_SIZE):
        raise ValueError(
            f"seq_len={documents.seq_len} is not a multiple of world_size x {BLOCK_SIZE} = {world_size * BLOCK_SIZE}; "
            "the skewed layout deals whole 128-token runs"
        )
    if isinstance(min_sparse_length, bool) or not isinstance(min_sparse_length, int) or min_sparse_length < 1:
        raise ValueError(f"min_sparse_length={min_sparse_length!r} must be a positive integer")
    shape = tuple(documents.starts.shape)
    for name, counts in (("far_verticals", far_verticals), ("far_slashes", far_slashes)):
        if not isinstance(counts, torch.Tensor) or tuple(counts.shape) != shape or counts.is_floating_point():
            raise ValueError(
                f"{name} must be an integer tensor [b, m_max] = {shape} (a count per document slot), got "
                f"{getattr(counts, 'dtype', type(counts).__name__)} {tuple(getattr(counts, 'shape', ()))}"
            )
        if bool((counts < 0).any()):
            raise ValueError(f"{name} holds negative counts; pass each document's far count (0 for dense documents)")


def plan_turns(
    documents: Documents,
    world_size: int,
    *,
    far_verticals: torch.Tensor,
    far_slashes: torch.Tensor,
    min_sparse_length: int,
    sink_tokens: int = 30,
    local_window: int = 100,
) -> tuple[int, ...]:
    """The turn of every round (N / (128·W) of them) for ``Layout("skewed", W, 128, turns=...)``.

    ``far_verticals`` / ``far_slashes`` int ``[b, m_max]``: each document's expected verticals beyond its sinks
    and slashes beyond its local window (its budget less the forced entries; ignored for dense documents).
    """
    _check(documents, world_size, far_verticals, far_slashes, min_sparse_length)
    world = world_size
    num_blocks = documents.seq_len // BLOCK_SIZE
    rounds = num_blocks // world
    spans = documents.host_spans.tolist()
    verticals, slashes = far_verticals.cpu().tolist(), far_slashes.cpu().tolist()
    by_round: list[list[_DocumentWork]] = [[] for _ in range(rounds)]
    for sample, sample_spans in enumerate(spans):
        for slot, (start, length) in enumerate(sample_spans):
            if length == 0:
                continue
            first, end = start // BLOCK_SIZE, (start + length - 1) // BLOCK_SIZE + 1
            work = _document_work(
                first,
                end,
                length >= min_sparse_length,
                verticals[sample][slot],
                slashes[sample][slot],
                sink_tokens,
                local_window,
                world,
            )
            for round_ in range(first // world, (end - 1) // world + 1):
                by_round[round_].append(work)

    steps = np.arange(world)
    # candidate turn h moves slot s to rank (s + h) mod W: source rows/columns of every candidate at once
    moved = (steps[None, :] - steps[:, None]) % world  # [h, r] -> slot (r − h) mod W
    owner = np.empty(num_blocks, dtype=np.int64)
    load = np.zeros((world, world), dtype=np.int64)  # [query rank, ring step]
    turns = []
    for round_, works in enumerate(by_round):
        low, high = round_ * world, (round_ + 1) * world
        earlier = np.zeros((world, world), dtype=np.int64)  # [slot, step at turn 0]: keys of past rounds
        this_round = np.zeros((world, world), dtype=np.int64)  # [slot, step]: keys of this round
        this_round[:, 0] = len(spans) * UNIT  # every block's diagonal tile, once per sample
        for work in works:
            queries = np.arange(max(work.first + 1, low), min(work.end, high))
            if queries.size == 0:
                continue
            slots = queries - low
            if work.first < low:  # past keys: the far cost by owner, then the near tiles' difference
                earlier[slots] += work.by_owner[(slots[:, None] - steps[None, :]) % world]
                for query, slot in zip(queries.tolist(), slots.tolist()):
                    for key in range(max(work.first, query - work.near), low):
                        earlier[slot, (slot - owner[key]) % world] += UNIT - work.far[key - work.first]
            keys = np.arange(max(work.first, low), min(work.end, high))
            distance = queries[:, None] - keys[None, :]
            pairs = distance > 0
            cost = np.where(distance <= work.near, UNIT, work.far[keys - work.first][None, :])
            np.add.at(
                this_round, (np.broadcast_to(slots[:, None], distance.shape)[pairs], distance[pairs]), cost[pairs]
            )
        added = earlier[moved[:, :, None], moved[:, None, :]] + this_round[moved]  # [h, r, t]
        paths = (load[None] + added).max(axis=1).sum(axis=1)
        turn = int(np.argmin(paths))  # the first of equal paths
        load += added[turn]
        owner[low:high] = (steps + turn) % world
        for work in works:
            keys = np.arange(max(work.first, low), min(work.end, high))
            np.add.at(work.by_owner, owner[keys], work.far[keys - work.first])
        turns.append(turn)
    return tuple(turns)


def planned_layout(
    documents: Documents,
    world_size: int,
    *,
    vertical_size: int,
    slash_size: int,
    min_sparse_length: int,
    sink_tokens: int,
    local_window: int,
) -> Layout:
    """``Layout("skewed", W, turns=...)`` for a micro-batch whose sparse documents each take the static budget
    ``vertical_size`` / ``slash_size`` (forced entries included, clamped to the document, as the estimator does):
    a document's far counts are its budget less its sinks and window."""
    lengths = documents.host_spans[..., 1]  # the host copy Documents keeps: no device sync
    far_verticals = (torch.clamp(lengths, max=vertical_size) - sink_tokens).clamp(min=0)
    far_slashes = (torch.clamp(lengths, max=slash_size) - local_window).clamp(min=0)
    turns = plan_turns(
        documents,
        world_size,
        far_verticals=far_verticals,
        far_slashes=far_slashes,
        min_sparse_length=min_sparse_length,
        sink_tokens=sink_tokens,
        local_window=local_window,
    )
    return Layout("skewed", world_size, turns=turns)
