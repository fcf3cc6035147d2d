"""A/B of kernel trees: the Triton sparse attention of each tree, each in its own process, on the same inputs.

A *tree* is a folder holding an ``mtraining_kernels`` package: ``kernels`` (the checkout's), or another revision's,
extracted beside it (``git archive <rev> kernels | tar -x -C .ab/<name>`` gives ``.ab/<name>/kernels``; ``.ab/`` is
ignored by git, so the device tool can carry it). Each tree runs in a fresh process with its folder first on
``PYTHONPATH``, so two revisions of the same modules never share a process or Triton's in-memory caches.

For every N and tree, on one seed's inputs (Qwen2.5-3B shape by default, bf16, batch 1), the ``--patterns`` of
``bench_attention.py``: ``vertical_slash`` (its fixed-budget pattern at ``--sparsity``) and ``block_only`` (a
block-only pattern of the same mask area, ``flex_peer.block_only_pattern``). Per row:

* ``fwd_ms``/``bwd_ms`` — medians of the forward and backward, CUDA events recorded as the host launches;
  ``fwd_queued_ms``/``bwd_queued_ms`` (N ≤ ``bench_attention.QUEUED_MAX_LEN``) behind a sleep kernel, the GPU's time;
* ``host_fwd_ms``/``host_bwd_ms`` (N ≤ ``HOST_MAX_LEN``) — the host's time per call (``perf_counter``) while
  the GPU sleeps, so no call waits for it;
* ``sm_clock_mhz`` (median), ``sm_clock_min_mhz``, ``power_max_w``, ``temperature_max_c`` — the GPU's state while
  those were timed (``gpu_telemetry.py``), which tells a change in the code from one in the clocks;
* ``rel_max_diff_vs_first`` (N ≤ ``QUEUED_MAX_LEN``) — the largest of max |Δ| / max |first| over out, dq, dk,
  dv against the first tree's results on the same inputs.

``--rounds R`` runs the trees in turn R times (A B A B …): clocks drift within a run, so a tree compared with
another should be timed beside it. ``--profile`` prints each tree's CUDA time per kernel of one forward and
backward at the largest N, on the first of ``--patterns``. Rows are appended to ``--jsonl``.
Example: ``python tools/kernel_ab.py --trees base=.ab/base/kernels new=kernels --seq-lens 32768 131072 524288``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
from bench_attention import (
    QUEUED_MAX_LEN,
    SHAPES,
    budget_pattern,
    fwd_bwd_timings,
    measure,
    sleep_cycles_per_ms,
)
from flex_peer import block_only_pattern
from gpu_telemetry import Telemetry
from provenance import git_commit

import mtraining_kernels
from mtraining_kernels import Layout, convert_index, sparse_attention
from mtraining_kernels.vertical_slash import mask_area

TOOLS = Path(__file__).resolve().parent
HOST_MAX_LEN = 32768  # host time per call is measured up to this N; beyond, the GPU's time dwarfs it
HOST_REPS = 7
HOST_LEAD_MS = 50.0  # the GPU sleeps this long while the host launches one timed call
PATTERNS = ("vertical_slash", "block_only")


def parse_trees(specs: list[str]) -> dict[str, Path]:
    """``name=folder`` pairs, in order; each folder must hold ``mtraining_kernels/__init__.py``."""
    trees = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise SystemExit(f"--trees {spec!r}: give each tree as NAME=FOLDER, e.g. base=.ab/base/kernels")
        if name in trees:
            raise SystemExit(f"--trees: the name {name!r} is given twice; give each tree its own name")
        path = Path(folder).resolve()
        if not (path / "mtraining_kernels" / "__init__.py").is_file():
            raise SystemExit(
                f"--trees {spec!r}: {path} holds no mtraining_kernels package; point at the folder that contains it "
                "(for a revision: git archive <rev> kernels | tar -x -C .ab/<name>, then .ab/<name>/kernels)"
            )
        trees[name] = path
    if len(trees) < 2:
        raise SystemExit(f"--trees: {len(trees)} tree given; an A/B needs at least two")
    return trees


def relative_max_difference(results: list[torch.Tensor], first: list[torch.Tensor]) -> float:
    """max over tensors of max |result − first| / max |first| (fp32; ``first`` moved to each result's device)."""
    worst = 0.0
    for result, reference in zip(results, first, strict=True):
        reference = reference.to(result.device).float()
        worst = max(worst, float((result.float() - reference).abs().max() / reference.abs().max()))
    return worst


def host_times(forward, backward) -> tuple[float, float]:
    """Median host milliseconds of ``forward()`` and ``backward(out)``, each launched while the GPU sleeps."""
    forward_ms, backward_ms = [], []
    for _ in range(HOST_REPS):
        torch.cuda._sleep(int(HOST_LEAD_MS * sleep_cycles_per_ms()))
        start = time.perf_counter()
        out = forward()
        middle = time.perf_counter()
        backward(out)
        end = time.perf_counter()
        torch.cuda.synchronize()
        forward_ms.append((middle - start) * 1e3)
        backward_ms.append((end - middle) * 1e3)
    return statistics.median(forward_ms), statistics.median(backward_ms)


def run_tree(args) -> None:
    """Time this process's tree (the ``mtraining_kernels`` first on ``PYTHONPATH``) and append its rows."""
    loaded = Path(mtraining_kernels.__file__).resolve().parent.parent
    if loaded != Path(args.tree_path).resolve():
        raise SystemExit(f"tree {args.tree!r}: mtraining_kernels was imported from {loaded}, not {args.tree_path}")
    if not torch.cuda.is_available():
        raise SystemExit(f"tree {args.tree!r} (mtraining_kernels from {loaded}): kernel_ab.py needs a CUDA device")
    heads, kv_heads, dim = SHAPES[args.shape]
    device = torch.device("cuda")
    common = dict(
        tree=args.tree,
        kernels=str(args.tree_path),
        round=args.round,
        shape=args.shape,
        heads_q=heads,
        heads_kv=kv_heads,
        head_dim=dim,
        dtype="bf16",
        batch=1,
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        commit=git_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        experiment=args.experiment,
    )
    for seq_len in args.seq_lens:
        torch.cuda.empty_cache()
        generator = torch.Generator().manual_seed(args.seed)
        q, k, v, dout = (
            torch.randn(1, seq_len, h, dim, generator=generator).to(device, torch.bfloat16)
            for h in (heads, kv_heads, kv_heads, heads)
        )
        for t in (q, k, v):
            t.requires_grad_()
        v_idx, s_idx, _ = budget_pattern(1, heads, seq_len, args.sparsity, device, generator)
        patterns = {  # built when asked for
            "vertical_slash": lambda: (v_idx, s_idx),
            "block_only": lambda: block_only_pattern(
                mask_area(v_idx, s_idx, seq_len), seq_len, torch.Generator().manual_seed(args.seed)
            ),
        }

        def backward(out):
            return torch.autograd.grad(out, (q, k, v), dout)

        forwards = {}
        for pattern in args.patterns:
            index = convert_index(*patterns[pattern](), Layout("contiguous", 1), 0, seq_len)
            forwards[pattern] = forward = functools.partial(sparse_attention, q, k, v, index, backend="triton")
            torch.cuda.reset_peak_memory_stats()
            row = dict(common, pattern=pattern, seq_len=seq_len, sparsity=args.sparsity)
            with Telemetry() as telemetry:
                row.update(
                    fwd_bwd_timings(lambda lead: measure(forward, backward, args.warmup, args.reps, lead), seq_len)
                )
            row.update(telemetry.summary)
            if telemetry.note:
                print(f"{args.tree} N={seq_len} {pattern}: {telemetry.note}", flush=True)
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if seq_len <= HOST_MAX_LEN:
                row["host_fwd_ms"], row["host_bwd_ms"] = host_times(forward, backward)
            if seq_len <= QUEUED_MAX_LEN:
                out = forward()
                results = [out.detach(), *backward(out)]
                first = Path(args.results) / f"{pattern}_{seq_len}.pt"
                if first.exists():
                    row["rel_max_diff_vs_first"] = relative_max_difference(results, torch.load(first))
                else:
                    torch.save([r.cpu() for r in results], first)
                del out, results
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps({key: row.get(key) for key in SUMMARY}), flush=True)
        if args.profile and seq_len == max(args.seq_lens):
            pattern = args.patterns[0]
            profile(lambda: backward(forwards[pattern]()), f"{args.tree}, {pattern}, N={seq_len}")


