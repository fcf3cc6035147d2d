"""``--mtraining-*`` command-line flags for Megatron's argument parser, and args → :class:`MTrainingConfig`.

Use with Megatron's own parsing (DESIGN.md §3)::

    args = parse_and_validate_args(extra_args_provider=add_mtraining_args)
    mtraining = validate_mtraining_args(args)

There is one flag per :class:`~megatron_mtraining.config.MTrainingConfig` field (``top_p`` is
``--mtraining-top-p``) with the config's defaults, plus the launcher's ``--mtraining-loss-chunk-size``
and ``--mtraining-check``; the former ``--mtraining-kernel`` is refused with the flags that replace
its value (``KERNEL_FLAG_REPLACEMENTS``). The config validates the MTraining settings;
:func:`validate_mtraining_args` adds the checks that involve Megatron's own flags (``--spec``,
``--cp-comm-type``, packed sequences, dropout, MTP, RoPE type). Every rejection is a ``ValueError``
naming the flag and the fix, raised before any work.
"""

from __future__ import annotations

import argparse
import dataclasses

from mtraining_kernels.layout import LAYOUT_KINDS

from .config import BUDGET_MODES, DENSE_IMPLS, FLAG_BACKENDS, GRAD_WIRE_DTYPES, RINGS, MTrainingConfig, flag

LOSS_CHUNK_SIZE_FLAG = "--mtraining-loss-chunk-size"
INTER_DOCUMENT_FLAG = "--dataloader-inter-document-masking"  # the dataset's documents, as cu_seqlens
CHECK_FLAG = "--mtraining-check"
REMOVED_KERNEL_FLAG = "--mtraining-kernel"
KERNEL_FLAG_REPLACEMENTS = {  # old --mtraining-kernel value → the flags that select the same kernels
    "triton": f"{flag('backend')} triton",
    "torch_blocksparse": f"{flag('backend')} torch",
    "sdpa_cudnn": f"{flag('dense_impl')} sdpa_cudnn (with {flag('dense')})",
    "sdpa_flash": f"{flag('dense_impl')} sdpa_flash (with {flag('dense')})",
    "reference": "nothing (the plain-autograd test oracle is MTrainingConfig(backend='reference') in Python)",
}
MTRAINING_SPEC = ("megatron_mtraining.spec", "get_gpt_layer_mtraining_spec")
RING_CP_COMM_TYPES = ("p2p", "a2a+p2p")


def _default(field_name: str):
    return MTrainingConfig.__dataclass_fields__[field_name].default


