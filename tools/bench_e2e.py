"""End-to-end training throughput of MTraining against the dense baseline: Qwen2.5 shapes, CP ranks of one host.

    python tools/bench_e2e.py --models 0.5b,1.5b,3b --seq-lens 131072,262144,524288   # on 2 GPUs
    python tools/bench_e2e.py --cp 1 --models 0.5b --seq-lens 65536 --mixtures none,prolong,uniform4k  # one GPU
    python tools/bench_e2e.py --dry-run        # print the launcher commands (no GPU needed)
    python tools/bench_e2e.py --plot-only      # table and chart from the JSONL
    python tools/bench_e2e.py --compare-runs   # configurations measured twice: the latest run vs the one before

Each configuration (model shape x sequence length x attention variant) trains with the real launcher through
``tools/train_probe.py`` (``torchrun --nproc-per-node CP``): random weights, bf16, local (non-TE) layers,
CP = ``--cp`` (1: one GPU, no ring), TP = PP = DP = 1, one sequence per iteration, chunked output layer and loss.

**Data** (``--mixtures``, the JSON's ``mixture``; every mixture is measured with every variant in the same
invocation). ``none``: Megatron's mock data, one unpacked sequence. ``prolong``, ``uniform4k``, ``single``: the
packed mixtures of ``document_mixtures.MIXTURES`` (PACKED.md; one draw, seed ``--mixture-seed``, the same
document lengths in every sequence, recorded as ``document_lengths``), written before the runs as a Megatron
indexed dataset whose entries are exactly one sequence each (``packed_dataset.py``: every document ends with the
NullTokenizer's EOD, so Megatron's samples hold exactly those documents) and trained with ``--data-path``,
``--reset-attention-mask``, ``--reset-position-ids`` and ``--eod-mask-loss``: every document attends only
within itself, sparse variants estimate one index per document of at least ``--min-sparse-length`` tokens.
The dense baseline applies the same document mask, so it runs our Triton kernels (``--dense-kernel triton``,
the default with a packed mixture: the SDPA dense impls have no document mask and are refused there).

Variants (``--variants``; the JSON's ``attention`` / ``sparsity_setting``):

* ``mtraining``: striped sparse ring, top-P 0.9 budgets (``mtraining`` / ``top_p=0.9``);
* ``mtraining-static``: striped sparse ring, fixed 95 % sparsity (``mtraining`` / ``sparsity=0.95``);
* ``mtraining-zigzag``: Megatron's zigzag split with top-P 0.9, the layout ablation (``mtraining_zigzag``);
* ``mtraining-zigzag-static``: the zigzag split with the fixed 95 % sparsity, the ablation of
  ``mtraining-static`` (random weights make top-P nearly dense, so this is the pair that shows the layout);
* ``dense``: the dense baseline (``dense`` / ``dense``; at CP > 1 the dense ring), with ``--dense-kernel``
  sdpa_cudnn (the default unpacked) or sdpa_flash over the zigzag layout (at CP = 1 a plain SDPA call), or
  triton (our dense kernels over the striped layout; the default, and the only one, for packed mixtures).

**Timing by reduced depth.** A configuration is trained at each layer count of ``--layers`` (default 2 and 4
of the real shape): ``--warmup`` iterations, ``--iters`` timed ones (their median; an iteration's time is the
slowest rank's), then one profiled iteration (``torch.profiler``: all kernel time, and attention kernel time),
then, for sparse variants, one iteration that logs the attention density. Per-layer cost is uniform, so
T(L) = fixed + per_layer x L is fitted (least squares) and extrapolated to the model's real depth; kernel and
attention kernel times are extrapolated the same way for the attention share. Rows say so
(``layers_timed``, ``extrapolated: true``, the measured ``points`` and the ``fit``). ``--full-depth`` times the
real layer count instead (the memory-fit check). ``peak_mem_gb`` (10^9 bytes, the largest rank's
``max_memory_allocated``) and ``reserved_mem_gb`` (the most the caching allocator held after a step) are
measured at ``peak_mem_layers`` layers, not extrapolated.

**FLOPs** (:func:`iteration_flops`) of one iteration, counted as model FLOPs (forward + backward = 3 x forward,
no recomputation): per layer the QKV and output projections, the SwiGLU MLP (3 matrices) and the causal
attention (scores and values over half the N^2 area, 2·N²·Hq·d per forward; packed: over the document-causal
area, 2·Σ L_d²·Hq·d, the row's ``mask_area`` = Σ L_d² / N² of the unpacked one); plus the output layer.
``dense_equiv`` counts the attention at density 1 (the dense baseline's mask); ``actual`` multiplies it by the
measured density (packed: the work listed over that of every document dense);
``hardware`` is ``actual`` plus the recomputed forwards (full activation recompute, chunked loss).
MFU = TFLOP/s per GPU / ``--peak-tflops`` (H200 bf16 dense: 989).

Output: one JSON object per configuration appended to ``--jsonl`` as soon as it is measured, its ``command``
the shell line of each timed run (a failed run — OOM, crash, timeout, unusable fit — is recorded with
``status: "failed"``, its ``error`` and the points measured before); a markdown table on stdout; the chart
``--plot`` (tokens/s speedup over the fastest dense row of the same model, length, mixture, GPU and method,
against sequence length) rebuilt from the whole JSONL; rows written before mixtures existed read as ``none``.
Every run is killed after ``--run-timeout-s``; with ``--time-budget-s`` a configuration whose estimated time
exceeds what is left is skipped and reported.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from provenance import git_commit

REPO = Path(__file__).resolve().parents[1]
PROBE = "tools/train_probe.py"
DEFAULT_JSONL = REPO / "docs" / "benchmarks" / "e2e.jsonl"
DEFAULT_PLOT = REPO / "docs" / "benchmarks" / "e2e_speedup.png"
H200_BF16_PEAK_TFLOPS = 989.0  # NVIDIA H200 SXM, dense bf16 (no sparsity)
QWEN25_VOCAB = 151936
TOP_P = 0.9
STATIC_SPARSITY = 0.95
LOSS_CHUNK_SIZE = 8192
ROTARY_BASE = 10_000_000  # 10 x Qwen2.5's 1e6 for 128K-512K contexts (ABF-style, DESIGN.md §4)
DENSE_KERNELS = ("sdpa_cudnn", "sdpa_flash", "triton")
DOCUMENT_DENSE_KERNELS = ("triton",)  # dense kernels with a document mask (the SDPA dense impls have none)
UNPACKED = "none"  # the mixture of unpacked mock data
# packed mixtures: documents end at each EOD, attend within themselves, positions restart, no loss on EOD
PACKED_FLAGS = ("--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss")
# Megatron's local layers without Transformer Engine or Apex fusions (as examples/quickstart.py LOCAL_IMPL_FLAGS)
LOCAL_IMPL_FLAGS = (
    "--transformer-impl",
    "local",
    "--no-gradient-accumulation-fusion",
    "--no-bias-swiglu-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
)
RECOMPUTE_FLAGS = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
KEEP_ATTENTION = "full-keep-attention"
RUN_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # Megatron asserts it for CP on Hopper
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
}  # less fragmentation at 512K
DENSITY_LINE = re.compile(r"mtraining \| iteration +(\d+) \| density ([0-9.]+)")
OOM_LINE = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory")
EXCEPTION_LINE = re.compile(r"^(?:\[\w+\]:\s*)?([\w.]*(?:Error|Exception): .*)$", re.MULTILINE)  # [rank0]: ...
ASSUMED_SPARSE_DENSITY = 0.1  # attention density the --time-budget-s estimate assumes for sparse runs


# ---------------------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class ModelShape:
    """A Qwen2.5 transformer shape (from the HF config); ``vocab`` is the padded output-layer size."""

    name: str
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int = QWEN25_VOCAB
    tied: bool = True

    def flags(self, num_layers: int) -> list[str]:
        """Megatron's model flags of this shape with ``num_layers`` layers."""
        return [
            "--num-layers",
            str(num_layers),
            "--hidden-size",
            str(self.hidden),
            "--ffn-hidden-size",
            str(self.ffn),
            "--num-attention-heads",
            str(self.heads),
            "--group-query-attention",
            "--num-query-groups",
            str(self.kv_heads),
            "--kv-channels",
            str(self.head_dim),
            "--normalization",
            "RMSNorm",
            "--norm-epsilon",
            "1e-6",
            "--swiglu",
            "--disable-bias-linear",
            "--add-qkv-bias",
            "--position-embedding-type",
            "rope",
            "--rotary-percent",
            "1.0",
            "--hidden-dropout",
            "0.0",
            "--attention-dropout",
            "0.0",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            str(self.vocab),
            *([] if self.tied else ["--untie-embeddings-and-output-weights"]),
        ]


