"""One run of the quality study: train a small Qwen2-shaped GPTModel on the retrieval task, evaluate, measure recall.

    python examples/quality/train.py --run dense  --attention dense          --device cuda:0 --out results/
    python examples/quality/train.py --run p0.9   --attention mtraining --top-p 0.9  --device cuda:1 --out results/

The model is Megatron-Core's ``GPTModel`` with MTraining's layer spec (local implementation) on one
device (TP = CP = 1): ``--attention dense`` sets ``MTrainingConfig(dense=True)`` (full causal
attention; on a GPU on torch's cuDNN SDPA kernels, ``dense_impl="sdpa_cudnn"``), ``--attention
mtraining`` the top-P budget (Triton kernels). Training follows ``--phases``, a length curriculum
``SEQ_LENxBATCHxSTEPS[xNEEDLES],...``;
AdamW with warm-up, a constant rate and a final cosine decay, grad clipping; on a GPU the model is in
bf16 with fp32 master weights (as Megatron's ``--bf16``).
Every run with the same ``--seed`` and phases sees the same batches and starts from the same weights.

``<out>/<run>.json`` is rewritten as the run goes (atomically): the settings, one record per step
(loss, LM loss, answer loss and accuracy, attention density), then the evaluation grid (retrieval
accuracy by length and needle depth, LM loss by length) and the per-layer pattern recall.
``--time-budget-s`` ends training early (recorded as ``stopped_early``) so that evaluation still fits.

Branching: one run with ``--stop-after-phase K`` trains the first K phases and saves ``<out>/<run>.pt``;
runs with ``--resume <that file>`` continue from it, so dense and MTraining runs share the short-context
training and differ only in the attention of the later phases (their records start with the shared ones).
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
    run.add_argument("--top-p", type=float, default=0.9, help="MTraining top-P budget (mtraining runs)")
    run.add_argument("--cap", type=int, default=None, help="MTraining cap (default: MTrainingConfig's)")
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
    run.add_argument("--log-interval", type=int, default=10, help="steps between attention-density records")
    run.add_argument(
        "--stop-after-phase",
        type=int,
        default=None,
        metavar="K",
        help="train phases 1..K, write the checkpoint <out>/<run>.pt and exit without evaluating: the "
        "shared start that --resume branches from",
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
    evaluation.add_argument("--eval-samples", type=int, default=16, help="sequences per (length, depth) cell")
    evaluation.add_argument("--eval-tokens", type=int, default=65536, help="tokens per evaluation forward")
    evaluation.add_argument("--recall-lengths", type=int_list, default=None, help="default: the longest phase")
    evaluation.add_argument("--recall-samples", type=int, default=1)
    evaluation.add_argument(
        "--recall-top-p",
        type=float_list,
        default=None,
        help="top-P budgets whose pattern recall is measured (default: the run's own; dense runs: 0.9,0.95)",
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


def mtraining_settings(args, kernel: str):
    from megatron_mtraining.config import MTrainingConfig

    common = dict(**KERNEL_SETTINGS[kernel], sink_tokens=args.sink_tokens, local_window=args.local_window)
    if args.attention == "dense":
        return MTrainingConfig(dense=True, **common)
    return MTrainingConfig(top_p=args.top_p, cap=args.cap, **common)


def recall_settings(args, top_ps: list[float]) -> dict:
    """The MTraining settings whose estimated pattern the recall measures, by name."""
    from megatron_mtraining.config import MTrainingConfig

    return {
        f"top-p {p:g}": MTrainingConfig(
            top_p=p, cap=args.cap, backend="torch", sink_tokens=args.sink_tokens, local_window=args.local_window
        )
        for p in top_ps
    }


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


def save_checkpoint(path: Path, model, optimizer: MasterWeightAdamW, args, step: int, records: list) -> None:
    torch.save(
        {
            "step": step,
            "settings": trajectory_settings(args),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "train": records,
        },
        path,
    )


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


def train(
    model,
    optimizer: MasterWeightAdamW,
    task,
    args,
    device,
    results: Results,
    deadline: float | None,
    start_step: int = 0,
) -> int:
    """Train from step ``start_step`` through the phases (the first ``--stop-after-phase`` ones when set); returns
    the number of steps done."""
    total = sum(phase[2] for phase in args.phases)
    phases = args.phases[: args.stop_after_phase] if args.stop_after_phase else args.phases
    records = results.data["train"]
    step = 0
    started = time.perf_counter()
    for seq_len, batch_size, steps, pairs in phases:
        phase_task = task if pairs is None else dataclasses.replace(task, num_pairs=pairs)
        for _ in range(steps):
            if step < start_step:  # done by the checkpoint's run
                step += 1
                continue
            if deadline is not None and time.perf_counter() > deadline:
                results.data["stopped_early"] = True
                return step
            lr = learning_rate(step, total, args)
            batch = phase_task.batch(args.seed, TRAIN_STREAM, step, batch_size, seq_len).to(device)
            losses, predictions = token_losses(model, batch)
            lm_loss, answer_loss = masked_mean(losses, batch.loss_mask), masked_mean(losses, batch.answer_mask)
            objective = lm_loss + args.answer_weight * answer_loss
            objective.backward()
            grad_norm = optimizer.step(lr)
            step += 1
            accuracy = query_correct(predictions, batch.labels, batch.answer_slots).float().mean()
            values = torch.stack([objective, lm_loss, answer_loss, accuracy, grad_norm]).detach().tolist()
            record = dict(zip(("loss", "lm_loss", "answer_loss", "answer_accuracy", "grad_norm"), values))
            record.update(
                step=step, seq_len=seq_len, batch=batch_size, lr=lr, elapsed_s=round(time.perf_counter() - started, 3)
            )
            records.append(record)
            results.data["steps_done"] = step
            if step % args.log_interval == 0 or step == total:
                record["density"] = mean_density(model)
                print(
                    f"[{args.run}] step {step}/{total} len {seq_len} | loss {record['loss']:.4f} | lm "
                    f"{record['lm_loss']:.4f} | answer {record['answer_loss']:.4f} acc "
                    f"{record['answer_accuracy']:.2f} | {record['elapsed_s']:.0f} s",
                    flush=True,
                )
                results.save()
    return step


@torch.no_grad()
def evaluate(model, task, args, device, results: Results) -> None:
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
    }
    results.data["eval"] = evaluation
    for seq_len in lengths:
        per_forward = max(1, min(args.eval_samples, args.eval_tokens // seq_len))
        row, per_sequence, loss_sum, answer_sum, token_count, answer_count = [], [], 0.0, 0.0, 0.0, 0.0
        for depth in depths:
            correct = []
            for first in range(0, args.eval_samples, per_forward):
                size = min(per_forward, args.eval_samples - first)
                batch = task.batch(args.seed, EVAL_STREAM, first, size, seq_len, target_depth=depth).to(device)
                losses, predictions = token_losses(model, batch)
                correct += query_correct(predictions, batch.labels, batch.answer_slots)[:, batch.target].int().tolist()
                loss_sum += float((losses * batch.loss_mask).sum())
                token_count += float(batch.loss_mask.sum())
                answer_sum += float((losses * batch.answer_mask).sum())
                answer_count += float(batch.answer_mask.sum())
            row.append(sum(correct) / args.eval_samples)
            per_sequence.append(correct)
        evaluation["accuracy"].append(row)
        evaluation["correct"].append(per_sequence)
        evaluation["lm_loss"].append(loss_sum / token_count)
        evaluation["answer_loss"].append(answer_sum / answer_count)
        print(
            f"[{args.run}] eval len {seq_len}: accuracy {sum(row) / len(row):.3f} by depth "
            f"{[round(a, 2) for a in row]} | lm loss {evaluation['lm_loss'][-1]:.4f}",
            flush=True,
        )
        results.save()
    model.train()


@torch.no_grad()
def measure_recall(model, task, args, device, results: Results) -> None:
    model.eval()
    top_ps = args.recall_top_p or ([0.9, 0.95] if args.attention == "dense" else [args.top_p])
    settings = recall_settings(args, top_ps)
    results.data["recall"] = []
    for seq_len in args.recall_lengths:
        batch = task.batch(args.seed, RECALL_STREAM, 0, args.recall_samples, seq_len).to(device)
        by_setting = pattern_recall(model, batch.tokens, settings, args.recall_row_chunk)
        results.data["recall"].append({"seq_len": seq_len, "samples": args.recall_samples, "by_setting": by_setting})
        for name, layers in by_setting.items():
            print(
                f"[{args.run}] recall len {seq_len} {name}: per layer mean/min over heads "
                + " ".join(f"{sum(x['recall']) / len(x['recall']):.3f}/{min(x['recall']):.3f}" for x in layers),
                flush=True,
            )
        results.save()
    model.train()


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.time_budget_s is not None and args.time_budget_s <= args.eval_reserve_s:
        parser.error(
            f"--time-budget-s={args.time_budget_s} leaves no training time after --eval-reserve-s="
            f"{args.eval_reserve_s}; raise the budget or lower the reserve"
        )
    if not args.eval_depths or not all(0.0 <= depth <= 1.0 for depth in args.eval_depths):
        parser.error(f"--eval-depths={args.eval_depths} must be fractions in [0, 1], e.g. 0,0.5,1")
    if args.eval_samples < 1 or args.recall_samples < 1:
        parser.error("--eval-samples and --recall-samples must be >= 1")
    if args.stop_after_phase is not None and not 1 <= args.stop_after_phase < len(args.phases):
        parser.error(
            f"--stop-after-phase={args.stop_after_phase} must leave phases to branch into: use 1 .. "
            f"{len(args.phases) - 1} for {len(args.phases)} phases"
        )
    if args.stop_after_phase is not None and args.resume is not None:
        parser.error(
            "--stop-after-phase and --resume exclude each other: one run writes the checkpoint, the "
            "others resume from it"
        )
    if args.resume is not None and not args.resume.is_file():
        parser.error(f"--resume {args.resume}: no such checkpoint; run train.py --stop-after-phase K first")
    start = time.perf_counter()
    deadline = None if args.time_budget_s is None else start + args.time_budget_s - args.eval_reserve_s
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    lengths = [phase[0] for phase in args.phases]
    args.eval_lengths = args.eval_lengths or sorted({n for n in lengths if n >= 1024} or set(lengths))
    args.recall_lengths = args.recall_lengths or [max(lengths)]
    max_len = max(lengths + args.eval_lengths + args.recall_lengths)
    task = RetrievalTask(
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
    for seq_len, _, _, pairs in args.phases:
        (task if pairs is None else dataclasses.replace(task, num_pairs=pairs)).check_length(seq_len)
    for seq_len in set(args.eval_lengths + args.recall_lengths):
        task.check_length(seq_len)
    kernel = resolve_kernel(args.kernel, args.attention, device)
    mtraining = mtraining_settings(args, kernel)
    bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
    init_megatron(device)
    model = build_model(args, mtraining, max_len).to(device, torch.bfloat16 if bf16 else torch.float32)
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    results = Results(
        args.out / f"{args.run}.json",
        {
            "run": args.run,
            "attention": args.attention,
            "top_p": args.top_p if args.attention == "mtraining" else None,
            "kernel": kernel,
            "precision": "bf16" if bf16 else "fp32",
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "parameters": sum(p.numel() for p in model.parameters()),
            "settings": settings,
            "mtraining": {k: v for k, v in vars(mtraining).items()},
            "task": dataclasses.asdict(task),
            "steps_planned": sum(phase[2] for phase in args.phases[: args.stop_after_phase or len(args.phases)]),
            "steps_done": 0,
            "stopped_early": False,
            "status": "training",
            "train": [],
        },
    )
    optimizer = MasterWeightAdamW(model, args)
    start_step = 0
    if args.resume is not None:
        checkpoint = load_checkpoint(args.resume, model, optimizer, args)
        start_step = checkpoint["step"]
        results.data.update(
            resumed_from={"path": str(args.resume), "step": start_step},
            steps_done=start_step,
            train=checkpoint["train"],
        )
    results.save()
    print(
        f"[{args.run}] {results.data['parameters'] / 1e6:.1f}M parameters, attention {args.attention}, kernel "
        f"{kernel}, {results.data['precision']}, device {device}",
        flush=True,
    )
    timings = results.data.setdefault("timing_s", {})
    with rope_tables_on(device):
        steps_done = train(model, optimizer, task, args, device, results, deadline, start_step)
        timings["train"] = round(time.perf_counter() - start, 1)
        if args.stop_after_phase is not None:
            if results.data["stopped_early"]:
                raise SystemExit(
                    f"[{args.run}] the time budget ended training at step {steps_done} of "
                    f"{results.data['steps_planned']}: no checkpoint written; raise --time-budget-s"
                )
            save_checkpoint(args.out / f"{args.run}.pt", model, optimizer, args, steps_done, results.data["train"])
            results.data["status"] = "checkpointed"
            results.save()
            return results.data
        results.data["status"] = "evaluating"
        results.save()
        evaluate(model, task, args, device, results)
        timings["eval"] = round(time.perf_counter() - start - timings["train"], 1)
        measure_recall(model, task, args, device, results)
        timings["total"] = round(time.perf_counter() - start, 1)
    results.data["status"] = "done"
    results.save()
    return results.data


if __name__ == "__main__":
    main()
