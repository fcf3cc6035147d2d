"""The launcher's pre-flight: Megatron pitfalls caught before any work, and the ``--mtraining-check`` mode.

:func:`check_launch_flags` rejects command lines that Megatron would accept and then fail on after
minutes of start-up (the validation-set size divides ``--train-iters`` by an unset
``--eval-interval``; evaluation asked of an empty validation split; a warm-up as long as the run; head
dims the chosen kernels cannot run; missing checkpoint or data files). :func:`check_resumed_schedule`
runs Megatron's schedule comparison of a resumed run before the model is built. :func:`run_check` is
``--mtraining-check``: on any machine (no GPU, no data read) it parses and validates the whole command
as the launcher would for ``WORLD_SIZE`` ranks, builds the model config, and prints the resolved
configuration — what a user runs before submitting a 512K job.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
from pathlib import Path
from typing import Callable

from .arguments import CHECK_FLAG, document_source, validate_mtraining_args
from .config import MTrainingConfig, flag
from .conversion.checkpoint_dir import TRACKER_FILE

CHECK_GPU_ARCH = 9  # the check validates as on Hopper (Megatron asks the GPU's architecture when TP or CP > 1)


def head_dim(args: argparse.Namespace) -> int:
    """Megatron's attention head dim: ``--kv-channels``, else hidden size / query heads."""
    return args.kv_channels or args.hidden_size // args.num_attention_heads


def _check_head_dim(args: argparse.Namespace, mtraining: MTrainingConfig) -> None:
    dim = head_dim(args)
    if mtraining.sdpa_impl is not None:
        from mtraining_kernels.sdpa_backend import MAX_HEAD_DIM

        limit = MAX_HEAD_DIM[mtraining.sdpa_impl]
        if dim % 8 or dim > limit:
            raise ValueError(
                f"head dim {dim} is not run by {flag('dense_impl')} {mtraining.dense_impl} (multiples "
                f"of 8 up to {limit}); use {flag('dense_impl')} mtraining"
            )
    elif mtraining.backend == "triton":
        from mtraining_kernels.triton_backend import HEAD_DIMS

        if dim not in HEAD_DIMS:
            raise ValueError(
                f"head dim {dim} (--kv-channels or --hidden-size / --num-attention-heads) is not run by "
                f"{flag('backend')} triton, which supports {', '.join(map(str, HEAD_DIMS))}; use "
                f"{flag('backend')} torch or a model with one of those head dims"
            )


def _split_parts(split: str) -> list[float]:
    return [float(part) for part in re.split(r"[,/]", split) if part.strip()]


def _check_evaluation(args: argparse.Namespace) -> None:
    sized_by_iterations = args.train_iters is not None and not args.skip_train and not args.full_validation
    if sized_by_iterations and args.eval_interval is None:
        raise ValueError(
            "--eval-interval is not set, but Megatron sizes the validation set as --train-iters / "
            "--eval-interval × --eval-iters; add --eval-interval N (e.g. 1000) and --eval-iters M "
            "(--eval-iters 0 turns evaluation off)"
        )
    real_data = not args.mock_data and args.data_path is not None and args.valid_data_path is None
    if args.eval_iters > 0 and real_data and args.split is not None:
        parts = _split_parts(args.split)
        if len(parts) < 2 or parts[1] == 0:
            raise ValueError(
                f"--eval-iters {args.eval_iters} evaluates on the validation split, but --split "
                f"{args.split} gives it no documents; give it a share (e.g. --split 98,2,0) or use "
                "--eval-iters 0"
            )


def _check_schedule(args: argparse.Namespace) -> None:
    if args.train_iters is None or not args.lr_warmup_iters:
        return
    decay = args.lr_decay_iters or args.train_iters
    if args.lr_warmup_iters >= decay:
        raise ValueError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than the decay length {decay} "
            "(--lr-decay-iters, default --train-iters), or Megatron's scheduler stops the run after "
            "building the model; lower --lr-warmup-iters or raise --train-iters"
        )


def data_prefixes(args: argparse.Namespace) -> list[str]:
    """The indexed-dataset prefixes of ``--data-path`` and the per-split paths (weights dropped)."""
    from megatron.training.utils import get_blend_and_blend_per_split

    if args.mock_data:
        return []
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    blends = [blend] + list(blend_per_split or [])
    return [prefix for entry in blends if entry is not None for prefix in entry[0]]


def missing_paths(args: argparse.Namespace) -> list[str]:
    """Files the run reads that do not exist here: the pretrained checkpoint's tracker, each prefix's .bin/.idx."""
    missing = []
    if args.pretrained_checkpoint is not None:
        tracker = Path(args.pretrained_checkpoint) / TRACKER_FILE
        if not tracker.is_file():
            missing.append(
                f"--pretrained-checkpoint {args.pretrained_checkpoint} (no {TRACKER_FILE}; "
                "give the --output-dir of tools/convert_qwen2_hf_to_megatron.py)"
            )
    for prefix in data_prefixes(args):
        absent = [suffix for suffix in (".bin", ".idx") if not Path(prefix + suffix).is_file()]
        if absent:
            missing.append(
                f"--data-path {prefix} (no {' / '.join(prefix + s for s in absent)}; give the "
                "--output-prefix of tools/preprocess_data.py)"
            )
    return missing


