"""Single-GPU benchmark: Triton vertical-slash sparse attention against dense torch SDPA and FlexAttention.

Causal attention, one GPU, shapes ``[b, N, H, d]``. For every N and shape it times, in one run:

* ``mtraining`` — ``sparse_attention(..., backend="triton")`` on a vertical-slash pattern whose
  budgets are calibrated to a target sparsity (30 sinks + N/128 random verticals, the 100-offset
  window + random slashes; DESIGN.md §2.1 mask), default (atomic) backward; and, for every ``--top-p``,
  on the pattern that the top-P estimator selects on structured q/k (``structured_qk.py``: a local band,
  a distant diagonal, sinks and hub columns — random q/k have no structure to find), timed on those q/k;
* ``mtraining_deterministic`` — the same with ``deterministic=True`` (only with ``--deterministic``);
* ``mtraining_dense`` — our kernels on the full causal pattern (N ≤ ``--dense-max-len``);
* ``sdpa_cudnn`` / ``sdpa_flash`` — ``F.scaled_dot_product_attention(is_causal=True)`` with the cuDNN
  and flash backends (K/V expanded to Hq heads beforehand, outside the timing);
* ``flex_attention`` — ``torch.compile(flex_attention)`` on exactly each fixed-budget pattern's mask
  (``flex_peer.py``: the active blocks as full blocks, the diagonal and the blocks holding a vertical as
  partial ones), N ≤ ``--flex-max-len``, unless ``--no-flex``; heads-first copies of q/k/v made outside the
  timing. ``mask_ms`` is its BlockMask construction, and its ``index_ms`` that plus the estimation;
* ``mtraining_blocks`` / ``flex_attention_blocks`` — both on a block-only pattern (slashes at multiples of
  128, no verticals; ``flex_peer.block_only_pattern``) with each head's mask area just below that of the
  fixed-budget pattern; ``index_ms`` is the conversion, or the BlockMask construction.

Cross-check: at every N where Flex runs, Flex's out/dq/dk/dv are compared with ours (Triton, default
backward) on the same inputs and mask; the Flex rows record ``flex_check`` (max |Δ| and relative RMSE
‖Δ‖₂/‖ours‖₂ per tensor), and a relative RMSE above ``FLEX_REL_RMSE`` stops the run (SystemExit naming
N, the pattern and the tensor).

Timing: CUDA events around the forward and around the backward (``torch.autograd.grad``) of each
repetition, after warm-up; the median is reported. Up to ``QUEUED_MAX_LEN`` every row is also timed queued
(``fwd_queued_ms``/``bwd_queued_ms``: each repetition behind a ``QUEUE_LEAD_MS`` sleep kernel, so the GPU's time
without the host's launch time, as in training where the host runs ahead). ``index_ms`` is the index estimation
(``mtraining_kernels.estimation.estimate_vertical_slash`` with the pattern's static budget, or the top-P
budget on the structured inputs) plus the conversion (``convert_index``, which also builds the block lists by
key that the backward reads), without the content checks, as training converts its own estimated index; the
deterministic rows add ``bar_chunks_ms``, the bars' lists by column that their backward reads
(``BlockBarIndex.bar_chunks``, built once per index, so the timed backwards find them built). Each index step
is timed twice: ``convert_ms``/``estimate_ms``/``index_ms`` with the events recorded as the host launches the
step, so a host-bound step measures the host; ``*_queued_ms`` behind a ``QUEUE_LEAD_MS`` sleep kernel that lets
the host queue the whole step first, so they measure the GPU's time plus whatever host time follows a host sync
inside the step. ``index_chain_ms``/``index_chain_queued_ms`` time the two as one call, as a layer runs them: the
estimation, then the conversion of the index it estimated, so the host prepares the conversion while the GPU still
estimates (the separate steps each pay the host's start alone).
Each attention timing also records the GPU's median SM clock and peak power while it ran (``sm_clock_mhz``,
``power_max_w``; ``sm_clock_queued_mhz``, ``power_max_queued_w``; from ``gpu_telemetry``): a repetition much shorter
than the sleep runs at higher clocks than one at the GPU's power limit, which long ones reach. A timing shorter than
the telemetry's period (0.25 s) has no samples and so no clock fields.
FLOPs (DESIGN.md §7): dense-equivalent forward 2·N²·Hq·d, actually computed forward 4·|M|·d·Hq
(|M| per head), backward 2.5× forward.

Writes one JSON object per (configuration, implementation) to ``--jsonl`` (appending), a markdown
table (speed-ups over cuDNN, over Flex on the same pattern and over flash) to ``--table`` and a plot of
speedup over cuDNN against N to ``--plot``; ``--report-only``
rebuilds the table and plot from the latest run in an existing JSONL (the rows sharing its last row's
``date``; e.g. on a machine with matplotlib).
Example: ``python tools/bench_attention.py --seq-lens 32768 131072 524288 --sparsities 0.9 0.95``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import statistics
import sys
from typing import Callable

import torch
import torch.nn.functional as F
from flex_peer import (
    block_only_block_mask,
    block_only_pattern,
    flex_forward,
    flex_fwd_bwd,
    heads_first,
    vertical_slash_block_mask,
)
from gpu_telemetry import Telemetry
from provenance import git_commit
from structured_qk import structured_qk
from torch.nn.attention import SDPBackend, sdpa_kernel

from mtraining_kernels import Layout, convert_index, sparse_attention
from mtraining_kernels.budget import StaticBudget, TopPBudget
from mtraining_kernels.estimation import estimate_vertical_slash
from mtraining_kernels.index import BlockBarIndex
from mtraining_kernels.layout import BLOCK_SIZE
from mtraining_kernels.vertical_slash import full_index, mask_area

SHAPES = {"qwen2.5-3b": (16, 2, 128), "mha": (16, 16, 128)}  # (Hq, Hkv, d)
SINKS, WINDOW = 30, 100
# DESIGN.md §6 bounds the relative RMSE of each bf16 result against the fp32 reference by 5e-3, so two such
# results (Flex and ours) differ by at most twice that
FLEX_REL_RMSE = 1e-2
# the row whose speed-up over Flex an implementation reports: Flex on the same pattern
FLEX_PEER = {
    "mtraining": "flex_attention",
    "mtraining_deterministic": "flex_attention",
    "mtraining_blocks": "flex_attention_blocks",
}


# ---------------------------------------------------------------------------------------- patterns
def budget_pattern(batch: int, heads: int, seq_len: int, sparsity: float, device, generator: torch.Generator):
    """(v_idx, s_idx, slash count): forced entries, N/128 random verticals, and as many random slashes
    (the same count per head, a nested random order so density grows with it) as keep the mean
    sparsity ≥ ``sparsity``."""
    rows = batch * heads
    n_vertical = min(4096, seq_len // BLOCK_SIZE)
    vertical_pool = torch.stack(
        [torch.randperm(seq_len - SINKS, generator=generator)[:n_vertical] + SINKS for _ in range(rows)]
    )
    v_idx = torch.cat([torch.arange(SINKS).expand(rows, SINKS), vertical_pool], 1).sort(1).values
    slash_order = torch.stack([torch.randperm(seq_len - WINDOW, generator=generator) + WINDOW for _ in range(rows)])
    v_idx = v_idx.to(device=device, dtype=torch.int32).view(batch, heads, -1)
    slash_order = slash_order.to(device)
    window = torch.arange(WINDOW, device=device).expand(rows, WINDOW)
    total = seq_len * (seq_len + 1) / 2

    def slashes(count: int) -> torch.Tensor:
        picked = torch.cat([window, slash_order[:, :count]], 1).sort(1).values
        return picked.to(torch.int32).view(batch, heads, -1)

    def density(count: int) -> float:
        return float(mask_area(v_idx, slashes(count), seq_len).double().mean()) / total

    low, high = 0, seq_len - WINDOW
    while low < high:  # largest count with density ≤ 1 − sparsity
        mid = (low + high + 1) // 2
        if density(mid) <= 1.0 - sparsity:
            low = mid
        else:
            high = mid - 1
    return v_idx, slashes(low), low


def mask_density(v_idx: torch.Tensor, s_idx: torch.Tensor, seq_len: int) -> float:
    return float(mask_area(v_idx, s_idx, seq_len).double().mean()) / (seq_len * (seq_len + 1) / 2)


# ---------------------------------------------------------------------------------------- timing
def _event_times(
    forward: Callable, backward: Callable, warmup: int, reps: int, queue_lead_ms: float, split: bool
) -> list[tuple[float, ...]]:
    """Per repetition of ``backward(forward())`` after ``warmup`` untimed ones, CUDA-event milliseconds: (forward,
    backward) with ``split``, else (forward+backward,) between one pair of events. ``queue_lead_ms``: the GPU
    first sleeps that long in each repetition (see :func:`measure`)."""
    for _ in range(warmup):
        backward(forward())
    torch.cuda.synchronize()
    lead_cycles = int(queue_lead_ms * sleep_cycles_per_ms()) if queue_lead_ms else 0
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        middle = torch.cuda.Event(enable_timing=True) if split else None
        if lead_cycles:
            torch.cuda._sleep(lead_cycles)
        start.record()
        result = forward()
        if middle is not None:
            middle.record()
        backward(result)
        end.record()
        torch.cuda.synchronize()
        times.append(
            (start.elapsed_time(middle), middle.elapsed_time(end)) if middle is not None else (start.elapsed_time(end),)
        )
        del result
    return times


def measure(
    forward: Callable, backward: Callable, warmup: int, reps: int, queue_lead_ms: float = 0.0
) -> tuple[float, float]:
    """Median forward and backward milliseconds (CUDA events), ``backward(forward())`` per repetition. With
    ``queue_lead_ms`` the GPU first sleeps that long in each repetition, so the host has queued the repetition's
    launches before its start event fires: the GPU's time, plus the host time after any host sync inside."""
    times = _event_times(forward, backward, warmup, reps, queue_lead_ms, split=True)
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def measure_step(forward: Callable, backward: Callable, warmup: int, reps: int) -> float:
    """Median milliseconds of ``backward(forward())`` launched, between one pair of CUDA events. :func:`measure`'s
    event between the two is a driver call on the host's path from the forward's launch to the backward's, which
    a host-bound step waits on; a training step records none there."""
    return statistics.median(t[0] for t in _event_times(forward, backward, warmup, reps, 0.0, split=False))


