"""One tree's process of ``kernel_ab.py``: times the ``mtraining_kernels`` first on ``PYTHONPATH`` and appends its
rows (fields in ``kernel_ab.py``'s docstring). Started by ``kernel_ab.py`` with the driver's options plus
``--tree``, ``--tree-path``, ``--results`` (the folder of the first tree's outputs) and ``--round``."""

from __future__ import annotations

import datetime
import functools
import json
import statistics
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
from flex_peer import same_area_pattern
from gpu_telemetry import Telemetry
from kernel_ab import build_parser
from provenance import git_commit

import mtraining_kernels
from mtraining_kernels import Layout, convert_index, sparse_attention
from mtraining_kernels.vertical_slash import full_index

HOST_MAX_LEN = 32768  # host time per call is measured up to this N; beyond, the GPU's time dwarfs it
HOST_REPS = 7
HOST_LEAD_MS = 50.0  # the GPU sleeps this long while the host launches one timed call
OVER_BOTH_TIMINGS = ("sm_clock_min_mhz", "temperature_max_c")  # telemetry fields a row takes from both timings


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
        deterministic=args.deterministic,
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
            **{
                kind: functools.partial(
                    same_area_pattern, kind, v_idx, s_idx, seq_len, torch.Generator().manual_seed(args.seed)
                )
                for kind in ("block_only", "block_band")
            },
            "dense": lambda: full_index(1, heads, seq_len, device=device),
        }

        def backward(out):
            return torch.autograd.grad(out, (q, k, v), dout)

        forwards = {}
        for pattern in args.patterns:
            index = convert_index(*patterns[pattern](), Layout("contiguous", 1), 0, seq_len)
            forwards[pattern] = forward = functools.partial(
                sparse_attention, q, k, v, index, backend="triton", deterministic=args.deterministic
            )
            torch.cuda.reset_peak_memory_stats()
            row = dict(common, pattern=pattern, seq_len=seq_len, sparsity=args.sparsity)
            with Telemetry() as telemetry:
                timings = fwd_bwd_timings(
                    lambda lead: measure(forward, backward, args.warmup, args.reps, lead), seq_len
                )
            # over both timings, the lowest clock and the hottest; each timing's clock and power are its own (none for
            # a timing shorter than the telemetry's period, rather than the other timing's)
            row.update({name: telemetry.summary[name] for name in OVER_BOTH_TIMINGS if name in telemetry.summary})
            row.update(timings)
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
    parser = build_parser()
    parser.add_argument("--tree", required=True)
    parser.add_argument("--tree-path", required=True)
    parser.add_argument("--results", required=True)
    parser.add_argument("--round", type=int, default=0)
    run_tree(parser.parse_args(argv))


if __name__ == "__main__":
    main()
