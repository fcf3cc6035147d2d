"""Sequence layouts for context parallelism (DESIGN.md §2.3).

A layout is a permutation between global token positions ``p`` in ``[0, N)`` and pairs
``(rank r, local position l)`` with ``l`` in ``[0, N/W)``. This module is the only place that
knows the formulas; the data loader, RoPE, the index conversion and the tests all call it.

Kinds:

* ``contiguous`` — rank r holds positions ``[r·N/W, (r+1)·N/W)``.
* ``zigzag``     — the sequence is cut into 2W chunks; rank r holds chunks r and 2W−1−r.
* ``striped``    — the sequence is cut into runs of ``granularity`` tokens dealt round-robin,
  run c goes to rank ``c mod W``.
* ``skewed``     — striped with every round of W runs turned by one more rank: run c goes to rank
  ``(c + ⌊c/W⌋) mod W``. A rank still holds one run per round, in ascending global order, but the rank
  that holds a round's first run moves on by one each round, so packed documents whose length is a whole
  number of rounds (all-4K documents are 32 blocks) no longer put their first block on the same rank every
  time (docs/benchmarks.md: the simulated ring balance of the mixtures). With ``turns`` (one entry per round,
  N / (W·granularity) of them) round j is turned by ``turns[j]`` ranks instead of j: run c goes to rank
  ``(c mod W + turns[⌊c/W⌋]) mod W``. Every rank still holds one run per round, in ascending order; turns
  planned from packed documents (``megatron_mtraining.turn_plan``) even out their work.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch

LAYOUT_KINDS = ("contiguous", "zigzag", "striped", "skewed")
STRIPED_KINDS = ("striped", "skewed")  # the kinds cut into runs of ``granularity`` tokens
BLOCK_SIZE = 128


@dataclass(frozen=True)
class Layout:
    """How a sequence of length N is split over ``world_size`` context-parallel ranks.

    ``granularity`` is the stripe length of the striped and skewed layouts (ignored by the others).
    ``turns`` (skewed only): the turn of every round, in ``[0, W)``; None turns round j by j. A layout with
    turns fits one sequence length, N = len(turns)·W·granularity; ``repr`` shows their count and a digest
    (ranks compare layouts by their ``repr``).
    """

    kind: str
    world_size: int
    granularity: int = BLOCK_SIZE
    turns: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        text = f"Layout(kind={self.kind!r}, world_size={self.world_size}, granularity={self.granularity}"
        if self.turns is None:
            return text + ")"
        digest = hashlib.sha256(repr(self.turns).encode()).hexdigest()[:16]
        return text + f", turns=<{len(self.turns)} rounds, sha256 {digest}>)"

    def __post_init__(self) -> None:
        if self.kind not in LAYOUT_KINDS:
            raise ValueError(f"layout kind {self.kind!r} is unknown; use one of {LAYOUT_KINDS}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} must be an integer >= 1")
        g = self.granularity
        if not isinstance(g, int) or g < 16 or g & (g - 1):
            raise ValueError(f"granularity={g!r} must be a power of two >= 16 (the default is {BLOCK_SIZE})")
        if self.turns is not None:
            if self.kind != "skewed":
                raise ValueError(f"turns are a skewed layout's; the {self.kind} layout takes none")
            turns = tuple(self.turns)
            bad = [t for t in turns if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.world_size]
            if not turns or bad:
                raise ValueError(
                    f"turns must be a non-empty sequence of integers in [0, {self.world_size}) (one per round of "
                    f"{self.world_size} runs), got {bad[:3] or 'none'}"
                )
            object.__setattr__(self, "turns", turns)

    # ------------------------------------------------------------------ validation
    def unit(self, block_size: int | None = None) -> int:
        """The length N must be a multiple of (see DESIGN.md §2.3).

        With ``block_size`` set, every rank's chunk must also consist of whole blocks that are
        each one contiguous global block, as the sparse kernels need.
        """
        w = self.world_size
        if self.kind == "contiguous":
            return w * (block_size or 1)
        if self.kind == "zigzag":
            return 2 * w * (block_size or 1)
        if block_size is not None and self.granularity % block_size:
            raise ValueError(
                f"{self.kind} granularity={self.granularity} is not a multiple of the block size "
                f"{block_size}; the sparse kernels need granularity to be a multiple of {block_size}"
            )
        return w * self.granularity

    def validate(self, seq_len: int, block_size: int | None = None) -> None:
        """Raise ``ValueError`` unless ``seq_len`` can be split by this layout."""
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r} must be a positive integer")
        if self.turns is not None and seq_len != len(self.turns) * self.world_size * self.granularity:
            raise ValueError(
                f"seq_len={seq_len} does not match the layout's {len(self.turns)} turns (rounds of "
                f"{self.world_size} x {self.granularity} tokens: N = {len(self.turns) * self.unit()}); plan the "
                f"turns for this sequence"
            )
        unit = self.unit(block_size)
        if seq_len % unit:
            lower = seq_len // unit * unit
            raise ValueError(
                f"seq_len={seq_len} is not divisible by {unit} as the {self.kind} layout needs "
                f"with world_size={self.world_size}"
                + (f", granularity={self.granularity}" if self.kind in STRIPED_KINDS else "")
                + (f", block_size={block_size}" if block_size else "")
                + f"; use {lower or unit} or {lower + unit}"
            )

    def run_length(self, seq_len: int) -> int:
        """How many consecutive global positions each run of a rank's chunk holds, the runs back to back in local
        order from local position 0: N/W (contiguous), N/(2W) (zigzag) or the granularity (striped, skewed)."""
        self.validate(seq_len)
        if self.kind == "contiguous":
            return seq_len // self.world_size
        if self.kind == "zigzag":
            return seq_len // (2 * self.world_size)
        return self.granularity

    def local_len(self, seq_len: int) -> int:
        self.validate(seq_len)
        return seq_len // self.world_size

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside [0, {self.world_size})")

    # ------------------------------------------------------------------ formulas
    def to_local(self, positions: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global positions → (rank, local position), elementwise on an integer tensor."""
        self.validate(seq_len)
        p = positions.long()
        w, n_loc = self.world_size, seq_len // self.world_size
        if self.kind == "contiguous":
            return p // n_loc, p % n_loc
        if self.kind == "zigzag":
            chunk = seq_len // (2 * w)
            c = p // chunk
            first = c < w
            rank = torch.where(first, c, 2 * w - 1 - c)
            local = p % chunk + torch.where(first, 0, chunk)
            return rank, local
        g = self.granularity
        c = p // g
        rank = c % w if self.kind == "striped" else (c + self._round_turns(c // w)) % w
        return rank, (c // w) * g + p % g

    def to_global(self, rank: int | torch.Tensor, local: torch.Tensor, seq_len: int) -> torch.Tensor:
        """(rank, local position) → global position, elementwise."""
        self.validate(seq_len)
        pos = local.long()
        r = torch.as_tensor(rank, dtype=torch.long, device=pos.device)
        w = self.world_size
        if self.kind == "contiguous":
            return r * (seq_len // w) + pos
        if self.kind == "zigzag":
            chunk = seq_len // (2 * w)
            return torch.where(pos < chunk, r * chunk + pos, (2 * w - 1 - r) * chunk + (pos - chunk))
        g = self.granularity
        round_ = pos // g  # the rank's j-th run is in round j
        slot = r if self.kind == "striped" else (r - self._round_turns(round_)) % w
        return (round_ * w + slot) * g + pos % g

    def _round_turns(self, rounds: torch.Tensor) -> torch.Tensor:
        """The skewed turn of each round index in ``rounds`` (int64)."""
        if self.turns is None:
            return rounds
        return torch.tensor(self.turns, dtype=torch.long, device=rounds.device)[rounds]

    def global_positions(self, seq_len: int, rank: int, device=None) -> torch.Tensor:
        """Global positions held by ``rank``, in local order: int64 ``[N/W]``."""
        self._check_rank(rank)
        local = torch.arange(self.local_len(seq_len), device=device)
        return self.to_global(rank, local, seq_len)

    def global_blocks(self, seq_len: int, rank: int, block_size: int = BLOCK_SIZE, device=None) -> torch.Tensor:
        """Global block index of each local block of ``rank``: int64 ``[N/W/block_size]``.

        Requires the layout to keep blocks whole (see :meth:`unit`).
        """
        self.validate(seq_len, block_size)
        starts = self.global_positions(seq_len, rank, device=device)[::block_size]
        return starts // block_size

    # ------------------------------------------------------------------ tensors
    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """This rank's part of ``x`` along ``dim`` (the full sequence), in local order."""
        pos = self.global_positions(x.shape[dim], rank, device=x.device)
        return x.index_select(dim, pos)

    def unshard(self, parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of :meth:`shard`: ``parts[r]`` is rank r's part; returns the full sequence."""
        if len(parts) != self.world_size:
            raise ValueError(f"got {len(parts)} parts for world_size={self.world_size}")
        lengths = [part.shape[dim] for part in parts]
        if len(set(lengths)) != 1:
            raise ValueError(
                f"parts have unequal lengths {lengths} along dim {dim} (by rank); every rank holds "
                f"N/W tokens, so pass the {self.world_size} parts of one sequence"
            )
        seq_len = lengths[0] * self.world_size
        stacked = torch.cat(list(parts), dim=dim)
        # position in the concatenation of global p = owner(p)·N_loc + local(p)
        rank, local = self.to_local(torch.arange(seq_len, device=stacked.device), seq_len)
        return stacked.index_select(dim, rank * (seq_len // self.world_size) + local)


def shard(
    x: torch.Tensor, layout: str, world_size: int, rank: int, dim: int = 1, granularity: int = BLOCK_SIZE
) -> torch.Tensor:
    """Functional form of :meth:`Layout.shard`."""
    return Layout(layout, world_size, granularity).shard(x, rank, dim)


def unshard(parts: Sequence[torch.Tensor], layout: str, dim: int = 1, granularity: int = BLOCK_SIZE) -> torch.Tensor:
    """Functional form of :meth:`Layout.unshard`; the world size is ``len(parts)``."""
    return Layout(layout, len(parts), granularity).unshard(parts, dim)


def global_positions(
    layout: str, seq_len: int, world_size: int, rank: int, granularity: int = BLOCK_SIZE
) -> torch.Tensor:
    """Functional form of :meth:`Layout.global_positions`."""
    return Layout(layout, world_size, granularity).global_positions(seq_len, rank)