QUEUE_LEAD_MS = 20.0  # the GPU sleeps this long before a queued timing starts: longer than a step's host time
INDEX_REPS = 10  # repetitions of each index step (after one warm-up call); the median is reported
QUEUED_MAX_LEN = 131072  # attention rows are also timed queued up to this N; beyond, launches are < 1 % of a step


@functools.cache
def sleep_cycles_per_ms() -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on this GPU, measured once."""
    cycles = 10**7
    torch.cuda._sleep(cycles)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / start.elapsed_time(end)


def median_ms(fn: Callable, reps: int, queue_lead_ms: float = 0.0) -> float:
    """Median CUDA-event milliseconds of ``fn`` after one warm-up call. With ``queue_lead_ms`` the GPU first sleeps
    that long, so the host has queued ``fn`` before its start event fires: its GPU time, plus the host time after
    any host sync inside ``fn``."""
    fn()
    torch.cuda.synchronize()
    lead_cycles = int(queue_lead_ms * sleep_cycles_per_ms()) if queue_lead_ms else 0
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead_cycles:
            torch.cuda._sleep(lead_cycles)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def step_timings(steps: dict[str, Callable], reps: int) -> dict[str, float]:
    """``{name}_ms`` and ``{name}_queued_ms`` (:func:`median_ms` launch-bound, and queued behind
    ``QUEUE_LEAD_MS``) of each named index step, and their sums ``index_ms`` and ``index_queued_ms``."""
    timings = {}
    for name, step in steps.items():
        timings[f"{name}_ms"] = median_ms(step, reps)
        timings[f"{name}_queued_ms"] = median_ms(step, reps, QUEUE_LEAD_MS)
    timings["index_ms"] = sum(timings[f"{name}_ms"] for name in steps)
    timings["index_queued_ms"] = sum(timings[f"{name}_queued_ms"] for name in steps)
    return timings


def clock_fields(telemetry: Telemetry, suffix: str = "") -> dict[str, float]:
    """``sm_clock{suffix}_mhz`` (median) and ``power_max{suffix}_w`` of a timing's ``gpu_telemetry`` samples; empty
    where nvidia-smi gave none."""
    summary = telemetry.summary
    if not summary:
        return {}
    return {f"sm_clock{suffix}_mhz": summary["sm_clock_mhz"], f"power_max{suffix}_w": summary["power_max_w"]}


def _telemetry() -> Telemetry:
    return Telemetry(torch.cuda.current_device() if torch.cuda.is_available() else 0)


def fwd_bwd_timings(time_fn: Callable[[float], tuple[float, float]], seq_len: int) -> dict[str, float]:
    """``fwd_ms``/``bwd_ms`` from ``time_fn(0.0)`` (events recorded as the host launches) and, for N up to
    ``QUEUED_MAX_LEN``, ``fwd_queued_ms``/``bwd_queued_ms`` from ``time_fn(QUEUE_LEAD_MS)`` (the GPU's time), each
    with the GPU's clock and power while it ran (:func:`clock_fields`; ``_queued`` in the queued one's names).
    Under sustained load the GPU holds its power limit by lowering its clocks, so a short repetition timed behind
    the sleep runs faster than the same one timed back to back (docs/benchmarks.md, session 37)."""
    with _telemetry() as telemetry:
        fwd_ms, bwd_ms = time_fn(0.0)
    timings = dict(fwd_ms=fwd_ms, bwd_ms=bwd_ms, **clock_fields(telemetry))
    if seq_len <= QUEUED_MAX_LEN:
        with _telemetry() as telemetry:
            timings["fwd_queued_ms"], timings["bwd_queued_ms"] = time_fn(QUEUE_LEAD_MS)
        timings.update(clock_fields(telemetry, "_queued"))
    return timings


def grads_of(inputs, dout):
    return lambda out: torch.autograd.grad(out, inputs, dout)


def time_sparse(
    q, k, v, dout, index: BlockBarIndex, deterministic: bool, warmup: int, reps: int, queue_lead_ms: float = 0.0
):
    return measure(
        lambda: sparse_attention(q, k, v, index, backend="triton", deterministic=deterministic),
        grads_of((q, k, v), dout),
        warmup,
        reps,
        queue_lead_ms,
    )


def time_sdpa(backend: SDPBackend, q, k, v, dout, warmup: int, reps: int, queue_lead_ms: float = 0.0):
    """q ``[b, N, Hq, d]``; SDPA gets ``[b, H, N, d]`` copies with K/V repeated to Hq heads."""
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2).contiguous().detach().requires_grad_()
    kh = k.transpose(1, 2).repeat_interleave(group, 1).contiguous().detach().requires_grad_()
    vh = v.transpose(1, 2).repeat_interleave(group, 1).contiguous().detach().requires_grad_()
    douth = dout.transpose(1, 2).contiguous()

    def forward():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)

    return measure(forward, grads_of((qh, kh, vh), douth), warmup, reps, queue_lead_ms)


def time_flex(q, k, v, dout, block_mask, scale: float, warmup: int, reps: int, queue_lead_ms: float = 0.0):
    """q ``[b, N, Hq, d]``; Flex gets heads-first ``[b, H, N, d]`` copies (made outside the timing)."""
    qh, kh, vh = (heads_first(x).requires_grad_() for x in (q, k, v))
    douth = heads_first(dout)
    return measure(
        lambda: flex_forward(qh, kh, vh, block_mask, scale),
        grads_of((qh, kh, vh), douth),
        warmup,
        reps,
        queue_lead_ms,
    )


def flex_check(q, k, v, dout, index: BlockBarIndex, block_mask, scale: float, title: str) -> dict:
    """Flex against ours (Triton, default backward) on the same inputs and mask: ``{tensor: {max_abs_err,
    rel_rmse}}`` for out, dq, dk, dv, rel_rmse = ‖flex − ours‖₂ / ‖ours‖₂; SystemExit past FLEX_REL_RMSE."""
    out = sparse_attention(q, k, v, index, softmax_scale=scale, backend="triton")
    ours = (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))
    theirs = flex_fwd_bwd(q, k, v, dout, block_mask, scale)
    errors = {}
    for name, flex, mine in zip(("out", "dq", "dk", "dv"), theirs, ours):
        diff = flex.float() - mine.float()
        errors[name] = {"max_abs_err": float(diff.abs().max()), "rel_rmse": float(diff.norm() / mine.float().norm())}
        if not errors[name]["rel_rmse"] <= FLEX_REL_RMSE:
            raise SystemExit(
                f"Flex cross-check failed, {title}: {name} relative RMSE {errors[name]['rel_rmse']:.3e} "
                f"> {FLEX_REL_RMSE} (max |flex - ours| {errors[name]['max_abs_err']:.3e})"
            )
    return errors


def run_flex(
    q, k, v, dout, index: BlockBarIndex, build_mask: Callable, scale: float, warmup: int, reps: int, title: str
) -> dict:
    """Flex on ``build_mask()``'s BlockMask, cross-checked against ours on ``index`` (:func:`flex_check`), then
    timed: :func:`fwd_bwd_timings`, mask_ms and mask_queued_ms (the BlockMask construction, median of INDEX_REPS,
    as the index steps are timed) and flex_check."""
    block_mask = build_mask()
    mask_ms, mask_queued_ms = median_ms(build_mask, INDEX_REPS), median_ms(build_mask, INDEX_REPS, QUEUE_LEAD_MS)
    check = flex_check(q, k, v, dout, index, block_mask, scale, title)
    torch.cuda.reset_peak_memory_stats()
    timings = fwd_bwd_timings(functools.partial(time_flex, q, k, v, dout, block_mask, scale, warmup, reps), q.shape[1])
    return dict(**timings, mask_ms=mask_ms, mask_queued_ms=mask_queued_ms, flex_check=check)


def profile_kernels(q, k, v, dout, index: BlockBarIndex, deterministic: bool, title: str) -> None:
    """Print the CUDA time per kernel of one forward + backward (after a warm-up run)."""

    def run():
        return grads_of((q, k, v), dout)(
            sparse_attention(q, k, v, index, backend="triton", deterministic=deterministic)
        )

    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    print(f"# kernel times, {title}")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=12, max_name_column_width=60))


HOST_SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync")


def converted_index(v_idx, s_idx, seq_len: int) -> BlockBarIndex:
    """The conversion as a training layer runs it on its own estimated index (no content checks)."""
    return convert_index(v_idx, s_idx, Layout("contiguous", 1), 0, seq_len, check_contents=False)


def deterministic_timings(index: BlockBarIndex, kv_heads: int, timings: dict[str, float]) -> dict[str, float]:
    """``timings`` plus ``bar_chunks_ms``/``bar_chunks_queued_ms``, the deterministic backward's bar lists by
    column (``BlockBarIndex.bar_chunks``, built on a fresh copy of the index each time, as its cache would
    otherwise answer), added to the index sums (the chain's too, where timed)."""
    chunks = step_timings({"bar_chunks": lambda: dataclasses.replace(index).bar_chunks(0, kv_heads)}, INDEX_REPS)
    sums = {
        f"{total}{suffix}": timings[f"{total}{suffix}"] + chunks[f"bar_chunks{suffix}"]
        for total in ("index", "index_chain")
        for suffix in ("_ms", "_queued_ms")
        if f"{total}{suffix}" in timings
    }
    return {
        **timings,
        "bar_chunks_ms": chunks["bar_chunks_ms"],
        "bar_chunks_queued_ms": chunks["bar_chunks_queued_ms"],
        **sums,
    }


def index_steps(q, k, v_idx, s_idx, seq_len: int) -> tuple[Callable, Callable]:
    """(conversion, static-budget estimation) of the pattern's counts, as calls; the conversion includes the
    block lists by key, which the Triton backward builds once per index."""
    counts = ((v_idx < seq_len).sum(-1).max().item(), (s_idx < seq_len).sum(-1).max().item())
    budget = StaticBudget(int(counts[0]), int(counts[1]))
    return (
        lambda: converted_index(v_idx, s_idx, seq_len),
        lambda: estimate_vertical_slash(q, k, budget),
    )


def index_chain(estimate: Callable, seq_len: int) -> Callable:
    """The estimation, then the conversion of the index it estimated, as one call (a layer's index step)."""
    return lambda: converted_index(*estimate()[:2], seq_len)


def profile_index(steps: dict[str, Callable], title: str) -> None:
    """Print, per named index step (after a warm-up call), the CUDA time per kernel and the host calls that
    wait for the device (synchronisations and blocking copies)."""
    on_gpu = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * on_gpu
    for name, step in steps.items():
        step()
        if on_gpu:
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            step()
            if on_gpu:
                torch.cuda.synchronize()
        events = prof.key_averages()
        waits = {event.key: event.count for event in events if event.key in HOST_SYNC_EVENTS}
        print(f"# index kernel times, {name}, {title}; host waits and copies per call: {waits or 'none'}")
        print(events.table(sort_by="device_time_total", row_limit=12, max_name_column_width=60))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 65536, 131072, 262144, 524288])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument(
        "--shape-max-len", nargs="*", default=["mha=131072"], help="per-shape largest N, e.g. mha=131072"
    )
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.9, 0.95])
    parser.add_argument(
        "--top-p",
        type=float,
        nargs="*",
        default=[0.9],
        help="top-P budgets estimated on structured q/k (none: only the fixed budgets)",
    )
    parser.add_argument("--dense-max-len", type=int, default=131072, help="largest N for mtraining_dense")
    parser.add_argument("--flash-max-len", type=int, default=131072, help="largest N for sdpa_flash")
    parser.add_argument("--cudnn-max-len", type=int, default=524288, help="largest N for sdpa_cudnn")
    parser.add_argument(
        "--flex-max-len", type=int, default=524288, help="largest N for the FlexAttention rows and their cross-check"
    )
    parser.add_argument("--no-flex", action="store_true", help="no FlexAttention rows (nor cross-check)")
    parser.add_argument("--deterministic", action="store_true", help="also time deterministic=True")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dense-reps", type=int, default=2, help="repetitions for dense runs at N > 128K")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--jsonl", default="docs/benchmarks/attention.jsonl")
    parser.add_argument("--table", default="docs/benchmarks/attention.md")
    parser.add_argument("--plot", default="docs/benchmarks/attention_speedup.png")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print per-kernel CUDA times (torch.profiler) of one sparse fwd+bwd per N, default and "
        "deterministic, and of the index steps (conversion, estimation) with their host waits",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="measure nothing: rebuild --table and --plot from the latest run in --jsonl",
    )
    args = parser.parse_args(argv)
    if args.report_only:
        with open(args.jsonl) as f:
            rows = latest_run([json.loads(line) for line in f if line.strip()])
        write_table(rows, args.table)
        write_plot(rows, args.plot)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA device")
    budgets = []
    if args.top_p:
        budgets = [TopPBudget(p) for p in args.top_p]  # validates every p before any work

    device = torch.device("cuda")
    base = {
        "gpu": torch.cuda.get_device_name(),
        "commit": args.commit or git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "dtype": "bf16",
        "batch": args.batch,
    }
    shape_limit = dict(item.split("=") for item in args.shape_max_len)
    os.makedirs(os.path.dirname(os.path.abspath(args.jsonl)), exist_ok=True)
    rows = []

    def record(**fields) -> None:
        row = {**base, **fields}
        n, hq, d = row["seq_len"], row["heads_q"], row["head_dim"]
        dense_fwd = 2.0 * n * n * hq * d * row["batch"]
        actual_fwd = dense_fwd * row["density"] * (n + 1) / n
        total_ms = row["fwd_ms"] + row["bwd_ms"]
        for key, flops in (("dense_equiv_tflops", dense_fwd), ("actual_tflops", actual_fwd)):
            row[key] = {
                "fwd": flops / row["fwd_ms"] / 1e9,
                "bwd": 2.5 * flops / row["bwd_ms"] / 1e9,
                "fwd_bwd": 3.5 * flops / total_ms / 1e9,
            }
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rows.append(row)
        with open(args.jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(row_summary(row), flush=True)

    for shape in args.shapes:
        heads, kv_heads, dim = SHAPES[shape]
        for seq_len in args.seq_lens:
            if seq_len > int(shape_limit.get(shape, seq_len)):
                continue
            torch.cuda.empty_cache()
            gen = torch.Generator().manual_seed(args.seed)
            q, k, v, dout = (
                torch.randn(args.batch, seq_len, h, dim, generator=gen).to(device, torch.bfloat16)
                for h in (heads, kv_heads, kv_heads, heads)
            )
            q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
            common = dict(shape=shape, seq_len=seq_len, heads_q=heads, heads_kv=kv_heads, head_dim=dim)
            dense_reps = args.reps if seq_len <= 131072 else args.dense_reps
            flex_here = not args.no_flex and seq_len <= args.flex_max_len
            scale = dim**-0.5
            block_gen = torch.Generator().manual_seed(args.seed)  # the fixed-budget patterns do not depend on it

            for sparsity in args.sparsities:
                v_idx, s_idx, n_slash = budget_pattern(args.batch, heads, seq_len, sparsity, device, gen)
                density = mask_density(v_idx, s_idx, seq_len)
                index = convert_index(v_idx, s_idx, Layout("contiguous", 1), 0, seq_len)
                convert, estimate = index_steps(q.detach(), k.detach(), v_idx, s_idx, seq_len)
                timings = step_timings({"convert": convert, "estimate": estimate}, INDEX_REPS)
                chain = step_timings({"index_chain": index_chain(estimate, seq_len)}, INDEX_REPS)
                timings.update({name: chain[name] for name in ("index_chain_ms", "index_chain_queued_ms")})
                pattern = dict(
                    target_sparsity=sparsity, density=density, slashes=n_slash + WINDOW, verticals=int(v_idx.shape[-1])
                )
                extra = dict(**pattern, **timings)
                modes = [False, True] if args.deterministic else [False]
                if args.profile and sparsity == args.sparsities[-1]:
                    profile_index(
                        {"conversion": convert, "static estimation": estimate},
                        f"{shape} N={seq_len} sparsity {sparsity}",
                    )
                    for deterministic in modes:
                        profile_kernels(
                            q,
                            k,
                            v,
                            dout,
                            index,
                            deterministic,
                            f"{shape} N={seq_len} sparsity {sparsity} deterministic={deterministic}",
                        )
                for deterministic in modes:
                    torch.cuda.reset_peak_memory_stats()
                    record(
                        impl="mtraining_deterministic" if deterministic else "mtraining",
                        **fwd_bwd_timings(
                            functools.partial(time_sparse, q, k, v, dout, index, deterministic, args.warmup, args.reps),
                            seq_len,
                        ),
                        **common,
                        **(
                            dict(extra, **deterministic_timings(index, k.shape[2], timings)) if deterministic else extra
                        ),
                    )
                if flex_here:
                    flex = run_flex(
                        q,
                        k,
                        v,
                        dout,
                        index,
                        functools.partial(vertical_slash_block_mask, v_idx, s_idx, seq_len),
                        scale,
                        args.warmup,
                        args.reps,
                        f"{shape} N={seq_len} sparsity {sparsity}",
                    )
                    record(
                        impl="flex_attention",
                        **flex,
                        estimate_ms=timings["estimate_ms"],
                        estimate_queued_ms=timings["estimate_queued_ms"],
                        index_ms=flex["mask_ms"] + timings["estimate_ms"],
                        index_queued_ms=flex["mask_queued_ms"] + timings["estimate_queued_ms"],
                        **common,
                        **pattern,
                    )
                del index

                block_v_idx, block_s_idx = block_only_pattern(mask_area(v_idx, s_idx, seq_len), seq_len, block_gen)
                index = convert_index(block_v_idx, block_s_idx, Layout("contiguous", 1), 0, seq_len)
                timings = step_timings(
                    {"convert": lambda: converted_index(block_v_idx, block_s_idx, seq_len)},
                    INDEX_REPS,
                )
                pattern = dict(
                    target_sparsity=sparsity,
                    density=mask_density(block_v_idx, block_s_idx, seq_len),
                    slashes=int((block_s_idx < seq_len).sum(-1).max()),
                    verticals=0,
                )
                torch.cuda.reset_peak_memory_stats()
                record(
                    impl="mtraining_blocks",
                    **fwd_bwd_timings(
                        functools.partial(time_sparse, q, k, v, dout, index, False, args.warmup, args.reps), seq_len
                    ),
                    **timings,
                    **common,
                    **pattern,
                )
                if flex_here:
                    flex = run_flex(
                        q,
                        k,
                        v,
                        dout,
                        index,
                        functools.partial(block_only_block_mask, block_s_idx, seq_len),
                        scale,
                        args.warmup,
                        args.reps,
                        f"{shape} N={seq_len} block-only, sparsity {sparsity}",
                    )
                    record(
                        impl="flex_attention_blocks",
                        **flex,
                        index_ms=flex["mask_ms"],
                        index_queued_ms=flex["mask_queued_ms"],
                        **common,
                        **pattern,
                    )
                del index

            if seq_len <= args.dense_max_len:
                v_idx, s_idx = full_index(args.batch, heads, seq_len, device=device)
                index = convert_index(v_idx, s_idx, Layout("contiguous", 1), 0, seq_len)
                torch.cuda.reset_peak_memory_stats()
                record(
                    impl="mtraining_dense",
                    **fwd_bwd_timings(
                        functools.partial(time_sparse, q, k, v, dout, index, False, args.warmup, dense_reps), seq_len
                    ),
                    density=1.0,
                    index_ms=0.0,
                    **common,
                )
                del index

            for impl, backend, limit in (
                ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION, args.cudnn_max_len),
                ("sdpa_flash", SDPBackend.FLASH_ATTENTION, args.flash_max_len),
            ):
                if seq_len > limit:
                    continue
                torch.cuda.reset_peak_memory_stats()
                try:
                    sdpa_timings = fwd_bwd_timings(
                        functools.partial(
                            time_sdpa, backend, q.detach(), k.detach(), v.detach(), dout, args.warmup, dense_reps
                        ),
                        seq_len,
                    )
                except RuntimeError as err:
                    print(f"# {impl} at N={seq_len} failed: {str(err).splitlines()[0]}", file=sys.stderr)
                    continue
                record(impl=impl, **sdpa_timings, density=1.0, index_ms=0.0, **common)

            if budgets:  # own generator: the structured q/k must not depend on which fixed budgets ran
                q, k = (
                    t.to(torch.bfloat16).requires_grad_()
                    for t in structured_qk(
                        args.batch,
                        seq_len,
                        heads,
                        kv_heads,
                        dim,
                        generator=torch.Generator().manual_seed(args.seed),
                        device=device,
                    )
                )
            for budget in budgets:
                v_idx, s_idx = estimate_vertical_slash(q.detach(), k.detach(), budget)[:2]
                estimate = functools.partial(estimate_vertical_slash, q.detach(), k.detach(), budget)
                if args.profile:
                    profile_index({f"top-P {budget.p} estimation": estimate}, f"{shape} N={seq_len}, structured q/k")
                timings = step_timings(
                    {
                        "convert": lambda: converted_index(v_idx, s_idx, seq_len),
                        "estimate": estimate,
                    },
                    INDEX_REPS,
                )
                index = convert_index(v_idx, s_idx, Layout("contiguous", 1), 0, seq_len)
                extra = dict(
                    top_p=budget.p,
                    inputs="structured",
                    density=mask_density(v_idx, s_idx, seq_len),
                    slashes=int((s_idx < seq_len).sum(-1).max()),
                    verticals=int((v_idx < seq_len).sum(-1).max()),
                    **timings,
                )
                torch.cuda.reset_peak_memory_stats()
                record(
                    impl="mtraining",
                    **fwd_bwd_timings(
                        functools.partial(time_sparse, q, k, v, dout, index, False, args.warmup, args.reps), seq_len
                    ),
                    **common,
                    **extra,
                )
                del index
            del q, k, v, dout

    write_table(rows, args.table)
    write_plot(rows, args.plot)


