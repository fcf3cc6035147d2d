"""One run of the quality study: train a small Qwen2-shaped GPTModel on the retrieval task, evaluate, measure recall.

    export PYTHONPATH=$PWD:$PWD/kernels   # from the repository root
    python examples/quality/train.py --run dense  --attention dense                   --device cuda:0 --out results/
    python examples/quality/train.py --run p0.9   --attention mtraining --top-p 0.9   --device cuda:0 --out results/
    python examples/quality/train.py --run s0.95  --attention mtraining --sparsity 0.95 --device cuda:0 --out results/ \
        --phases 16384x1x100,32768x1x80   # a static 0.95 budget needs >= 8832 tokens (30 sinks, 100-token window)

The model is Megatron-Core's ``GPTModel`` with MTraining's layer spec (local implementation) on one
device (TP = CP = 1): ``--attention dense`` sets ``MTrainingConfig(dense=True)`` (full causal
attention; on a GPU on torch's cuDNN SDPA kernels, ``dense_impl="sdpa_cudnn"``), ``--attention
mtraining`` the top-P budget (``--top-p``) or the static one (``--sparsity``, a target sparsity, or a
schedule of them by sequence length such as ``0.8:16384,0.9:32768,0.95``), on the Triton kernels.
Training follows ``--phases``, a length curriculum ``SEQ_LENxBATCHxSTEPS[xNEEDLES],...``;
AdamW with warm-up, a constant rate and a final cosine decay, grad clipping; on a GPU the model is in
bf16 with fp32 master weights (as Megatron's ``--bf16``).
Every run with the same ``--seed`` and phases sees the same batches and starts from the same weights.

``<out>/<run>.json`` is rewritten as the run goes (atomically): the settings, one record per step
(loss, LM loss, answer loss and accuracy, per-layer attention density every ``--log-interval`` steps),
one record per phase (its wall-clock training time, CUDA-synchronised, and the time spent in the
attention modules, from CUDA events around their forward and backward), the pattern recall at the end
of each ``--recall-lengths`` phase, then the evaluation grid (retrieval accuracy by length and needle
depth, LM loss by length). ``--time-budget-s`` ends training early (recorded as ``stopped_early``) so
that evaluation still fits.

Branching and stages: a run with ``--stop-after-phase K`` trains through phase K and saves
``<out>/<run>.phase<K>.pt``; runs with ``--resume <that file>`` continue from it (and may stop after a
later phase in turn), so dense and MTraining runs share the short-context training and differ only in
the attention of the later phases (their records start with the shared ones). ``study.py`` drives the
whole study in such stages.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quickstart import rope_tables_on_cpu
from recall import pattern_recall
from tasks import RetrievalTask, query_correct

TRAIN_STREAM, EVAL_STREAM, RECALL_STREAM = 0, 1, 2
KERNEL_SETTINGS = {  # --kernel (the kernels named in the results) → MTrainingConfig settings
    "triton": dict(backend="triton"),
    "torch_blocksparse": dict(backend="torch"),
    "sdpa_cudnn": dict(dense_impl="sdpa_cudnn"),
    "sdpa_flash": dict(dense_impl="sdpa_flash"),
}


# ------------------------------------------------------------------------------------------ arguments
def parse_phases(text: str) -> list[tuple[int, int, int, int | None]]:
    """``"256x64x800x8,2048x8x300"`` → [(seq_len, batch, steps, pairs or None for --pairs), ...]."""
    phases = []
    for part in text.split(","):
        try:
            numbers = [int(x) for x in part.lower().split("x")]
        except ValueError:
            numbers = []
        if len(numbers) not in (3, 4):
            raise argparse.ArgumentTypeError(f"phase {part!r} must be SEQ_LENxBATCHxSTEPS[xPAIRS], e.g. 2048x8x300")
        seq_len, batch, steps, pairs = *numbers[:3], (numbers[3] if len(numbers) == 4 else None)
        if seq_len % 128 or seq_len < 128 or batch < 1 or steps < 1 or (pairs is not None and pairs < 1):
            raise argparse.ArgumentTypeError(
                f"phase {part!r}: seq_len must be a multiple of 128, batch, steps and pairs >= 1"
            )
        phases.append((seq_len, batch, steps, pairs))
    return phases


def parse_sparsity(text: str) -> tuple[tuple[float, int | None], ...]:
    """``"0.95"`` → ((0.95, None),); ``"0.8:16384,0.9:32768,0.95"`` → sparsity 0.8 up to 16384 tokens, 0.9 up
    to 32768, 0.95 beyond (a static budget schedule by sequence length)."""
    entries = []
    for part in text.split(","):
        value, _, limit = part.partition(":")
        try:
            entry = (float(value), int(limit) if limit else None)
        except ValueError:
            entry = None
        if entry is None or not 0 <= entry[0] < 1 or (entry[1] is not None and entry[1] < 1):
            raise argparse.ArgumentTypeError(
                f"sparsity {part!r} must be S or S:MAX_LEN with S in [0, 1), e.g. 0.95 or 0.8:16384"
            )
        entries.append(entry)
    limits = [limit for _, limit in entries[:-1]]
    if None in limits or entries[-1][1] is not None or limits != sorted(set(limits)):
        raise argparse.ArgumentTypeError(
            f"sparsity schedule {text!r}: every entry but the last needs an ascending :MAX_LEN and the last "
            "none (it applies beyond), e.g. 0.8:16384,0.9:32768,0.95"
        )
    return tuple(entries)


def sparsity_at(schedule: tuple[tuple[float, int | None], ...], seq_len: int) -> float:
    """The schedule's sparsity at ``seq_len``: the first entry whose MAX_LEN is at least ``seq_len``."""
    return next(sparsity for sparsity, limit in schedule if limit is None or seq_len <= limit)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    run = parser.add_argument_group("run")
    run.add_argument("--run", required=True, help="run name; results go to <out>/<run>.json")
    run.add_argument("--out", type=Path, required=True, help="results folder")
    run.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    run.add_argument("--attention", choices=("dense", "mtraining"), required=True)
    run.add_argument(
        "--top-p", type=float, default=None, help="MTraining top-P budget (mtraining runs; the default, 0.9)"
    )
    run.add_argument("--cap", type=int, default=None, help="MTraining top-P cap (default: MTrainingConfig's)")
    run.add_argument(
        "--block-slashes",
        action="store_true",
        help="MTraining top-P over whole 128-token block diagonals (--mtraining-block-slashes)",
    )
    run.add_argument(
        "--sparsity",
        type=parse_sparsity,
        default=None,
        help="MTraining static budget instead of top-P: a target sparsity (0.95) or a schedule by sequence "
        "length (0.8:16384,0.9:32768,0.95 = 0.8 up to 16K tokens, 0.9 up to 32K, 0.95 beyond)",
    )
    run.add_argument("--sink-tokens", type=int, default=30)
    run.add_argument("--local-window", type=int, default=100)
    run.add_argument(
        "--kernel",
        choices=("auto", *KERNEL_SETTINGS),
        default="auto",
        help="MTraining kernels; auto: torch_blocksparse on CPU, triton on GPU (dense runs: sdpa_cudnn)",
    )
    run.add_argument("--seed", type=int, default=1234)
    run.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="wall-clock budget of the whole run; training stops --eval-reserve-s before it",
    )
    run.add_argument("--eval-reserve-s", type=float, default=60.0)
    run.add_argument(
        "--log-interval", type=int, default=10, help="steps between attention-density records (and phase ends)"
    )
    run.add_argument(
        "--stop-after-phase",
        type=int,
        default=None,
        metavar="K",
        help="train through phase K, write the checkpoint <out>/<run>.phase<K>.pt and exit without "
        "evaluating: the shared start that --resume branches from, or one stage of a staged run",
    )
    run.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="a --stop-after-phase checkpoint: continue its training (same weights, optimizer state, "
        "step, seed and phases), so that every run differs only from that step on",
    )
    run.add_argument("--threads", type=int, default=None, help="torch CPU threads")

    model = parser.add_argument_group("model (Qwen2-shaped)")
    model.add_argument("--layers", type=int, default=8)
    model.add_argument("--hidden", type=int, default=512)
    model.add_argument("--heads", type=int, default=8)
    model.add_argument("--kv-heads", type=int, default=2)
    model.add_argument("--head-dim", type=int, default=64)
    model.add_argument("--ffn", type=int, default=3584)
    model.add_argument("--rope-base", type=float, default=1_000_000.0)

    task = parser.add_argument_group("task (see tasks.py)")
    task.add_argument("--vocab", type=int, default=1024)
    task.add_argument("--key-alphabet", type=int, default=16)
    task.add_argument("--key-len", type=int, default=1)
    task.add_argument("--value-len", type=int, default=2)
    task.add_argument("--value-choices", type=int, default=16, help="tokens each answer slot chooses from")
    task.add_argument(
        "--shared-values",
        action="store_true",
        help="draw every value token from one shared alphabet (needs induction; slow to learn)",
    )
    task.add_argument(
        "--pairs", type=int, default=12, help="needles per sequence (evaluation, and phases without their own count)"
    )
    task.add_argument("--queries", type=int, default=8, help="queries at the end (keep them in the last 64 tokens)")
    task.add_argument("--filler", choices=("walks", "phrases"), default="walks")
    task.add_argument("--phrases", type=int, default=32, help="filler words per sequence (--filler phrases)")
    task.add_argument("--phrase-len", type=int, default=6, help="tokens per filler word (--filler phrases)")

    train = parser.add_argument_group("training")
    train.add_argument(
        "--phases",
        type=parse_phases,
        default=parse_phases("128x64x2400x8,512x16x400x8,2048x8x300,8192x2x150,16384x1x150"),
        help="length curriculum SEQ_LENxBATCHxSTEPS[xPAIRS],...",
    )
    train.add_argument("--lr", type=float, default=2e-3)
    train.add_argument("--min-lr-ratio", type=float, default=0.1)
    train.add_argument("--warmup", type=int, default=100)
    train.add_argument("--decay-fraction", type=float, default=0.25, help="share of the steps with cosine decay")
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument("--clip-grad", type=float, default=1.0)
    train.add_argument(
        "--answer-weight",
        type=float,
        default=1.0,
        help="objective = mean loss over all tokens + this x mean loss over the answer tokens "
        "(0 = plain LM loss); keeps the retrieval signal independent of the length",
    )
    train.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="bf16: model in bf16, fp32 master weights in the optimizer; auto: bf16 on a GPU, fp32 on a CPU",
    )

    evaluation = parser.add_argument_group("evaluation")
    evaluation.add_argument(
        "--eval-lengths",
        type=int_list,
        default=None,
        help="default: the phases' lengths from 1024 on (all of them if none is that long)",
    )
    evaluation.add_argument("--eval-depths", type=float_list, default=[i / 10 for i in range(11)])
    evaluation.add_argument(
        "--eval-samples",
        type=int_list,
        default=[16],
        help="sequences per (length, depth) cell: one number, or one per --eval-lengths entry (e.g. 16,16,8,8)",
    )
    evaluation.add_argument("--eval-tokens", type=int, default=65536, help="tokens per evaluation forward")
    evaluation.add_argument(
        "--recall-lengths",
        type=int_list,
        default=None,
        help="phase lengths after whose (last) phase the pattern recall is measured; default: the longest phase",
    )
    evaluation.add_argument("--recall-samples", type=int, default=1)
    evaluation.add_argument(
        "--recall-top-p",
        type=float_list,
        default=None,
        help="top-P budgets whose pattern recall is measured (default: the run's own budget; dense runs: 0.9,0.95)",
    )
    evaluation.add_argument(
        "--recall-sparsity",
        type=float_list,
        default=None,
        help="static sparsities whose pattern recall is measured (as --recall-top-p; both may be given)",
    )
    evaluation.add_argument("--recall-row-chunk", type=int, default=1024)
    return parser