def _layer_numbers(text: str) -> tuple[int, ...]:
    """argparse type of ``--mtraining-dense-layers``: ``"1,2"`` → ``(1, 2)``."""
    try:
        return tuple(int(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of 1-based layer numbers, e.g. 1,2"
        ) from None


class _RemovedKernelFlag(argparse.Action):
    """``--mtraining-kernel``: refused with the flags that replace the given value."""

    def __call__(self, parser, namespace, value, option_string=None):
        mapping = "; ".join(f"{old} → {new}" for old, new in KERNEL_FLAG_REPLACEMENTS.items())
        replace = (
            f"replace {REMOVED_KERNEL_FLAG} {value} with {KERNEL_FLAG_REPLACEMENTS[value]}; "
            if value in KERNEL_FLAG_REPLACEMENTS
            else ""
        )
        raise argparse.ArgumentError(
            self,
            f"removed: split into {flag('backend')} (the block-sparse kernels) and "
            f"{flag('dense_impl')} (how {flag('dense')} layers run); {replace}"
            f"old values: {mapping}",
        )


def add_mtraining_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--mtraining-*`` flags (Megatron's ``extra_args_provider``); returns ``parser``.

    Also changes two Megatron defaults that MTraining needs: no attention mask in the data loader
    (the attention is causal by construction; a mask at 512K would be [N, N]) and attention dropout 0
    (the attention has none; :func:`validate_mtraining_args` rejects an explicit non-zero value).
    """
    group = parser.add_argument_group("MTraining", "distributed dynamic vertical-slash sparse attention")
    group.add_argument(
        flag("layout"),
        choices=LAYOUT_KINDS,
        default=_default("layout"),
        help="how the sequence is split over CP ranks; striped balances sparse work, skewed (striped with each "
        "round of stripes turned by one rank) also balances packed documents of equal length, zigzag is "
        "Megatron's split (for ablations)",
    )
    group.add_argument(
        flag("stripe_granularity"),
        type=int,
        default=_default("stripe_granularity"),
        help="tokens per stripe of the striped and skewed layouts (a multiple of 128)",
    )
    group.add_argument(
        flag("budget"),
        choices=BUDGET_MODES,
        default=_default("budget"),
        help="top-p: per-head budgets from the estimated attention mass; static: fixed budgets",
    )
    group.add_argument(
        flag("top_p"), type=float, default=None, help="attention mass the top-P budget covers (default 0.9)"
    )
    group.add_argument(
        flag("cap"), type=int, default=None, help="largest top-P budget per head and kind (default 4096)"
    )
    group.add_argument(
        flag("block_slashes"),
        action="store_true",
        help="top-P: rank whole 128-token block diagonals by their mass, the work the kernels do for any slash, "
        "instead of single slashes (the cap then counts block diagonals)",
    )
    group.add_argument(
        flag("vertical_size"), type=int, default=None, help="static budget: verticals per head (sinks included)"
    )
    group.add_argument(
        flag("slash_size"), type=int, default=None, help="static budget: slashes per head (local window included)"
    )
    group.add_argument(
        flag("sparsity"),
        type=float,
        default=None,
        help="static budget: target sparsity in [0, 1), converted to one uniform pair",
    )
    group.add_argument(
        flag("pattern_file"),
        default=None,
        help="static budget: JSON {layer: {head: [v_size, s_size]}} (0-based layers, global heads)",
    )
    group.add_argument(
        flag("last_q"),
        type=int,
        default=_default("last_q"),
        help="last global queries used to estimate the index (at most 64)",
    )
    group.add_argument(
        flag("sink_tokens"), type=int, default=_default("sink_tokens"), help="leading key columns always selected"
    )
    group.add_argument(
        flag("local_window"),
        type=int,
        default=_default("local_window"),
        help="diagonal offsets 0 … W-1 always selected",
    )
    group.add_argument(
        flag("backend"),
        choices=FLAG_BACKENDS,
        default=_default("backend"),
        help="block-sparse attention kernels: triton (CUDA GPUs, the default) or torch (PyTorch, any "
        "device; pass it on CPU)",
    )
    group.add_argument(
        REMOVED_KERNEL_FLAG, nargs="?", action=_RemovedKernelFlag, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    group.add_argument(
        flag("deterministic"),
        action="store_true",
        help="bitwise-reproducible backward (also implied by --deterministic-mode)",
    )
    group.add_argument(
        flag("grad_wire_dtype"),
        choices=GRAD_WIRE_DTYPES,
        default=_default("grad_wire_dtype"),
        help="dtype of the dK/dV partials sent around the ring",
    )
    group.add_argument(
        flag("dense"), action="store_true", help="compute every layer with the full causal pattern (the dense baseline)"
    )
    group.add_argument(
        flag("dense_impl"),
        choices=DENSE_IMPLS,
        default=_default("dense_impl"),
        help="how --mtraining-dense layers run: mtraining (the --mtraining-backend kernels through the "
        "same ring as sparse layers) or sdpa_cudnn / sdpa_flash (torch's cuDNN / flash SDPA "
        "kernels; with CP > 1 the zigzag dense ring: --mtraining-layout zigzag, flat ring)",
    )
    group.add_argument(
        flag("dense_layers"),
        type=_layer_numbers,
        default=_default("dense_layers"),
        help="comma-separated 1-based layer numbers computed densely, e.g. 1,2",
    )
    group.add_argument(
        flag("ring"),
        choices=RINGS,
        default=_default("ring"),
        help="flat ring over the CP group, or an inner (intra-node) ring inside an outer ring",
    )
    group.add_argument(
        flag("inner_ring_size"),
        type=int,
        default=None,
        help="CP ranks per inner ring of the hierarchical ring (or set --hierarchical-context-parallel-sizes L O)",
    )
    group.add_argument(
        flag("stats_interval"),
        type=int,
        default=_default("stats_interval"),
        help="log MTraining metrics (density, imbalance, index time) every N iterations; 0 = never",
    )
    group.add_argument(
        flag("keep_attention_output"),
        action="store_true",
        help="with --recompute-granularity full: keep each layer's attention output (and lse) from "
        "the first forward so that the recomputation skips attention (N_loc x hidden x 2 bytes "
        "more per layer and rank)",
    )
    group.add_argument(
        flag("min_sparse_length"),
        type=int,
        default=_default("min_sparse_length"),
        help="packed documents at least this long get their own sparse index, shorter ones are attended "
        "densely (provisional default, not yet measured on a GPU)",
    )
    group.add_argument(
        flag("plan_turns"),
        action="store_true",
        help="with --mtraining-layout skewed, a static budget and packed documents: turn every round of stripes "
        "by a turn planned per micro-batch from its documents, which evens out the ring's work",
    )
    group.add_argument(
        LOSS_CHUNK_SIZE_FLAG,
        type=int,
        default=0,
        help="compute the output layer and cross-entropy in chunks of N positions per CP rank, "
        "recomputed in backward, so the full logits never exist (e.g. 8192 for 512K "
        "tokens); 0 = Megatron's full logits",
    )
    group.add_argument(
        CHECK_FLAG,
        action="store_true",
        help="validate the whole command for WORLD_SIZE ranks (default 1) as the launcher would, print "
        "the resolved configuration and exit; runs without GPU or data, no torchrun needed",
    )
    parser.set_defaults(create_attention_mask_in_dataloader=False, attention_dropout=0.0)
    return parser


def mtraining_config_from_args(args: argparse.Namespace) -> MTrainingConfig:
    """The :class:`MTrainingConfig` of parsed ``--mtraining-*`` flags (settings-only checks run here).

    ``--deterministic-mode`` (Megatron's bitwise-reproducibility switch) implies
    ``--mtraining-deterministic``.
    """
    values = {field.name: getattr(args, "mtraining_" + field.name) for field in dataclasses.fields(MTrainingConfig)}
    values["deterministic"] = bool(values["deterministic"] or getattr(args, "deterministic_mode", False))
    return MTrainingConfig(**values)


def _seq_length(args: argparse.Namespace):
    return args.seq_length if args.seq_length is not None else args.encoder_seq_length


def validate_mtraining_args(args: argparse.Namespace) -> MTrainingConfig:
    """Check the ``--mtraining-*`` flags against each other and against Megatron's; return the config.

    Works on Megatron's parsed arguments before or after Megatron's own ``validate_args``. Raises
    ``ValueError`` naming the offending flag and the fix.
    """
    config = mtraining_config_from_args(args)
    config.validate(
        num_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        seq_length=_seq_length(args),
        context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        attention_backend=args.attention_backend,
    )
    _check_megatron_flags(args, config)
    return config


def _check_megatron_flags(args: argparse.Namespace, config: MTrainingConfig) -> None:
    if args.spec is not None and tuple(args.spec) != MTRAINING_SPEC:
        raise ValueError(
            f"--spec {' '.join(args.spec)} replaces MTraining's layer spec; drop --spec (the launcher "
            f"uses {' '.join(MTRAINING_SPEC)})"
        )
    if args.context_parallel_size > 1:
        unsupported = [kind for kind in args.cp_comm_type if kind not in RING_CP_COMM_TYPES]
        if unsupported:
            raise ValueError(
                f"--cp-comm-type {' '.join(args.cp_comm_type)} is not supported by MTraining's ring "
                f"({', '.join(unsupported)}); use p2p (flat or hierarchical ring)"
            )
        if "a2a+p2p" in args.cp_comm_type and args.hierarchical_context_parallel_sizes is None:
            raise ValueError(
                "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes L O; set it or use p2p"
            )
    thd = [
        name
        for name, given in (("--sft", args.sft), ("--hybrid-context-parallel", args.hybrid_context_parallel))
        if given
    ]
    if thd:
        raise ValueError(
            f"{', '.join(thd)} hand the attention THD packed sequences (cu_seqlens, Transformer Engine's own "
            f"context-parallel split), which MTraining's attention does not take; drop them (for packed "
            f"documents use --reset-attention-mask or {INTER_DOCUMENT_FLAG})"
        )
    _check_document_flags(args, config)
    if args.attention_dropout:
        raise ValueError(
            f"--attention-dropout {args.attention_dropout} is not supported: MTraining attention has "
            "no dropout; use --attention-dropout 0"
        )
    reorders = args.context_parallel_size > 1 and config.layout != "zigzag"
    if reorders and args.mtp_num_layers:
        raise ValueError(
            f"--mtp-num-layers {args.mtp_num_layers} shifts tokens assuming Megatron's zigzag split, "
            f"but {flag('layout')}={config.layout} reorders the sequence; drop --mtp-num-layers or "
            f"use {flag('layout')} zigzag"
        )
    if reorders and args.position_embedding_type == "mrope":
        raise ValueError(
            f"--position-embedding-type mrope is not supported with {flag('layout')}={config.layout}; use rope or yarn"
        )
    if config.keep_attention_output and args.recompute_granularity != "full":
        raise ValueError(
            f"{flag('keep_attention_output')} only saves work when layers are recomputed "
            f"(--recompute-granularity full), but it is {args.recompute_granularity}; add "
            f"--recompute-granularity full or drop {flag('keep_attention_output')}"
        )
    if args.mtraining_loss_chunk_size < 0:
        raise ValueError(
            f"{LOSS_CHUNK_SIZE_FLAG}={args.mtraining_loss_chunk_size} must be >= 0 (0 computes the full logits)"
        )
    if args.mtraining_loss_chunk_size and args.defer_embedding_wgrad_compute:
        raise ValueError(
            f"{LOSS_CHUNK_SIZE_FLAG} recomputes the output layer in backward, which "
            "--defer-embedding-wgrad-compute cannot follow; drop one of them"
        )


def document_source(args: argparse.Namespace) -> str | None:
    """Where a micro-batch's document boundaries come from: ``"cu_seqlens"`` (``--dataloader-inter-document-masking``:
    the dataset's own documents, as Megatron's ``GPTDataset`` hands them), ``"eod"`` (``--reset-attention-mask``:
    a document ends at each EOD token) or None (unpacked)."""
    if getattr(args, "dataloader_inter_document_masking", False):
        return "cu_seqlens"
    return "eod" if args.reset_attention_mask else None


def per_document_positions(args: argparse.Namespace) -> bool:
    """Whether RoPE positions restart per document (``--reset-position-ids``, or the dataset's own with
    ``--dataloader-inter-document-masking``)."""
    return bool(args.reset_position_ids or getattr(args, "dataloader_inter_document_masking", False))


def _check_document_flags(args: argparse.Namespace, config: MTrainingConfig) -> None:
    """Packed documents (``--reset-attention-mask`` or ``--dataloader-inter-document-masking``) and per-document
    RoPE positions (``--reset-position-ids``, or the dataset's with inter-document masking)."""
    packing_flags = [
        name
        for name, given in (
            ("--reset-attention-mask", args.reset_attention_mask),
            (INTER_DOCUMENT_FLAG, getattr(args, "dataloader_inter_document_masking", False)),
        )
        if given
    ]
    if packing_flags:
        packing = " and ".join(packing_flags)
        if config.sdpa_impl is not None:
            raise ValueError(
                f"{packing} needs a document mask, which {flag('dense_impl')}={config.dense_impl} "
                f"does not have; use {flag('dense_impl')} mtraining"
            )
        if args.mtp_num_layers:
            raise ValueError(
                f"--mtp-num-layers {args.mtp_num_layers} rolls packed sequences by THD cu_seqlens, which "
                f"MTraining's packed documents do not carry; drop --mtp-num-layers or {packing}"
            )
    if config.plan_turns and not (packing_flags and per_document_positions(args)):
        raise ValueError(
            f"{flag('plan_turns')} plans each micro-batch's layout from its packed documents, and RoPE then reads "
            "each token's position id; add --reset-attention-mask --reset-position-ids (or "
            f"{INTER_DOCUMENT_FLAG}) or drop {flag('plan_turns')}"
        )
    documents = packing_flags + (["--reset-position-ids"] if args.reset_position_ids else [])
    if documents and args.pipeline_model_parallel_size > 1:
        raise ValueError(
            f"{', '.join(documents)} need the micro-batch's tokens and position ids on every pipeline stage, "
            f"which only the first and last stages read; use --pipeline-model-parallel-size 1 or drop them"
        )
    if per_document_positions(args) and args.apply_rope_fusion and args.position_embedding_type in ("rope", "yarn"):
        positions = [name for name in documents if name != "--reset-attention-mask"]
        raise ValueError(
            f"{' and '.join(positions)} restart the RoPE positions per document ([s, b, 1, dim] tables), which "
            "MTraining runs on the unfused RoPE path only; add --no-rope-fusion"
        )


def hierarchical_cp_sizes(args: argparse.Namespace, config: MTrainingConfig) -> list[int] | None:
    """The run's ``--hierarchical-context-parallel-sizes``: as given, or [L, CP/L] from ``--mtraining-inner-ring-size``.

    Megatron builds the inner/outer CP groups that the hierarchical ring runs on from these sizes.
    """
    if args.hierarchical_context_parallel_sizes is not None or config.ring != "hierarchical":
        return args.hierarchical_context_parallel_sizes
    return [config.inner_ring_size, args.context_parallel_size // config.inner_ring_size]
