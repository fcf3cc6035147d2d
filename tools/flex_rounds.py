"""Our sparse attention against FlexAttention on exactly our mask, in alternating rounds in one process.

``bench_attention.py`` times each implementation once, minutes apart. Under a GPU's power cap the clocks drift
between the two timings, so one run's ratio moves by a few percent from run to run (docs/benchmarks.md). Here every
round times ours and Flex back to back, in alternating order, on the same inputs and mask
(``bench_attention.measure``: launched, and queued behind its sleep up to ``QUEUED_MAX_LEN``; there also launched
between one pair of events, ``bench_attention.measure_step``, without the event between forward and backward that a
host-bound step waits on, and so again with autograd's backward run on the calling thread, without its hand-over to
the CUDA device thread), and the ratio is read per round: its median and its range over the rounds.

Inputs as ``trace_steps.py``'s: Qwen2.5-3B shape, bf16, one sample, and ``profile_step.sparse_pattern``'s block
pattern of the mask area of the bench's budget, drawn from a generator of its own (so its density differs slightly
from the bench's row). Flex's BlockMask is ``flex_peer.block_only_block_mask`` of the same lists, checked against
ours first (``bench_attention.flex_check``). One row per implementation, N and round is appended to ``--jsonl``; the
summary per N is printed.

    python tools/flex_rounds.py --seq-lens 131072 32768 --rounds 8 --reps 7
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch
from bench_attention import QUEUE_LEAD_MS, QUEUED_MAX_LEN, SHAPES, flex_check, mask_density, measure, measure_step
from flex_peer import block_only_block_mask, flex_forward, heads_first
from profile_step import sparse_pattern
from provenance import git_commit

from mtraining_kernels import Layout, convert_index, sparse_attention

IMPLEMENTATIONS = ("mtraining_blocks", "flex_attention_blocks")  # bench_attention.py's names of the two rows
BLOCK_PATTERNS = ("block_only", "block_band")
PAIRED = "_paired"  # the suffix of the fwd+bwd timed between one pair of events: ``step_paired_ms``
CALLER = "_caller"  # the same with autograd's backward on the calling thread: ``step_caller_ms``
MODES = {  # the timings' field suffixes
    "": "launched",
    "_queued": "queued",
    PAIRED: "launched, one event pair",
    CALLER: "launched, one event pair, backward on the calling thread",
}


def step_ms(row: dict, suffix: str = "") -> float:
    """A row's fwd+bwd milliseconds, launched (``suffix`` ""), queued ("_queued"), launched between one pair of
    events (``PAIRED``), or so with the backward on the calling thread (``CALLER``)."""
    if suffix in (PAIRED, CALLER):
        return row[f"step{suffix}_ms"]
    return row[f"fwd{suffix}_ms"] + row[f"bwd{suffix}_ms"]


def ratio_summary(rows: list[dict], suffix: str = "") -> dict[str, float]:
    """Flex's fwd+bwd time over ours, from one N's rows (``impl``, ``round`` and the fields :func:`step_ms`
    reads for ``suffix``): per round its ``median``, ``low`` and ``high``, and ``of_medians``, the ratio of the two
    implementations' median times. Rounds missing either implementation are left out."""
    steps = {impl: {} for impl in IMPLEMENTATIONS}
    for row in rows:
        steps[row["impl"]][row["round"]] = step_ms(row, suffix)
    ours, flex = (steps[impl] for impl in IMPLEMENTATIONS)
    rounds = sorted(ours.keys() & flex.keys())
    if not rounds:
        raise ValueError(f"no round holds both {IMPLEMENTATIONS[0]} and {IMPLEMENTATIONS[1]} rows")
    ratios = [flex[r] / ours[r] for r in rounds]
    return dict(
        median=statistics.median(ratios),
        low=min(ratios),
        high=max(ratios),
        of_medians=statistics.median(flex[r] for r in rounds) / statistics.median(ours[r] for r in rounds),
        rounds=len(rounds),
    )


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse what cannot run, naming the value, before any work."""
    for seq_len in args.seq_lens:
        if seq_len <= 0 or seq_len % 128:
            raise SystemExit(f"--seq-lens {seq_len}: give positive multiples of 128")
    for name in ("rounds", "reps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} {getattr(args, name)}: give at least 1")
    if args.warmup < 0:
        raise SystemExit(f"--warmup {args.warmup}: give 0 or more")
    if not torch.cuda.is_available():
        raise SystemExit("flex_rounds.py needs a CUDA device")


def steps_of(args: argparse.Namespace, seq_len: int) -> tuple[dict, dict]:
    """(``{impl: (forward, backward)}`` on one N's fresh inputs and pattern, the pattern's fields for the rows),
    after Flex's cross-check against ours."""
    heads, kv_heads, dim = SHAPES["qwen2.5-3b"]
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(args.seed)
    q, k, v, dout = (
        torch.randn(1, seq_len, h, dim, generator=generator).to(device, torch.bfloat16)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    pattern = argparse.Namespace(seq_len=seq_len, seed=args.seed, sparsity=args.sparsity, pattern=args.pattern)
    v_idx, s_idx = sparse_pattern(pattern, heads, device)
    index = convert_index(v_idx, s_idx, Layout("contiguous", 1), 0, seq_len)
    mask = block_only_block_mask(s_idx, seq_len)
    ours = [t.requires_grad_() for t in (q, k, v)]
    theirs = [heads_first(t).requires_grad_() for t in (q, k, v)]
    check = flex_check(*ours, dout, index, mask, dim**-0.5, f"N={seq_len} {args.pattern}")
    dout_heads_first = heads_first(dout)
    steps = {
        IMPLEMENTATIONS[0]: (
            lambda: sparse_attention(*ours, index, backend="triton"),
            lambda out: torch.autograd.grad(out, ours, dout),
        ),
        IMPLEMENTATIONS[1]: (
            lambda: flex_forward(*theirs, mask, dim**-0.5),
            lambda out: torch.autograd.grad(out, theirs, dout_heads_first),
        ),
    }
    return steps, dict(pattern=args.pattern, density=mask_density(v_idx, s_idx, seq_len), flex_check=check)


def time_round(steps: dict, order, leads: dict[str, float], warmup: int, reps: int) -> dict[str, dict[str, float]]:
    """One round: ``{impl: {fwd{suffix}_ms, bwd{suffix}_ms}}``, each mode of ``leads`` (field suffix → the queue
    lead of ``bench_attention.measure``; ``PAIRED``: ``step_paired_ms`` by ``bench_attention.measure_step``;
    ``CALLER``: ``step_caller_ms`` likewise, under ``torch.autograd.set_multithreading_enabled(False)``, so autograd
    runs the backward on the calling thread instead of handing it to its CUDA device thread) timed for the
    implementations in ``order``, one after the other."""
    timings = {impl: {} for impl in order}
    for suffix, lead in leads.items():
        for impl in order:
            forward, backward = steps[impl]
            if suffix in (PAIRED, CALLER):
                with torch.autograd.set_multithreading_enabled(suffix != CALLER):
                    timings[impl][f"step{suffix}_ms"] = measure_step(forward, backward, warmup, reps)
                continue
            fwd_ms, bwd_ms = measure(forward, backward, warmup, reps, lead)
            timings[impl].update({f"fwd{suffix}_ms": fwd_ms, f"bwd{suffix}_ms": bwd_ms})
    return timings


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 32768])
    parser.add_argument("--pattern", default="block_only", choices=BLOCK_PATTERNS)
    parser.add_argument("--sparsity", type=float, default=0.95, help="the bench's budget whose mask area is kept")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per round, implementation and mode")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--jsonl", default="docs/benchmarks/flex_rounds.jsonl")
    args = parser.parse_args(argv)
    check_arguments(args)
    base = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        commit=args.commit or git_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        shape="qwen2.5-3b",
        dtype="bf16",
        batch=1,
        target_sparsity=args.sparsity,
    )
    for seq_len in args.seq_lens:
        torch.cuda.empty_cache()
        steps, fields = steps_of(args, seq_len)
        short = seq_len <= QUEUED_MAX_LEN
        leads = {"": 0.0, PAIRED: 0.0, CALLER: 0.0, "_queued": QUEUE_LEAD_MS} if short else {"": 0.0}
        rows = []
        for round_ in range(args.rounds):
            order = IMPLEMENTATIONS if round_ % 2 == 0 else IMPLEMENTATIONS[::-1]
            timings = time_round(steps, order, leads, args.warmup, args.reps)
            for impl in IMPLEMENTATIONS:
                rows.append(dict(base, impl=impl, seq_len=seq_len, round=round_, **fields, **timings[impl]))
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
            ours, flex = (timings[impl] for impl in IMPLEMENTATIONS)
            ratios = ", ".join(f"{MODES[s]} {step_ms(flex, s) / step_ms(ours, s):.3f}×" for s in leads)
            print(f"N={seq_len} round {round_}: Flex / ours {ratios}", flush=True)
        for suffix in leads:
            summary = ratio_summary(rows, suffix)
            print(
                f"N={seq_len} {args.pattern} {MODES[suffix]}: Flex / ours per round median "
                f"{summary['median']:.3f}× (range {summary['low']:.3f}–{summary['high']:.3f}× over {summary['rounds']} "
                f"rounds), ratio of the median times {summary['of_medians']:.3f}×",
                flush=True,
            )
        del steps


if __name__ == "__main__":
    main()