# ------------------------------------------------------------------------------------------ model
def resolve_kernel(requested: str, attention: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    if device.type != "cuda":
        return "torch_blocksparse"
    return "sdpa_cudnn" if attention == "dense" else "triton"


class Budget:
    """The run's MTraining settings at each sequence length (one ``MTrainingConfig`` per length under a
    ``--sparsity`` schedule, the same one otherwise), their names, and the pattern-recall settings."""

    def __init__(self, args, kernel: str):
        self.args, self.kernel = args, kernel
        self._configs: dict[int, object] = {}

    def config(self, seq_len: int):
        from megatron_mtraining.config import MTrainingConfig

        if seq_len not in self._configs:
            args = self.args
            common = dict(**KERNEL_SETTINGS[self.kernel], sink_tokens=args.sink_tokens, local_window=args.local_window)
            if args.attention == "dense":
                config = MTrainingConfig(dense=True, **common)
            elif args.sparsity is not None:
                config = MTrainingConfig(budget="static", sparsity=sparsity_at(args.sparsity, seq_len), **common)
            else:
                config = MTrainingConfig(top_p=args.top_p, cap=args.cap, block_slashes=args.block_slashes, **common)
            self._configs[seq_len] = config
        return self._configs[seq_len]

    def name(self, seq_len: int | None = None) -> str:
        """``dense``, ``top-p 0.9``, ``static 0.95``; a schedule without ``seq_len``: ``static 0.8 to 16384, …``."""
        args = self.args
        if args.attention == "dense":
            return "dense"
        if args.sparsity is None:
            return f"top-p {args.top_p:g}" + (" blocks" if args.block_slashes else "")
        if seq_len is not None:
            return f"static {sparsity_at(args.sparsity, seq_len):g}"
        return "static " + ", ".join(
            f"{sparsity:g}" + (f" to {limit}" if limit else (" beyond" if len(args.sparsity) > 1 else ""))
            for sparsity, limit in args.sparsity
        )

    def use(self, model, seq_len: int) -> None:
        """Give every attention module the settings for ``seq_len`` before a forward at that length.

        Only a schedule changes them; the module caches its per-layer budgets by sequence length, which
        stays right because the settings are a function of the length."""
        if self.args.attention == "mtraining" and self.args.sparsity is not None and len(self.args.sparsity) > 1:
            from megatron_mtraining.attention import MTrainingAttention

            for module in model.modules():
                if isinstance(module, MTrainingAttention):
                    module.mtraining = self.config(seq_len)

    def check(self, lengths, recall_lengths) -> None:
        """Raise ``ValueError`` (e.g. a sparsity the forced entries cannot reach) before any work."""
        shape = dict(num_layers=self.args.layers, num_heads=self.args.heads)
        for seq_len in sorted(set(lengths)):
            config = self.config(seq_len)
            if not config.dense:
                config.budget_table(**shape, seq_length=seq_len)
        for seq_len in sorted(set(recall_lengths)):
            for config in self.recall_settings(seq_len)[0].values():
                config.budget_table(**shape, seq_length=seq_len)

    def recall_settings(self, seq_len: int) -> tuple[dict, str | None]:
        """({name: MTrainingConfig} whose estimated pattern the recall measures at ``seq_len``, the name of
        the run's own budget among them or None)."""
        from megatron_mtraining.config import MTrainingConfig

        args = self.args
        top_ps, sparsities = args.recall_top_p, args.recall_sparsity
        if top_ps is None and sparsities is None:
            if args.attention == "dense":
                top_ps = [0.9, 0.95]
            elif args.sparsity is None:
                top_ps = [args.top_p]
            else:
                sparsities = [sparsity_at(args.sparsity, seq_len)]
        common = dict(backend="torch", sink_tokens=args.sink_tokens, local_window=args.local_window)
        blocks = " blocks" if args.block_slashes else ""
        settings = {
            f"top-p {p:g}{blocks}": MTrainingConfig(top_p=p, cap=args.cap, block_slashes=args.block_slashes, **common)
            for p in top_ps or []
        }
        settings |= {f"static {x:g}": MTrainingConfig(budget="static", sparsity=x, **common) for x in sparsities or []}
        own = self.name(seq_len)
        return settings, (own if own in settings else None)


def init_megatron(device: torch.device) -> None:
    """A one-process group (TP = CP = 1) and Megatron's parallel state, on ``device``."""
    from megatron.core import parallel_state

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()


def rope_tables_on(device: torch.device):
    """On a CPU run, keep Megatron's RoPE frequencies on the CPU (see ``quickstart.rope_tables_on_cpu``)."""
    return contextlib.nullcontext() if device.type == "cuda" else rope_tables_on_cpu()


def build_model(args, mtraining, max_len: int) -> torch.nn.Module:
    """The Qwen2-shaped GPTModel (RMSNorm, SwiGLU, QKV bias, RoPE, tied embeddings) with MTraining attention."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mtraining.spec import get_gpt_layer_mtraining_spec

    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        kv_channels=args.head_dim,
        ffn_hidden_size=args.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    torch.manual_seed(args.seed)
    spec = get_gpt_layer_mtraining_spec(config, transformer_impl="local", mtraining=mtraining)
    return GPTModel(
        config,
        spec,
        vocab_size=args.vocab,
        max_sequence_length=max_len,
        position_embedding_type="rope",
        rotary_base=int(args.rope_base),
        share_embeddings_and_output_weights=True,
    )


# ------------------------------------------------------------------------------------------ steps
def token_losses(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy ``[b, N]`` fp32, argmax predictions ``[b, N]``) of ``batch``."""
    positions = torch.arange(batch.tokens.shape[1], device=batch.tokens.device).expand_as(batch.tokens)
    logits = model(batch.tokens, positions, None).float()
    losses = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none").view_as(batch.labels)
    return losses, logits.argmax(dim=-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum()


def learning_rate(step: int, total: int, args) -> float:
    """Linear warm-up over ``--warmup`` steps, constant, then cosine decay to ``--min-lr-ratio`` · lr over the last
    ``--decay-fraction`` of the steps (warm-up, stable, decay: the short-context phase keeps the full rate)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    decay_start = max(args.warmup, total - int(args.decay_fraction * total))
    progress = min(1.0, max(0, step - decay_start) / max(1, total - decay_start))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class MasterWeightAdamW:
    """AdamW with gradient clipping on fp32 master copies of the model's parameters (the parameters themselves
    when they are fp32), as Megatron's mixed-precision optimizer does for a bf16 model."""

    def __init__(self, model: torch.nn.Module, args):
        self.params = list(model.parameters())
        self.master = [
            p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float().clone()) for p in self.params
        ]
        self.optimizer = torch.optim.AdamW(self.master, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
        self.clip_grad = args.clip_grad

    def step(self, lr: float) -> torch.Tensor:
        """Apply the model's gradients at learning rate ``lr``; returns the gradient norm before clipping."""
        for param, master in zip(self.params, self.master):
            if master is not param:
                master.grad, param.grad = param.grad.float(), None
        grad_norm = torch.nn.utils.clip_grad_norm_(self.master, self.clip_grad)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for param, master in zip(self.params, self.master):
                if master is not param:
                    param.copy_(master)
        return grad_norm

    def state_dict(self) -> dict:
        return {"master": [master.detach() for master in self.master], "adamw": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for param, master, saved in zip(self.params, self.master, state["master"], strict=True):
                master.copy_(saved)
                if master is not param:
                    param.copy_(saved)
        self.optimizer.load_state_dict(state["adamw"])


# The settings a checkpoint and the run resuming it must share: model, task, data and schedule.
TRAJECTORY_SETTINGS = (
    "seed",
    "phases",
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "ffn",
    "rope_base",
    "vocab",
    "key_alphabet",
    "key_len",
    "value_len",
    "value_choices",
    "shared_values",
    "pairs",
    "queries",
    "filler",
    "phrases",
    "phrase_len",
    "lr",
    "min_lr_ratio",
    "warmup",
    "decay_fraction",
    "weight_decay",
    "clip_grad",
    "answer_weight",
    "precision",
)


def trajectory_settings(args) -> dict:
    return {name: getattr(args, name) for name in TRAJECTORY_SETTINGS}


# What a checkpoint carries of the run's JSON, so that a resumed run's JSON continues the one that wrote it.
CARRIED_RESULTS = ("train", "phases", "recall", "resumed_from")


def save_checkpoint(path: Path, model, optimizer: MasterWeightAdamW, args, step: int, results: dict) -> None:
    """Write atomically (a killed save leaves no checkpoint that looks complete)."""
    scratch = path.with_suffix(".pt.tmp")
    torch.save(
        {
            "step": step,
            "run": args.run,
            "settings": trajectory_settings(args),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "results": {key: results[key] for key in CARRIED_RESULTS},
        },
        scratch,
    )
    os.replace(scratch, path)


def load_checkpoint(path: Path, model, optimizer: MasterWeightAdamW, args) -> dict:
    """Restore weights and optimizer state from ``path``; ``ValueError`` when its run trained something else."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    saved, ours = checkpoint["settings"], trajectory_settings(args)
    differing = {name: (saved.get(name), ours[name]) for name in ours if saved.get(name) != ours[name]}
    if differing:
        raise ValueError(
            f"--resume {path}: the checkpoint was trained with other settings (saved, this run): "
            f"{differing}; pass the same flags as the run that wrote it"
        )
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return checkpoint


class Results:
    """The run's JSON, rewritten atomically on every :meth:`save`."""

    def __init__(self, path: Path, data: dict):
        self.path, self.data = path, data
        path.parent.mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        scratch = self.path.with_suffix(".json.tmp")
        scratch.write_text(json.dumps(self.data, indent=1))
        os.replace(scratch, self.path)


def mean_density(model) -> list[float] | None:
    from megatron_mtraining.attention_stats import collect_stats

    stats = sorted(collect_stats([model]), key=lambda s: s.layer_number)
    return [s.density for s in stats] or None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class AttentionTimer:
    """Time spent in every MTraining attention module (index estimation included) during training steps:
    CUDA events (wall clock on a CPU) from the module's forward entry to its exit, and in backward from the
    gradient of its output to that of its query (the attention's own backward, which yields dq, dk and dv
    together). The hooks only record events, they never synchronise; :meth:`collect` reads them once the
    step's own synchronisation has made them complete."""

    def __init__(self, model, device: torch.device):
        from megatron_mtraining.attention import MTrainingAttention

        self.cuda = device.type == "cuda"
        self.active = True
        self.forward_marks: list[tuple] = []  # (start, end) per module call
        self.backward_marks: list[dict] = []  # {"start": …, "end": …} per module call, filled during backward
        self._open: dict[int, tuple] = {}
        self.handles = []
        for module in model.modules():
            if isinstance(module, MTrainingAttention):
                self.handles.append(module.register_forward_pre_hook(self._enter))
                self.handles.append(module.register_forward_hook(self._exit))

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _timing(self, module) -> bool:
        return self.active and module.training and torch.is_grad_enabled()

    def _enter(self, module, args):
        if not self._timing(module):
            return
        backward = None
        if args[0].requires_grad:  # the query
            backward = {}

            def gradient_of_query(grad):
                backward["end"] = self._now()

            args[0].register_hook(gradient_of_query)
        self._open[id(module)] = (self._now(), backward)

    def _exit(self, module, args, output):
        if not self._timing(module):
            return
        start, backward = self._open.pop(id(module))
        self.forward_marks.append((start, self._now()))
        if backward is not None and output.requires_grad:

            def gradient_of_output(grad):
                backward["start"] = self._now()

            output.register_hook(gradient_of_output)
            self.backward_marks.append(backward)

    def _seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    def collect(self) -> tuple[float, float]:
        """(forward seconds, backward seconds) since the last call; the step must have synchronised."""
        forward = sum(self._seconds(start, end) for start, end in self.forward_marks)
        backward = sum(self._seconds(m["start"], m["end"]) for m in self.backward_marks if len(m) == 2)
        self.forward_marks.clear()
        self.backward_marks.clear()
        return forward, backward

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def warm_up(model, task, args, device, step: int, batch_size: int, seq_len: int) -> None:
    """One untimed forward and backward on the phase's first batch (Triton compilation, cuDNN plans, allocator
    growth happen here, not in the timed steps); the gradients are dropped, so weights and optimizer stay."""
    batch = task.batch(args.seed, TRAIN_STREAM, step, batch_size, seq_len).to(device)
    losses, _ = token_losses(model, batch)
    (masked_mean(losses, batch.loss_mask) + args.answer_weight * masked_mean(losses, batch.answer_mask)).backward()
    model.zero_grad(set_to_none=True)
    synchronize(device)


def train(
    model,
    optimizer: MasterWeightAdamW,
    task,
    args,
    device,
    results: Results,
    budget: Budget,
    deadline: float | None,
    start_step: int = 0,
) -> int:
    """Train from step ``start_step`` through the phases (through ``--stop-after-phase`` when set); returns the
    number of steps done. Appends one record per phase: ``train_s``, the sum of its steps' wall-clock times
    (each from the batch on the device to the synchronised end of the optimizer step; drawing the synthetic
    batch, logging, saving and the phase's untimed :func:`warm_up` excluded), and
    ``attention_fwd_s``/``attention_bwd_s`` from :class:`AttentionTimer`."""
    total = sum(phase[2] for phase in args.phases)
    last_phase = args.stop_after_phase or len(args.phases)
    last_of_length = {phase[0]: number for number, phase in enumerate(args.phases[:last_phase], start=1)}
    records, data = results.data["train"], results.data
    timer = AttentionTimer(model, device)
    started = time.perf_counter()
    end = 0
    try:
        for number, (seq_len, batch_size, steps, pairs) in enumerate(args.phases[:last_phase], start=1):
            first, end = end, end + steps
            if end <= start_step:  # done by the checkpoint's run
                continue
            if first < start_step:
                raise ValueError(f"checkpoint step {start_step} lies inside phase {number}; resume at a phase end")
            phase_task = task if pairs is None else dataclasses.replace(task, num_pairs=pairs)
            budget.use(model, seq_len)
            timer.active = False
            warm_up(model, phase_task, args, device, first, batch_size, seq_len)
            timer.active = True
            phase = dict(
                phase=number,
                seq_len=seq_len,
                batch=batch_size,
                steps=0,
                first_step=first + 1,
                run=args.run,
                budget=budget.name(seq_len),
                train_s=0.0,
                attention_fwd_s=0.0,
                attention_bwd_s=0.0,
            )
            densities = []
            for step in range(first, end):
                if deadline is not None and time.perf_counter() > deadline:
                    data["stopped_early"] = True
                    break
                lr = learning_rate(step, total, args)
                batch = phase_task.batch(args.seed, TRAIN_STREAM, step, batch_size, seq_len).to(device)
                tick = time.perf_counter()  # the synthetic batch is drawn on the CPU first, as a loader would
                losses, predictions = token_losses(model, batch)
                lm_loss, answer_loss = masked_mean(losses, batch.loss_mask), masked_mean(losses, batch.answer_mask)
                objective = lm_loss + args.answer_weight * answer_loss
                objective.backward()
                grad_norm = optimizer.step(lr)
                accuracy = query_correct(predictions, batch.labels, batch.answer_slots).float().mean()
                values = torch.stack([objective, lm_loss, answer_loss, accuracy, grad_norm]).detach().tolist()  # sync
                step_s = time.perf_counter() - tick
                forward_s, backward_s = timer.collect()
                phase["train_s"] += step_s
                phase["attention_fwd_s"] += forward_s
                phase["attention_bwd_s"] += backward_s
                phase["steps"] += 1
                record = dict(zip(("loss", "lm_loss", "answer_loss", "answer_accuracy", "grad_norm"), values))
                record.update(
                    step=step + 1,
                    seq_len=seq_len,
                    batch=batch_size,
                    lr=lr,
                    step_s=round(step_s, 5),
                    elapsed_s=round(time.perf_counter() - started, 3),
                )
                records.append(record)
                data["steps_done"] = step + 1
                if (step + 1) % args.log_interval == 0 or step + 1 in (end, total):
                    record["density"] = mean_density(model)
                    if record["density"]:
                        densities.append(record["density"])
                    print(
                        f"[{args.run}] step {step + 1}/{total} len {seq_len} | loss {record['loss']:.4f} | lm "
                        f"{record['lm_loss']:.4f} | answer {record['answer_loss']:.4f} acc "
                        f"{record['answer_accuracy']:.2f} | {record['step_s'] * 1e3:.0f} ms/step",
                        flush=True,
                    )
                    results.save()
            phase["attention_s"] = phase["attention_fwd_s"] + phase["attention_bwd_s"]
            phase["density"] = np.mean(densities, axis=0).tolist() if densities else None
            data["phases"].append(phase)
            print(
                f"[{args.run}] phase {number} ({seq_len} tokens, {phase['budget']}): {phase['steps']} steps in "
                f"{phase['train_s']:.1f} s, attention {phase['attention_s']:.1f} s",
                flush=True,
            )
            results.save()
            if data["stopped_early"]:
                break
            if seq_len in args.recall_lengths and last_of_length[seq_len] == number:
                measure_recall(model, task, args, device, results, budget, seq_len, step=end)
    finally:
        timer.remove()
    return data["steps_done"]


@torch.no_grad()
def evaluate(model, task, args, device, results: Results, budget: Budget) -> None:
    """Retrieval accuracy of the depth-controlled query per (length, depth), and LM/answer loss per length.

    ``correct[length][depth]`` keeps each sequence's 0/1 (the same sequences for every run of a seed), so that
    runs can be compared pair by pair."""
    model.eval()
    lengths, depths = args.eval_lengths, args.eval_depths
    evaluation = {
        "lengths": lengths,
        "depths": depths,
        "samples": args.eval_samples,
        "accuracy": [],
        "correct": [],
        "lm_loss": [],
        "answer_loss": [],
        "seconds": [],
    }
    results.data["eval"] = evaluation
    for seq_len, samples in zip(lengths, args.eval_samples):
        started = time.perf_counter()
        budget.use(model, seq_len)
        per_forward = max(1, min(samples, args.eval_tokens // seq_len))
        row, per_sequence, loss_sum, answer_sum, token_count, answer_count = [], [], 0.0, 0.0, 0.0, 0.0
        for depth in depths:
            correct = []
            for first in range(0, samples, per_forward):
                size = min(per_forward, samples - first)
                batch = task.batch(args.seed, EVAL_STREAM, first, size, seq_len, target_depth=depth).to(device)
                losses, predictions = token_losses(model, batch)
                correct += query_correct(predictions, batch.labels, batch.answer_slots)[:, batch.target].int().tolist()
                loss_sum += float((losses * batch.loss_mask).sum())
                token_count += float(batch.loss_mask.sum())
                answer_sum += float((losses * batch.answer_mask).sum())
                answer_count += float(batch.answer_mask.sum())
            row.append(sum(correct) / samples)
            per_sequence.append(correct)
        evaluation["accuracy"].append(row)
        evaluation["correct"].append(per_sequence)
        evaluation["lm_loss"].append(loss_sum / token_count)
        evaluation["answer_loss"].append(answer_sum / answer_count)
        evaluation["seconds"].append(round(time.perf_counter() - started, 2))
        print(
            f"[{args.run}] eval len {seq_len}: accuracy {sum(row) / len(row):.3f} by depth "
            f"{[round(a, 2) for a in row]} | lm loss {evaluation['lm_loss'][-1]:.4f}",
            flush=True,
        )
        results.save()
    model.train()


@torch.no_grad()
def measure_recall(model, task, args, device, results: Results, budget: Budget, seq_len: int, step: int) -> None:
    """Pattern recall of real sequences at ``seq_len`` on the model as it is now (after ``step`` steps)."""
    model.eval()
    budget.use(model, seq_len)
    settings, own = budget.recall_settings(seq_len)
    batch = task.batch(args.seed, RECALL_STREAM, 0, args.recall_samples, seq_len).to(device)
    by_setting = pattern_recall(model, batch.tokens, settings, args.recall_row_chunk)
    results.data["recall"].append(
        {"seq_len": seq_len, "step": step, "samples": args.recall_samples, "own": own, "by_setting": by_setting}
    )
    for name, layers in by_setting.items():
        print(
            f"[{args.run}] recall len {seq_len} {name}: per layer mean/min over heads "
            + " ".join(f"{sum(x['recall']) / len(x['recall']):.3f}/{min(x['recall']):.3f}" for x in layers),
            flush=True,
        )
    results.save()
    model.train()


# ------------------------------------------------------------------------------------------ main
def check_arguments(parser: argparse.ArgumentParser, args) -> None:
    if args.time_budget_s is not None and args.time_budget_s <= args.eval_reserve_s:
        parser.error(
            f"--time-budget-s={args.time_budget_s} leaves no training time after --eval-reserve-s="
            f"{args.eval_reserve_s}; raise the budget or lower the reserve"
        )
    if not args.eval_depths or not all(0.0 <= depth <= 1.0 for depth in args.eval_depths):
        parser.error(f"--eval-depths={args.eval_depths} must be fractions in [0, 1], e.g. 0,0.5,1")
    if not args.eval_samples or min(args.eval_samples) < 1 or args.recall_samples < 1:
        parser.error("--eval-samples and --recall-samples must be >= 1")
    if args.stop_after_phase is not None and not 1 <= args.stop_after_phase < len(args.phases):
        parser.error(
            f"--stop-after-phase={args.stop_after_phase} must leave phases to branch into: use 1 .. "
            f"{len(args.phases) - 1} for {len(args.phases)} phases"
        )
    if args.resume is not None and not args.resume.is_file():
        parser.error(f"--resume {args.resume}: no such checkpoint; run train.py --stop-after-phase K first")
    if args.sparsity is not None and (args.top_p is not None or args.cap is not None or args.block_slashes):
        parser.error(
            "--sparsity (a static budget) excludes --top-p, --cap and --block-slashes (the top-P budget); give one"
        )
    lengths = [phase[0] for phase in args.phases]
    args.eval_lengths = args.eval_lengths or sorted({n for n in lengths if n >= 1024} or set(lengths))
    if len(args.eval_samples) == 1:
        args.eval_samples = args.eval_samples * len(args.eval_lengths)
    if len(args.eval_samples) != len(args.eval_lengths):
        parser.error(
            f"--eval-samples has {len(args.eval_samples)} entries for {len(args.eval_lengths)} --eval-lengths; "
            "give one number or one per length"
        )
    args.recall_lengths = args.recall_lengths or [max(lengths)]
    untrained = sorted(set(args.recall_lengths) - set(lengths))
    if untrained:
        parser.error(f"--recall-lengths {untrained} are not phase lengths; recall is measured at the end of a phase")
    if args.attention == "mtraining" and args.sparsity is None and args.top_p is None:
        args.top_p = 0.9


def build_task(args) -> RetrievalTask:
    return RetrievalTask(
        vocab_size=args.vocab,
        key_alphabet=args.key_alphabet,
        key_len=args.key_len,
        value_len=args.value_len,
        value_choices=args.value_choices,
        key_specific_values=not args.shared_values,
        num_pairs=args.pairs,
        num_queries=args.queries,
        filler=args.filler,
        phrases=args.phrases,
        phrase_len=args.phrase_len,
    )


def check_lengths(args, task: RetrievalTask, budget: Budget, start_step: int) -> None:
    """Raise ``ValueError`` unless every length fits: the task at every phase and evaluation length, the budget
    at the phases from step ``start_step`` on (a branch need not fit the shared phases before it), at the
    evaluation lengths and, for the recall settings, at the recall lengths among those phases."""
    for seq_len, _, _, pairs in args.phases:
        (task if pairs is None else dataclasses.replace(task, num_pairs=pairs)).check_length(seq_len)
    for seq_len in args.eval_lengths:
        task.check_length(seq_len)
    last_phase = args.stop_after_phase or len(args.phases)
    ahead = [phase[0] for phase in args.phases[_phase_index(args.phases, start_step) : last_phase]]
    budget.check(ahead + args.eval_lengths, [n for n in ahead if n in args.recall_lengths])


def check(argv: list[str], start_step: int = 0) -> None:
    """The checks :func:`main` makes before training, for a run that starts at step ``start_step`` (a resumed
    run: its checkpoint's step, ``--resume`` left out), without a model, a device or a checkpoint:
    ``SystemExit`` for a bad flag, ``ValueError`` for a length the task or the budget cannot take."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    kernel = resolve_kernel(args.kernel, args.attention, torch.device(args.device))
    check_lengths(args, build_task(args), Budget(args, kernel), start_step)


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    start = time.perf_counter()
    deadline = None if args.time_budget_s is None else start + args.time_budget_s - args.eval_reserve_s
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    lengths = [phase[0] for phase in args.phases]
    max_len = max(lengths + args.eval_lengths)
    task = build_task(args)
    kernel = resolve_kernel(args.kernel, args.attention, device)
    budget = Budget(args, kernel)
    bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
    init_megatron(device)
    model = build_model(args, budget.config(lengths[-1]), max_len).to(device, torch.bfloat16 if bf16 else torch.float32)
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    last_phase = args.stop_after_phase or len(args.phases)
    results = Results(
        args.out / f"{args.run}.json",
        {
            "run": args.run,
            "attention": args.attention,
            "budget": budget.name(),
            "top_p": args.top_p if args.attention == "mtraining" else None,
            "sparsity": args.sparsity if args.attention == "mtraining" else None,
            "kernel": kernel,
            "precision": "bf16" if bf16 else "fp32",
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "torch": torch.__version__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "settings": settings,
            "mtraining": {k: v for k, v in vars(budget.config(lengths[-1])).items()},
            "task": dataclasses.asdict(task),
            "steps_planned": sum(phase[2] for phase in args.phases[:last_phase]),
            "steps_done": 0,
            "stopped_early": False,
            "status": "training",
            "train": [],
            "phases": [],
            "recall": [],
            "resumed_from": [],
        },
    )
    optimizer = MasterWeightAdamW(model, args)
    start_step = 0
    if args.resume is not None:
        checkpoint = load_checkpoint(args.resume, model, optimizer, args)
        start_step = checkpoint["step"]
        if start_step >= results.data["steps_planned"]:
            parser.error(
                f"--resume {args.resume} is at step {start_step}, not before the end of phase {last_phase}; "
                "resume from an earlier checkpoint or stop after a later phase"
            )
        results.data.update(checkpoint["results"], steps_done=start_step)
        results.data["resumed_from"] = [
            *checkpoint["results"]["resumed_from"],
            {"path": str(args.resume), "step": start_step, "run": checkpoint["run"]},
        ]
    check_lengths(args, task, budget, start_step)
    results.save()
    print(
        f"[{args.run}] {results.data['parameters'] / 1e6:.1f}M parameters, attention {budget.name()}, kernel "
        f"{kernel}, {results.data['precision']}, device {device}",
        flush=True,
    )
    timings = results.data.setdefault("timing_s", {})
    with rope_tables_on(device):
        steps_done = train(model, optimizer, task, args, device, results, budget, deadline, start_step)
        timings["train"] = round(time.perf_counter() - start, 1)
        if args.stop_after_phase is not None:
            if results.data["stopped_early"]:
                raise SystemExit(
                    f"[{args.run}] the time budget ended training at step {steps_done} of "
                    f"{results.data['steps_planned']}: no checkpoint written; raise --time-budget-s"
                )
            path = args.out / f"{args.run}.phase{args.stop_after_phase}.pt"
            save_checkpoint(path, model, optimizer, args, steps_done, results.data)
            results.data["status"] = "checkpointed"
            results.data["checkpoint"] = str(path)
            results.save()
            return results.data
        results.data["status"] = "evaluating"
        results.save()
        evaluate(model, task, args, device, results, budget)
        timings["eval"] = round(time.perf_counter() - start - timings["train"], 1)
        timings["total"] = round(time.perf_counter() - start, 1)
    results.data["status"] = "done"
    results.save()
    return results.data


def _phase_index(phases, step: int) -> int:
    """Index of the phase that step ``step`` (0-based) belongs to."""
    end = 0
    for index, phase in enumerate(phases):
        end += phase[2]
        if step < end:
            return index
    return len(phases)


if __name__ == "__main__":
    main()
