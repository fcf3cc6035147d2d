"""A/B of kernel trees: the Triton sparse attention of each tree, each in its own process, on the same inputs.

A *tree* is a folder holding an ``mtraining_kernels`` package: ``kernels`` (the checkout's), or another revision's,
extracted beside it (``git archive <rev> kernels | tar -x -C .ab/<name>`` gives ``.ab/<name>/kernels``; ``.ab/`` is
ignored by git, so the device tool can carry it). Each tree runs in a fresh process with its folder first on
``PYTHONPATH``, so two revisions of the same modules never share a process or Triton's in-memory caches.

For every N and tree, on one seed's inputs (Qwen2.5-3B shape by default, bf16, batch 1), the ``--patterns`` of
``bench_attention.py``: ``vertical_slash`` (its fixed-budget pattern at ``--sparsity``) and ``block_only`` (a
block-only pattern of the same mask area, ``flex_peer.block_only_pattern``), and on request ``block_band`` (the same
area as consecutive block distances, ``flex_peer.block_band_pattern``: the same work with the best L2 locality) and
``dense`` (every causal block: the kernels' dense mode).
Per row:

* ``fwd_ms``/``bwd_ms`` — medians of the forward and backward, CUDA events recorded as the host launches;
  ``fwd_queued_ms``/``bwd_queued_ms`` (N ≤ ``bench_attention.QUEUED_MAX_LEN``) behind a sleep kernel, the GPU's time;
* ``host_fwd_ms``/``host_bwd_ms`` (N ≤ ``HOST_MAX_LEN``) — the host's time per call (``perf_counter``) while
  the GPU sleeps, so no call waits for it;
* ``sm_clock_mhz`` (median) and ``power_max_w`` while the launched timing ran, ``sm_clock_queued_mhz`` and
  ``power_max_queued_w`` while the queued one did (``bench_attention.fwd_bwd_timings``), ``sm_clock_min_mhz`` and
  ``temperature_max_c`` over both (``gpu_telemetry.py``): the GPU's state, which tells a change in the code from one
  in the clocks;
* ``rel_max_diff_vs_first`` (N ≤ ``QUEUED_MAX_LEN``) — the largest of max |Δ| / max |first| over out, dq, dk,
  dv against the first tree's results on the same inputs.

``--deterministic`` times every tree's deterministic mode instead of its default one (rows carry
``deterministic``). ``--rounds R`` runs the trees in turn R times (A B A B …): clocks drift within a run, so a
tree compared with another should be timed beside it. A tree whose process fails, or outlasts ``--tree-timeout``
seconds (a kernel that hangs), is reported and skipped and the others go on; the run then ends with an error naming
it. The first tree is the reference: if it fails, the A/B stops. ``--profile`` prints each tree's CUDA time per
kernel of one forward and backward at the largest N, on the first of ``--patterns``. Rows are appended to ``--jsonl``.
This driver imports no kernels: each tree's process runs ``kernel_ab_tree.py`` with the tree first on
``PYTHONPATH``. Example: ``python tools/kernel_ab.py --trees base=.ab/base/kernels new=kernels --seq-lens 32768
131072 524288``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

TOOLS = Path(__file__).resolve().parent
PATTERNS = ("vertical_slash", "block_only", "block_band", "dense")
SHAPE_NAMES = ("qwen2.5-3b", "mha")  # bench_attention.SHAPES, whose module imports the kernels


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


def build_parser() -> argparse.ArgumentParser:
    """The options shared by the driver and each tree's process (``kernel_ab_tree.py``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", required=True, help="NAME=FOLDER pairs, the first the reference")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 131072, 524288])
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS[:2]), choices=PATTERNS)
    parser.add_argument("--shape", default=SHAPE_NAMES[0], choices=SHAPE_NAMES)
    parser.add_argument("--sparsity", type=float, default=0.95)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--deterministic", action="store_true", help="time deterministic=True in every tree")
    parser.add_argument("--experiment", default="", help="what the trees are, recorded in every row")
    parser.add_argument(
        "--tree-timeout", type=float, default=None, help="seconds a tree's process may take per round (default: none)"
    )
    parser.add_argument("--jsonl", default="docs/benchmarks/kernel_ab.jsonl")
    return parser


def run_tree_process(command: list[str], env: dict, timeout: float | None) -> str | None:
    """Run one tree's process: None once it finished, else why it did not (its rows are then missing)."""
    try:
        subprocess.run(command, env=env, check=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"stopped after {timeout:g} s (a hang, or a --tree-timeout too short for it)"
    except subprocess.CalledProcessError as error:
        return f"exited with status {error.returncode}"
    return None


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    trees = parse_trees(args.trees)
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: give at least 1")
    if args.tree_timeout is not None and args.tree_timeout <= 0:
        raise SystemExit(f"--tree-timeout {args.tree_timeout:g}: give a positive number of seconds, or leave it out")
    if not torch.cuda.is_available():
        raise SystemExit("kernel_ab.py needs a CUDA device")
    forwarded = list(argv if argv is not None else sys.argv[1:])
    unfinished = []
    with tempfile.TemporaryDirectory() as results:
        for round_ in range(args.rounds):
            for index, (name, path) in enumerate(trees.items()):
                search = [str(path), str(TOOLS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(search))
                command = [sys.executable, str(TOOLS / "kernel_ab_tree.py"), *forwarded, "--tree", name]
                command += ["--tree-path", str(path), "--results", results, "--round", str(round_)]
                failure = run_tree_process(command, env, args.tree_timeout)
                if failure is None:
                    continue
                if index == 0:
                    raise SystemExit(f"tree {name!r}, round {round_}: {failure}; it is the reference, so the A/B stops")
                print(f"tree {name!r}, round {round_}: {failure}; its rows are missing, the others go on", flush=True)
                unfinished.append(f"{name!r} (round {round_}: {failure})")
    if unfinished:
        raise SystemExit(f"trees that did not finish: {'; '.join(unfinished)}")


if __name__ == "__main__":
    main()
