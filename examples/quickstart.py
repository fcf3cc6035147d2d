"""Quickstart: train a tiny Qwen2-shaped GPT with MTraining's sparse attention over a CP = 2 striped ring.

    python examples/quickstart.py            # or: make demo

* **Machine with GPUs:** runs the real launcher, ``torchrun -m megatron_mtraining.pretrain`` with the
  flags below, ``--mock-data`` and the Triton kernels; Megatron prints the loss, the launcher the
  MTraining metrics, every iteration.
* **CPU-only machine:** Megatron's ``pretrain`` needs CUDA, so two gloo processes run a minimal loop
  instead, around the same pieces: the same flags parsed and validated by Megatron and
  ``megatron_mtraining.arguments``, the same ``GPTModel`` built by the launcher's model config
  (MTraining layer spec, layout RoPE), Megatron's ``MockGPTDataset`` split into the striped layout by
  ``select_layout_positions``, and the same metrics. Kernels: ``--mtraining-backend torch``; about a minute on 2 cores.

The output says first what runs (the model, sequence, CP layout and budget) and how to read density and
imbalance, then one line per step (loss, density, worker/step imbalance, time) and a closing summary
with what to try next. Megatron's warnings about Transformer Engine and Apex being absent are silenced.

The model: 2 layers, hidden 256, 4 query heads in 2 KV groups of head dim 64, SwiGLU, RMSNorm
(eps 1e-6), QKV bias, RoPE base 1e6, tied embeddings (Qwen2's shape, scaled down), 4,096-token
sequences. The budget is top-P with a small cap so that the attention is visibly sparse at this length.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import logging
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from typing import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONTEXT_PARALLEL = 2
STEPS = 20

TINY_QWEN2 = [
    "--num-layers",
    "2",
    "--hidden-size",
    "256",
    "--ffn-hidden-size",
    "704",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--kv-channels",
    "64",
    "--normalization",
    "RMSNorm",
    "--norm-epsilon",
    "1e-6",
    "--swiglu",
    "--disable-bias-linear",
    "--add-qkv-bias",
    "--position-embedding-type",
    "rope",
    "--rotary-base",
    "1000000",
    "--rotary-percent",
    "1.0",
    "--seq-length",
    "4096",
    "--max-position-embeddings",
    "4096",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "512",
    "--mock-data",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "1",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-3",
    "--lr-decay-style",
    "constant",
    "--weight-decay",
    "0.0",
    "--clip-grad",
    "1.0",
    "--seed",
    "1234",
    "--context-parallel-size",
    str(CONTEXT_PARALLEL),
    "--mtraining-layout",
    "striped",
    "--mtraining-top-p",
    "0.9",
    "--mtraining-cap",
    "80",
    "--mtraining-sink-tokens",
    "16",
    "--mtraining-local-window",
    "64",
    "--mtraining-loss-chunk-size",
    "1024",
]
# without Transformer Engine, Megatron's local layers and no TE/Apex fusions
LOCAL_IMPL_FLAGS = [
    "--transformer-impl",
    "local",
    "--no-gradient-accumulation-fusion",
    "--no-bias-swiglu-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
]
GPU_FLAGS = [
    "--bf16",
    "--mtraining-backend",
    "triton",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
    *([] if importlib.util.find_spec("transformer_engine") else LOCAL_IMPL_FLAGS),
]
CPU_FLAGS = ["--mtraining-backend", "torch", "--use-cpu-initialization", *LOCAL_IMPL_FLAGS]

# Megatron warns on import that these optional libraries are absent; the demo runs without them on purpose
ABSENT_LIBRARY_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "Only transformer-engine>=",
    "absl.logging is not installed",
)
NEXT_STEPS = [
    "next: make test                                 the test suite (GPU tests skip without CUDA)",
    "      docs/user_journey.md                      Qwen2.5 from Hugging Face to a 512K-context model and back",
    "      examples/qwen2.5-0.5b_1gpu_demo.sh        a real model at 64K tokens on one or two GPUs",
    "      examples/qwen2.5-3b_32k_to_512k.sh        the full 32K -> 512K recipe",
]


# ------------------------------------------------------------------------------------------ output
def _flag(name: str) -> str:
    """The value the demo gives to ``name``."""
    return TINY_QWEN2[TINY_QWEN2.index(name) + 1]


def introduction(steps: int, launcher_command: Sequence[str] | None = None) -> list[str]:
    """What runs, in plain words (the launcher's command, or the CPU loop and why), and how to read the step lines."""
    if launcher_command:
        runs = [
            f"  runs      the real launcher on {CONTEXT_PARALLEL} GPUs (Megatron's training loop, Triton kernels):",
            f"            {shlex.join(launcher_command)}",
        ]
    else:
        runs = [
            f"  runs      a minimal training loop in {CONTEXT_PARALLEL} gloo processes: Megatron's `pretrain` "
            "needs CUDA, so this",
            "            loop drives the launcher's pieces itself (flags, model, mock data, metrics); with",
            f"            >= {CONTEXT_PARALLEL} GPUs this script runs the real launcher, "
            "torchrun -m megatron_mtraining.pretrain",
        ]
    return [
        f"MTraining quickstart: {steps} training steps of a tiny GPT with dynamic sparse attention",
        *runs,
        f"  model     Qwen2-shaped: {_flag('--num-layers')} layers, hidden {_flag('--hidden-size')}, "
        f"{_flag('--num-attention-heads')} query heads in {_flag('--num-query-groups')} KV groups, "
        f"vocabulary {_flag('--vocab-size')}, Megatron's mock data",
        f"  sequence  {_flag('--seq-length')} tokens split over CP = {CONTEXT_PARALLEL} ranks in the "
        f"{_flag('--mtraining-layout')} layout (stripes dealt out in turn,",
        "            so that every rank gets an equal share of the causal attention work)",
        f"  budget    per head, the key columns and diagonals holding {float(_flag('--mtraining-top-p')):.0%} of the "
        f"estimated attention mass",
        f"            (at most {_flag('--mtraining-cap')} of each), plus the first {_flag('--mtraining-sink-tokens')} "
        f"tokens and a {_flag('--mtraining-local-window')}-token local window",
        "reading the step lines:",
        "  density    fraction of the causal attention area computed (1.0 = dense attention)",
        "  imbalance  max/mean of the ring's attention work over ranks (worker) and over ring steps (step);",
        "             1.0 = perfectly balanced",
    ]


def step_line(record: dict, steps: int) -> str:
    """One training step: loss, density, worker/step imbalance and time."""
    return (
        f"step {record['step']:3d}/{steps} | loss {record['loss']:.4f} | density {record['density']:.3f} | "
        f"worker imbalance {record['worker_imbalance']:.3f} | step imbalance {record['step_imbalance']:.3f} | "
        f"{record['seconds']:.1f} s"
    )


def summary(records: Sequence[dict]) -> list[str]:
    """The run in numbers: steps, first -> last loss, mean density (= share of dense work), worst imbalance, time."""
    density = sum(record["density"] for record in records) / len(records)
    worker = max(record["worker_imbalance"] for record in records)
    step = max(record["step_imbalance"] for record in records)
    return [
        f"summary: {len(records)} steps, loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}, "
        f"{sum(record['seconds'] for record in records):.1f} s of steps",
        f"         mean density {density:.3f}: the sparse attention did {density:.0%} of dense attention's work",
        f"         worst imbalance: worker {worker:.3f}, step {step:.3f}",
    ]


# ------------------------------------------------------------------------------------------ GPU: the launcher
MEGATRON_ITERATION_LINE = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.* elapsed time per iteration \(ms\): ([\d.]+) \|"
    r".* lm loss: ([-+.\dE]+) \|"
)
MTRAINING_METRICS_LINE = re.compile(
    r"mtraining \| iteration\s+(\d+) \| density ([\d.]+) \| worker imbalance ([\d.]+)"
    r" \| step imbalance ([\d.]+)"
)