# ---------------------------------------------------------------------------------------- reports
def row_summary(row: dict) -> str:
    """One line of the run's log for a recorded row: timings (queued ones in parentheses), index, TFLOP/s, the SM
    clocks while timed (launched/queued) where known and, for Flex rows, the mask's time and the cross-check's worst
    relative RMSE."""
    worst = max(e["rel_rmse"] for e in row["flex_check"].values()) if "flex_check" in row else None
    check = f" mask={row['mask_ms']:.2f} ms, vs ours max rel RMSE {worst:.1e}" if worst is not None else ""
    queued = f" (queued {row['index_queued_ms']:.2f})" if "index_queued_ms" in row else ""
    if "index_chain_ms" in row:
        queued += f", as one chain {row['index_chain_ms']:.2f} (queued {row['index_chain_queued_ms']:.2f})"
    attention_queued = (
        f" (queued {row['fwd_queued_ms']:.2f}/{row['bwd_queued_ms']:.2f})" if "fwd_queued_ms" in row else ""
    )
    clocks = "/".join(f"{row[name]:.0f}" for name in ("sm_clock_mhz", "sm_clock_queued_mhz") if name in row)
    return (
        f"{row['shape']:10s} N={row['seq_len']:7d} {row['impl']:24s} density={row['density']:.4f} "
        f"fwd/bwd={row['fwd_ms']:.2f}/{row['bwd_ms']:.2f}{attention_queued} index={row['index_ms']:.2f}{queued} ms "
        f"dense-eq fwd+bwd {row['dense_equiv_tflops']['fwd_bwd']:7.1f} TFLOP/s{f' at {clocks} MHz' if clocks else ''}"
        f"{check}"
    )


