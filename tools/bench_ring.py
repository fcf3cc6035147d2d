"""Benchmark the sparse ring (striped vs zigzag) against the dense ring on the GPUs of one host.

    torchrun --nproc-per-node 2 tools/bench_ring.py --seq-lens 131072 262144 524288

For each (N, layout, pattern) it times forward+backward of ``ring_attention`` (median of CUDA-event
timings, fresh random inputs per repeat, after warm-up), and the same per-step kernel launches with
no communication ("compute"); exposed communication is ring time minus the slowest rank's compute.
The sparse pattern is ``balance.realistic_pattern`` with as many far slashes/verticals as reach the
requested density; the dense ring is the full causal pattern through the same ring and kernels.
Rank 0 prints a table and appends one JSON object per configuration to ``--jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess

import torch
import torch.distributed as dist

from megatron_mtraining.balance import balance_report, realistic_pattern
from megatron_mtraining.ring import ring_attention
from megatron_mtraining.ring_groups import RingGroups
from mtraining_kernels.index import convert_index, count_work
from mtraining_kernels.interface import get_backend
from mtraining_kernels.layout import BLOCK_SIZE, Layout
from mtraining_kernels.reference import full_index, slash_block_hits


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 262144, 524288])
    parser.add_argument("--layouts", nargs="+", default=["striped", "zigzag"])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--density", type=float, default=0.05, help="target computed fraction of the causal area")
    parser.add_argument("--dense-max-len", type=int, default=0,
                        help="also time the dense ring (full pattern) for N up to this length")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--jsonl", default="docs/benchmarks/ring.jsonl")
    return parser.parse_args()


def block_density(s_idx, seq_len: int) -> float:
    """Fraction of causal 128-blocks the slashes switch on (what the bisection steers; bars are extra)."""
    num_blocks = seq_len // BLOCK_SIZE
    hit = slash_block_hits(s_idx, num_blocks).double()                   # [b, H, NB]
    blocks_at_distance = num_blocks - torch.arange(num_blocks, dtype=torch.float64)
    return float((hit * blocks_at_distance).sum() / (hit.shape[0] * hit.shape[1] * num_blocks * (num_blocks + 1) / 2))


def pattern_with_density(seq_len: int, heads: int, density: float, seed: int):
    """A realistic pattern whose computed fraction of the causal area is close to ``density``."""
    lo, hi = 0, seq_len // BLOCK_SIZE
    while lo < hi:  # smallest far-line count reaching the block density
        lines = (lo + hi) // 2
        _, s_idx = realistic_pattern(seq_len, heads, far_slashes=lines, far_verticals=lines, seed=seed)
        lo, hi = (lines + 1, hi) if block_density(s_idx, seq_len) < density else (lo, lines)
    v_idx, s_idx = realistic_pattern(seq_len, heads, far_slashes=lo, far_verticals=lo, seed=seed)
    report = balance_report(v_idx, s_idx, Layout("contiguous", 1), seq_len)
    computed = report.blocks.sum().item() * BLOCK_SIZE ** 2 + report.bars.sum().item() * BLOCK_SIZE
    return v_idx, s_idx, computed / (heads * seq_len * (seq_len + 1) / 2)


def timed(fn, warmup: int, repeats: int, group) -> float:
    """Median milliseconds of ``fn`` over repeats (all ranks start together)."""
    times = []
    for i in range(warmup + repeats):
        dist.barrier(group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def compute_only(backend, q, k, v, dout, index, groups, scale):
    """The ring's per-step kernel launches for this rank with no communication (K/V stand in for every source)."""
    b, n_loc, hq, d = q.shape
    out = torch.zeros(b, n_loc, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, n_loc), float("-inf"), device=q.device)
    sources = [groups.source_of(o, i) for o in range(groups.outer_size) for i in range(groups.inner_size)]
    for step, src in enumerate(sources):
        backend.block_bar_forward(q, k, v, index.blk_ptr[src], index.blk_col, index.bar_ptr[src], index.bar_col,
                                  out, lse, causal_diag=step == 0, softmax_scale=scale)
    delta = (out * dout.float()).sum(-1).transpose(1, 2).contiguous()
    dq = torch.zeros_like(out)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for step, src in enumerate(sources):
        backend.block_bar_backward(q, k, v, dout, lse, delta, index.blk_ptr[src], index.blk_col,
                                   index.bar_ptr[src], index.bar_col, dq, dk, dv, causal_diag=step == 0,
                                   softmax_scale=scale)


