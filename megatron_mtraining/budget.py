"""The budgets of a whole model (DESIGN.md §2.2, flags in §3): :class:`BudgetTable`.

One uniform setting (a :class:`~mtraining_kernels.budget.StaticBudget` or
:class:`~mtraining_kernels.budget.TopPBudget`), or a static pair per (layer, head) read from JSON
``{"<layer>": {"<head>": [v_size, s_size]}}``. **JSON layer keys are 0-based** (``"0"`` is the first
transformer layer, as in the ``decoder.layers.<i>`` and HF ``model.layers.<i>`` names); Megatron's
``layer_number``, which :meth:`BudgetTable.resolve` takes, is 1-based and global, so layer_number ``n``
reads key ``str(n - 1)``. Head keys are the model's global query-head ids ``0 … num_heads − 1`` (before the
tensor-parallel split).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from mtraining_kernels.budget import (
    DEFAULT_CAP,
    LayerBudget,
    StaticBudget,
    StaticHeadBudgets,
    TopPBudget,
    check_forced,
    check_int,
)


def _parse_key(kind: str, key: Any, context: str) -> int:
    """A JSON object key: a decimal string (or an int, for dicts built in Python) → int."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.isdigit() and str(int(key)) == key:
        return int(key)
    raise ValueError(f'{context}{kind} key {key!r} is not a non-negative integer written in decimal (e.g. "0")')


