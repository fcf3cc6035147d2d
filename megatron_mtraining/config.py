"""MTraining settings and all their validation (DESIGN.md §2.2, §2.3, §3).

:class:`MTrainingConfig` holds one field per ``--mtraining-*`` flag (field ``top_p`` is flag
``--mtraining-top-p``, see :func:`flag`). Checks that need nothing but the settings run when the
object is built; :meth:`MTrainingConfig.validate` adds the ones that need the model and the
parallel layout (layer and head counts, sequence length, CP size, hierarchical CP sizes). Every
error is a ``ValueError`` that names the flag and the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

from mtraining_kernels.budget import DEFAULT_CAP, StaticBudget
from mtraining_kernels.estimation import MAX_LAST_Q
from mtraining_kernels.layout import BLOCK_SIZE, LAYOUT_KINDS, Layout

from .budget import BudgetTable
from .ring.comm import WIRE_DTYPES

BUDGET_MODES = ("top-p", "static")
FLAG_BACKENDS = ("triton", "torch")  # --mtraining-backend choices
REFERENCE_BACKEND = "reference"  # the plain-autograd test oracle, Python API only
BACKENDS = (*FLAG_BACKENDS, REFERENCE_BACKEND)
BLOCK_SPARSE_BACKENDS = {"triton": "triton", "torch": "torch_blocksparse"}  # backend → mtraining_kernels name
SDPA_IMPLS = {"sdpa_cudnn": "cudnn", "sdpa_flash": "flash"}  # dense_impl → mtraining_kernels.sdpa_backend impl
DENSE_IMPLS = ("mtraining", *SDPA_IMPLS)
GRAD_WIRE_DTYPES = tuple(WIRE_DTYPES)
RINGS = ("flat", "hierarchical")
DEFAULT_TOP_P = 0.9
DEFAULT_MIN_SPARSE_LENGTH = 4096  # provisional: packed documents shorter than this are attended densely


def flag(field_name: str) -> str:
    """The command-line flag of a :class:`MTrainingConfig` field, e.g. ``top_p`` → ``--mtraining-top-p``."""
    return "--mtraining-" + field_name.replace("_", "-")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class MTrainingConfig:
    """Settings of MTraining's sparse attention; defaults follow DESIGN.md.

    Budget: ``budget="top-p"`` takes ``top_p`` (default 0.9), ``cap`` (default 4096) and ``block_slashes``
    (rank whole 128-token block diagonals instead of single slashes);
    ``budget="static"`` takes exactly one of the pair ``vertical_size``/``slash_size``, a target
    ``sparsity`` (converted to a uniform pair per sequence length) or a per-(layer, head)
    ``pattern_file`` (JSON ``{layer: {head: [v, s]}}``, 0-based layers, global heads).
    ``backend`` picks the block-sparse kernels: ``triton`` (CUDA GPUs, the default, as the launch
    scripts run) or ``torch`` (PyTorch, any device; CPU runs pass it); ``reference`` is the plain-autograd
    test oracle (one device, Python only, no flag). ``dense_layers`` are 1-based global layer numbers
    computed with the full pattern through the same ring; ``dense=True`` does that for every layer (the
    dense baseline), and ``dense_impl`` says how those layers run: ``mtraining`` (the ``backend`` kernels
    through the same ring) or ``sdpa_cudnn`` / ``sdpa_flash`` (torch's SDPA kernels, no index; with CP > 1
    the zigzag dense ring: zigzag layout, flat ring). ``keep_attention_output`` keeps each layer's
    attention output and lse from the first forward of a full activation recomputation, so that the
    recomputation skips the attention forward (costs N_loc·Hq·d activations per layer and rank).
    ``min_sparse_length``: packed documents (DESIGN.md §2.7) at least this long get their own index,
    shorter ones are attended densely (the default is provisional until measured on a GPU).
    ``plan_turns``: with the skewed layout and packed documents, every micro-batch gets its own turns, planned
    from its documents and the static budget (``megatron_mtraining.turn_plan``), so the ring's work evens out.
    """

    layout: str = "striped"
    stripe_granularity: int = BLOCK_SIZE
    budget: str = "top-p"
    top_p: float | None = None
    cap: int | None = None
    block_slashes: bool = False
    vertical_size: int | None = None
    slash_size: int | None = None
    sparsity: float | None = None
    pattern_file: str | None = None
    last_q: int = MAX_LAST_Q
    sink_tokens: int = 30
    local_window: int = 100
    backend: str = "triton"
    deterministic: bool = False
    grad_wire_dtype: str = "fp32"
    dense: bool = False
    dense_impl: str = "mtraining"
    dense_layers: tuple[int, ...] = ()
    ring: str = "flat"
    inner_ring_size: int | None = None
    stats_interval: int = 1
    keep_attention_output: bool = False
    min_sparse_length: int = DEFAULT_MIN_SPARSE_LENGTH
    plan_turns: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.dense_layers, (list, range)):
            object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        self._check_choices()
        self._check_numbers()
        self._check_budget_settings()
        self._check_dense_layers()
        self._check_dense_impl()
        if self.keep_attention_output and self.backend == REFERENCE_BACKEND:
            raise ValueError(
                f"{flag('keep_attention_output')} needs a kernel with a separate backward; "
                f"backend='reference' (the test oracle) is plain autograd; use {flag('backend')} "
                "triton or torch"
            )
        if self.plan_turns:
            self._check_plan_turns()
        if self.inner_ring_size is not None and self.ring != "hierarchical":
            raise ValueError(
                f"{flag('inner_ring_size')}={self.inner_ring_size} only applies to the hierarchical "
                f"ring, but {flag('ring')}={self.ring}; add {flag('ring')} hierarchical or drop it"
            )

    # ------------------------------------------------------------------ settings-only checks
    def _check_choices(self) -> None:
        for name, choices in (
            ("layout", LAYOUT_KINDS),
            ("budget", BUDGET_MODES),
            ("backend", BACKENDS),
            ("dense_impl", DENSE_IMPLS),
            ("grad_wire_dtype", GRAD_WIRE_DTYPES),
            ("ring", RINGS),
        ):
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{flag(name)}={value!r} is unknown; use one of {', '.join(choices)}")
        for name in ("deterministic", "dense", "keep_attention_output", "plan_turns"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{flag(name)} must be a bool, got {getattr(self, name)!r}")

    def _check_numbers(self) -> None:
        g = self.stripe_granularity
        if not _is_int(g) or g < BLOCK_SIZE or g % BLOCK_SIZE or g & (g - 1):
            raise ValueError(
                f"{flag('stripe_granularity')}={g!r} must be a power of two and a multiple of "
                f"{BLOCK_SIZE} (the sparse kernels need whole {BLOCK_SIZE}-token blocks); "
                f"use {BLOCK_SIZE}"
            )
        if not _is_int(self.last_q) or not 1 <= self.last_q <= MAX_LAST_Q:
            raise ValueError(
                f"{flag('last_q')}={self.last_q!r} must be an integer in [1, {MAX_LAST_Q}] "
                f"(one {MAX_LAST_Q}-row estimation tile); use {MAX_LAST_Q}"
            )
        for name in ("sink_tokens", "local_window", "stats_interval"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"{flag(name)}={value!r} must be an integer >= 0")
        if not _is_int(self.min_sparse_length) or self.min_sparse_length < max(
            self.last_q, self.sink_tokens, self.local_window
        ):
            raise ValueError(
                f"{flag('min_sparse_length')}={self.min_sparse_length!r} must be an integer >= max("
                f"{flag('last_q')}, {flag('sink_tokens')}, {flag('local_window')}) = "
                f"{max(self.last_q, self.sink_tokens, self.local_window)}: a packed document with its own index "
                "holds its estimation queries, sinks and window offsets"
            )
        if self.inner_ring_size is not None and (not _is_int(self.inner_ring_size) or self.inner_ring_size < 1):
            raise ValueError(
                f"{flag('inner_ring_size')}={self.inner_ring_size!r} must be an integer >= 1 "
                "(the number of CP ranks per node)"
            )

    def _check_plan_turns(self) -> None:
        if self.layout != "skewed" or self.stripe_granularity != BLOCK_SIZE:
            raise ValueError(
                f"{flag('plan_turns')} turns the skewed layout's rounds of {BLOCK_SIZE}-token stripes, but "
                f"{flag('layout')}={self.layout} with {flag('stripe_granularity')}={self.stripe_granularity}; use "
                f"{flag('layout')} skewed with {flag('stripe_granularity')} {BLOCK_SIZE}"
            )
        if self.budget != "static":
            raise ValueError(
                f"{flag('plan_turns')} plans from each document's static budget, which a top-P budget only has "
                f"after estimation; use {flag('budget')} static or drop {flag('plan_turns')}"
            )

    def _check_budget_settings(self) -> None:
        static = {
            name: getattr(self, name)
            for name in ("vertical_size", "slash_size", "sparsity", "pattern_file")
            if getattr(self, name) is not None
        }
        top_p = {name: getattr(self, name) for name in ("top_p", "cap") if getattr(self, name) is not None}
        if not isinstance(self.block_slashes, bool):
            raise ValueError(f"{flag('block_slashes')}={self.block_slashes!r} must be True or False")
        if self.block_slashes:
            top_p["block_slashes"] = True
        if self.budget == "top-p" and static:
            raise ValueError(
                f"{flag('budget')}=top-p does not take the static budget settings "
                f"{', '.join(flag(n) for n in static)}; drop them or add {flag('budget')} static"
            )
        if self.budget == "static" and top_p:
            raise ValueError(
                f"{flag('budget')}=static does not take the top-P settings "
                f"{', '.join(flag(n) for n in top_p)}; drop them or add {flag('budget')} top-p"
            )
        if self.top_p is not None and (not _is_number(self.top_p) or not 0 < self.top_p <= 1):
            raise ValueError(f"{flag('top_p')}={self.top_p!r} must be a number in (0, 1]; use e.g. 0.9 or 0.95")
        if self.cap is not None and (not _is_int(self.cap) or self.cap < 1):
            raise ValueError(f"{flag('cap')}={self.cap!r} must be an integer >= 1; the default is {DEFAULT_CAP}")
        if self.sparsity is not None and (not _is_number(self.sparsity) or not 0 <= self.sparsity < 1):
            raise ValueError(f"{flag('sparsity')}={self.sparsity!r} must be a number in [0, 1), e.g. 0.95")
        for name in ("vertical_size", "slash_size"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{flag(name)}={value!r} must be an integer >= 1")
        if self.budget == "static":
            pair_given = self.vertical_size is not None or self.slash_size is not None
            sources = [
                name
                for name, given in (
                    ("vertical_size/slash_size", pair_given),
                    ("sparsity", self.sparsity is not None),
                    ("pattern_file", self.pattern_file is not None),
                )
                if given
            ]
            if len(sources) != 1:
                raise ValueError(
                    f"{flag('budget')}=static needs exactly one of {flag('vertical_size')} with "
                    f"{flag('slash_size')}, {flag('sparsity')} or {flag('pattern_file')}; got "
                    f"{' and '.join(sources) if sources else 'none'}"
                )
            if pair_given and (self.vertical_size is None or self.slash_size is None):
                missing = "slash_size" if self.slash_size is None else "vertical_size"
                raise ValueError(f"a static budget pair needs both sizes; add {flag(missing)}")
            if self.pattern_file is not None and not os.path.isfile(self.pattern_file):
                raise ValueError(
                    f"{flag('pattern_file')}={self.pattern_file!r} is not a file; give the path of "
                    "a JSON file {layer: {head: [v_size, s_size]}}"
                )
        if self.vertical_size is not None and self.vertical_size < self.sink_tokens:
            raise ValueError(
                f"{flag('vertical_size')}={self.vertical_size} is smaller than the "
                f"{flag('sink_tokens')}={self.sink_tokens} forced sinks, which count toward it; "
                f"use {flag('vertical_size')} >= {self.sink_tokens}"
            )
        if self.slash_size is not None and self.slash_size < self.local_window:
            raise ValueError(
                f"{flag('slash_size')}={self.slash_size} is smaller than the "
                f"{flag('local_window')}={self.local_window} forced window offsets, which count "
                f"toward it; use {flag('slash_size')} >= {self.local_window}"
            )
        forced = max(self.sink_tokens, self.local_window)
        if self.budget == "top-p" and self.effective_cap < forced:
            raise ValueError(
                f"{flag('cap')}={self.effective_cap} is smaller than the forced entries "
                f"({flag('sink_tokens')}={self.sink_tokens}, {flag('local_window')}="
                f"{self.local_window}), which count toward it; use {flag('cap')} >= {forced}"
            )

    def _check_dense_layers(self) -> None:
        layers = self.dense_layers
        if not isinstance(layers, tuple) or not all(_is_int(n) and n >= 1 for n in layers):
            raise ValueError(
                f"{flag('dense_layers')}={layers!r} must list 1-based layer numbers (integers >= 1), e.g. 1,2"
            )
        if len(set(layers)) != len(layers):
            raise ValueError(f"{flag('dense_layers')}={layers!r} lists a layer twice; list each layer once")
        if self.dense and layers:
            raise ValueError(
                f"{flag('dense')} already computes every layer densely; drop "
                f"{flag('dense_layers')}={','.join(map(str, layers))}"
            )

    def _check_dense_impl(self) -> None:
        if self.dense_impl == "mtraining":
            return
        if not self.dense:
            raise ValueError(
                f"{flag('dense_impl')}={self.dense_impl} sets how {flag('dense')} runs its layers, but "
                f"{flag('dense')} is not set; add {flag('dense')}, or drop {flag('dense_impl')} for "
                "sparse attention"
            )
        if self.deterministic:
            raise ValueError(
                f"{flag('dense_impl')}={self.dense_impl} cannot promise a bitwise-reproducible backward "
                f"({flag('deterministic')}, also implied by --deterministic-mode); drop it or use "
                f"{flag('dense_impl')} mtraining"
            )

    # ------------------------------------------------------------------ derived settings
    @property
    def sdpa_impl(self) -> str | None:
        """The ``mtraining_kernels.sdpa_backend`` impl (``cudnn``/``flash``) of an SDPA ``dense_impl``, else None."""
        return SDPA_IMPLS.get(self.dense_impl)

    @property
    def block_sparse_backend(self) -> str:
        """The ``mtraining_kernels`` name of ``backend``: ``triton`` or ``torch_blocksparse`` (not reference)."""
        return BLOCK_SPARSE_BACKENDS[self.backend]

    @property
    def effective_top_p(self) -> float:
        return DEFAULT_TOP_P if self.top_p is None else float(self.top_p)

    @property
    def effective_cap(self) -> int:
        return DEFAULT_CAP if self.cap is None else self.cap

    def is_dense_layer(self, layer_number: int) -> bool:
        """Whether Megatron layer ``layer_number`` (1-based, global) uses the full pattern."""
        return self.dense or layer_number in self.dense_layers

    def layout_for(self, world_size: int) -> Layout:
        """The sequence layout over ``world_size`` CP ranks."""
        return Layout(self.layout, world_size, self.stripe_granularity)

    def budget_table(self, *, num_layers: int, num_heads: int, seq_length: int) -> BudgetTable:
        """Budgets of every (layer, global query head) at sequence length ``seq_length``.

        Reads ``pattern_file`` (once per distinct argument set). Raises ``ValueError`` naming the flag
        when the budgets do not fit the model or the sequence.
        """
        return _budget_table(self, num_layers, num_heads, seq_length)

    # ------------------------------------------------------------------ model-dependent checks
    def validate(
        self,
        *,
        num_layers: int,
        num_attention_heads: int,
        seq_length: int,
        context_parallel_size: int = 1,
        hierarchical_context_parallel_sizes: Sequence[int] | None = None,
        attention_backend: Any = None,
    ) -> None:
        """Raise ``ValueError`` (naming the flag and the fix) unless these settings fit the run.

        ``attention_backend`` is Megatron's ``--attention-backend`` (an ``AttnBackend`` or its name);
        ``hierarchical_context_parallel_sizes`` is ``--hierarchical-context-parallel-sizes`` (or None).
        """
        cp = context_parallel_size
        if not _is_int(cp) or cp < 1:
            raise ValueError(f"--context-parallel-size={cp!r} must be an integer >= 1")
        for name, value in (
            ("--num-layers", num_layers),
            ("--num-attention-heads", num_attention_heads),
            ("--seq-length", seq_length),
        ):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if getattr(attention_backend, "name", attention_backend) == "local":
            raise ValueError(
                "--attention-backend local replaces every custom core attention, MTraining's "
                "included; drop it (keep the default auto)"
            )
        out_of_range = [n for n in self.dense_layers if n > num_layers]
        if out_of_range:
            raise ValueError(
                f"{flag('dense_layers')} lists layers {out_of_range} but the model has "
                f"--num-layers={num_layers}; layer numbers are 1-based, use 1 … {num_layers}"
            )
        self._validate_sequence(seq_length, cp)
        self.check_parallelism(
            cp, hierarchical=self.ring == "hierarchical" or hierarchical_context_parallel_sizes is not None
        )
        self._validate_ring(cp, hierarchical_context_parallel_sizes)
        if not self.dense:
            self.budget_table(num_layers=num_layers, num_heads=num_attention_heads, seq_length=seq_length)

    def _validate_sequence(self, seq_length: int, cp: int) -> None:
        layout = self.layout_for(cp)
        unit = layout.unit(BLOCK_SIZE)
        if seq_length % unit:
            lower = seq_length // unit * unit
            why = {
                "striped": f"--context-parallel-size x {flag('stripe_granularity')} = {cp} x {self.stripe_granularity}",
                "skewed": f"--context-parallel-size x {flag('stripe_granularity')} = {cp} x {self.stripe_granularity}",
                "zigzag": f"2 x --context-parallel-size x {BLOCK_SIZE} = 2 x {cp} x {BLOCK_SIZE}",
                "contiguous": f"--context-parallel-size x {BLOCK_SIZE} = {cp} x {BLOCK_SIZE}",
            }[self.layout]
            raise ValueError(
                f"--seq-length={seq_length} is not divisible by {unit}, which "
                f"{flag('layout')}={self.layout} needs ({why}); use --seq-length "
                f"{lower or unit} or {lower + unit}"
            )
        if not self.dense and seq_length < self.last_q:
            raise ValueError(
                f"{flag('last_q')}={self.last_q} is longer than --seq-length={seq_length}; "
                f"use {flag('last_q')} <= {seq_length}"
            )

    def _validate_ring(self, cp: int, hcp_sizes: Sequence[int] | None) -> None:
        if hcp_sizes is not None:
            sizes = list(hcp_sizes)
            if self.ring != "hierarchical":
                raise ValueError(
                    f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} selects "
                    f"MTraining's hierarchical ring, but {flag('ring')}={self.ring}; add "
                    f"{flag('ring')} hierarchical or drop the hierarchical sizes"
                )
            if len(sizes) != 2 or not all(_is_int(s) and s >= 1 for s in sizes):
                raise ValueError(
                    f"--hierarchical-context-parallel-sizes={sizes} must be two sizes "
                    "[inner, outer] (ranks per node, nodes); e.g. 8 4"
                )
            if sizes[0] * sizes[1] != cp:
                raise ValueError(
                    f"--hierarchical-context-parallel-sizes {sizes[0]} {sizes[1]} multiply to "
                    f"{sizes[0] * sizes[1]}, not --context-parallel-size={cp}; choose sizes whose "
                    "product is the CP size"
                )
            if self.inner_ring_size is not None and self.inner_ring_size != sizes[0]:
                raise ValueError(
                    f"{flag('inner_ring_size')}={self.inner_ring_size} contradicts "
                    f"--hierarchical-context-parallel-sizes {sizes[0]} {sizes[1]} (inner size "
                    f"{sizes[0]}); drop one of them"
                )
            return
        if self.ring != "hierarchical":
            return
        if cp == 1:
            raise ValueError(
                f"{flag('ring')}=hierarchical needs context parallelism, but "
                "--context-parallel-size=1; drop it or raise the CP size"
            )
        if self.inner_ring_size is None:
            raise ValueError(
                f"{flag('ring')}=hierarchical needs the inner ring size: add "
                f"{flag('inner_ring_size')} L (CP ranks per node) or "
                "--hierarchical-context-parallel-sizes L O"
            )
        if cp % self.inner_ring_size:
            divisors = [d for d in range(1, cp + 1) if cp % d == 0]
            raise ValueError(
                f"{flag('inner_ring_size')}={self.inner_ring_size} does not divide "
                f"--context-parallel-size={cp}; use one of {divisors}"
            )

    def check_parallelism(self, context_parallel_size: int, hierarchical: bool) -> None:
        """Raise ``ValueError`` unless the backend and the dense implementation run at this CP size and ring.

        The reference backend runs on one device; an SDPA ``dense_impl`` with CP > 1 runs the zigzag
        dense ring, flat only. The attention module calls this with its actual process groups.
        """
        cp = context_parallel_size
        if self.backend == REFERENCE_BACKEND and cp > 1:
            raise ValueError(
                f"backend='reference' (the test oracle) runs on one device only, but "
                f"--context-parallel-size={cp}; use {flag('backend')} triton or torch"
            )
        if self.sdpa_impl is None or cp == 1:
            return
        if self.layout != "zigzag":
            raise ValueError(
                f"{flag('dense_impl')}={self.dense_impl} with --context-parallel-size={cp} runs the "
                f"zigzag dense ring, but {flag('layout')}={self.layout}; add {flag('layout')} zigzag"
            )
        if hierarchical:
            raise ValueError(
                f"{flag('dense_impl')}={self.dense_impl} runs the flat ring only, but a hierarchical ring "
                f"was requested ({flag('ring')}=hierarchical or --hierarchical-context-parallel-sizes); "
                f"use {flag('ring')} flat and drop the hierarchical sizes"
            )

    def budget_flags(self) -> str:
        """The flags that set the budget, for error messages."""
        if self.budget == "top-p":
            return f"{flag('top_p')}/{flag('cap')}"
        if self.pattern_file is not None:
            return flag("pattern_file")
        if self.sparsity is not None:
            return flag("sparsity")
        return f"{flag('vertical_size')}/{flag('slash_size')}"


@lru_cache(maxsize=16)
def _budget_table(config: MTrainingConfig, num_layers: int, num_heads: int, seq_length: int) -> BudgetTable:
    try:
        if config.budget == "static" and config.sparsity is not None:
            table = BudgetTable.uniform(
                StaticBudget.for_sparsity(
                    config.sparsity, seq_length, sink_tokens=config.sink_tokens, local_window=config.local_window
                ),
                num_layers=num_layers,
                num_heads=num_heads,
            )
        else:
            table = BudgetTable.from_settings(
                mode=config.budget,
                num_layers=num_layers,
                num_heads=num_heads,
                top_p=config.effective_top_p if config.budget == "top-p" else None,
                cap=config.effective_cap if config.budget == "top-p" else None,
                block_slashes=config.block_slashes,
                v_size=config.vertical_size,
                s_size=config.slash_size,
                pattern_file=config.pattern_file,
            )
        table.validate_for(seq_length, config.sink_tokens, config.local_window)
    except ValueError as error:
        raise ValueError(
            f"{config.budget_flags()} does not fit --num-layers={num_layers}, "
            f"--num-attention-heads={num_heads}, --seq-length={seq_length}: {error}"
        ) from None
    return table