QWEN25 = {
    shape.name: shape
    for shape in (
        ModelShape("0.5b", num_layers=24, hidden=896, ffn=4864, heads=14, kv_heads=2, head_dim=64),
        ModelShape("1.5b", num_layers=28, hidden=1536, ffn=8960, heads=12, kv_heads=2, head_dim=128),
        ModelShape("3b", num_layers=36, hidden=2048, ffn=11008, heads=16, kv_heads=2, head_dim=128),
    )
}


@dataclass(frozen=True)
class Variant:
    """An attention variant: the JSON's ``attention`` and ``sparsity_setting``, and its ``--mtraining-*`` flags."""

    key: str
    attention: str
    sparsity_setting: str
    layout: str
    flags: tuple[str, ...]
    dense_kernel: str | None = None

    @property
    def sparse(self) -> bool:
        return self.dense_kernel is None


BUDGETS = {  # sparsity_setting → the launcher's budget flags
    f"top_p={TOP_P}": ("--mtraining-budget", "top-p", "--mtraining-top-p", str(TOP_P)),
    f"sparsity={STATIC_SPARSITY}": ("--mtraining-budget", "static", "--mtraining-sparsity", str(STATIC_SPARSITY)),
}


def sparse_variant(key: str, layout: str, sparsity_setting: str) -> Variant:
    attention = "mtraining" if layout == "striped" else f"mtraining_{layout}"
    flags = ("--mtraining-layout", layout, *BUDGETS[sparsity_setting], "--mtraining-backend", "triton")
    return Variant(key, attention, sparsity_setting, layout, flags)


SPARSE_VARIANTS = {
    variant.key: variant
    for variant in (
        sparse_variant("mtraining", "striped", f"top_p={TOP_P}"),
        sparse_variant("mtraining-static", "striped", f"sparsity={STATIC_SPARSITY}"),
        sparse_variant("mtraining-zigzag", "zigzag", f"top_p={TOP_P}"),
        sparse_variant("mtraining-zigzag-static", "zigzag", f"sparsity={STATIC_SPARSITY}"),
    )
}
VARIANT_KEYS = (*SPARSE_VARIANTS, "dense")


def dense_variant(kernel: str) -> Variant:
    """The dense ring baseline: cuDNN/flash SDPA per ring step over the zigzag layout, or our kernels striped."""
    if kernel not in DENSE_KERNELS:
        raise ValueError(f"--dense-kernel={kernel!r} is unknown; use one of {', '.join(DENSE_KERNELS)}")
    if kernel == "triton":
        layout, kernel_flags = "striped", ("--mtraining-backend", "triton")
    else:
        layout, kernel_flags = "zigzag", ("--mtraining-dense-impl", kernel)
    return Variant(
        "dense", "dense", "dense", layout, ("--mtraining-dense", "--mtraining-layout", layout, *kernel_flags), kernel
    )


def variant_for(key: str, dense_kernel: str) -> Variant:
    if key == "dense":
        return dense_variant(dense_kernel)
    if key not in SPARSE_VARIANTS:
        raise ValueError(f"--variants: {key!r} is unknown; use some of {', '.join(VARIANT_KEYS)}")
    return SPARSE_VARIANTS[key]


@dataclass(frozen=True)
class Config:
    """One benchmarked configuration."""

    model: ModelShape
    seq_len: int
    variant: Variant
    mixture: str = UNPACKED
    document_lengths: tuple[int, ...] = ()  # of every sequence of a packed mixture; () unpacked

    def __post_init__(self) -> None:
        if (self.mixture == UNPACKED) != (not self.document_lengths):
            raise ValueError(f"mixture {self.mixture!r} needs document lengths exactly when it is packed")
        if self.document_lengths and sum(self.document_lengths) != self.seq_len:
            raise ValueError(f"document lengths sum to {sum(self.document_lengths)}, not seq_len={self.seq_len}")

    @property
    def packed(self) -> bool:
        return self.mixture != UNPACKED

    @property
    def mask_area(self) -> float:
        """The dense baseline's attention area over the unpacked causal one: Σ L_d² / N² (1 unpacked)."""
        if not self.packed:
            return 1.0
        from packed_dataset import mask_area

        return mask_area(list(self.document_lengths))

    @property
    def name(self) -> str:
        kernel = f"-{self.variant.dense_kernel}" if self.variant.dense_kernel else ""
        mixture = f"_{self.mixture}" if self.packed else ""
        return f"qwen2.5-{self.model.name}_{self.seq_len // 1024}k{mixture}_{self.variant.key}{kernel}"


