"""Where a timed repetition's milliseconds go: a profiler trace of a few fwd+bwd repetitions, with the GPU's gaps.

Runs our sparse attention (Triton) or compiled FlexAttention on ``bench_attention.py``'s inputs (Qwen2.5-3B shape,
bf16, one sample; ``--pattern`` as in ``profile_step.py``), or ``index``, the bench's index chain on them (the
static-budget estimation of ``bench_attention.index_steps``, then the conversion of the index it estimated, in
place of forward and backward), under ``torch.profiler`` with CPU and CUDA activity, one repetition per ``REP_<n>``
annotation, as ``bench_attention.measure`` times them: back to back with a sync after each (its launched timings),
or with ``--queued`` each behind the sleep kernel of its queued ones. Writes the Chrome trace to ``--trace`` and
prints, per repetition, the CUDA-event milliseconds of its two steps and each GPU op launched inside it: when the
host launched it and when the GPU ran it (µs from the repetition's start), for how long, and the GPU's idle gap
before it. A gap after the first op is time the GPU waited for the host; none means the difference between launched
and queued timings lies elsewhere (the clocks: docs/benchmarks.md, session 37). The profiler slows the host,
so host times here are upper bounds.

    python tools/trace_steps.py ours --pattern block_only --seq-len 32768 --reps 4 --trace /tmp/trace.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import torch
from bench_attention import QUEUE_LEAD_MS, SHAPES, converted_index, index_steps, sleep_cycles_per_ms
from flex_peer import block_only_block_mask, flex_forward, heads_first
from profile_step import PATTERNS, check_step_arguments, sparse_pattern

from mtraining_kernels import Layout, convert_index, sparse_attention

IMPLEMENTATIONS = ("ours", "flex", "index")
GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
WARMUP = 3


@dataclasses.dataclass(frozen=True)
class GpuOp:
    """One GPU op of a repetition; times in µs from the repetition's start (its annotation on the host)."""

    name: str
    launched: float  # the host's launch call
    start: float  # on the GPU
    duration: float
    gap: float  # the GPU's idle time since the repetition's previous op ended (0 for its first)


def rep_timelines(events: list[dict]) -> dict[str, list[GpuOp]]:
    """Per ``REP_*`` annotation of a Chrome trace's ``events``, in time order, the GPU ops whose launch call lies
    inside it (until the next annotation starts), in GPU order; a GPU op is tied to its launch by the trace's
    correlation id."""
    complete = [event for event in events if event.get("ph") == "X"]
    reps = sorted(
        (e for e in complete if e.get("cat") == "user_annotation" and e.get("name", "").startswith("REP_")),
        key=lambda e: e["ts"],
    )
    launches = {e["args"]["correlation"]: e for e in complete if e.get("cat") in LAUNCH_CATEGORIES and "args" in e}
    gpu_ops = sorted(
        (e for e in complete if e.get("cat") in GPU_CATEGORIES and e.get("args", {}).get("correlation") in launches),
        key=lambda e: e["ts"],
    )
    timelines = {}
    for number, rep in enumerate(reps):
        start = rep["ts"]
        end = reps[number + 1]["ts"] if number + 1 < len(reps) else float("inf")
        ops, previous_end = [], None
        for op in gpu_ops:
            launch = launches[op["args"]["correlation"]]
            if not start <= launch["ts"] < end:
                continue
            gap = op["ts"] - previous_end if previous_end is not None else 0.0
            ops.append(GpuOp(op["name"], launch["ts"] - start, op["ts"] - start, op["dur"], max(gap, 0.0)))
            previous_end = op["ts"] + op["dur"]
        timelines[rep["name"]] = ops
    return timelines


def step_functions(args: argparse.Namespace):
    """(forward, backward) of ``args.impl`` on fresh inputs: ``backward(forward())`` is one repetition; for
    ``index`` the estimation and the conversion of its estimate."""
    heads, kv_heads, dim = SHAPES["qwen2.5-3b"]
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(args.seed)
    q, k, v, dout = (
        torch.randn(1, args.seq_len, h, dim, generator=generator).to(device, torch.bfloat16)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    v_idx, s_idx = sparse_pattern(args, heads, device)
    if args.impl == "index":
        _, estimate = index_steps(q, k, v_idx, s_idx, args.seq_len)
        return estimate, lambda estimated: converted_index(estimated.v_idx, estimated.s_idx, args.seq_len)
    if args.impl == "flex":
        mask = block_only_block_mask(s_idx, args.seq_len)
        q, k, v, dout = (heads_first(t) for t in (q, k, v, dout))
        inputs = [t.requires_grad_() for t in (q, k, v)]
        forward = functools.partial(flex_forward, *inputs, mask, dim**-0.5)
    else:
        inputs = [t.requires_grad_() for t in (q, k, v)]
        index = convert_index(v_idx, s_idx, Layout("contiguous", 1), 0, args.seq_len)
        forward = functools.partial(sparse_attention, *inputs, index, backend="triton")
    return forward, lambda out: torch.autograd.grad(out, inputs, dout)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("impl", choices=IMPLEMENTATIONS)
    parser.add_argument(
        "--pattern", choices=PATTERNS, help="block_only by default; the index steps take vertical_slash only"
    )
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--sparsity", type=float, default=0.95)
    parser.add_argument("--reps", type=int, default=4, help="repetitions traced, after three untraced ones")
    parser.add_argument("--queued", action="store_true", help="each repetition behind the queued timings' sleep")
    parser.add_argument("--trace", default="trace_steps.json", help="where the Chrome trace goes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.impl == "index" and args.pattern not in (None, "vertical_slash"):
        raise SystemExit(f"--pattern {args.pattern}: the index steps estimate the vertical_slash pattern's budget")
    args.pattern = args.pattern or ("vertical_slash" if args.impl == "index" else "block_only")
    check_step_arguments(args, "reps", "trace_steps.py")
    forward, backward = step_functions(args)
    for _ in range(WARMUP):
        backward(forward())
    torch.cuda.synchronize()
    lead_cycles = int(QUEUE_LEAD_MS * sleep_cycles_per_ms()) if args.queued else 0
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    milliseconds = []
    with torch.profiler.profile(activities=activities) as profiler:
        for number in range(args.reps):
            if lead_cycles:
                torch.cuda._sleep(lead_cycles)
            with torch.profiler.record_function(f"REP_{number}"):
                start, middle, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                start.record()
                out = forward()
                middle.record()
                backward(out)
                end.record()
            torch.cuda.synchronize()
            milliseconds.append((start.elapsed_time(middle), middle.elapsed_time(end)))
            del out
    profiler.export_chrome_trace(args.trace)
    with open(args.trace) as trace:
        timelines = rep_timelines(json.load(trace)["traceEvents"])
    mode = "queued" if args.queued else "launched back to back"
    print(f"{args.impl} {args.pattern} N={args.seq_len}, {mode}; trace in {args.trace}")
    steps = ("estimate", "convert") if args.impl == "index" else ("fwd", "bwd")
    for (name, ops), (first_ms, second_ms) in zip(timelines.items(), milliseconds):
        idle = sum(op.gap for op in ops)
        timing = f"{steps[0]} {first_ms:.3f} ms, {steps[1]} {second_ms:.3f} ms"
        print(f"{name}: {timing}; {len(ops)} GPU ops, {idle:.0f} µs idle between them")
        for op in ops:
            print(
                f"  host {op.launched:8.0f}  gpu {op.start:8.0f}  {op.duration:8.0f} µs  gap {op.gap:6.0f}  "
                f"{op.name[:70]}"
            )


if __name__ == "__main__":
    main()
