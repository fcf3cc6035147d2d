"""Quickstart: train a tiny Qwen2-shaped GPT with MTraining's sparse attention over a CP = 2 striped ring.

    python examples/quickstart.py                     # or: make demo
    python examples/quickstart.py --packed-documents  # several documents per sequence, each attending to itself only

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

``--packed-documents`` trains on packed documents instead of the mock data: Megatron's
``--reset-attention-mask --reset-position-ids --eod-mask-loss`` with ``--mtraining-min-sparse-length 1024``,
on a Megatron indexed dataset of synthetic documents written to a temporary directory
(:func:`write_packed_documents`) and read by Megatron's ``GPTDataset`` in both paths. Every step line
then also gives the documents per sequence.
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
import tempfile
import time
import warnings
from datetime import timedelta
from typing import Iterable, Iterator, Sequence

import numpy
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

# --packed-documents: documents end at each EOD, each attends only within itself with its own RoPE positions
# (unfused RoPE), no loss on EOD; documents of >= MIN_SPARSE_LENGTH tokens get their own sparse index
MIN_SPARSE_LENGTH = 1024
PACKED_DOCUMENT_FLAGS = [
    "--reset-attention-mask",
    "--reset-position-ids",
    "--no-rope-fusion",
    "--eod-mask-loss",
    "--mtraining-min-sparse-length",
    str(MIN_SPARSE_LENGTH),
]
SHORT_DOCUMENT_TOKENS = (128, MIN_SPARSE_LENGTH)  # [low, high): attended densely
LONG_DOCUMENT_TOKENS = (MIN_SPARSE_LENGTH, 3072)  # [low, high): sparse; short + long < a sequence
PACKED_ENTRIES = 256  # about 130 sequences; Megatron's GPTDataset repeats them in a reshuffled epoch if needed

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


def introduction(steps: int, launcher_command: Sequence[str] | None = None, packed: bool = False) -> list[str]:
    """What runs, in plain words (the launcher's command, or the CPU loop and why), and how to read the step lines."""
    data = "packed data" if packed else "mock data"
    if launcher_command:
        runs = [
            f"  runs      the real launcher on {CONTEXT_PARALLEL} GPUs (Megatron's training loop, Triton kernels):",
            f"            {shlex.join(launcher_command)}",
        ]
    else:
        runs = [
            f"  runs      a minimal training loop in {CONTEXT_PARALLEL} gloo processes: Megatron's `pretrain` "
            "needs CUDA, so this",
            f"            loop drives the launcher's pieces itself (flags, model, {data}, metrics); with",
            f"            >= {CONTEXT_PARALLEL} GPUs this script runs the real launcher, "
            "torchrun -m megatron_mtraining.pretrain",
        ]
    documents = [
        "  documents every sequence packs several synthetic documents (runs of consecutive token ids, each ending",
        "            in EOD); each document attends only within itself, its RoPE positions start at 0 and its EOD",
        f"            carries no loss; documents of >= {MIN_SPARSE_LENGTH} tokens get their own sparse index, "
        "shorter ones are",
        "            attended densely",
    ]
    reading_density = [
        "  density    fraction of the documents' causal attention area computed (1.0 = dense attention within",
        "             every document)",
        "  documents/sequence  documents in the step's sequence",
    ]
    return [
        f"MTraining quickstart: {steps} training steps of a tiny GPT with dynamic sparse attention",
        *runs,
        f"  model     Qwen2-shaped: {_flag('--num-layers')} layers, hidden {_flag('--hidden-size')}, "
        f"{_flag('--num-attention-heads')} query heads in {_flag('--num-query-groups')} KV groups, "
        f"vocabulary {_flag('--vocab-size')}, " + ("synthetic packed documents" if packed else "Megatron's mock data"),
        f"  sequence  {_flag('--seq-length')} tokens split over CP = {CONTEXT_PARALLEL} ranks in the "
        f"{_flag('--mtraining-layout')} layout (stripes dealt out in turn,",
        "            so that every rank gets an equal share of the causal attention work)",
        f"  budget    per head, the key columns and diagonals holding {float(_flag('--mtraining-top-p')):.0%} of the "
        f"estimated attention mass",
        f"            (at most {_flag('--mtraining-cap')} of each), plus the first {_flag('--mtraining-sink-tokens')} "
        f"tokens and a {_flag('--mtraining-local-window')}-token local window",
        *(documents if packed else []),
        "reading the step lines:",
        *(
            reading_density
            if packed
            else ["  density    fraction of the causal attention area computed (1.0 = dense attention)"]
        ),
        "  imbalance  max/mean of the ring's attention work over ranks (worker) and over ring steps (step);",
        "             1.0 = perfectly balanced",
    ]


def step_line(record: dict, steps: int) -> str:
    """One training step: loss, density, worker/step imbalance, documents per sequence (packed) and time."""
    documents = record.get("documents_per_sequence")
    return (
        f"step {record['step']:3d}/{steps} | loss {record['loss']:.4f} | density {record['density']:.3f} | "
        f"worker imbalance {record['worker_imbalance']:.3f} | step imbalance {record['step_imbalance']:.3f} | "
        + ("" if documents is None else f"documents/sequence {documents:.1f} | ")
        + f"{record['seconds']:.1f} s"
    )


def summary(records: Sequence[dict]) -> list[str]:
    """The run in numbers: steps, first -> last loss, mean density (= share of dense work), worst imbalance, time,
    and the mean documents per sequence of a packed run."""
    density = sum(record["density"] for record in records) / len(records)
    worker = max(record["worker_imbalance"] for record in records)
    step = max(record["step_imbalance"] for record in records)
    lines = [
        f"summary: {len(records)} steps, loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}, "
        f"{sum(record['seconds'] for record in records):.1f} s of steps",
        f"         mean density {density:.3f}: the sparse attention did {density:.0%} of dense attention's work",
        f"         worst imbalance: worker {worker:.3f}, step {step:.3f}",
    ]
    documents = [record["documents_per_sequence"] for record in records if "documents_per_sequence" in record]
    if documents:
        lines.append(f"         documents: {sum(documents) / len(documents):.1f} per sequence on average")
    return lines


# ------------------------------------------------------------------------------------------ data
def demo_flags(packed_data: str | None) -> list[str]:
    """TINY_QWEN2 on Megatron's mock data, or (``packed_data``: an indexed dataset's prefix) on those documents
    with PACKED_DOCUMENT_FLAGS."""
    if packed_data is None:
        return list(TINY_QWEN2)
    flags = [flag for flag in TINY_QWEN2 if flag != "--mock-data"]
    return [*flags, "--data-path", packed_data, "--split", "100,0,0", *PACKED_DOCUMENT_FLAGS]


def write_packed_documents(prefix: str, seed: int) -> None:
    """Megatron's indexed dataset ``prefix``.bin/.idx: PACKED_ENTRIES entries, each a short document then a long one.

    A document is a run of consecutive token ids from a random start (as in Megatron's mock data), without
    the tokenizer's EOD, then EOD. ``GPTDataset`` shuffles whole entries, so short and long documents
    alternate in every sequence; as a short and a long one together have fewer tokens than a sequence, every
    sequence holds at least three documents, one of them attended densely and one with >= MIN_SPARSE_LENGTH tokens.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    eod = NullTokenizer(int(_flag("--vocab-size"))).eod
    rng = numpy.random.default_rng(seed)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.int32)
    for _ in range(PACKED_ENTRIES):
        documents = [
            numpy.append((rng.integers(eod) + numpy.arange(rng.integers(*tokens) - 1)) % eod, eod)
            for tokens in (SHORT_DOCUMENT_TOKENS, LONG_DOCUMENT_TOKENS)
        ]
        entry = numpy.concatenate(documents)
        builder.add_document(entry, [entry.size])
    builder.finalize(get_idx_path(prefix))


# ------------------------------------------------------------------------------------------ GPU: the launcher
MEGATRON_ITERATION_LINE = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.* elapsed time per iteration \(ms\): ([\d.]+) \|"
    r".* lm loss: ([-+.\dE]+) \|"
)
MTRAINING_METRICS_LINE = re.compile(
    r"mtraining \| iteration\s+(\d+) \| density ([\d.]+) \| worker imbalance ([\d.]+)"
    r" \| step imbalance ([\d.]+)(?:.* \| documents/sequence ([\d.]+))?"
)


def records_from_launcher_log(lines: Iterable[str]) -> list[dict]:
    """Step records like ``train_on_cpu``'s, from the launcher's output (Megatron's and MTraining's lines);
    iterations without both lines are left out."""
    records: dict[int, dict] = {}
    for line in lines:
        if match := MEGATRON_ITERATION_LINE.search(line):
            records.setdefault(int(match[1]), {}).update(seconds=float(match[2]) / 1e3, loss=float(match[3]))
        elif match := MTRAINING_METRICS_LINE.search(line):
            record = records.setdefault(int(match[1]), {})
            record.update(density=float(match[2]), worker_imbalance=float(match[3]), step_imbalance=float(match[4]))
            if match[5] is not None:
                record["documents_per_sequence"] = float(match[5])
    return [
        {"step": step, **record} for step, record in sorted(records.items()) if {"loss", "density"} <= record.keys()
    ]


def _echoed(lines: Iterable[str]) -> Iterator[str]:
    """``lines``, each printed as it passes."""
    for line in lines:
        print(line, end="", flush=True)
        yield line


def run_launcher(steps: int, extra_flags: Sequence[str] = (), packed_data: str | None = None) -> int:
    """``torchrun -m megatron_mtraining.pretrain`` on CONTEXT_PARALLEL GPUs, output passed on; returns its exit code.

    ``packed_data``: train on the packed documents of :func:`write_packed_documents` at that prefix.
    """
    flags = [*demo_flags(packed_data), *GPU_FLAGS, "--train-iters", str(steps), *extra_flags]
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
    print("\n".join(introduction(steps, command, packed=packed_data is not None)), flush=True)
    metrics = "the density and imbalance" + (" (and the documents per sequence)" if packed_data else "")
    print(
        "starting torchrun: Megatron prints its arguments and set-up, then one line per iteration and an "
        f"'mtraining' line with\n{metrics}; iteration 1 compiles the Triton kernels and is the slowest ...",
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


def train_on_cpu(
    steps: int, report=print, extra_flags: Sequence[str] = (), packed_data: str | None = None
) -> list[dict]:
    """Train on this gloo process group (one rank per CP rank); returns one record per step on every rank.

    ``report(line)`` is called on rank 0 once the model is built and then with one line per step;
    ``extra_flags`` are appended to the demo's flags (e.g. another ``--seed``); ``packed_data``: train on
    the packed documents at that prefix (:func:`demo_flags`).
    """
    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_mtraining.arguments import validate_mtraining_args
    from megatron_mtraining.attention import PackedDocuments
    from megatron_mtraining.chunked_loss import ChunkedLossOutputProcessor
    from megatron_mtraining.index_cache import assert_index_caches_empty
    from megatron_mtraining.layout import select_layout_positions
    from megatron_mtraining.pretrain import gpt_dataset_config_from_args, mtraining_model_config
    from megatron_mtraining.step_metrics import gather_step_metrics
    from mtraining_kernels.documents import Documents

    args = cpu_args([*demo_flags(packed_data), *CPU_FLAGS, "--train-iters", str(steps), *extra_flags])
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
        tokenizer = build_tokenizer(args)
        eod_token = tokenizer.eod if args.reset_attention_mask else None
        dataset, _, _ = BlendedMegatronDatasetBuilder(
            MockGPTDataset if args.mock_data else GPTDataset,
            [steps, 0, 0],
            lambda: True,
            gpt_dataset_config_from_args(args, tokenizer),
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
                # as the launcher's get_batch (which needs CUDA): the documents of the whole sequence on every
                # rank, then this rank's positions
                packed = None if eod_token is None else PackedDocuments(Documents.from_eod(sample["tokens"], eod_token))
                local = select_layout_positions(sample, layout, dist.get_rank(cp_group))
                token_losses = model(
                    local["tokens"],
                    local["position_ids"],
                    None,
                    labels=local["labels"],
                    packed_seq_params=packed,
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
                if metrics.documents_per_sequence is not None:
                    record["documents_per_sequence"] = metrics.documents_per_sequence
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


def _cpu_rank(rank: int, port: int, steps: int, extra_flags: Sequence[str], packed_data: str | None) -> None:
    torch.set_num_threads(1)
    # Megatron wraps RMSNorm, dropout-add and more in torch.compile; on a CPU that builds C++ kernels with the
    # machine's compiler at the first step (and again at evaluation), slower than the tiny model's eager steps
    torch.compiler.set_stance("force_eager")
    silence_expected_warnings()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=CONTEXT_PARALLEL,
        timeout=timedelta(minutes=5),
    )
    try:
        records = train_on_cpu(steps, lambda line: print(line, flush=True), extra_flags, packed_data)
        if rank == 0:
            print("\n".join(summary(records)), flush=True)
    finally:
        dist.destroy_process_group()


def run_on_cpu(steps: int, extra_flags: Sequence[str] = (), packed_data: str | None = None) -> None:
    """The CPU loop in CONTEXT_PARALLEL gloo processes, with the demo's introduction and closing lines
    (``packed_data``: on the packed documents at that prefix)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    print("\n".join(introduction(steps, packed=packed_data is not None)), flush=True)
    data = "mock data" if packed_data is None else "packed data"
    print(
        f"starting {CONTEXT_PARALLEL} processes: importing Megatron, building the model and the {data} ...",
        flush=True,
    )
    started = time.perf_counter()
    mp.spawn(_cpu_rank, args=(port, steps, list(extra_flags), packed_data), nprocs=CONTEXT_PARALLEL)
    print("\n".join([f"finished in {time.perf_counter() - started:.1f} s, start-up included", *NEXT_STEPS]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps")
    parser.add_argument("--cpu", action="store_true", help="run the CPU loop even when GPUs are present")
    parser.add_argument("--seed", type=int, help=f"seed of the initialisation and data (default {_flag('--seed')})")
    parser.add_argument(
        "--packed-documents",
        action="store_true",
        help="train on synthetic packed documents, several per sequence, each attending only within itself",
    )
    options = parser.parse_args()
    if options.steps < 1:
        parser.error(f"--steps={options.steps} must be >= 1")
    extra_flags = [] if options.seed is None else ["--seed", str(options.seed)]
    on_gpus = torch.cuda.device_count() >= CONTEXT_PARALLEL and not options.cpu
    data_dir = (
        tempfile.TemporaryDirectory(prefix="mtraining-quickstart-")
        if options.packed_documents
        else contextlib.nullcontext()
    )
    with data_dir as directory:
        packed_data = None
        if directory is not None:
            silence_expected_warnings()  # this process imports Megatron to write the documents
            packed_data = os.path.join(directory, "documents")
            write_packed_documents(packed_data, int(_flag("--seed")) if options.seed is None else options.seed)
        if on_gpus:
            sys.exit(run_launcher(options.steps, extra_flags, packed_data))
        run_on_cpu(options.steps, extra_flags, packed_data)


if __name__ == "__main__":
    main()
