"""Index budgets for online vertical-slash estimation (DESIGN.md §2.2, flags in §3).

A budget says how many verticals and slashes one query head keeps. Two kinds exist:

* :class:`StaticBudget` — fixed counts ``v_size`` and ``s_size``. The forced entries (sinks, local
  window) are part of the count.
* :class:`TopPBudget` — per head, the smallest count whose softmax mass reaches ``p``, at most
  ``cap``; verticals and slashes are counted independently.

A :class:`BudgetTable` holds the budgets of a whole model, either one uniform setting or a static pair
per (layer, head) read from JSON ``{"<layer>": {"<head>": [v_size, s_size]}}``. **JSON layer keys
are 0-based** (``"0"`` is the first transformer layer, as in the ``decoder.layers.<i>`` and HF
``model.layers.<i>`` names); Megatron's ``layer_number``, which :meth:`BudgetTable.resolve` takes,
is 1-based and global, so layer_number ``n`` reads key ``str(n - 1)``. Head keys are the model's
global query-head ids ``0 … num_heads − 1`` (before the tensor-parallel split).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Union

import torch

from mtraining_kernels.layout import BLOCK_SIZE

DEFAULT_CAP = 4096


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


def _check_forced(v_size: int, s_size: int, seq_len: int, sink_tokens: int, local_window: int,
                  where: str = "") -> None:
    """Raise unless ``sink_tokens <= v_size <= seq_len`` and ``local_window <= s_size <= seq_len``."""
    for name, size, forced, forced_name, what in (
        ("v_size", v_size, sink_tokens, "sink_tokens", "sink columns"),
        ("s_size", s_size, local_window, "local_window", "local-window offsets"),
    ):
        if size > seq_len:
            raise ValueError(f"{where}{name}={size} is larger than the sequence (seq_len={seq_len}); "
                             f"use {name} <= {seq_len}")
        if size < forced:
            raise ValueError(f"{where}{name}={size} is smaller than the {forced} forced {what} "
                             f"({forced_name}={forced}), which count toward the budget; "
                             f"use {name} >= {forced}")


@dataclass(frozen=True)
class StaticBudget:
    """Fixed per-head counts: ``v_size`` verticals and ``s_size`` slashes, forced entries included."""

    v_size: int
    s_size: int

    def __post_init__(self) -> None:
        _check_int("v_size", self.v_size, 1)
        _check_int("s_size", self.s_size, 1)

    def validate_for(self, seq_len: int, sink_tokens: int, local_window: int) -> None:
        """Raise ``ValueError`` unless the counts fit a sequence of ``seq_len`` with these forced entries."""
        _check_forced(self.v_size, self.s_size, seq_len, sink_tokens, local_window)

    @classmethod
    def for_sparsity(cls, sparsity: float, seq_len: int, *, vertical_share: float = 0.1,
                     sink_tokens: int = 30, local_window: int = 100,
                     block_size: int = BLOCK_SIZE) -> "StaticBudget":
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
        _check_int("seq_len", seq_len, 1)
        _check_int("block_size", block_size, 1)
        if seq_len % block_size:
            raise ValueError(f"seq_len={seq_len} must be a multiple of block_size={block_size} to convert "
                             f"a sparsity into budgets; use {seq_len // block_size * block_size or block_size} "
                             f"or {(seq_len // block_size + 1) * block_size}")
        _check_int("sink_tokens", sink_tokens, 0)
        _check_int("local_window", local_window, 2)     # offsets 0 and 1 make block distance 1 forced
        if max(sink_tokens, local_window) > seq_len:
            raise ValueError(f"sink_tokens={sink_tokens} and local_window={local_window} must both be <= "
                             f"seq_len={seq_len}")
        n, b, nb = seq_len, block_size, seq_len // block_size
        forced_blocks = nb * b * (b + 1) // 2 + (nb - 1) * b * b
        min_vertical = max(sink_tokens, 1)
        forced_area = forced_blocks + min_vertical * n
        allowed = math.floor((1 - sparsity) * n * (n + 1) / 2)
        if allowed < forced_area:
            best = 1 - forced_area / (n * (n + 1) / 2)
            raise ValueError(f"sparsity={sparsity} cannot be guaranteed at seq_len={seq_len}: the forced sinks, "
                             f"window and diagonal blocks alone may keep {forced_area} pairs; "
                             f"use sparsity <= {math.floor(best * 1e4) / 1e4}")
        v_size = min(n, max(min_vertical, math.floor(vertical_share * (allowed - forced_blocks) / n)))
        remaining = allowed - forced_blocks - v_size * n
        extra_diagonals = 0
        for delta in range(2, nb):                          # at most NB−2 iterations over block distances
            cost = (nb - delta) * b * b
            if cost > remaining:
                break
            remaining -= cost
            extra_diagonals += 1
        all_fit = extra_diagonals == max(nb - 2, 0)        # then no slash set can exceed the bound
        s_size = n if all_fit else min(n, local_window + extra_diagonals // 2)
        return cls(v_size, s_size)


@dataclass(frozen=True)
class TopPBudget:
    """Per head, the fewest entries whose softmax mass reaches ``p``, forced entries included, at most ``cap``.

    ``cap`` is a ceiling, not a request: on a sequence shorter than ``cap`` it is ``seq_len``.
    """

    p: float
    cap: int = DEFAULT_CAP

    def __post_init__(self) -> None:
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not 0 < self.p <= 1:
            raise ValueError(f"p={self.p!r} must be a number in (0, 1], e.g. 0.9 or 0.95")
        _check_int("cap", self.cap, 1)

    def validate_for(self, seq_len: int, sink_tokens: int, local_window: int) -> None:
        """Raise ``ValueError`` unless the cap leaves room for the forced entries."""
        forced = max(sink_tokens, local_window)
        if self.cap < forced:
            raise ValueError(f"cap={self.cap} is smaller than the forced entries (sink_tokens={sink_tokens}, "
                             f"local_window={local_window}), which count toward the cap; use cap >= {forced}")

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
                raise ValueError(f"{name} must be a non-empty 1-D int64 tensor, got shape "
                                 f"{tuple(sizes.shape)} and dtype {sizes.dtype}")
        if self.v_size.shape != self.s_size.shape:
            raise ValueError(f"v_size has {self.v_size.numel()} heads but s_size has {self.s_size.numel()}")

    @classmethod
    def uniform(cls, budget: StaticBudget, num_heads: int) -> "StaticHeadBudgets":
        _check_int("num_heads", num_heads, 1)
        return cls(torch.full((num_heads,), budget.v_size, dtype=torch.int64),
                   torch.full((num_heads,), budget.s_size, dtype=torch.int64))

    @property
    def num_heads(self) -> int:
        return self.v_size.numel()

    def validate_for(self, seq_len: int, sink_tokens: int, local_window: int) -> None:
        """Raise ``ValueError`` naming the first head whose counts do not fit (see :class:`StaticBudget`)."""
        for head, (v, s) in enumerate(zip(self.v_size.tolist(), self.s_size.tolist())):
            _check_forced(v, s, seq_len, sink_tokens, local_window, where=f"head {head}: ")


LayerBudget = Union[StaticHeadBudgets, TopPBudget]


def _parse_key(kind: str, key: Any, context: str) -> int:
    """A JSON object key: a decimal string (or an int, for dicts built in Python) → int."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.isdigit() and str(int(key)) == key:
        return int(key)
    raise ValueError(f"{context}{kind} key {key!r} is not a non-negative integer written in decimal (e.g. \"0\")")