def check_launch_flags(args: argparse.Namespace, mtraining: MTrainingConfig, *, require_files: bool = True) -> None:
    """Raise ``ValueError`` (naming the flag and the fix) for a command that Megatron would fail on later.

    With ``require_files`` the checkpoint and data files the run reads must exist here.
    """
    _check_head_dim(args, mtraining)
    _check_evaluation(args)
    _check_schedule(args)
    if require_files:
        missing = missing_paths(args)
        if missing:
            raise ValueError("not found: " + "; ".join(missing))


def latest_iteration_dir(checkpoint_root: str | None) -> Path | None:
    """The ``iter_XXXXXXX`` directory that ``--load checkpoint_root`` resumes from, or None (nothing saved yet)."""
    if checkpoint_root is None:
        return None
    tracker = Path(checkpoint_root) / TRACKER_FILE
    if not tracker.is_file():
        return None
    iteration = tracker.read_text().strip()
    return None if iteration == "release" else Path(checkpoint_root) / f"iter_{int(iteration):07d}"


def check_resumed_schedule(args: argparse.Namespace) -> None:
    """Megatron's learning-rate schedule check of a resumed run, before the model is built.

    Megatron compares the run's schedule with the one stored in the ``--load`` checkpoint only after
    building the model and optimizer, and stops on any difference (e.g. another ``--train-iters``). This
    runs the same comparison on the stored state. Needs Megatron's global ``args`` (after
    ``parse_and_validate_args``); reads the checkpoint's common state only (``torch_dist``).
    """
    iteration_dir = latest_iteration_dir(args.load)
    loads_schedule = not (
        args.finetune
        or args.no_load_optim
        or args.override_opt_param_scheduler
        or args.use_checkpoint_opt_param_scheduler
    )
    if iteration_dir is None or not loads_schedule or args.ckpt_format != "torch_dist":
        return
    import torch
    from megatron.core import dist_checkpointing
    from megatron.training.training import get_optimizer_param_scheduler

    stored = dist_checkpointing.load_common_state_dict(str(iteration_dir)).get("opt_param_scheduler")
    if stored is None:
        return
    stand_in_optimizer = torch.optim.SGD([torch.zeros(1)], lr=0.0)
    try:
        get_optimizer_param_scheduler(stand_in_optimizer).load_state_dict(stored)
    except AssertionError as error:
        raise ValueError(
            f"resuming {iteration_dir}: {error}; add --override-opt_param-scheduler to take this "
            "run's schedule, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's"
        ) from None


@contextlib.contextmanager
def _validation_without_gpu():
    """Megatron's ``validate_args`` on a machine without a GPU, as on a Hopper node launched by our scripts.

    It asks the GPU for its architecture when TP or CP > 1 and asserts ``CUDA_DEVICE_MAX_CONNECTIONS=1``
    there; the check answers Hopper and sets the variable (the example scripts export it) for the call.
    """
    import megatron.training.arguments as megatron_arguments

    arch_version = megatron_arguments.get_device_arch_version
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    megatron_arguments.get_device_arch_version = lambda: CHECK_GPU_ARCH
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    try:
        yield
    finally:
        megatron_arguments.get_device_arch_version = arch_version
        if connections is None:
            del os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]
        else:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = connections


def _megatron_validated(args: argparse.Namespace) -> argparse.Namespace:
    from megatron.training.arguments import validate_args

    try:
        with _validation_without_gpu(), contextlib.redirect_stdout(io.StringIO()):  # it prints every argument
            validate_args(args)
    except AssertionError as error:
        raise ValueError(f"Megatron's argument check: {error}") from None
    return args


def _budget_text(mtraining: MTrainingConfig) -> str:
    if mtraining.sdpa_impl is not None:
        return f"dense (full causal pattern), torch SDPA {mtraining.dense_impl}"
    if mtraining.dense:
        return f"dense (full causal pattern), backend {mtraining.backend}"
    if mtraining.budget == "top-p":
        from mtraining_kernels.budget import DEFAULT_CAP

        from .config import DEFAULT_TOP_P

        top_p = mtraining.top_p if mtraining.top_p is not None else DEFAULT_TOP_P
        slashes = "block diagonals" if mtraining.block_slashes else "slashes"
        budget = f"top-P {top_p} (cap {mtraining.cap or DEFAULT_CAP} verticals/{slashes} per head)"
    elif mtraining.sparsity is not None:
        budget = f"static, target sparsity {mtraining.sparsity}"
    elif mtraining.pattern_file is not None:
        budget = f"static, per-head budgets from {mtraining.pattern_file}"
    else:
        budget = f"static, {mtraining.vertical_size} verticals + {mtraining.slash_size} slashes per head"
    dense_layers = ",".join(map(str, mtraining.dense_layers)) or "none"
    return f"sparse vertical-slash, {budget}; backend {mtraining.backend}; dense layers: {dense_layers}"