def latest_run(rows: list[dict]) -> list[dict]:
    """The rows of the last run in an appended JSONL: those with the last row's ``date`` (one per run)."""
    return [r for r in rows if r["date"] == rows[-1]["date"]] if rows else []


def speedup(base: dict, row: dict) -> dict:
    return {
        "fwd": base["fwd_ms"] / row["fwd_ms"],
        "bwd": base["bwd_ms"] / row["bwd_ms"],
        "fwd_bwd": (base["fwd_ms"] + base["bwd_ms"]) / (row["fwd_ms"] + row["bwd_ms"]),
    }


def queued_ms(row: dict) -> float | None:
    """fwd+bwd ms timed queued (the GPU's time; see :func:`fwd_bwd_timings`), or None where not timed."""
    return row["fwd_queued_ms"] + row["bwd_queued_ms"] if "fwd_queued_ms" in row else None


def with_speedups(row: dict, rows: list[dict]) -> dict:
    """``row`` plus its speed-ups over the rows of ``rows`` at the same shape and N in the same run, where there
    are such rows: ``vs_sdpa_cudnn`` and ``vs_sdpa_flash``, and ``vs_flex`` over its ``FLEX_PEER`` row of the
    same target sparsity (fixed-budget patterns only), and ``vs_flex_queued`` (fwd+bwd) where both were timed
    queued."""
    enriched = dict(row)

    def same_run(r: dict) -> bool:
        return r["shape"] == row["shape"] and r["seq_len"] == row["seq_len"] and r["date"] == row["date"]

    for name in ("sdpa_cudnn", "sdpa_flash"):
        base = next((r for r in rows if r["impl"] == name and same_run(r)), None)
        if base:
            enriched[f"vs_{name}"] = speedup(base, row)
    peer = FLEX_PEER.get(row["impl"]) if "target_sparsity" in row else None
    base = next(
        (r for r in rows if r["impl"] == peer and same_run(r) and r.get("target_sparsity") == row["target_sparsity"]),
        None,
    )
    if base:
        enriched["vs_flex"] = speedup(base, row)
        if queued_ms(base) and queued_ms(row):
            enriched["vs_flex_queued"] = queued_ms(base) / queued_ms(row)
    return enriched