def _check_keys(kind: str, found: set[int], expected: int, context: str) -> None:
    if found != set(range(expected)):
        missing = sorted(set(range(expected)) - found)[:5]
        extra = sorted(found - set(range(expected)))[:5]
        raise ValueError(
            f"{context}has {kind} keys for {len(found)} {kind}s but the model has "
            f"{expected} ({kind} keys 0 … {expected - 1}, 0-based); missing {missing}, "
            f"unexpected {extra}"
        )


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
        check_int("num_layers", self.num_layers, 1)
        check_int("num_heads", self.num_heads, 1)
        if (self.per_head is None) == (self.top_p is None):
            raise ValueError(
                "a BudgetTable needs exactly one of per_head (static) and top_p; "
                f"got per_head={'set' if self.per_head is not None else None}, top_p={self.top_p}"
            )
        if self.per_head is not None:
            if len(self.per_head) != self.num_layers or any(len(row) != self.num_heads for row in self.per_head):
                raise ValueError(
                    f"per_head must be {self.num_layers} layers x {self.num_heads} heads, got "
                    f"{len(self.per_head)} layers with {sorted({len(r) for r in self.per_head})} heads"
                )

    # ------------------------------------------------------------------ construction
    @classmethod
    def uniform(cls, budget: StaticBudget | TopPBudget, *, num_layers: int, num_heads: int) -> "BudgetTable":
        """The same budget for every layer and head."""
        if isinstance(budget, TopPBudget):
            return cls(num_layers, num_heads, top_p=budget)
        if isinstance(budget, StaticBudget):
            check_int("num_heads", num_heads, 1)
            check_int("num_layers", num_layers, 1)
            return cls(num_layers, num_heads, per_head=((budget,) * num_heads,) * num_layers)
        raise ValueError(f"budget={budget!r} must be a StaticBudget or a TopPBudget")

    @classmethod
    def for_sparsity(
        cls, sparsity: float, seq_len: int, *, num_layers: int, num_heads: int, **conversion: Any
    ) -> "BudgetTable":
        """A uniform static table from a target sparsity; see :meth:`StaticBudget.for_sparsity`."""
        return cls.uniform(
            StaticBudget.for_sparsity(sparsity, seq_len, **conversion), num_layers=num_layers, num_heads=num_heads
        )

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
    def from_settings(
        cls,
        *,
        mode: str,
        num_layers: int,
        num_heads: int,
        top_p: float | None = None,
        cap: int | None = None,
        block_slashes: bool = False,
        v_size: int | None = None,
        s_size: int | None = None,
        pattern_file: str | os.PathLike | None = None,
    ) -> "BudgetTable":
        """The table described by the ``--mtraining-budget``/``-top-p``/``-cap``/``-vertical-size``/
        ``-slash-size``/``-pattern-file`` flags (unset ones are ``None``).

        ``mode="static"`` takes either ``pattern_file`` or both ``v_size`` and ``s_size``;
        ``mode="top-p"`` takes ``top_p`` and optionally ``cap`` and ``block_slashes``. Settings of the other
        mode raise.
        """
        static_given = {
            name: value
            for name, value in (("v_size", v_size), ("s_size", s_size), ("pattern_file", pattern_file))
            if value is not None
        }
        top_p_given = {
            name: value
            for name, value in (("top_p", top_p), ("cap", cap), ("block_slashes", block_slashes or None))
            if value is not None
        }
        if static_given and top_p_given:
            raise ValueError(
                f"top-P settings {top_p_given} and static settings {static_given} were given together; "
                "set only the ones of the chosen budget mode"
            )
        if mode == "top-p":
            if static_given:
                raise ValueError(
                    f"budget mode 'top-p' does not take static settings {static_given}; drop them or use mode 'static'"
                )
            if top_p is None:
                raise ValueError("budget mode 'top-p' needs top_p (e.g. 0.9 or 0.95)")
            return cls.uniform(
                TopPBudget(top_p, DEFAULT_CAP if cap is None else cap, block_slashes),
                num_layers=num_layers,
                num_heads=num_heads,
            )
        if mode == "static":
            if top_p_given:
                raise ValueError(
                    f"budget mode 'static' does not take top-P settings {top_p_given}; drop them or use mode 'top-p'"
                )
            if pattern_file is not None:
                if v_size is not None or s_size is not None:
                    raise ValueError(
                        f"pattern_file={os.fspath(pattern_file)!r} and a uniform pair "
                        f"(v_size={v_size}, s_size={s_size}) were given together; use one of them"
                    )
                return cls.from_json(pattern_file, num_layers=num_layers, num_heads=num_heads)
            if v_size is None or s_size is None:
                raise ValueError(
                    f"budget mode 'static' needs pattern_file or both v_size and s_size; "
                    f"got v_size={v_size}, s_size={s_size}"
                )
            return cls.uniform(StaticBudget(v_size, s_size), num_layers=num_layers, num_heads=num_heads)
        raise ValueError(f"budget mode {mode!r} is unknown; use 'static' or 'top-p'")

    # ------------------------------------------------------------------ use
    def to_json(self) -> dict[str, dict[str, list[int]]]:
        """The ``{"<layer>": {"<head>": [v, s]}}`` form (0-based layers) of a static table."""
        if self.per_head is None:
            raise ValueError(f"a top-P table ({self.top_p}) has no per-head JSON form; only static tables do")
        return {
            str(layer): {str(head): [b.v_size, b.s_size] for head, b in enumerate(row)}
            for layer, row in enumerate(self.per_head)
        }

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
                check_forced(
                    budget.v_size,
                    budget.s_size,
                    seq_len,
                    sink_tokens,
                    local_window,
                    where=f"layer {layer} (0-based) head {head}: ",
                )

    def resolve(self, layer_number: int, heads: range | None = None) -> LayerBudget:
        """Budgets of Megatron layer ``layer_number`` (1-based, global) for the global query heads ``heads``.

        ``heads`` defaults to all heads; a tensor-parallel rank passes its own contiguous range, e.g.
        ``range(tp_rank * n, (tp_rank + 1) * n)``. Static tables give int64 tensors over ``heads``.
        """
        if (
            isinstance(layer_number, bool)
            or not isinstance(layer_number, int)
            or not 1 <= layer_number <= self.num_layers
        ):
            raise ValueError(
                f"layer_number={layer_number!r} is outside 1 … {self.num_layers} "
                "(Megatron layer numbers are 1-based and global)"
            )
        heads = range(self.num_heads) if heads is None else heads
        if (
            not isinstance(heads, range)
            or len(heads) == 0
            or heads.step != 1
            or heads.start < 0
            or heads.stop > self.num_heads
        ):
            raise ValueError(f"heads={heads!r} must be a non-empty contiguous range inside range(0, {self.num_heads})")
        if self.top_p is not None:
            return self.top_p
        row = self.per_head[layer_number - 1][heads.start : heads.stop]
        return StaticHeadBudgets(
            torch.tensor([b.v_size for b in row], dtype=torch.int64),
            torch.tensor([b.s_size for b in row], dtype=torch.int64),
        )