def _ring_text(args: argparse.Namespace, mtraining: MTrainingConfig) -> str:
    if args.context_parallel_size == 1:
        return "single device (CP = 1)"
    ring = "flat ring"
    if mtraining.ring == "hierarchical":
        inner = mtraining.inner_ring_size or args.hierarchical_context_parallel_sizes[0]
        ring = f"hierarchical ring ({inner} inner × {args.context_parallel_size // inner} outer)"
    return f"{mtraining.layout} layout, {ring}"


def layout_note(args: argparse.Namespace, mtraining: MTrainingConfig) -> str | None:
    """Advice when packed documents meet the striped layout over CP > 1, or None.

    Striped puts the same position of every document of one length on the same rank (simulated all-4K at
    CP = 32: 2.3× the ideal ring time; skewed 1.03×, docs/benchmarks.md)."""
    if args.context_parallel_size == 1 or document_source(args) is None or mtraining.layout != "striped":
        return None
    return (
        f"packed documents in the striped layout: documents of one length unbalance the ring; "
        f"{flag('layout')} skewed balances them"
    )


def resolved_configuration(args: argparse.Namespace, mtraining: MTrainingConfig) -> list[str]:
    """Lines describing what the run will do, from Megatron-validated ``args``."""
    tp, pp, cp, dp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
        args.data_parallel_size,
    )
    micro_batches = args.global_batch_size // (args.micro_batch_size * dp)
    vocab = args.padded_vocab_size or args.vocab_size
    evaluation = (
        "off (--eval-iters 0)"
        if args.eval_iters == 0
        else f"every {args.eval_interval} iterations, {args.eval_iters} validation batches each"
    )
    if args.mock_data:
        data = "mock (synthetic tokens)"
    else:
        data = ", ".join(data_prefixes(args)) + (f"; split {args.split}" if args.split else "")
    return [
        f"ranks        {args.world_size} = TP {tp} × PP {pp} × CP {cp} × DP {dp}",
        f"batch        micro-batch {args.micro_batch_size}, global batch {args.global_batch_size} "
        f"({micro_batches} micro-batches per step and DP rank)",
        f"sequence     {args.seq_length:,} tokens, {args.seq_length // cp:,} per CP rank; "
        f"{_ring_text(args, mtraining)}",
        f"model        {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} query heads / "
        f"{args.num_query_groups or args.num_attention_heads} KV groups, head dim {head_dim(args)}, FFN "
        f"{args.ffn_hidden_size}, vocab {vocab}, {args.position_embedding_type} θ {args.rotary_base:g}"
        + (", q/k norm" if args.qk_layernorm else ""),
        f"layers       --transformer-impl {args.transformer_impl}",
        f"attention    {_budget_text(mtraining)}",
        f"training     {args.train_iters} iterations, lr {args.lr:g} → {args.min_lr:g} ({args.lr_decay_style}), "
        f"{'bf16' if args.bf16 else 'fp16' if args.fp16 else 'fp32'}, recompute {args.recompute_granularity or 'none'}",
        f"evaluation   {evaluation}",
        f"data         {data}",
        f"checkpoints  pretrained {args.pretrained_checkpoint or '-'}; load {args.load or '-'}; "
        f"save {args.save or '-'} every {args.save_interval or '-'} ({args.ckpt_format})",
        f"tokenizer    {args.tokenizer_type} {args.tokenizer_model or ''}".rstrip(),
    ] + ([f"note         {note}"] if (note := layout_note(args, mtraining)) else [])


def run_check(command_line: argparse.Namespace, model_config: Callable, report=print) -> int:
    """``--mtraining-check``: validate ``command_line`` (parsed launcher flags) for ``WORLD_SIZE`` ranks.

    ``model_config(args, mtraining)`` is the launcher's model-config builder (Megatron's config checks
    run in it). Returns 0 and reports the resolved configuration, or raises ``ValueError`` with
    Megatron's or our message. Reads no data and needs no GPU.
    """
    validate_mtraining_args(command_line)
    args = _megatron_validated(command_line)
    mtraining = validate_mtraining_args(args)
    check_launch_flags(args, mtraining, require_files=False)
    if args.padded_vocab_size is None and args.vocab_size is None:
        raise ValueError(
            "the vocabulary size is unknown without reading the tokenizer; add --padded-vocab-size V "
            "(the converter's megatron_model_args.sh has it)"
        )
    if args.padded_vocab_size is None:
        args.padded_vocab_size = args.vocab_size
    try:
        model_config(args, mtraining)  # Megatron's TransformerConfig checks (fusions, shapes)
    except AssertionError as error:
        raise ValueError(f"Megatron's model config: {error}") from None
    report(f"{CHECK_FLAG}: the command is valid for WORLD_SIZE={args.world_size} ranks")
    for line in resolved_configuration(args, mtraining):
        report("  " + line)
    for missing in missing_paths(args):
        report(f"  not found on this machine: {missing}")
    return 0