@dataclass(frozen=True)
class Schedule:
    """Iteration numbers (1-based) of one run: warm-up, timed, the profiled one, and the density-logging one."""

    warmup: int
    iters: int
    log_density: bool

    @property
    def timed(self) -> range:
        return range(self.warmup + 1, self.warmup + self.iters + 1)

    @property
    def profile_iteration(self) -> int:
        return self.warmup + self.iters + 1

    @property
    def density_iteration(self) -> int | None:
        """The iteration that logs the MTraining metrics (``--mtraining-stats-interval``), after all the others."""
        return self.profile_iteration + 1 if self.log_density else None

    @property
    def train_iters(self) -> int:
        return self.density_iteration or self.profile_iteration


# ---------------------------------------------------------------------------------------- FLOPs
def layer_linear_flops(shape: ModelShape, seq_len: int) -> float:
    """Forward FLOPs of one layer's matrix multiplies over ``seq_len`` tokens: QKV, output projection, SwiGLU MLP."""
    q_width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    qkv = 2 * seq_len * shape.hidden * (q_width + 2 * kv_width)
    out = 2 * seq_len * q_width * shape.hidden
    mlp = 2 * seq_len * shape.hidden * shape.ffn * 3
    return float(qkv + out + mlp)


def layer_attention_flops(shape: ModelShape, seq_len: int, density: float = 1.0, area: float = 1.0) -> float:
    """Forward FLOPs of one layer's causal attention: Q·Kᵀ and P·V (2 x 2·N²·Hq·d) over half the N² area,
    times ``area`` (the mask's area over that, Σ L_d² / N² for packed documents) and ``density`` (the computed
    fraction of the mask)."""
    return density * area * 2.0 * seq_len * seq_len * shape.heads * shape.head_dim


def output_layer_flops(shape: ModelShape, seq_len: int) -> float:
    """Forward FLOPs of the output layer (logits)."""
    return 2.0 * seq_len * shape.hidden * shape.vocab


def iteration_flops(
    shape: ModelShape,
    seq_len: int,
    num_layers: int,
    density: float = 1.0,
    *,
    area: float = 1.0,
    recompute_layers: bool = False,
    recompute_attention: bool = True,
    recompute_output: bool = False,
) -> float:
    """FLOPs of one training iteration of one ``seq_len``-token sequence (all ranks together).

    Forward + backward = 3 x forward. With ``recompute_layers`` (full activation recompute) every layer's
    forward runs once more (without attention's when not ``recompute_attention``: the kept attention
    output), with ``recompute_output`` (chunked loss) the output layer's: hardware FLOPs. Without both:
    model FLOPs, what MFU counts. ``area``: the attention mask's area over the causal one (packed documents).
    """
    attention = layer_attention_flops(shape, seq_len, density, area)
    layer = layer_linear_flops(shape, seq_len) + attention
    output = output_layer_flops(shape, seq_len)
    total = 3 * (num_layers * layer + output)
    if recompute_layers:
        total += num_layers * (layer if recompute_attention else layer - attention)
    if recompute_output:
        total += output
    return total


def throughput(
    shape: ModelShape,
    seq_len: int,
    iter_ms: float,
    density: float,
    gpus: int,
    peak_tflops: float,
    recompute: str,
    loss_chunked: bool,
    area: float = 1.0,
) -> dict:
    """Tokens/s, TFLOP/s per GPU (dense-equivalent, actually computed, hardware) and MFU of one iteration time;
    ``area``: the dense mask's area over the causal one (packed documents)."""
    seconds = iter_ms / 1e3

    def per_gpu_tflops(flops: float) -> float:
        return flops / gpus / seconds / 1e12

    dense = per_gpu_tflops(iteration_flops(shape, seq_len, shape.num_layers, area=area))
    actual = per_gpu_tflops(iteration_flops(shape, seq_len, shape.num_layers, density, area=area))
    hardware = per_gpu_tflops(
        iteration_flops(
            shape,
            seq_len,
            shape.num_layers,
            density,
            area=area,
            recompute_layers=recompute != "none",
            recompute_attention=recompute == "full",
            recompute_output=loss_chunked,
        )
    )
    return {
        "tokens_per_s": seq_len / seconds,
        "tflops_per_gpu_dense_equiv": dense,
        "tflops_per_gpu_actual": actual,
        "tflops_per_gpu_hardware": hardware,
        "mfu_dense_equiv": dense / peak_tflops,
        "mfu_actual": actual / peak_tflops,
    }


# ---------------------------------------------------------------------------------------- commands
def dataset_prefix(config: Config, run_dir: Path) -> Path:
    """The indexed dataset (``.bin``/``.idx`` prefix) of a packed ``config`` under ``run_dir``."""
    return run_dir / "datasets" / f"{config.mixture}_{config.seq_len}_v{config.model.vocab}"


def dataset_sequences(options: argparse.Namespace) -> int:
    """Sequences of each packed dataset: one epoch of every run's iterations (``GPTDataset`` makes one sample
    fewer than there are sequences of N tokens: each sample reads one token past its N)."""
    return Schedule(options.warmup, options.iters, log_density=True).train_iters + 1


def eod_token(vocab: int) -> int:
    """The EOD id of the runs' tokenizer (``--tokenizer-type NullTokenizer --vocab-size vocab``)."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return NullTokenizer(vocab).eod


def data_flags(config: Config, options: argparse.Namespace, run_dir: Path) -> list[str]:
    """Mock data, or a packed mixture's dataset with the document flags."""
    if not config.packed:
        return ["--mock-data"]
    sparse_length = [] if options.min_sparse_length is None else ["--mtraining-min-sparse-length"]
    sparse_length += [str(options.min_sparse_length)] if sparse_length else []
    return [
        "--data-path",
        str(dataset_prefix(config, run_dir)),
        "--split",
        "100,0,0",
        *PACKED_FLAGS,
        *sparse_length,
    ]


def write_datasets(configs: list[Config], options: argparse.Namespace, run_dir: Path) -> None:
    """Write (and read back) the indexed dataset of every packed mixture and length of ``configs``."""
    from packed_dataset import read_document_lengths, write_mixture_dataset

    sequences = dataset_sequences(options)
    for config in {dataset_prefix(c, run_dir): c for c in configs if c.packed}.values():
        prefix, eod = dataset_prefix(config, run_dir), eod_token(config.model.vocab)
        write_mixture_dataset(prefix, list(config.document_lengths), sequences, eod, seed=options.mixture_seed)
        if read_document_lengths(prefix, eod) != [list(config.document_lengths)] * sequences:
            raise SystemExit(f"bench_e2e: {prefix}: the documents read back are not the mixture's")
        print(
            f"# dataset {prefix}: {sequences} sequences of {len(config.document_lengths)} documents "
            f"({config.mixture}, N = {config.seq_len})",
            flush=True,
        )


