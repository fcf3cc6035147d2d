"""Python host time of a kernels tree's Gluon launches and of its index estimation, measured without a GPU.

Per call of ``gluon_bwd.one_pass_backward`` (default mode) and ``gluon_fwd.block_forward``, on the shapes of
``tools/compile_sm90.py`` (Qwen2.5-3B heads): the microseconds our wrapper, the tensor descriptors and the launch
(Triton's JIT, or on a repeat call a tree's ``direct_launch``) take before the C launcher, which here does nothing
(Triton compiles against ``compile_sm90``'s stand-in driver). Then the static-budget ``estimate_vertical_slash`` (its
scores pass and the selection's four launches), per call and until its scores pass is launched, the host time a launched
index pays before its first long kernel; on CPU tensors of ``ESTIMATION_KEYS`` keys, as the PyTorch ops it runs between
launches (allocations, a fill) do real work here, and its Python does not depend on the length. On a GPU each launch
also pays the C launcher, and the device's host may be slower, so this compares two trees' Python, not what a device
shows. Needs the Triton release the tree's Gluon is written for, first on ``PYTHONPATH``, as ``compile_sm90.py`` does.
Example: ``PYTHONPATH=/tmp/triton36 python tools/launch_host_time.py --kernels .ab/base/kernels``.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from pathlib import Path

import torch
import triton
from compile_sm90 import forward_inputs, one_pass_inputs, persistent_keywords, use_tree
from triton.compiler.compiler import CompiledKernel


def microseconds_per_call(call, calls: int, batches: int) -> float:
    """The fastest batch's mean microseconds per ``call()``, after one call that compiles."""
    call()
    best = float("inf")
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


ESTIMATION_KEYS = 4096
ESTIMATION_BUDGET = (1024, 1024)  # the static budget's vertical and slash counts


def estimation_microseconds(estimation, calls: int, batches: int) -> tuple[float, float]:
    """(µs per static estimation call, µs from the call's start to its first launch: the scores pass), the first as
    :func:`microseconds_per_call`, the second the median over ``calls`` calls."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, ESTIMATION_KEYS, 16, 128, generator=generator, dtype=torch.bfloat16)
    k = torch.randn(1, ESTIMATION_KEYS, 2, 128, generator=generator, dtype=torch.bfloat16)
    budget = importlib.import_module("mtraining_kernels.budget").StaticBudget(*ESTIMATION_BUDGET)

    def call():
        return estimation.estimate_vertical_slash(q, k, budget, implementation="triton")

    per_call = microseconds_per_call(call, calls, batches)
    launches = []
    CompiledKernel.run = staticmethod(lambda *args, **kwargs: launches.append(time.perf_counter()))
    until_first = []
    for _ in range(calls):
        launches.clear()
        start = time.perf_counter()
        call()
        until_first.append((launches[0] - start) * 1e6)
    CompiledKernel.run = staticmethod(lambda *args, **kwargs: None)
    return per_call, statistics.median(until_first)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default="kernels", help="the folder holding the tree's mtraining_kernels")
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--calls", type=int, default=200, help="calls per timed batch")
    parser.add_argument("--batches", type=int, default=5, help="timed batches; the fastest one counts")
    args = parser.parse_args(argv)
    folder = Path(args.kernels).resolve()
    if not (folder / "mtraining_kernels" / "gluon_fwd.py").is_file():
        raise SystemExit(f"--kernels {args.kernels}: no mtraining_kernels/gluon_fwd.py under {folder}")
    if args.seq_len <= 0 or args.seq_len % 128:
        raise SystemExit(f"--seq-len {args.seq_len}: give a positive multiple of 128")
    if args.calls < 1 or args.batches < 1:
        raise SystemExit(f"--calls {args.calls} --batches {args.batches}: give at least 1 of each")
    use_tree(folder)
    CompiledKernel._init_handles = lambda self: None  # no module to load: nothing runs
    CompiledKernel.run = staticmethod(lambda *args, **kwargs: None)  # the C launcher, a no-op
    gluon_bwd = importlib.import_module("mtraining_kernels.gluon_bwd")
    gluon_fwd = importlib.import_module("mtraining_kernels.gluon_fwd")
    backward = one_pass_inputs(args.seq_len, 16, 2, 128)
    forward = forward_inputs(args.seq_len, 16, 2, 128) | persistent_keywords(gluon_fwd)
    scale = 128**-0.5
    launches = {
        "one_pass_backward": lambda: gluon_bwd.one_pass_backward(**backward, causal_diag=True, softmax_scale=scale),
        "block_forward": lambda: gluon_fwd.block_forward(**forward, causal_diag=True, softmax_scale=scale),
    }
    print(f"tree {folder}, Triton {triton.__version__}, N = {args.seq_len}, C launcher not run")
    for name, call in launches.items():
        print(f"{name}: {microseconds_per_call(call, args.calls, args.batches):.1f} us of Python per launch")
    estimation = importlib.import_module("mtraining_kernels.estimation")
    per_call, until_scores = estimation_microseconds(estimation, args.calls, args.batches)
    print(
        f"estimate_vertical_slash (static {ESTIMATION_BUDGET}, {ESTIMATION_KEYS} keys): {per_call:.1f} us of Python "
        f"per call, its scores pass launched after {until_scores:.1f} us"
    )


if __name__ == "__main__":
    main()
