"""Index budgets of one layer for online vertical-slash estimation (DESIGN.md §2.2, flags in §3).

A budget says how many verticals and slashes one query head keeps. Two kinds exist:

* :class:`StaticBudget` — fixed counts ``v_size`` and ``s_size``. The forced entries (sinks, local
  window) are part of the count; :class:`StaticHeadBudgets` holds one such pair per query head.
* :class:`TopPBudget` — per head, the smallest count whose softmax mass reaches ``p``, at most
  ``cap``; verticals and slashes are counted independently. With ``block_slashes`` the slashes are whole
  block diagonals, ranked by the mass of the 128 × 128 blocks they make the kernels compute.

A whole model's budgets (one setting, or a static pair per layer and head from JSON) are
``megatron_mtraining.budget.BudgetTable``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union

import torch

from .layout import BLOCK_SIZE

DEFAULT_CAP = 4096


def check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


def check_forced(v_size: int, s_size: int, seq_len: int, sink_tokens: int, local_window: int, where: str = "") -> None:
    """Raise unless ``sink_tokens <= v_size <= seq_len`` and ``local_window <= s_size <= seq_len``."""
    for name, size, forced, forced_name, what in (
        ("v_size", v_size, sink_tokens, "sink_tokens", "sink columns"),
        ("s_size", s_size, local_window, "local_window", "local-window offsets"),
    ):
        if size > seq_len:
            raise ValueError(
                f"{where}{name}={size} is larger than the sequence (seq_len={seq_len}); use {name} <= {seq_len}"
            )
        if size < forced:
            raise ValueError(
                f"{where}{name}={size} is smaller than the {forced} forced {what} "
                f"({forced_name}={forced}), which count toward the budget; "
                f"use {name} >= {forced}"
            )


@dataclass(frozen=True)
class StaticBudget:
    """Fixed per-head counts: ``v_size`` verticals and ``s_size`` slashes, forced entries included."""

    v_size: int
    s_size: int

    def __post_init__(self) -> None:
        check_int("v_size", self.v_size, 1)
        check_int("s_size", self.s_size, 1)

    def validate_for(self, seq_len: int, sink_tokens: int, local_window: int) -> None:
        """Raise ``ValueError`` unless the counts fit a sequence of ``seq_len`` with these forced entries."""
        check_forced(self.v_size, self.s_size, seq_len, sink_tokens, local_window)

    @classmethod
    def for_sparsity(
        cls,
        sparsity: float,
        seq_len: int,
        *,
        vertical_share: float = 0.1,
        sink_tokens: int = 30,
        local_window: int = 100,
        block_size: int = BLOCK_SIZE,
    ) -> "StaticBudget":
        """The uniform pair whose every possible index has mask sparsity ``>= sparsity`` (§2.1).

        Conversion (a guaranteed bound, so realised sparsity is usually higher): the causal triangle has
        T = N(N+1)/2 pairs and the kept area may be A = (1 − sparsity)·T. The forced part costs at most
        F = NB·B(B+1)/2 (diagonal blocks) + (NB−1)·B² (block distance 1, switched on by the window),
        with NB = N/B. Each vertical adds at most N pairs; ``v_size`` gets the share
        ``vertical_share`` of A − F, and at least the ``sink_tokens`` sinks. Each slash beyond the
        window switches on at most two new block diagonals, the costliest being distances 2, 3, …
        (distance δ covers (NB−δ)·B² pairs); with D the most such diagonals that fit in what is left,
        ``s_size = local_window + ⌊D/2⌋`` (N when every diagonal fits). Both are capped at N.
        """
        if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0 <= sparsity < 1:
            raise ValueError(f"sparsity={sparsity!r} must be a number in [0, 1)")
        if not isinstance(vertical_share, (int, float)) or not 0 <= vertical_share <= 1:
            raise ValueError(f"vertical_share={vertical_share!r} must be a number in [0, 1]")
        check_int("seq_len", seq_len, 1)
        check_int("block_size", block_size, 1)
        if seq_len % block_size:
            raise ValueError(
                f"seq_len={seq_len} must be a multiple of block_size={block_size} to convert "
                f"a sparsity into budgets; use {seq_len // block_size * block_size or block_size} "
                f"or {(seq_len // block_size + 1) * block_size}"
            )
        check_int("sink_tokens", sink_tokens, 0)
        check_int("local_window", local_window, 2)  # offsets 0 and 1 make block distance 1 forced
        if max(sink_tokens, local_window) > seq_len:
            raise ValueError(
                f"sink_tokens={sink_tokens} and local_window={local_window} must both be <= seq_len={seq_len}"
            )
        n, b, nb = seq_len, block_size, seq_len // block_size
        forced_blocks = nb * b * (b + 1) // 2 + (nb - 1) * b * b
        min_vertical = max(sink_tokens, 1)
        forced_area = forced_blocks + min_vertical * n
        allowed = math.floor((1 - sparsity) * n * (n + 1) / 2)
        if allowed < forced_area:
            best = 1 - forced_area / (n * (n + 1) / 2)
            raise ValueError(
                f"sparsity={sparsity} cannot be guaranteed at seq_len={seq_len}: the forced sinks, "
                f"window and diagonal blocks alone may keep {forced_area} pairs; "
                f"use sparsity <= {math.floor(best * 1e4) / 1e4}"
            )
        v_size = min(n, max(min_vertical, math.floor(vertical_share * (allowed - forced_blocks) / n)))
        remaining = allowed - forced_blocks - v_size * n
        extra_diagonals = 0
        for delta in range(2, nb):  # at most NB−2 iterations over block distances
            cost = (nb - delta) * b * b
            if cost > remaining:
                break
            remaining -= cost
            extra_diagonals += 1
        all_fit = extra_diagonals == max(nb - 2, 0)  # then no slash set can exceed the bound
        s_size = n if all_fit else min(n, local_window + extra_diagonals // 2)
        return cls(v_size, s_size)


@dataclass(frozen=True)
class TopPBudget:
    """Per head, the fewest entries whose softmax mass reaches ``p``, forced entries included, at most ``cap``.

    ``cap`` is a ceiling, not a request: on a sequence shorter than ``cap`` it is ``seq_len``.
    ``block_slashes``: the slash candidates are the block diagonals δ = 0, 1, … (kept as slash offsets
    128·δ, each of which covers exactly its block diagonal), their mass that of the estimation rows in the
    key block δ blocks before the last; ``cap`` then counts block diagonals. The kernels compute whole
    blocks for any slash, so this ranks what they compute.
    """

    p: float
    cap: int = DEFAULT_CAP
    block_slashes: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not 0 < self.p <= 1:
            raise ValueError(f"p={self.p!r} must be a number in (0, 1], e.g. 0.9 or 0.95")
        check_int("cap", self.cap, 1)
        if not isinstance(self.block_slashes, bool):
            raise ValueError(f"block_slashes={self.block_slashes!r} must be True or False")

    def validate_for(self, seq_len: int, sink_tokens: int, local_window: int) -> None:
        """Raise ``ValueError`` unless the cap leaves room for the forced entries."""
        forced = max(sink_tokens, local_window)
        if self.cap < forced:
            raise ValueError(
                f"cap={self.cap} is smaller than the forced entries (sink_tokens={sink_tokens}, "
                f"local_window={local_window}), which count toward the cap; use cap >= {forced}"
            )

    def effective_cap(self, seq_len: int) -> int:
        return min(self.cap, seq_len)


@dataclass(frozen=True, eq=False)
class StaticHeadBudgets:
    """Static budgets of one layer's query heads, in head order: int64 ``v_size [H]``, ``s_size [H]``."""

    v_size: torch.Tensor
    s_size: torch.Tensor

    def __post_init__(self) -> None:
        for name, sizes in (("v_size", self.v_size), ("s_size", self.s_size)):
            if sizes.dim() != 1 or sizes.dtype != torch.int64 or sizes.numel() == 0:
                raise ValueError(
                    f"{name} must be a non-empty 1-D int64 tensor, got shape "
                    f"{tuple(sizes.shape)} and dtype {sizes.dtype}"
                )
        if self.v_size.shape != self.s_size.shape:
            raise ValueError(f"v_size has {self.v_size.numel()} heads but s_size has {self.s_size.numel()}")

    @classmethod
    def uniform(cls, budget: StaticBudget, num_heads: int) -> "StaticHeadBudgets":
        check_int("num_heads", num_heads, 1)
        return cls(
            torch.full((num_heads,), budget.v_size, dtype=torch.int64),
            torch.full((num_heads,), budget.s_size, dtype=torch.int64),
        )

    @property
    def num_heads(self) -> int:
        return self.v_size.numel()

    def validate_for(self, seq_len: int, sink_tokens: int, local_window: int) -> None:
        """Raise ``ValueError`` naming the first head whose counts do not fit (see :class:`StaticBudget`)."""
        for head, (v, s) in enumerate(zip(self.v_size.tolist(), self.s_size.tolist())):
            check_forced(v, s, seq_len, sink_tokens, local_window, where=f"head {head}: ")


LayerBudget = Union[StaticHeadBudgets, TopPBudget]
