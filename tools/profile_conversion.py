"""Host-side profile of the index conversion (``convert_index``, the block lists by key included) on one GPU.

Builds an estimated index of ``b = 1``, N = ``--seq-len`` (131072), Hq = ``--heads`` (16; Hkv 2, d 128, the
Qwen2.5-3B shape) with ``estimate_vertical_slash`` on random bf16 q/k and ``StaticBudget(*--budget)``, warms up,
then prints ``torch.profiler``'s CPU-only table (by self CPU time) around ``--calls`` conversions, and the
wall ms per call (``time.perf_counter`` between ``torch.cuda.synchronize`` calls).

``--check-contents 0`` converts with ``check_contents=False`` (the trusted path of our training pipeline); ``1``
converts as a user call does, and passes no keyword, so it also runs on a tree from before the keyword.

Usage: ``python tools/profile_conversion.py --check-contents 0`` (on the H200 machines with
``PYTHONPATH=$PWD:$PWD/kernels``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mtraining_kernels import Layout, convert_index
from mtraining_kernels.budget import StaticBudget
from mtraining_kernels.estimation import estimate_vertical_slash

KV_HEADS, HEAD_DIM = 2, 128


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check-contents", type=int, choices=(0, 1), required=True)
    parser.add_argument("--seq-len", type=int, default=131072)
    parser.add_argument("--heads", type=int, default=16, help="query heads Hq")
    parser.add_argument("--budget", type=int, nargs=2, default=(1000, 6000), metavar=("VERTICALS", "SLASHES"))
    parser.add_argument("--calls", type=int, default=5, help="profiled calls")
    parser.add_argument("--wall-calls", type=int, default=20, help="calls timed with perf_counter")
    parser.add_argument("--row-limit", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def estimated_index(seq_len: int, heads: int, budget: StaticBudget, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(v_idx, s_idx) int32 ``[1, Hq, ·]`` estimated on random bf16 q ``[1, N, Hq, d]`` and k ``[1, N, Hkv, d]``."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, seq_len, heads, HEAD_DIM, device="cuda", generator=generator).to(torch.bfloat16)
    k = torch.randn(1, seq_len, KV_HEADS, HEAD_DIM, device="cuda", generator=generator).to(torch.bfloat16)
    estimated = estimate_vertical_slash(q, k, budget)
    return estimated.v_idx, estimated.s_idx


def wall_ms(fn, calls: int) -> list[float]:
    """Wall milliseconds of each of ``calls`` calls of ``fn``, the device drained before and after each."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_conversion.py needs a CUDA device (it times the Triton conversion)")
    seq_len = args.seq_len
    v_idx, s_idx = estimated_index(seq_len, args.heads, StaticBudget(*args.budget), args.seed)
    layout = Layout("contiguous", 1)
    keywords = {} if args.check_contents else {"check_contents": False}

    def convert():
        return convert_index(v_idx, s_idx, layout, 0, seq_len, **keywords)

    for _ in range(3):  # compiles the Triton kernels, fills the caches
        index = convert()
    torch.cuda.synchronize()

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.calls):
            with torch.profiler.record_function("convert_index"):
                convert()
        torch.cuda.synchronize()
    print(
        f"# N={seq_len} Hq={args.heads} budget={tuple(args.budget)} check_contents={bool(args.check_contents)}: "
        f"{index.blk_col.numel() // 2} blocks, {index.bar_col.numel()} bars; {args.calls} calls"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.row_limit))
    times = wall_ms(convert, args.wall_calls)
    print(f"# wall ms per call, convert_index: median {statistics.median(times):.3f}, min {min(times):.3f}")


if __name__ == "__main__":
    main()
