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

import torch

from mtraining_kernels.documents import Documents
from mtraining_kernels.layout import BLOCK_SIZE

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


def _document_work(
    length: int, sparse: bool, far_verticals: int, far_slashes: int, sink_tokens: int, local_window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile units by block distance δ ``[n]``, bar units of one query block by key block ``[n]``) of a document
    of ``length`` tokens starting on a block boundary, int64."""
    blocks = -(-length // BLOCK_SIZE)
    if not sparse:
        return torch.full((blocks,), UNIT, dtype=torch.long), torch.zeros(blocks, dtype=torch.long)
    missed = _power(1.0 - min(1.0, 2.0 / blocks), far_slashes)
    tiles = torch.full((blocks,), round((1.0 - missed) * UNIT), dtype=torch.long)
    tiles[: -(-local_window // BLOCK_SIZE) + 1] = UNIT
    bars = torch.full((blocks,), far_verticals * UNIT // (BLOCK_SIZE * blocks), dtype=torch.long)
    bars[0] += sink_tokens * UNIT // BLOCK_SIZE
    return tiles, bars


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
    num_blocks = documents.seq_len // BLOCK_SIZE
    rounds = num_blocks // world_size
    spans = documents.host_spans.tolist()
    verticals, slashes = far_verticals.cpu().tolist(), far_slashes.cpu().tolist()
    by_round: list[list[tuple[int, int, torch.Tensor, torch.Tensor]]] = [[] for _ in range(rounds)]
    for sample, sample_spans in enumerate(spans):
        for slot, (start, length) in enumerate(sample_spans):
            if length == 0:
                continue
            first, end = start // BLOCK_SIZE, (start + length - 1) // BLOCK_SIZE + 1
            sparse = length >= min_sparse_length
            work = _document_work(
                end * BLOCK_SIZE - first * BLOCK_SIZE,
                sparse,
                verticals[sample][slot],
                slashes[sample][slot],
                sink_tokens,
                local_window,
            )
            for round_ in range(first // world_size, (end - 1) // world_size + 1):
                by_round[round_].append((first, end, *work))

    owner = torch.empty(num_blocks, dtype=torch.long)
    load = torch.zeros(world_size, world_size, dtype=torch.long)  # [query rank, ring step]
    ranks = torch.arange(world_size)
    turns = []
    for round_, round_spans in enumerate(by_round):
        low, high = round_ * world_size, (round_ + 1) * world_size
        earlier = torch.zeros(world_size, world_size, dtype=torch.long)  # [slot, step at turn 0], key in a past round
        this_round = torch.zeros(world_size, world_size, dtype=torch.long)  # [slot, step], key in this round
        this_round[:, 0] = len(spans) * UNIT  # every block's diagonal tile, once per sample
        for first, end, tiles, bars in round_spans:
            for query_block in range(max(first + 1, low), min(end, high)):
                key_blocks = torch.arange(first, query_block)
                distance = query_block - key_blocks
                on = tiles[distance]
                cost = on + bars[key_blocks - first] * (UNIT - on) // UNIT
                slot = query_block - low
                past = key_blocks < low
                earlier[slot].index_add_(0, (slot - owner[key_blocks[past]]) % world_size, cost[past])
                this_round[slot].index_add_(0, (slot - (key_blocks[~past] - low)) % world_size, cost[~past])
        best_turn, best_path, best_added = 0, None, None
        for turn in range(world_size):
            added = torch.roll(earlier, (turn, turn), (0, 1)) + torch.roll(this_round, turn, 0)
            path = int((load + added).amax(0).sum())
            if best_path is None or path < best_path:
                best_turn, best_path, best_added = turn, path, added
        load += best_added
        owner[low:high] = (ranks + best_turn) % world_size
        turns.append(best_turn)
    return tuple(turns)