SUMMARY = (
    "tree",
    "round",
    "pattern",
    "seq_len",
    "fwd_ms",
    "bwd_ms",
    "fwd_queued_ms",
    "bwd_queued_ms",
    "host_bwd_ms",
    "sm_clock_mhz",
)


def profile(step, title: str) -> None:
    """Print the CUDA time per kernel of one call of ``step`` (after a warm-up call)."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(f"--- {title}: CUDA time per kernel")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", required=True, help="NAME=FOLDER pairs, the first the reference")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 131072, 524288])
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    parser.add_argument("--shape", default="qwen2.5-3b", choices=list(SHAPES))
    parser.add_argument("--sparsity", type=float, default=0.95)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--experiment", default="", help="what the trees are, recorded in every row")
    parser.add_argument("--jsonl", default="docs/benchmarks/kernel_ab.jsonl")
    for internal in ("--tree", "--tree-path", "--results"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tree:  # one tree's process, started below
        run_tree(args)
        return
    trees = parse_trees(args.trees)
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: give at least 1")
    if not torch.cuda.is_available():
        raise SystemExit("kernel_ab.py needs a CUDA device")
    forwarded = list(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as results:
        for round_ in range(args.rounds):
            for name, path in trees.items():
                search = [str(path), str(TOOLS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(search))
                command = [sys.executable, __file__, *forwarded, "--tree", name, "--tree-path", str(path)]
                command += ["--results", results, "--round", str(round_)]
                subprocess.run(command, env=env, check=True)


if __name__ == "__main__":
    main()