def records_from_launcher_log(lines: Iterable[str]) -> list[dict]:
    """Step records like ``train_on_cpu``'s, from the launcher's output (Megatron's and MTraining's lines)."""
    records: dict[int, dict] = {}
    for line in lines:
        if match := MEGATRON_ITERATION_LINE.search(line):
            records.setdefault(int(match[1]), {}).update(seconds=float(match[2]) / 1e3, loss=float(match[3]))
        elif match := MTRAINING_METRICS_LINE.search(line):
            records.setdefault(int(match[1]), {}).update(
                density=float(match[2]), worker_imbalance=float(match[3]), step_imbalance=float(match[4])
            )
    return [{"step": step, **record} for step, record in sorted(records.items()) if len(record) == 5]


def _echoed(lines: Iterable[str]) -> Iterator[str]:
    """``lines``, each printed as it passes."""
    for line in lines:
        print(line, end="", flush=True)
        yield line


def run_launcher(steps: int, extra_flags: Sequence[str] = ()) -> int:
    """``torchrun -m megatron_mtraining.pretrain`` on CONTEXT_PARALLEL GPUs, output passed on; returns its exit code."""
    flags = [*TINY_QWEN2, *GPU_FLAGS, "--train-iters", str(steps), *extra_flags]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={CONTEXT_PARALLEL}",
        "-m",
        "megatron_mtraining.pretrain",
        *flags,
    ]
    print("\n".join(introduction(steps, command)), flush=True)
    print(
        "starting torchrun: Megatron prints its arguments and set-up, then one line per iteration and an "
        "'mtraining' line with\nthe density and imbalance; iteration 1 compiles the Triton kernels and is the "
        "slowest ...",
        flush=True,
    )
    # Megatron asserts CUDA_DEVICE_MAX_CONNECTIONS=1 for context parallelism on Hopper and older GPUs
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    env["PYTHONWARNINGS"] = ",".join(
        [
            *filter(None, [os.environ.get("PYTHONWARNINGS")]),
            *(f"ignore:{message}" for message in ABSENT_LIBRARY_WARNINGS),
        ]
    )
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, set here so that it does not warn about it
    started = time.perf_counter()
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as launcher:
        records = records_from_launcher_log(_echoed(launcher.stdout))
    if launcher.returncode == 0 and records:
        print(
            "\n".join(
                [
                    *summary(records),
                    f"finished in {time.perf_counter() - started:.1f} s, start-up included",
                    *NEXT_STEPS,
                ]
            ),
            flush=True,
        )
    return launcher.returncode