def main() -> None:
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda")
    groups = RingGroups.flat(dist.group.WORLD)
    backend = get_backend(args.backend)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = []
    for seq_len in args.seq_lens:
        v_sparse, s_sparse, density = pattern_with_density(seq_len, args.heads, args.density, seed=seq_len)
        patterns = [("sparse", v_sparse, s_sparse, density)]
        if seq_len <= args.dense_max_len:
            patterns.append(("dense", *full_index(1, args.heads, seq_len), 1.0))
        for kind in args.layouts:
            layout = Layout(kind, world)
            for pattern, v_idx, s_idx, dens in patterns:
                index = convert_index(v_idx.to(device), s_idx.to(device), layout, rank, seq_len)
                n_loc = seq_len // world
                shape_q = (1, n_loc, args.heads, args.head_dim)
                shape_kv = (1, n_loc, args.kv_heads, args.head_dim)
                q, dout = (torch.randn(shape_q, device=device, dtype=torch.bfloat16) for _ in range(2))
                k, v = (torch.randn(shape_kv, device=device, dtype=torch.bfloat16) for _ in range(2))
                q.requires_grad_(), k.requires_grad_(), v.requires_grad_()

                def ring_step():
                    out = ring_attention(q, k, v, index, groups, backend=args.backend)
                    out.backward(dout)

                ring_ms = timed(ring_step, args.warmup, args.repeats, groups.cp)
                scale = args.head_dim ** -0.5
                with torch.no_grad():
                    comp_ms = timed(lambda: compute_only(backend, q.detach(), k.detach(), v.detach(), dout, index,
                                                          groups, scale), args.warmup, args.repeats, groups.cp)
                per_rank = torch.tensor([comp_ms], device=device)
                everyone = [torch.zeros_like(per_rank) for _ in range(world)]
                dist.all_gather(everyone, per_rank)
                comp = [t.item() for t in everyone]
                report = balance_report(v_idx, s_idx, layout, seq_len) if pattern == "sparse" else None
                row = dict(
                    gpu=torch.cuda.get_device_name(), commit=commit, date=datetime.date.today().isoformat(),
                    world_size=world, inner=world, outer=1, seq_len=seq_len, layout=kind, pattern=pattern,
                    heads_q=args.heads, heads_kv=args.kv_heads, head_dim=args.head_dim, density=round(dens, 4),
                    fwd_bwd_ms=round(ring_ms, 3), compute_ms=round(max(comp), 3),
                    exposed_comm_frac=round(max(0.0, ring_ms - max(comp)) / ring_ms, 4),
                    imbalance_worker=round(max(comp) / statistics.mean(comp), 4),
                    imbalance_step=round(report.step_imbalance, 4) if report else 1.0,
                    analytic_worker=round(report.worker_imbalance, 4) if report else 1.0,
                    blocks_this_rank=int(count_work(index)[0].sum()),
                )
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
                del index, q, k, v, dout
                torch.cuda.empty_cache()
    if rank == 0:
        os.makedirs(os.path.dirname(args.jsonl) or ".", exist_ok=True)
        with open(args.jsonl, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"{'N':>8} {'layout':>8} {'pattern':>7} {'density':>7} {'fwd+bwd ms':>10} {'compute ms':>10} "
              f"{'exposed':>7} {'imb.w':>6}")
        for r in rows:
            print(f"{r['seq_len']:>8} {r['layout']:>8} {r['pattern']:>7} {r['density']:>7.3f} {r['fwd_bwd_ms']:>10.2f} "
                  f"{r['compute_ms']:>10.2f} {r['exposed_comm_frac']:>7.3f} {r['imbalance_worker']:>6.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