def _check_keys(kind: str, found: set[int], expected: int, context: str) -> None:
    if found != set(range(expected)):
        missing = sorted(set(range(expected)) - found)[:5]
        extra = sorted(found - set(range(expected)))[:5]
        raise ValueError(f"{context}has {kind} keys for {len(found)} {kind}s but the model has "
                         f"{expected} ({kind} keys 0 … {expected - 1}, 0-based); missing {missing}, "
                         f"unexpected {extra}")


@dataclass(frozen=True)
class BudgetTable:
    """Budgets of every (layer, query head) of a model: ``per_head[layer][head]`` or one ``top_p``.

    Layers are indexed 0-based here and in JSON; :meth:`resolve` takes Megatron's 1-based
    ``layer_number``. Exactly one of ``per_head`` and ``top_p`` is set.
    """

    num_layers: int
    num_heads: int
    per_head: tuple[tuple[StaticBudget, ...], ...] | None = None
    top_p: TopPBudget | None = None

    def __post_init__(self) -> None:
        _check_int("num_layers", self.num_layers, 1)
        _check_int("num_heads", self.num_heads, 1)
        if (self.per_head is None) == (self.top_p is None):
            raise ValueError("a BudgetTable needs exactly one of per_head (static) and top_p; "
                             f"got per_head={'set' if self.per_head is not None else None}, top_p={self.top_p}")
        if self.per_head is not None:
            if len(self.per_head) != self.num_layers or any(len(row) != self.num_heads for row in self.per_head):
                raise ValueError(f"per_head must be {self.num_layers} layers x {self.num_heads} heads, got "
                                 f"{len(self.per_head)} layers with {sorted({len(r) for r in self.per_head})} heads")

    # ------------------------------------------------------------------ construction
    @classmethod
    def uniform(cls, budget: StaticBudget | TopPBudget, *, num_layers: int, num_heads: int) -> "BudgetTable":
        """The same budget for every layer and head."""
        if isinstance(budget, TopPBudget):
            return cls(num_layers, num_heads, top_p=budget)
        if isinstance(budget, StaticBudget):
            _check_int("num_heads", num_heads, 1)
            _check_int("num_layers", num_layers, 1)
            return cls(num_layers, num_heads, per_head=((budget,) * num_heads,) * num_layers)
        raise ValueError(f"budget={budget!r} must be a StaticBudget or a TopPBudget")

    @classmethod
    def for_sparsity(cls, sparsity: float, seq_len: int, *, num_layers: int, num_heads: int,
                     **conversion: Any) -> "BudgetTable":
        """A uniform static table from a target sparsity; see :meth:`StaticBudget.for_sparsity`."""
        return cls.uniform(StaticBudget.for_sparsity(sparsity, seq_len, **conversion),
                           num_layers=num_layers, num_heads=num_heads)

    @classmethod
    def from_json(cls, source: str | os.PathLike | Mapping, *, num_layers: int, num_heads: int) -> "BudgetTable":
        """Read ``{"<layer>": {"<head>": [v_size, s_size]}}`` from a file path or an already-loaded mapping.

        Every layer 0 … num_layers−1 and every head 0 … num_heads−1 must be present, nothing else.
        """
        if isinstance(source, Mapping):
            data, context = source, "the pattern mapping "
        else:
            with open(source, encoding="utf-8") as handle:
                data = json.load(handle)
            context = f"pattern file {os.fspath(source)!r} "
        if not isinstance(data, Mapping):
            raise ValueError(f"{context}must be an object {{layer: {{head: [v, s]}}}}, got {type(data).__name__}")
        layers = {_parse_key("layer", key, context): value for key, value in data.items()}
        _check_keys("layer", set(layers), num_layers, context)
        rows = []
        for layer in range(num_layers):
            heads_data = layers[layer]
            if not isinstance(heads_data, Mapping):
                raise ValueError(f"{context}layer {layer} must map head ids to [v, s], got {heads_data!r}")
            heads = {_parse_key("head", key, f"{context}layer {layer} "): value for key, value in heads_data.items()}
            _check_keys("head", set(heads), num_heads, f"{context}layer {layer} ")
            row = []
            for head in range(num_heads):
                pair = heads[head]
                if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                    raise ValueError(f"{context}layer {layer} head {head}: {pair!r} must be a pair [v_size, s_size]")
                try:
                    row.append(StaticBudget(*pair))
                except ValueError as error:
                    raise ValueError(f"{context}layer {layer} head {head}: {error}") from None
            rows.append(tuple(row))
        return cls(num_layers, num_heads, per_head=tuple(rows))

    @classmethod
    def from_settings(cls, *, mode: str, num_layers: int, num_heads: int, top_p: float | None = None,
                      cap: int | None = None, v_size: int | None = None, s_size: int | None = None,
                      pattern_file: str | os.PathLike | None = None) -> "BudgetTable":
        """The table described by the ``--mtraining-budget``/``-top-p``/``-cap``/``-vertical-size``/
        ``-slash-size``/``-pattern-file`` flags (unset ones are ``None``).

        ``mode="static"`` takes either ``pattern_file`` or both ``v_size`` and ``s_size``;
        ``mode="top-p"`` takes ``top_p`` and optionally ``cap``. Settings of the other mode raise.
        """
        static_given = {name: value for name, value in
                        (("v_size", v_size), ("s_size", s_size), ("pattern_file", pattern_file)) if value is not None}
        top_p_given = {name: value for name, value in (("top_p", top_p), ("cap", cap)) if value is not None}
        if static_given and top_p_given:
            raise ValueError(f"top-P settings {top_p_given} and static settings {static_given} were given together; "
                             "set only the ones of the chosen budget mode")
        if mode == "top-p":
            if static_given:
                raise ValueError(f"budget mode 'top-p' does not take static settings {static_given}; drop them "
                                 "or use mode 'static'")
            if top_p is None:
                raise ValueError("budget mode 'top-p' needs top_p (e.g. 0.9 or 0.95)")
            return cls.uniform(TopPBudget(top_p, DEFAULT_CAP if cap is None else cap),
                               num_layers=num_layers, num_heads=num_heads)
        if mode == "static":
            if top_p_given:
                raise ValueError(f"budget mode 'static' does not take top-P settings {top_p_given}; drop them "
                                 "or use mode 'top-p'")
            if pattern_file is not None:
                if v_size is not None or s_size is not None:
                    raise ValueError(f"pattern_file={os.fspath(pattern_file)!r} and a uniform pair "
                                     f"(v_size={v_size}, s_size={s_size}) were given together; use one of them")
                return cls.from_json(pattern_file, num_layers=num_layers, num_heads=num_heads)
            if v_size is None or s_size is None:
                raise ValueError(f"budget mode 'static' needs pattern_file or both v_size and s_size; "
                                 f"got v_size={v_size}, s_size={s_size}")
            return cls.uniform(StaticBudget(v_size, s_size), num_layers=num_layers, num_heads=num_heads)
        raise ValueError(f"budget mode {mode!r} is unknown; use 'static' or 'top-p'")

    # ------------------------------------------------------------------ use
    def to_json(self) -> dict[str, dict[str, list[int]]]:
        """The ``{"<layer>": {"<head>": [v, s]}}`` form (0-based layers) of a static table."""
        if self.per_head is None:
            raise ValueError(f"a top-P table ({self.top_p}) has no per-head JSON form; only static tables do")
        return {str(layer): {str(head): [b.v_size, b.s_size] for head, b in enumerate(row)}
                for layer, row in enumerate(self.per_head)}

    def save_json(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_json(), handle, indent=1)

    def validate_for(self, seq_len: int, sink_tokens: int, local_window: int) -> None:
        """Raise ``ValueError`` naming the first (0-based layer, head) whose budget does not fit."""
        if self.top_p is not None:
            self.top_p.validate_for(seq_len, sink_tokens, local_window)
            return
        for layer, row in enumerate(self.per_head):
            for head, budget in enumerate(row):
                _check_forced(budget.v_size, budget.s_size, seq_len, sink_tokens, local_window,
                              where=f"layer {layer} (0-based) head {head}: ")

    def resolve(self, layer_number: int, heads: range | None = None) -> LayerBudget:
        """Budgets of Megatron layer ``layer_number`` (1-based, global) for the global query heads ``heads``.

        ``heads`` defaults to all heads; a tensor-parallel rank passes its own contiguous range, e.g.
        ``range(tp_rank * n, (tp_rank + 1) * n)``. Static tables give int64 tensors over ``heads``.
        """
        if isinstance(layer_number, bool) or not isinstance(layer_number, int) \
                or not 1 <= layer_number <= self.num_layers:
            raise ValueError(f"layer_number={layer_number!r} is outside 1 … {self.num_layers} "
                             "(Megatron layer numbers are 1-based and global)")
        heads = range(self.num_heads) if heads is None else heads
        if not isinstance(heads, range) or len(heads) == 0 or heads.step != 1 \
                or heads.start < 0 or heads.stop > self.num_heads:
            raise ValueError(f"heads={heads!r} must be a non-empty contiguous range inside "
                             f"range(0, {self.num_heads})")
        if self.top_p is not None:
            return self.top_p
        row = self.per_head[layer_number - 1][heads.start:heads.stop]
        return StaticHeadBudgets(torch.tensor([b.v_size for b in row], dtype=torch.int64),
                                 torch.tensor([b.s_size for b in row], dtype=torch.int64))
