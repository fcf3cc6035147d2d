"""The launcher on 2 GPUs: CP/TP/PP with sparse and dense attention, bitwise-deterministic
training, checkpoint resume, and flat memory over a long run.

Each case runs ``torchrun tools/train_probe.py <launcher flags>`` (the launcher with a per-iteration record
of the loss, grad norm, a hash of the gradients and CUDA memory; see ``tools/train_probe.py``) on the tiny
Qwen2-shaped model of ``examples/quickstart.py`` with Megatron's mock data.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tool_modules import load_tool

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]

ITERATIONS = 20
RUN_TIMEOUT_S = 420
DENSITY_LINE = re.compile(r"mtraining \| iteration +(\d+) \| density ([0-9.]+)")


def _model_flags(context_parallel: int) -> list[str]:
    from quickstart import GPU_FLAGS, TINY_QWEN2

    flags = list(TINY_QWEN2)
    flags[flags.index("--context-parallel-size") + 1] = str(context_parallel)
    return [*flags, *GPU_FLAGS]


def launch(out_dir: Path, flags: list[str], extra_env: dict[str, str] | None = None) -> tuple[dict, str]:
    """Run the probe on 2 GPUs; returns ({rank: records}, output). Fails the test with the output's tail."""
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(REPO / "tools" / "train_probe.py"),
        *flags,
    ]
    env = dict(
        os.environ,
        CUDA_DEVICE_MAX_CONNECTIONS="1",
        MTRAINING_PROBE_DIR=str(out_dir),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        **(extra_env or {}),
    )
    done = subprocess.run(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT_S
    )
    assert done.returncode == 0, f"launcher failed ({done.returncode}):\n{' '.join(command)}\n{done.stdout[-6000:]}"
    read_records = load_tool("train_probe").read_records

    return {rank: read_records(out_dir, rank) for rank in (0, 1)}, done.stdout


def _losses(records: dict) -> list[float]:
    """The per-iteration losses of the rank that has them (the last pipeline stage)."""
    with_loss = [r for r in records.values() if r and r[0]["loss"] is not None]
    assert with_loss, "no rank recorded a loss"
    return [record["loss"] for record in with_loss[-1]]


def _densities(output: str) -> list[float]:
    return [float(match.group(2)) for match in DENSITY_LINE.finditer(output)]


# Megatron's local (torch) norms refuse sequence parallelism: TP runs with it only under Transformer Engine
SEQUENCE_PARALLEL = ["--sequence-parallel"] if importlib.util.find_spec("transformer_engine") else []
PARALLEL = {  # name: (CP size, other flags) on 2 GPUs
    "cp2": (2, []),
    "tp2": (1, ["--tensor-model-parallel-size", "2", *SEQUENCE_PARALLEL]),
    "pp2": (1, ["--pipeline-model-parallel-size", "2"]),
}