def launcher_flags(
    config: Config, num_layers: int, schedule: Schedule, options: argparse.Namespace, run_dir: Path | None = None
) -> list[str]:
    """The launcher's flags of one run of ``config`` at ``num_layers`` layers (a packed mixture's dataset under
    ``run_dir``, by default ``--out-dir``/<run>, the placeholder of ``--dry-run``)."""
    seq = str(config.seq_len)
    run_dir = options.out_dir / "<run>" if run_dir is None else run_dir
    return [
        *config.model.flags(num_layers),
        "--rotary-base",
        str(options.rotary_base),
        "--seq-length",
        seq,
        "--max-position-embeddings",
        seq,
        *data_flags(config, options, run_dir),
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--train-iters",
        str(schedule.train_iters),
        "--lr",
        "1e-5",
        "--min-lr",
        "1e-5",
        "--lr-decay-style",
        "constant",
        "--weight-decay",
        "0.1",
        "--clip-grad",
        "1.0",
        "--seed",
        "1234",
        "--bf16",
        "--context-parallel-size",
        str(options.cp),
        "--cp-comm-type",
        "p2p",
        *(RECOMPUTE_FLAGS if options.recompute != "none" else ()),
        *(("--mtraining-keep-attention-output",) if options.recompute == KEEP_ATTENTION else ()),
        *(("--use-distributed-optimizer",) if options.distributed_optimizer else ()),
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--eval-interval",
        "1000000",
        "--distributed-timeout-minutes",
        "30",
        *LOCAL_IMPL_FLAGS,
        "--mtraining-loss-chunk-size",
        str(options.loss_chunk_size),
        "--mtraining-stats-interval",
        str(schedule.density_iteration or 0),
        *config.variant.flags,
    ]