def write_table(rows: list[dict], path: str) -> None:
    lines = (
        [
            f"GPU {rows[0]['gpu']}, torch {rows[0]['torch']}, commit {rows[0]['commit']}, {rows[0]['date']}; "
            "causal bf16, batch 1; ms are medians of CUDA-event timings; index ms queued: the index steps with the "
            "host's launches queued ahead of the GPU (GPU time plus the host time after its syncs), and fwd+bwd "
            f"queued likewise (N ≤ {QUEUED_MAX_LEN}); × Flex: over "
            "FlexAttention on the same pattern, whose index ms is its BlockMask construction (plus the estimation).",
            "",
            "| shape | N | impl | density | fwd ms | bwd ms | fwd+bwd ms | fwd+bwd ms queued | index ms "
            "| index ms queued | dense-eq TFLOP/s (fwd/bwd/all) | actual TFLOP/s (all) | × cuDNN (fwd/bwd/all) "
            "| × Flex (fwd/bwd/all) | × Flex queued (all) | × flash (all) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        if rows
        else []
    )

    def ratios(s: dict | None) -> str:
        return f"{s['fwd']:.2f}/{s['bwd']:.2f}/{s['fwd_bwd']:.2f}" if s else "–"

    for row in rows:
        r = row if row["impl"].startswith("sdpa") else with_speedups(row, rows)
        de, ac = r["dense_equiv_tflops"], r["actual_tflops"]
        fl = r.get("vs_sdpa_flash")
        impl = r["impl"] + (f" (top-P {r['top_p']})" if "top_p" in r else "")
        cells = [
            r["shape"],
            r["seq_len"],
            impl,
            f"{r['density']:.4f}",
            f"{r['fwd_ms']:.2f}",
            f"{r['bwd_ms']:.2f}",
            f"{r['fwd_ms'] + r['bwd_ms']:.2f}",
            f"{queued_ms(r):.2f}" if queued_ms(r) else "–",
            f"{r['index_ms']:.2f}",
            f"{r['index_queued_ms']:.2f}" if "index_queued_ms" in r else "–",
            f"{de['fwd']:.0f}/{de['bwd']:.0f}/{de['fwd_bwd']:.0f}",
            f"{ac['fwd_bwd']:.0f}",
            ratios(r.get("vs_sdpa_cudnn")),
            ratios(r.get("vs_flex")),
            f"{r['vs_flex_queued']:.2f}" if "vs_flex_queued" in r else "–",
            f"{fl['fwd_bwd']:.2f}" if fl else "–",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    print(text)


# how the plot names each implementation, before its pattern
IMPL_LABEL = {
    "mtraining_deterministic": "deterministic",
    "mtraining_blocks": "block-only",
    "flex_attention": "Flex",
    "flex_attention_blocks": "Flex block-only",
}


def pattern_label(row: dict) -> str:
    if "top_p" in row:
        return f" top-P {row['top_p']:.2f} (structured q/k)"
    return "" if row["impl"] == "mtraining_dense" else f" sparsity {row.get('target_sparsity', 0):.2f}"


def write_plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        print("# matplotlib missing: no plot (run --report-only on the JSONL elsewhere)", file=sys.stderr)
        return
    figure = speedup_figure(rows)
    if figure is None:
        print("# no sdpa_cudnn rows to compare with: no plot", file=sys.stderr)
        return
    figure.savefig(path, dpi=120)
    print(f"# plot written to {path}")


def speedup_figure(rows: list[dict]):
    """A matplotlib figure of fwd+bwd speed-up over cuDNN against N: one panel per shape, one colour per
    implementation and pattern (deterministic runs dashed in the colour of the default ones), Flex dotted;
    None when no row has a cuDNN row to compare with."""
    import matplotlib.pyplot as plt

    series: dict[str, dict[str, list[tuple[int, float]]]] = {}  # shape -> label -> (N, speed-up)
    for r in (with_speedups(row, rows) for row in rows if not row["impl"].startswith("sdpa")):
        if "vs_sdpa_cudnn" not in r:
            continue
        label = (IMPL_LABEL.get(r["impl"], "") + pattern_label(r)).strip() or "dense mode"
        series.setdefault(r["shape"], {}).setdefault(label, []).append((r["seq_len"], r["vs_sdpa_cudnn"]["fwd_bwd"]))
    if not series:
        return None
    labels = sorted({label for by_label in series.values() for label in by_label})
    colors = {
        label: plt.get_cmap("tab10")(i % 10)
        for i, label in enumerate(sorted({label.removeprefix("deterministic ") for label in labels}))
    }
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 4.5), sharey=True, squeeze=False)
    for ax, (shape, by_label) in zip(axes[0], sorted(series.items())):
        for label, points in sorted(by_label.items()):
            points.sort()
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                marker="o",
                label=label,
                color=colors[label.removeprefix("deterministic ")],
                linestyle="--" if label.startswith("deterministic") else ":" if label.startswith("Flex") else "-",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(shape)
    axes[0][0].set_ylabel("fwd+bwd speed-up over\nSDPA cuDNN (dense causal)")
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_lines() if not h.get_label().startswith("_")}
    columns = 2 * len(series)  # two labels fit across a 5-inch panel
    fig.legend([handles[label] for label in labels], labels, loc="lower center", ncol=columns, fontsize=8)
    fig.suptitle(f"{rows[0]['gpu']}, bf16, causal, batch {rows[0].get('batch', 1)}")
    fig.tight_layout(rect=(0, 0.06 * (1 + (len(labels) - 1) // columns), 1, 1))
    return fig


if __name__ == "__main__":
    main()