# ------------------------------------------------------------------------------------------ CPU: a minimal loop
def cpu_args(flags: list[str]) -> argparse.Namespace:
    """Megatron's parsed and validated arguments (``--mtraining-*`` included) for ``flags``, on a CPU.

    Megatron's ``validate_args`` asks the GPU for its architecture when CP > 1, so it validates the
    CP = 1 equivalent (nothing it derives depends on CP) and the CP size is put back afterwards.
    """
    from megatron.training.arguments import add_megatron_arguments, validate_args

    from megatron_mtraining.arguments import add_mtraining_args

    parser = add_mtraining_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    args = parser.parse_args(flags)
    cp = args.context_parallel_size
    args.rank, args.world_size, args.context_parallel_size = 0, 1, 1
    with contextlib.redirect_stdout(io.StringIO()):  # Megatron prints every argument
        validate_args(args)
    args.world_size, args.context_parallel_size = cp, cp
    return args


@contextlib.contextmanager
def rope_tables_on_cpu():
    """Megatron's RoPE moves its frequencies to ``torch.cuda.current_device()`` on first use; keep them on the CPU."""
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = current_device


def train_on_cpu(steps: int, report=print, extra_flags: Sequence[str] = ()) -> list[dict]:
    """Train on this gloo process group (one rank per CP rank); returns one record per step on every rank.

    ``report(line)`` is called on rank 0 once the model is built and then with one line per step;
    ``extra_flags`` are appended to the demo's flags (e.g. another ``--seed``).
    """
    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import MockGPTDataset
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_mtraining.arguments import validate_mtraining_args
    from megatron_mtraining.chunked_loss import ChunkedLossOutputProcessor
    from megatron_mtraining.index_cache import assert_index_caches_empty
    from megatron_mtraining.layout import select_layout_positions
    from megatron_mtraining.pretrain import gpt_dataset_config_from_args, mtraining_model_config
    from megatron_mtraining.step_metrics import gather_step_metrics

    args = cpu_args([*TINY_QWEN2, *CPU_FLAGS, "--train-iters", str(steps), *extra_flags])
    if dist.get_world_size() != args.context_parallel_size:
        raise ValueError(
            f"the CPU demo runs one process per CP rank: {args.context_parallel_size} processes, "
            f"got {dist.get_world_size()}"
        )
    mtraining = validate_mtraining_args(args)
    parallel_state.initialize_model_parallel(context_parallel_size=args.context_parallel_size)
    try:
        cp_group = parallel_state.get_context_parallel_group()
        layout = mtraining.layout_for(args.context_parallel_size)
        torch.manual_seed(args.seed)
        model_config = mtraining_model_config(args, mtraining)
        with contextlib.redirect_stdout(io.StringIO()):  # Megatron prints the padded vocabulary size
            model = GPTModelBuilder(model_config).build_model(ProcessGroupCollection.use_mpu_process_groups())
        for hook in model_config.pre_wrap_hooks:
            (model,) = hook([model])
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=args.lr,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
            weight_decay=args.weight_decay,
        )
        output_processor = ChunkedLossOutputProcessor(args.mtraining_loss_chunk_size)
        dataset_config = gpt_dataset_config_from_args(args, build_tokenizer(args))
        dataset, _, _ = BlendedMegatronDatasetBuilder(
            MockGPTDataset, [steps, 0, 0], lambda: True, dataset_config
        ).build()
        if dist.get_rank() == 0:
            parameters = sum(param.numel() for param in model.parameters())
            report(
                f"model built: {parameters / 1e6:.1f} M parameters, a full copy on each rank (CP splits the "
                "sequence, not the model);\nstep 1 is the slowest (one-time set-up) ..."
            )
        records = []
        with rope_tables_on_cpu():
            for step in range(steps):
                started = time.perf_counter()
                sample = {key: value[None] for key, value in dataset[step].items()}
                local = select_layout_positions(sample, layout, dist.get_rank(cp_group))
                token_losses = model(
                    local["tokens"],
                    local["position_ids"],
                    None,
                    labels=local["labels"],
                    output_processor=output_processor,
                )
                sums = torch.stack([(token_losses * local["loss_mask"]).sum(), local["loss_mask"].sum()])
                totals = sums.detach().clone()
                dist.all_reduce(totals, group=cp_group)
                (sums[0] / totals[1]).backward()
                for param in model.parameters():  # each CP rank holds its tokens' share
                    dist.all_reduce(param.grad, group=cp_group)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                assert_index_caches_empty([model])
                metrics = gather_step_metrics([model], args.num_layers, group=cp_group)
                record = {
                    "step": step + 1,
                    "loss": float(totals[0] / totals[1]),
                    "density": metrics.mean_density,
                    "worker_imbalance": metrics.worker_imbalance,
                    "step_imbalance": metrics.step_imbalance,
                    "seconds": time.perf_counter() - started,
                }
                records.append(record)
                if dist.get_rank() == 0:
                    report(step_line(record, steps))
        return records
    finally:
        parallel_state.destroy_model_parallel()