def run_command(flags: list[str], cp: int) -> list[str]:
    """``python -m torch.distributed.run ... tools/train_probe.py <flags>``: one process per CP rank."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp), PROBE, *flags]


def run_environment(probe_dir: Path, schedule: Schedule) -> dict[str, str]:
    """The variables a run adds to the environment: the probe's output folder and profiled iteration, and the
    repository on ``PYTHONPATH`` (the probe runs as a script from ``tools/``)."""
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {
        **RUN_ENV,
        "PYTHONPATH": python_path,
        "MTRAINING_PROBE_DIR": str(probe_dir),
        "MTRAINING_PROBE_PROFILE_ITER": str(schedule.profile_iteration),
    }


def shell_line(command: list[str], env: dict[str, str]) -> str:
    """The run as one shell line, environment first (what ``--dry-run`` prints and the JSON records)."""
    return shlex.join([f"{key}={value}" for key, value in env.items()] + command)


def layer_counts(model: ModelShape, options: argparse.Namespace) -> list[int]:
    """Layer counts to time: the real depth with ``--full-depth``, else ``--layers``."""
    return [model.num_layers] if options.full_depth else sorted(options.layers)


# ---------------------------------------------------------------------------------------- running
def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM to the run's process group (torchrun and its ranks), 30 s to exit, then SIGKILL to what is left."""
    with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def launch(command: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> tuple[int, bool]:
    """Run ``command`` in its own process group from the repository root, output to ``log_path``.

    Returns (exit code, timed out); after ``timeout_s`` seconds the whole group is stopped.
    """
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, env={**os.environ, **env}, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return process.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            stop_process_group(process)
            return process.returncode, True
        finally:
            if process.poll() is None:  # interrupted (Ctrl-C): leave no ranks behind
                stop_process_group(process)


def failure_reason(returncode: int, timed_out: bool, timeout_s: float, log_text: str) -> str:
    """A one-line description of a failed run from its exit status and output."""
    if timed_out:
        return f"timed out after {timeout_s:.0f} s (killed)"
    if OOM_LINE.search(log_text):
        return "CUDA out of memory"
    errors = [
        match.group(1).strip()
        for match in EXCEPTION_LINE.finditer(log_text)
        if "ChildFailedError" not in match.group(1)
    ]  # torchrun's summary names no cause
    detail = f": {errors[0][:300]}" if errors else ""  # the first exception is the cause
    return f"exit code {returncode}{detail}"


def parse_density(log_text: str, iteration: int) -> float:
    """The attention density the launcher logged at ``iteration`` (`` mtraining | iteration N | density D``)."""
    values = [float(density) for number, density in DENSITY_LINE.findall(log_text) if int(number) == iteration]
    if not values:
        raise ValueError(f"no ' mtraining | iteration {iteration} | density' line in the launcher output")
    return values[-1]


def summarize_point(records: dict[int, list[dict]], schedule: Schedule, num_layers: int, density: float) -> dict:
    """One timed layer count from the probe's per-rank records: median time (slowest rank), profile, memory."""
    by_iteration = [{record["iteration"]: record for record in rank_records} for rank_records in records.values()]
    missing = [
        number for number in range(1, schedule.train_iters + 1) if any(number not in rank for rank in by_iteration)
    ]
    if missing:
        raise ValueError(f"the probe has no record of iterations {missing} on some rank")
    timed = [max(rank[number]["iter_ms"] for rank in by_iteration) for number in schedule.timed]
    profiled = [rank[schedule.profile_iteration] for rank in by_iteration]
    kernel_ms = statistics.mean(record["kernel_ms"] for record in profiled)
    attention_ms = statistics.mean(record["attention_kernel_ms"] for record in profiled)
    if kernel_ms <= 0:
        raise ValueError(f"the profiled iteration {schedule.profile_iteration} recorded no kernel time")
    peak_bytes = max(record["max_mem_allocated"] for rank in by_iteration for record in rank.values())
    reserved_bytes = max(record["mem_reserved"] for rank in by_iteration for record in rank.values())
    return {
        "layers": num_layers,
        "iter_ms": statistics.median(timed),
        "iter_ms_timed": timed,
        "kernel_ms": kernel_ms,
        "attention_kernel_ms": attention_ms,
        "attention_share": attention_ms / kernel_ms,
        "density": density,
        "peak_mem_gb": peak_bytes / 1e9,
        "reserved_mem_gb": reserved_bytes / 1e9,
    }


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = intercept + slope·x; needs two distinct x."""
    if len(set(xs)) < 2:
        raise ValueError(f"a line needs two distinct layer counts, got {xs}")
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def extrapolate(points: list[dict], num_layers: int) -> dict:
    """Iteration time and attention share at ``num_layers`` layers from the timed points (one point: as measured).

    Raises ``ValueError`` when the time does not grow with the layer count (a fit that cannot be trusted).
    """
    if len(points) == 1:
        (point,) = points
        if point["layers"] != num_layers:
            raise ValueError(f"one point at {point['layers']} layers cannot be extrapolated to {num_layers}")
        return {"iter_ms": point["iter_ms"], "attention_share": point["attention_share"], "fit": None}
    layers = [point["layers"] for point in points]
    fixed, per_layer = fit_line(layers, [point["iter_ms"] for point in points])
    if per_layer <= 0:
        raise ValueError(
            f"iteration time does not grow with the layer count ({[p['iter_ms'] for p in points]} ms "
            f"at {layers} layers); time more iterations or layer counts further apart"
        )
    kernel_fixed, kernel_per_layer = fit_line(layers, [point["kernel_ms"] for point in points])
    attention_fixed, attention_per_layer = fit_line(layers, [point["attention_kernel_ms"] for point in points])
    share = (attention_fixed + attention_per_layer * num_layers) / (kernel_fixed + kernel_per_layer * num_layers)
    return {
        "iter_ms": fixed + per_layer * num_layers,
        "attention_share": share,
        "fit": {"fixed_ms": fixed, "per_layer_ms": per_layer},
    }


def estimate_run_seconds(config: Config, num_layers: int, schedule: Schedule, options: argparse.Namespace) -> float:
    """A rough estimate of one run's wall time: start-up, plus its iterations at ``--assumed-tflops`` per GPU."""
    density = ASSUMED_SPARSE_DENSITY if config.variant.sparse else 1.0
    flops = iteration_flops(
        config.model,
        config.seq_len,
        num_layers,
        density,
        area=config.mask_area,
        recompute_layers=options.recompute != "none",
        recompute_attention=options.recompute == "full",
        recompute_output=options.loss_chunk_size > 0,
    )
    iteration_s = flops / options.cp / (options.assumed_tflops * 1e12)
    return options.startup_s + schedule.train_iters * iteration_s


def run_point(
    config: Config, num_layers: int, schedule: Schedule, options: argparse.Namespace, run_dir: Path, timeout_s: float
) -> tuple[dict | None, str | None, str]:
    """Train ``config`` at ``num_layers`` layers once; returns (point, None, command) or (None, error, command)."""
    from train_probe import read_records

    probe_dir = run_dir / f"{config.name}_L{num_layers}"
    probe_dir.mkdir(parents=True, exist_ok=False)
    command = run_command(launcher_flags(config, num_layers, schedule, options, run_dir), options.cp)
    env = run_environment(probe_dir, schedule)
    line = shell_line(command, env)
    print(f"# {config.name}, {num_layers} layers: {line}", flush=True)
    log_path = probe_dir / "launcher.log"
    returncode, timed_out = launch(command, env, log_path, timeout_s)
    log_text = log_path.read_text(errors="replace")
    if timed_out or returncode != 0:
        return None, f"{num_layers} layers: {failure_reason(returncode, timed_out, timeout_s, log_text)}", line
    try:
        density = parse_density(log_text, schedule.density_iteration) if schedule.log_density else 1.0
        records = {rank: read_records(probe_dir, rank) for rank in range(options.cp)}
        return summarize_point(records, schedule, num_layers, density), None, line
    except (OSError, KeyError, ValueError) as error:
        return None, f"{num_layers} layers: unreadable results ({error}); see {log_path}", line


# ---------------------------------------------------------------------------------------- rows
def base_row(config: Config, options: argparse.Namespace, meta: dict, layers: list[int], commands: list[str]) -> dict:
    """The fields every row of ``config`` has, measured or failed."""
    return {
        **meta,
        "model": f"qwen2.5-{config.model.name}",
        "seq_len": config.seq_len,
        "mixture": config.mixture,
        "data": "packed" if config.packed else "mock",
        "document_lengths": list(config.document_lengths) if config.packed else None,
        "documents_per_sequence": len(config.document_lengths) if config.packed else 1,
        "mask_area": config.mask_area,
        "mixture_seed": options.mixture_seed if config.packed else None,
        "min_sparse_length": options.min_sparse_length if config.packed else None,
        "tp": 1,
        "cp": options.cp,
        "pp": 1,
        "global_batch": 1,
        "attention": config.variant.attention,
        "sparsity_setting": config.variant.sparsity_setting,
        "layout": config.variant.layout,
        "dense_kernel": config.variant.dense_kernel,
        "num_layers": config.model.num_layers,
        "layers_timed": layers,
        "extrapolated": layers != [config.model.num_layers],
        "recompute": options.recompute,
        "distributed_optimizer": options.distributed_optimizer,
        "rotary_base": options.rotary_base,
        "loss_chunk_size": options.loss_chunk_size,
        "transformer_impl": "local",
        "warmup": options.warmup,
        "iters": options.iters,
        "peak_tflops_per_gpu": options.peak_tflops,
        "command": commands,
    }


def measured_row(
    config: Config, options: argparse.Namespace, meta: dict, points: list[dict], commands: list[str]
) -> dict:
    """The row of a configuration whose every layer count ran (``ValueError`` when it cannot be extrapolated)."""
    result = extrapolate(points, config.model.num_layers)
    densities = [point["density"] for point in points]
    density = statistics.mean(densities)
    deepest = max(points, key=lambda point: point["layers"])
    row = base_row(config, options, meta, [point["layers"] for point in points], commands)
    row.update(
        status="ok",
        iter_ms=result["iter_ms"],
        density=density,
        **throughput(
            config.model,
            config.seq_len,
            result["iter_ms"],
            density,
            options.cp,
            options.peak_tflops,
            options.recompute,
            options.loss_chunk_size > 0,
            config.mask_area,
        ),
        peak_mem_gb=deepest["peak_mem_gb"],
        reserved_mem_gb=deepest["reserved_mem_gb"],
        peak_mem_layers=deepest["layers"],
        attention_share=result["attention_share"],
        fit=result["fit"],
        points=points,
    )
    return row


def failed_row(
    config: Config,
    options: argparse.Namespace,
    meta: dict,
    layers: list[int],
    commands: list[str],
    error: str,
    points: list[dict],
) -> dict:
    """The row of a configuration that failed (OOM, crash, timeout, unusable fit): the error and any measured points."""
    row = base_row(config, options, meta, layers, commands)
    row.update(status="failed", error=error, iter_ms=None, tokens_per_s=None, points=points)
    return row


def measure_config(
    config: Config, options: argparse.Namespace, meta: dict, run_dir: Path, deadline: float | None
) -> dict:
    """Train ``config`` at each layer count (stopping at the first failure) and return its row."""
    layers = layer_counts(config.model, options)
    schedule = Schedule(options.warmup, options.iters, log_density=config.variant.sparse)
    points, commands = [], []
    for num_layers in layers:
        timeout_s = (
            options.run_timeout_s
            if deadline is None
            else max(1.0, min(options.run_timeout_s, deadline - time.monotonic()))
        )
        point, error, command = run_point(config, num_layers, schedule, options, run_dir, timeout_s)
        commands.append(command)
        if error is not None:
            return failed_row(config, options, meta, layers, commands, error, points)
        points.append(point)
    try:
        return measured_row(config, options, meta, points, commands)
    except ValueError as error:
        return failed_row(config, options, meta, layers, commands, str(error), points)


# ---------------------------------------------------------------------------------------- report
def mixture_of(row: dict) -> str:
    """The row's document mixture; rows written before mixtures existed are unpacked."""
    return row.get("mixture", UNPACKED)


def comparison_key(row: dict) -> tuple:
    """Rows compared with each other (speed-up over dense): same GPU, CP, model, length, mixture, recompute and
    method."""
    return row["gpu"], row["cp"], row["model"], row["seq_len"], mixture_of(row), row["recompute"], row["extrapolated"]


def configuration_key(row: dict) -> tuple:
    """One configuration across runs: its comparison key, attention variant, sparsity setting and dense kernel."""
    return (*comparison_key(row), row["attention"], row["sparsity_setting"], row["dense_kernel"])


def latest_rows(rows: list[dict]) -> list[dict]:
    """The last measured row of each (comparison key, attention, sparsity setting, dense kernel), in file order."""
    latest = {}
    for row in rows:
        if row.get("status") == "ok":
            latest[configuration_key(row)] = row
    return list(latest.values())


def dense_baselines(rows: list[dict]) -> dict[tuple, dict]:
    """The fastest (highest tokens/s) measured dense row of each comparison key."""
    baselines: dict[tuple, dict] = {}
    for row in latest_rows(rows):
        key = comparison_key(row)
        if row["attention"] == "dense" and (
            key not in baselines or row["tokens_per_s"] > baselines[key]["tokens_per_s"]
        ):
            baselines[key] = row
    return baselines


def speedup(row: dict, baselines: dict[tuple, dict]) -> float | None:
    """Tokens/s of ``row`` over the fastest dense row of its comparison key (None without one)."""
    baseline = baselines.get(comparison_key(row))
    if row.get("status") != "ok" or baseline is None:
        return None
    return row["tokens_per_s"] / baseline["tokens_per_s"]


def _number(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def format_table(rows: list[dict], baselines: dict[tuple, dict], skipped: list[str] = ()) -> str:
    """A markdown table of ``rows`` (measured and failed), then the skipped configurations."""
    header = (
        "| model | N | mixture | attention | setting | layers timed | iter ms | tokens/s | TFLOP/s/GPU dense-eq | "
        "actual | MFU dense-eq | peak GB (layers) | density | attention share | × dense | status |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in rows:
        setting = row["sparsity_setting"] + (f" ({row['dense_kernel']})" if row["dense_kernel"] else "")
        timed = ",".join(map(str, row["layers_timed"])) + (f"→{row['num_layers']}" if row["extrapolated"] else "")
        ok = row["status"] == "ok"
        memory = f"{row['peak_mem_gb']:.1f} ({row['peak_mem_layers']})" if ok else "–"
        lines.append(
            " ".join(
                [
                    f"| {row['model']} | {row['seq_len'] // 1024}K | {mixture_of(row)} | {row['attention']} |",
                    f"{setting} | {timed} |",
                    f"{_number(row['iter_ms'], '.1f')} | {_number(row['tokens_per_s'], '.0f')} |",
                    f"{_number(row.get('tflops_per_gpu_dense_equiv'), '.1f')} |",
                    f"{_number(row.get('tflops_per_gpu_actual'), '.1f')} |",
                    f"{_number(row.get('mfu_dense_equiv'), '.3f')} | {memory} | {_number(row.get('density'), '.4f')} |",
                    f"{_number(row.get('attention_share'), '.3f')} | {_number(speedup(row, baselines), '.2f')} |",
                    f"{'ok' if ok else 'FAILED: ' + row['error'].replace('|', '/')} |",
                ]
            )
        )
    lines += [f"skipped: {entry}" for entry in skipped]
    return "\n".join(lines)


def speedup_series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{line label: [(N, tokens/s speed-up over the fastest dense row)]}: one line per model, CP, variant, mixture and
    method."""
    baselines = dense_baselines(rows)
    series: dict[str, list[tuple[int, float]]] = {}
    for row in latest_rows(rows):
        value = speedup(row, baselines)
        if row["attention"] == "dense" or value is None:
            continue
        method = ("" if row["extrapolated"] else ", full depth") + (
            "" if row["recompute"] == "full" else f", recompute {row['recompute']}"
        )
        mixture = "" if mixture_of(row) == UNPACKED else f", {mixture_of(row)}"
        label = f"{row['model']} CP {row['cp']} {row['attention']} {row['sparsity_setting']}{mixture}{method}"
        series.setdefault(label, []).append((row["seq_len"], value))
    return {label: sorted(points) for label, points in sorted(series.items())}


def write_plot(rows: list[dict], path: Path) -> None:
    """The speed-up chart (PNG) of ``rows``; raises ``ValueError`` when no row has a dense baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = speedup_series(rows)
    if not series:
        raise ValueError(
            "no measured sparse row has a dense row of the same model, length, GPU and method; nothing to plot"
        )
    figure, axes = plt.subplots(figsize=(7.5, 4.5))
    for label, points in series.items():
        axes.plot([n for n, _ in points], [value for _, value in points], marker="o", label=label)
    lengths = sorted({n for points in series.values() for n, _ in points})
    axes.set_xscale("log", base=2)
    axes.set_xticks(lengths, [f"{n // 1024}K" for n in lengths])
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xlabel("sequence length (tokens)")
    axes.set_ylabel("training tokens/s over the dense baseline")
    gpus = sorted({row["gpu"] for row in rows if row.get("status") == "ok"})
    cps = sorted({row["cp"] for row in rows if row.get("status") == "ok"})
    axes.set_title(f"End-to-end speed-up, CP = {','.join(map(str, cps))}, {', '.join(gpus)}", fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"# chart written to {path}")


def run_to_run(rows: list[dict]) -> str:
    """A markdown table: each configuration measured in two or more runs, its latest run against the one before.

    Per-layer and fixed ms come from the fits (extrapolated rows) and × dense from the dense row of the same
    invocation (same ``date``), where it measured one, so the ratio's drift is visible next to its parts'."""
    runs: dict[tuple, list[dict]] = {}
    for row in rows:
        if row.get("status") == "ok":
            runs.setdefault(configuration_key(row), []).append(row)
    same_invocation = {
        (comparison_key(r), r["date"]): r for r in rows if r.get("status") == "ok" and r["attention"] == "dense"
    }

    def ratio(row: dict) -> float | None:
        dense = same_invocation.get((comparison_key(row), row["date"]))
        return None if dense is None or row["attention"] == "dense" else row["tokens_per_s"] / dense["tokens_per_s"]

    def change(before: float | None, now: float | None, spec: str) -> str:
        text = f"{_number(before, spec)} → {_number(now, spec)}"
        return text if before is None or now is None else f"{text} ({100 * (now / before - 1):+.1f} %)"

    lines = [
        "| model | N | mixture | attention | setting | recompute | runs (before → now) | per layer ms | fixed ms | "
        "tokens/s | × dense (same run) |",
        "|" + "---|" * 11,
    ]
    for key, measured in runs.items():
        if len(measured) < 2:
            continue
        before, now = measured[-2], measured[-1]
        fits = [r.get("fit") or {} for r in (before, now)]
        lines.append(
            " | ".join(
                [
                    f"| {now['model']}",
                    f"{now['seq_len'] // 1024}K",
                    mixture_of(now),
                    now["attention"],
                    now["sparsity_setting"],
                    now["recompute"],
                    f"{before['commit']} {before['date'][:16]} → {now['commit']} {now['date'][:16]}",
                    change(fits[0].get("per_layer_ms"), fits[1].get("per_layer_ms"), ".0f"),
                    change(fits[0].get("fixed_ms"), fits[1].get("fixed_ms"), ".0f"),
                    change(before["tokens_per_s"], now["tokens_per_s"], ",.0f"),
                    change(ratio(before), ratio(now), ".2f") + " |",
                ]
            )
        )
    return "\n".join(lines)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def append_jsonl(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as file:
        file.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------------------------------- main
def gpu_name(cp: int) -> str:
    """The name of GPU 0, asked in a child process (this one never initialises CUDA); needs ``cp`` GPUs."""
    probe = "import torch; n = torch.cuda.device_count(); print(n, torch.cuda.get_device_name(0) if n else '')"
    count, _, name = (
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
        .stdout.strip()
        .partition(" ")
    )
    if int(count) < cp:
        raise SystemExit(f"bench_e2e: --cp {cp} needs {cp} GPUs, this machine has {count}")
    return name


def _int_list(text: str) -> list[int]:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _name_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--models", type=_name_list, default=list(QWEN25), help=f"of {', '.join(QWEN25)}")
    parser.add_argument("--seq-lens", type=_int_list, default=[131072, 262144, 524288])
    parser.add_argument("--variants", type=_name_list, default=list(VARIANT_KEYS), help=f"of {', '.join(VARIANT_KEYS)}")
    parser.add_argument(
        "--dense-kernel",
        choices=DENSE_KERNELS,
        default=None,
        help="dense baseline kernel: SDPA cuDNN/flash (zigzag layout) or our Triton kernels (striped); default "
        "sdpa_cudnn unpacked, triton (the dense kernel with a document mask) for packed mixtures",
    )
    parser.add_argument(
        "--mixtures",
        type=_name_list,
        default=[UNPACKED],
        help=f"document mixtures: {UNPACKED} (unpacked mock data) and those of tools/document_mixtures.py "
        "(prolong, uniform4k, single), trained on packed datasets with per-document masks",
    )
    parser.add_argument("--mixture-seed", type=int, default=0, help="seed of the mixtures' document lengths")
    parser.add_argument(
        "--min-sparse-length",
        type=int,
        default=None,
        help="--mtraining-min-sparse-length of packed runs (default: the launcher's)",
    )
    parser.add_argument("--cp", type=int, default=2, help="context-parallel size = GPUs (1: one GPU, no ring)")
    parser.add_argument("--layers", type=_int_list, default=[2, 4], help="layer counts to time and extrapolate from")
    parser.add_argument("--full-depth", action="store_true", help="time the real layer count instead (memory fit)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per run")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per run (median)")
    parser.add_argument(
        "--recompute",
        choices=("full", KEEP_ATTENTION, "none"),
        default="full",
        help="full: --recompute-granularity full --recompute-method uniform --recompute-num-layers 1; "
        f"{KEEP_ATTENTION}: that plus --mtraining-keep-attention-output (the recomputation "
        "skips attention)",
    )
    parser.add_argument(
        "--distributed-optimizer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--use-distributed-optimizer: optimizer state sharded over the CP ranks (3B at 512K "
        "does not fit 2 H200s without it)",
    )
    parser.add_argument("--rotary-base", type=int, default=ROTARY_BASE)
    parser.add_argument("--loss-chunk-size", type=int, default=LOSS_CHUNK_SIZE, help="--mtraining-loss-chunk-size")
    parser.add_argument(
        "--peak-tflops", type=float, default=H200_BF16_PEAK_TFLOPS, help="GPU dense bf16 peak for MFU (H200: 989)"
    )
    parser.add_argument("--run-timeout-s", type=float, default=600, help="each run is killed after this long")
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="skip configurations whose estimated time exceeds what is left of this budget",
    )
    parser.add_argument(
        "--startup-s", type=float, default=45, help="estimated launcher start-up per run (budget; about 40 s on 2 H200)"
    )
    parser.add_argument(
        "--assumed-tflops",
        type=float,
        default=300,
        help="hardware TFLOP/s per GPU assumed by the run-time estimate (budget)",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/bench_e2e"), help="logs and probe records")
    parser.add_argument("--jsonl", type=Path, default=DEFAULT_JSONL)
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT)
    parser.add_argument("--commit", default=None, help="recorded commit (default: git rev-parse --short HEAD)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the commands and estimates, run nothing")
    mode.add_argument("--plot-only", action="store_true", help="table and chart from --jsonl, run nothing")
    mode.add_argument(
        "--compare-runs",
        action="store_true",
        help="run nothing: each configuration measured more than once in --jsonl, latest vs previous",
    )
    options = parser.parse_args(argv)
    _check_options(parser, options)
    return options


def _check_options(parser: argparse.ArgumentParser, options: argparse.Namespace) -> None:
    for name in ("models", "seq_lens", "variants", "layers", "mixtures"):
        values = getattr(options, name)
        if len(set(values)) != len(values):
            parser.error(f"--{name.replace('_', '-')} {values} lists a value twice")
    unknown = [name for name in options.models if name not in QWEN25]
    if unknown:
        parser.error(f"--models: {unknown} unknown; use some of {', '.join(QWEN25)}")
    unknown = [key for key in options.variants if key not in VARIANT_KEYS]
    if unknown:
        parser.error(f"--variants: {unknown} unknown; use some of {', '.join(VARIANT_KEYS)}")
    from packed_dataset import mixture_names

    unknown = [name for name in options.mixtures if name not in mixture_names()]
    if unknown:
        parser.error(f"--mixtures: {unknown} unknown; use some of {', '.join(mixture_names())}")
    packed = [name for name in options.mixtures if name != UNPACKED]
    if packed and options.dense_kernel not in (None, *DOCUMENT_DENSE_KERNELS) and "dense" in options.variants:
        parser.error(
            f"--dense-kernel {options.dense_kernel} has no document mask, so it cannot be the dense baseline of "
            f"--mixtures {','.join(packed)}; use --dense-kernel {' or '.join(DOCUMENT_DENSE_KERNELS)} (or leave it out)"
        )
    if options.min_sparse_length is not None and options.min_sparse_length < 1:
        parser.error(f"--min-sparse-length={options.min_sparse_length} must be >= 1")
    for name in ("warmup", "iters", "cp"):
        if getattr(options, name) < 1:
            parser.error(f"--{name}={getattr(options, name)} must be >= 1")
    if not options.full_depth and (len(set(options.layers)) < 2 or min(options.layers) < 1):
        parser.error(f"--layers {options.layers}: give at least two distinct layer counts >= 1 (or --full-depth)")
    too_deep = [name for name in options.models if max(options.layers) > QWEN25[name].num_layers]
    if not options.full_depth and too_deep:
        parser.error(f"--layers {options.layers} exceed the depth of {too_deep}; use smaller counts")
    if any(n < 1 for n in options.seq_lens) or not options.seq_lens:
        parser.error(f"--seq-lens {options.seq_lens} must be positive token counts")
    for name in ("run_timeout_s", "peak_tflops", "assumed_tflops"):
        if getattr(options, name) <= 0:
            parser.error(f"--{name.replace('_', '-')}={getattr(options, name)} must be > 0")


def dense_kernel_for(mixture: str, options: argparse.Namespace) -> str:
    """``--dense-kernel``, or its default: cuDNN SDPA unpacked, our Triton kernels (document mask) packed."""
    if options.dense_kernel is not None:
        return options.dense_kernel
    return "sdpa_cudnn" if mixture == UNPACKED else DOCUMENT_DENSE_KERNELS[0]


def configurations(options: argparse.Namespace) -> list[Config]:
    """The matrix in run order: sequence lengths outermost, then models, then mixtures, then variants."""
    from packed_dataset import mixture_lengths

    def lengths(mixture: str, seq_len: int) -> tuple[int, ...]:
        return () if mixture == UNPACKED else tuple(mixture_lengths(mixture, seq_len, options.mixture_seed))

    return [
        Config(QWEN25[model], seq_len, variant_for(key, dense_kernel_for(mixture, options)), mixture, documents)
        for seq_len in options.seq_lens
        for model in options.models
        for mixture in options.mixtures
        for documents in [lengths(mixture, seq_len)]
        for key in options.variants
    ]


def config_estimate_s(config: Config, options: argparse.Namespace) -> float:
    """Estimated wall time of all the runs of ``config``."""
    schedule = Schedule(options.warmup, options.iters, log_density=config.variant.sparse)
    return sum(
        estimate_run_seconds(config, layers, schedule, options) for layers in layer_counts(config.model, options)
    )


def dry_run(options: argparse.Namespace) -> None:
    """Print every packed dataset, then every run's shell line with its estimated time."""
    total = 0.0
    configs = configurations(options)
    for config in {dataset_prefix(c, options.out_dir / "<run>"): c for c in configs if c.packed}.values():
        print(
            f"# dataset {dataset_prefix(config, options.out_dir / '<run>')}: {dataset_sequences(options)} sequences, "
            f"documents {list(config.document_lengths)}"
        )
    for config in configs:
        schedule = Schedule(options.warmup, options.iters, log_density=config.variant.sparse)
        for layers in layer_counts(config.model, options):
            probe_dir = options.out_dir / "<run>" / f"{config.name}_L{layers}"
            estimate = estimate_run_seconds(config, layers, schedule, options)
            total += estimate
            print(f"# {config.name}, {layers} layers, estimated {estimate:.0f} s")
            print(
                shell_line(
                    run_command(launcher_flags(config, layers, schedule, options), options.cp),
                    run_environment(probe_dir, schedule),
                )
            )
    print(f"# estimated total {total:.0f} s")


def run_matrix(options: argparse.Namespace) -> None:
    """Measure every configuration (appending each row to the JSONL), print the table, redraw the chart."""
    started = time.monotonic()
    deadline = None if options.time_budget_s is None else started + options.time_budget_s
    meta = {
        "gpu": gpu_name(options.cp),
        "commit": options.commit or git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": importlib.metadata.version("torch"),
    }
    run_dir = options.out_dir / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    configs = configurations(options)
    write_datasets(configs, options, run_dir)
    rows, skipped = [], []
    for config in configs:
        estimate = config_estimate_s(config, options)
        if deadline is not None and estimate > deadline - time.monotonic():
            skipped.append(
                f"{config.name}: estimated {estimate:.0f} s, {deadline - time.monotonic():.0f} s of the "
                "time budget left"
            )
            print(f"# skipped {skipped[-1]}", flush=True)
            continue
        row = measure_config(config, options, meta, run_dir, deadline)
        append_jsonl(options.jsonl, row)
        rows.append(row)
        print(
            f"# {config.name}: "
            + (
                f"{row['iter_ms']:.1f} ms/iteration, {row['tokens_per_s']:.0f} tokens/s"
                if row["status"] == "ok"
                else f"FAILED: {row['error']}"
            ),
            flush=True,
        )
    everything = read_jsonl(options.jsonl)
    print(format_table(rows, dense_baselines(everything), skipped))
    if speedup_series(everything):
        write_plot(everything, options.plot)


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    if options.dry_run:
        dry_run(options)
    elif options.compare_runs:
        print(run_to_run(read_jsonl(options.jsonl)))
    elif options.plot_only:
        rows = read_jsonl(options.jsonl)
        print(format_table(rows, dense_baselines(rows)))
        try:
            write_plot(rows, options.plot)
        except ValueError as error:
            raise SystemExit(f"bench_e2e: {options.jsonl}: {error}") from None
    else:
        run_matrix(options)


if __name__ == "__main__":
    main()