@pytest.mark.parametrize("attention", ["sparse", "dense"])
@pytest.mark.parametrize("parallel", sorted(PARALLEL))
def test_launcher_trains_with_each_parallelism(tmp_path, parallel, attention):
    context_parallel, parallel_flags = PARALLEL[parallel]
    flags = [*_model_flags(context_parallel), *parallel_flags, "--train-iters", str(ITERATIONS)]
    if attention == "dense":
        flags.append("--mtraining-dense")
    records, output = launch(tmp_path / "run", flags)
    losses = _losses(records)
    print(f"{parallel} {attention}: losses {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert len(losses) == ITERATIONS and all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, f"loss did not fall: {losses}"
    densities = _densities(output)
    assert len(densities) == ITERATIONS, f"expected one metrics line per iteration, got {len(densities)}"
    if attention == "dense":
        assert all(d == 1.0 for d in densities), densities
    else:
        assert all(0.0 < d < 0.9 for d in densities), f"sparse run is not sparse: {densities}"


def _identical(a: dict, b: dict, iterations: range, fields=("loss_hex", "grad_norm_hex", "grad_sha256")) -> list[str]:
    """The (rank, iteration, field) triples where two runs' records differ."""
    diffs = []
    for rank in (0, 1):
        by_iteration_a = {r["iteration"]: r for r in a[rank]}
        by_iteration_b = {r["iteration"]: r for r in b[rank]}
        for iteration in iterations:
            for field in fields:
                if by_iteration_a[iteration][field] != by_iteration_b[iteration][field]:
                    diffs.append(
                        f"rank {rank} iteration {iteration} {field}: {by_iteration_a[iteration][field]} "
                        f"!= {by_iteration_b[iteration][field]}"
                    )
    return diffs


def test_deterministic_runs_and_resume_are_bitwise_identical(tmp_path):
    """CP = 2 sparse with --deterministic-mode: two runs agree bitwise (losses, grad norms, gradients on both
    ranks), and a run resumed from the iteration-10 ``torch_dist`` checkpoint repeats iterations 11-20 bitwise."""
    checkpoint = tmp_path / "checkpoint"
    flags = [*_model_flags(2), "--deterministic-mode", "--train-iters", str(ITERATIONS), "--ckpt-format", "torch_dist"]
    hash_grads = {"MTRAINING_PROBE_HASH_GRADS": "1"}
    first, _ = launch(tmp_path / "first", [*flags, "--save", str(checkpoint), "--save-interval", "10"], hash_grads)
    second, _ = launch(tmp_path / "second", flags, hash_grads)
    resumed, output = launch(tmp_path / "resumed", [*flags, "--load", str(checkpoint), "--ckpt-step", "10"], hash_grads)
    assert [r["iteration"] for r in resumed[0]] == list(range(11, ITERATIONS + 1)), output[-3000:]
    assert not _identical(first, second, range(1, ITERATIONS + 1))
    assert not _identical(first, resumed, range(11, ITERATIONS + 1))
    assert _losses(first)[-1] < _losses(first)[0]


@pytest.mark.parametrize("pipeline", [1, 2], ids=["cp2", "pp2"])
def test_kept_attention_output_trains_bitwise_like_the_plain_recomputation(tmp_path, pipeline):
    """Full recomputation with and without --mtraining-keep-attention-output, --deterministic-mode: the same
    losses, grad norms and gradients bitwise (CP = 2 sparse over the ring; PP = 2 with 1F1B's several
    micro-batches in flight, which the per-layer FIFO must replay in order)."""
    parallel = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"] if pipeline == 2 else []
    flags = [
        *_model_flags(1 if pipeline == 2 else 2),
        *parallel,
        "--deterministic-mode",
        "--train-iters",
        "6",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ]
    hash_grads = {"MTRAINING_PROBE_HASH_GRADS": "1"}
    plain, _ = launch(tmp_path / "plain", flags, hash_grads)
    kept, _ = launch(tmp_path / "kept", [*flags, "--mtraining-keep-attention-output"], hash_grads)
    assert not _identical(plain, kept, range(1, 7))


def test_long_run_memory_is_flat(tmp_path):
    """200 iterations at 16K tokens (CP = 2, sparse): the memory held between iterations does not grow
    (iterations 101-200 never hold more than 11-100 did)."""
    flags = _model_flags(2)
    for name, value in (("--seq-length", "16384"), ("--max-position-embeddings", "16384"), ("--log-interval", "50")):
        flags[flags.index(name) + 1] = value
    records, _ = launch(tmp_path / "long", [*flags, "--train-iters", "200", "--mtraining-stats-interval", "50"])
    for rank, rank_records in records.items():
        assert len(rank_records) == 200
        early, late = rank_records[10:100], rank_records[100:]
        summary = {
            name: (max(r[key] for r in early), max(r[key] for r in late))
            for name, key in (("allocated", "mem_allocated"), ("reserved", "mem_reserved"))
        }
        medians = [sorted(r["iter_ms"] for r in part)[len(part) // 2] for part in (early, late)]
        print(
            f"rank {rank}: max allocated {summary['allocated']} B, max reserved {summary['reserved']} B, "
            f"median iteration {medians[0]:.1f} ms (11-100) vs {medians[1]:.1f} ms (101-200)"
        )
        for name, (before, after) in summary.items():
            assert after <= before, f"rank {rank}: {name} memory grew from {before} B to {after} B"