def silence_expected_warnings() -> None:
    """Hide ABSENT_LIBRARY_WARNINGS, torch's no-CUDA note and Megatron's set-up log; errors still show."""
    for message in ABSENT_LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message))
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    logging.getLogger("megatron").setLevel(logging.ERROR)  # Megatron logs its set-up at INFO level


def _cpu_rank(rank: int, port: int, steps: int, extra_flags: Sequence[str]) -> None:
    torch.set_num_threads(1)
    silence_expected_warnings()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=CONTEXT_PARALLEL,
        timeout=timedelta(minutes=5),
    )
    try:
        records = train_on_cpu(steps, report=lambda line: print(line, flush=True), extra_flags=extra_flags)
        if rank == 0:
            print("\n".join(summary(records)), flush=True)
    finally:
        dist.destroy_process_group()


def run_on_cpu(steps: int, extra_flags: Sequence[str] = ()) -> None:
    """The CPU loop in CONTEXT_PARALLEL gloo processes, with the demo's introduction and closing lines."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    print("\n".join(introduction(steps)), flush=True)
    print(
        f"starting {CONTEXT_PARALLEL} processes: importing Megatron, building the model and the mock data ...",
        flush=True,
    )
    started = time.perf_counter()
    mp.spawn(_cpu_rank, args=(port, steps, list(extra_flags)), nprocs=CONTEXT_PARALLEL)
    print("\n".join([f"finished in {time.perf_counter() - started:.1f} s, start-up included", *NEXT_STEPS]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps")
    parser.add_argument("--cpu", action="store_true", help="run the CPU loop even when GPUs are present")
    parser.add_argument("--seed", type=int, help=f"seed of the initialisation and data (default {_flag('--seed')})")
    options = parser.parse_args()
    if options.steps < 1:
        parser.error(f"--steps={options.steps} must be >= 1")
    extra_flags = [] if options.seed is None else ["--seed", str(options.seed)]
    if torch.cuda.device_count() >= CONTEXT_PARALLEL and not options.cpu:
        sys.exit(run_launcher(options.steps, extra_flags))
    run_on_cpu(options.steps, extra_flags)


if __name__ == "__main__":
    main()
