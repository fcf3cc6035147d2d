"""Benchmark the sparse ring (striped vs zigzag) against the dense ring on the GPUs of one host.

    torchrun --nproc-per-node 2 tools/bench_ring.py --seq-lens 131072 262144 524288

For each (N, layout, pattern) it times forward+backward of ``ring_attention`` (median of CUDA-event
timings, fresh random inputs per repeat, after warm-up), and the ring's own forward and backward steps
over exchanges that move nothing ("compute"); exposed communication is ring time minus the slowest rank's compute.
The sparse pattern is ``realistic_pattern`` with as many far slashes/verticals as reach the
requested density; the dense ring is the full causal pattern through the same ring and kernels.
With ``--sdpa-max-len`` it also times the honest dense baseline: the zigzag dense ring on torch's SDPA
kernels (``megatron_mtraining.ring.dense_ring``, cuDNN unless ``--sdpa-impl flash``), as pattern ``sdpa_cudnn``
(or ``sdpa_flash``); its "compute" is that ring's steps (SDPA calls and merges) with no communication.
With ``--inner-size L`` the sparse ring is hierarchical (inner rings of L ranks, an outer ring over them).
``--emulate-node-size`` is a benchmark-only emulation (``slow_link.py``): ranks form nodes of that many
consecutive ranks (a hierarchical ring's nodes are its inner rings) and every transfer
between nodes is ``--outer-slowdown`` times slower than the intra-node bandwidth measured at the start;
rows then carry ``emulated_node_size``, ``outer_slowdown``, ``inner_gbps`` and ``model_fwd_bwd_ms``, the analytic
model's time (``ring_model.py``) from the measured compute and bandwidth.
``--mixtures`` (PACKED.md; default ``none``, unpacked) also times packed sequences of the mixtures of
``document_mixtures.MIXTURES`` (one draw per N, seed ``--mixture-seed``): the sparse pattern is
``realistic_document_index`` (every document of at least ``--min-sparse-length`` tokens its own realistic
pattern with the far-line count of the unpacked sparse pattern, scaled to its length; shorter ones dense) and
the baseline, in the same run, is the dense ring with the same document mask (``DocumentIndex.dense`` through
the same ring and kernels, pattern ``dense``); the SDPA ring has no document mask, so its rows are unpacked
only. A packed row's ``density`` is its ring work over that of every document dense.
Rank 0 prints a table and appends one JSON object per configuration to ``--jsonl`` (``mixture``: ``none`` or
the mixture's name, ``documents``: per sequence).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
from document_mixtures import MIXTURES, realistic_document_index
from provenance import git_commit
from realistic_pattern import realistic_pattern
from ring_model import CellCosts, flat_ring, hierarchical_ring, hop_bytes
from slow_link import SlowLink, SlowLinkRingGroups

from megatron_mtraining.attention_stats import document_work_density
from megatron_mtraining.balance import balance_report, document_balance_report
from megatron_mtraining.config import DEFAULT_MIN_SPARSE_LENGTH
from megatron_mtraining.ring.comm import RingExchange
from megatron_mtraining.ring.dense_ring import dense_ring_attention, dense_ring_backward, dense_ring_forward
from megatron_mtraining.ring.groups import RingGroups, build_hierarchical_groups
from megatron_mtraining.ring.sparse_ring import ring_attention, sparse_ring_backward, sparse_ring_forward
from mtraining_kernels.document_conversion import convert_document_index
from mtraining_kernels.document_index import DocumentIndex
from mtraining_kernels.documents import Documents
from mtraining_kernels.index import BlockBarIndex, convert_index, count_work
from mtraining_kernels.interface import get_backend
from mtraining_kernels.layout import BLOCK_SIZE, Layout
from mtraining_kernels.sdpa_backend import IMPLS
from mtraining_kernels.vertical_slash import full_index, slash_block_hits

UNPACKED = "none"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 262144, 524288])
    parser.add_argument("--layouts", nargs="+", default=["striped", "zigzag"])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--density", type=float, default=0.05, help="target computed fraction of the causal area")
    parser.add_argument(
        "--dense-max-len", type=int, default=0, help="also time the dense ring (full pattern) for N up to this length"
    )
    parser.add_argument(
        "--sdpa-max-len",
        type=int,
        default=0,
        help="also time the zigzag dense ring on torch's SDPA kernels for N up to this length",
    )
    parser.add_argument("--sdpa-impl", choices=IMPLS, default="cudnn", help="SDPA kernel of that dense ring")
    parser.add_argument(
        "--inner-size",
        type=int,
        default=0,
        help="hierarchical sparse ring with inner rings of this many ranks (0: flat ring)",
    )
    parser.add_argument(
        "--emulate-node-size",
        type=int,
        default=0,
        help="BENCHMARK EMULATION: nodes of this many consecutive ranks whose links to each other are "
        "--outer-slowdown times slower than the measured intra-node bandwidth (0: off)",
    )
    parser.add_argument("--outer-slowdown", type=float, default=10.0)
    parser.add_argument(
        "--mixtures",
        nargs="+",
        choices=[UNPACKED, *MIXTURES],
        default=[UNPACKED],
        help="document mixtures: none (unpacked) and the packed ones of tools/document_mixtures.py",
    )
    parser.add_argument("--mixture-seed", type=int, default=0, help="seed of the mixtures' document lengths")
    parser.add_argument(
        "--min-sparse-length",
        type=int,
        default=DEFAULT_MIN_SPARSE_LENGTH,
        help="packed documents at least this long get a sparse pattern, shorter ones are dense",
    )
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--jsonl", default="docs/benchmarks/ring.jsonl")
    return parser.parse_args(argv)


def block_density(s_idx, seq_len: int) -> float:
    """Fraction of causal 128-blocks the slashes switch on (what the bisection steers; bars are extra)."""
    num_blocks = seq_len // BLOCK_SIZE
    hit = slash_block_hits(s_idx, num_blocks).double()  # [b, H, NB]
    blocks_at_distance = num_blocks - torch.arange(num_blocks, dtype=torch.float64)
    return float((hit * blocks_at_distance).sum() / (hit.shape[0] * hit.shape[1] * num_blocks * (num_blocks + 1) / 2))


def far_lines_for_density(seq_len: int, heads: int, density: float, seed: int) -> int:
    """The smallest far-line count (slashes = verticals) of a realistic pattern reaching the block ``density``."""
    lo, hi = 0, seq_len // BLOCK_SIZE
    while lo < hi:
        lines = (lo + hi) // 2
        _, s_idx = realistic_pattern(seq_len, heads, far_slashes=lines, far_verticals=lines, seed=seed)
        lo, hi = (lines + 1, hi) if block_density(s_idx, seq_len) < density else (lo, lines)
    return lo


def pattern_with_density(seq_len: int, heads: int, density: float, seed: int):
    """A realistic pattern whose computed fraction of the causal area is close to ``density``."""
    lo = far_lines_for_density(seq_len, heads, density, seed)
    v_idx, s_idx = realistic_pattern(seq_len, heads, far_slashes=lo, far_verticals=lo, seed=seed)
    report = balance_report(v_idx, s_idx, Layout("contiguous", 1), seq_len)
    computed = report.blocks.sum().item() * BLOCK_SIZE**2 + report.bars.sum().item() * BLOCK_SIZE
    return v_idx, s_idx, computed / (heads * seq_len * (seq_len + 1) / 2)


@dataclass(frozen=True)
class Pattern:
    """One timed pattern of one sequence: unpacked (``v_idx``/``s_idx``) or packed (``documents``, a
    :class:`DocumentIndex`), ``sparse`` or the dense baseline of the same mask."""

    name: str
    seq_len: int
    sparse: bool
    v_idx: torch.Tensor | None = None
    s_idx: torch.Tensor | None = None
    documents: DocumentIndex | None = None
    unpacked_density: float = 1.0

    @property
    def num_documents(self) -> int:
        return 1 if self.documents is None else int(self.documents.documents.num_documents[0])

    def lists(self, layout: Layout, rank: int, device) -> BlockBarIndex:
        """This rank's block and bar lists (with the documents, packed) for the ring."""
        if self.documents is None:
            return convert_index(self.v_idx.to(device), self.s_idx.to(device), layout, rank, self.seq_len)
        index = self.documents
        documents = Documents(index.documents.starts.to(device), self.seq_len)
        moved = DocumentIndex(documents, *(x.to(device) for x in (index.sparse, index.v_idx, index.s_idx)))
        return convert_document_index(moved, layout, rank)

    def density(self, layout: Layout) -> float:
        """Computed fraction of the mask: of the causal area unpacked, of every document dense packed."""
        return self.unpacked_density if self.documents is None else document_work_density(self.documents, layout)

    def report(self, layout: Layout):
        """The sparse pattern's analytic balance (None for the dense baseline)."""
        if not self.sparse:
            return None
        if self.documents is None:
            return balance_report(self.v_idx, self.s_idx, layout, self.seq_len)
        return document_balance_report(self.documents, layout)


def mixture_patterns(args, mixture: str, seq_len: int, far_lines: int, unpacked: tuple | None = None) -> list[Pattern]:
    """The sparse pattern of ``mixture`` at ``seq_len`` (and its dense baseline where timed).

    Unpacked: ``unpacked`` = (v_idx, s_idx, density) of :func:`pattern_with_density`, the full causal pattern as
    baseline for N ≤ ``--dense-max-len``. Packed: one draw of the mixture, every long document its own realistic
    pattern with ``far_lines`` scaled to its length, and always the dense baseline of the same document mask.
    """
    if mixture == UNPACKED:
        v_idx, s_idx, density = unpacked
        patterns = [Pattern("sparse", seq_len, True, v_idx, s_idx, unpacked_density=density)]
        if seq_len <= args.dense_max_len:
            patterns.append(Pattern("dense", seq_len, False, *full_index(1, args.heads, seq_len)))
        return patterns
    documents = MIXTURES[mixture](seq_len, args.mixture_seed)
    sparse = realistic_document_index(
        documents,
        args.heads,
        min_sparse_length=args.min_sparse_length,
        far_slashes=far_lines,
        far_verticals=far_lines,
        seed=seq_len,
    )
    return [
        Pattern("sparse", seq_len, True, documents=sparse),
        Pattern("dense", seq_len, False, documents=DocumentIndex.dense(documents, args.heads)),
    ]


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


def link_bytes_per_s(group, nbytes: int, device, repeats: int = 5) -> float:
    """Median one-way bandwidth of a ring exchange of ``nbytes`` over ``group`` (every rank sends and receives)."""
    exchange = RingExchange(group)
    payload = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def hop():
        exchange.post(payload)
        exchange.wait()

    return nbytes / (timed(hop, 1, repeats, group) / 1e3)


def ring_groups(args, groups: RingGroups, seq_len: int, device) -> tuple[RingGroups, dict]:
    """The sparse ring's ``groups`` at ``seq_len``, with emulated slow links when asked, and the row fields that
    describe them."""
    world = groups.world_size
    fields = dict(inner=groups.inner_size, outer=groups.outer_size)
    if args.emulate_node_size:
        kv_bytes, _ = hop_bytes(seq_len, world, args.kv_heads, args.head_dim)
        inner_bytes_per_s = link_bytes_per_s(groups.inner if groups.inner_size > 1 else groups.cp, kv_bytes, device)
        link = SlowLink(args.emulate_node_size, args.outer_slowdown, inner_bytes_per_s)
        groups = SlowLinkRingGroups.wrap(groups, link)
        fields.update(
            emulated_node_size=link.node_size,
            outer_slowdown=link.slowdown,
            inner_gbps=round(inner_bytes_per_s / 1e9, 1),
        )
    return groups, fields


def model_fwd_bwd_ms(args, seq_len: int, world: int, topology: dict, compute_ms: float) -> float:
    """The ring model's forward + backward ms for this emulated topology: the measured compute of the slowest
    rank split evenly over its W cells (forward : backward = 1 : 2.5), bf16 K/V, fp32 gradient wire."""
    cell_s = compute_ms / world / 1e3
    inner_bytes_per_s = topology["inner_gbps"] * 1e9
    kv_bytes, grad_bytes = hop_bytes(seq_len, world, args.kv_heads, args.head_dim)
    costs = CellCosts(
        cell_s / 3.5,
        cell_s * 2.5 / 3.5,
        kv_bytes=kv_bytes,
        grad_bytes=grad_bytes,
        inner_bytes_per_s=inner_bytes_per_s,
        outer_bytes_per_s=inner_bytes_per_s / topology["outer_slowdown"],
    )
    if topology["outer"] > 1:
        return hierarchical_ring(costs, topology["inner"], topology["outer"]).total_s * 1e3
    return flat_ring(costs, world, topology["emulated_node_size"]).total_s * 1e3


def ring_inputs(local_len: int, args, device) -> tuple[torch.Tensor, ...]:
    """Fresh bf16 q, k, v (requiring grad) and dout of one rank: ``[1, local_len, heads, d]``."""
    q, dout = (
        torch.randn(1, local_len, args.heads, args.head_dim, device=device, dtype=torch.bfloat16) for _ in range(2)
    )
    k, v = (
        torch.randn(1, local_len, args.kv_heads, args.head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    return q.requires_grad_(), k, v, dout


def time_ring_and_compute(ring, compute, inputs, args, groups) -> tuple[float, float]:
    """Milliseconds of ``ring(q, k, v)`` forward + backward, and of ``compute(q, k, v, dout)`` without grad."""
    q, k, v, dout = inputs
    ring_ms = timed(lambda: ring(q, k, v).backward(dout), args.warmup, args.repeats, groups.cp)
    with torch.no_grad():
        comp_ms = timed(lambda: compute(q.detach(), k.detach(), v.detach(), dout), args.warmup, args.repeats, groups.cp)
    return ring_ms, comp_ms


class NoTransferExchange:
    """A ring exchange that moves nothing: ``post`` hands the tensor back, as a ring of one does."""

    def post(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return tensor

    def wait(self) -> None:
        pass


@dataclass(frozen=True)
class NoTransferRingGroups(RingGroups):
    """A ring's groups and sources with exchanges that move nothing: the ring's compute alone, local K/V
    standing in for every source."""

    @classmethod
    def of(cls, groups: RingGroups) -> "NoTransferRingGroups":
        return cls(cp=groups.cp, inner=groups.inner, outer=groups.outer)

    def exchange(self, group: dist.ProcessGroup, tag: int = 0) -> NoTransferExchange:
        return NoTransferExchange()


def compute_only(backend, q, k, v, dout, index, groups, scale):
    """The sparse ring's forward and backward steps for this rank with no communication."""
    local, kv = NoTransferRingGroups.of(groups), torch.stack([k, v])
    out, lse = sparse_ring_forward(q, kv, index, local, backend, scale)
    sparse_ring_backward(q, kv, dout, out.to(q.dtype), lse, index, local, backend, scale, False, torch.float32)


def sdpa_compute_only(impl, q, k, v, dout, groups, scale):
    """The SDPA dense ring's forward and backward steps (calls and merges) for this rank with no communication."""
    local, kv = NoTransferRingGroups.of(groups), torch.stack([k, v])
    out, lse = dense_ring_forward(q, kv, local, impl, scale)
    dense_ring_backward(q, kv, dout, out.to(q.dtype), lse, local, impl, scale, torch.float32)


def time_sdpa_ring(args, seq_len: int, groups: RingGroups, device) -> dict:
    """fwd+bwd and compute-only milliseconds of the SDPA zigzag dense ring, and this rank's dense block count."""
    rank, world = groups.cp_rank, groups.world_size
    layout = Layout("zigzag", world)
    scale = args.head_dim**-0.5
    ring_ms, comp_ms = time_ring_and_compute(
        lambda q, k, v: dense_ring_attention(q, k, v, layout, groups, impl=args.sdpa_impl),
        lambda q, k, v, dout: sdpa_compute_only(args.sdpa_impl, q, k, v, dout, groups, scale),
        ring_inputs(seq_len // world, args, device),
        args,
        groups,
    )
    full = balance_report(*full_index(1, 1, seq_len), layout, seq_len)  # the full pattern, one head
    return dict(ring_ms=ring_ms, comp_ms=comp_ms, blocks=int(full.blocks[rank].sum()) * args.heads)


def result_row(
    args,
    commit: str,
    world: int,
    seq_len: int,
    layout: str,
    pattern: str,
    density: float,
    timing: dict,
    report,
    device,
    topology: dict | None = None,
    mixture: str = UNPACKED,
    documents: int = 1,
) -> dict:
    """One JSON row; collective (gathers every rank's compute time). ``report`` is the sparse pattern's balance."""
    per_rank = torch.tensor([timing["comp_ms"]], device=device)
    everyone = [torch.zeros_like(per_rank) for _ in range(world)]
    dist.all_gather(everyone, per_rank)
    comp = [t.item() for t in everyone]
    ring_ms = timing["ring_ms"]
    return dict(
        gpu=torch.cuda.get_device_name(),
        commit=commit,
        date=datetime.date.today().isoformat(),
        world_size=world,
        **(topology or dict(inner=world, outer=1)),
        seq_len=seq_len,
        mixture=mixture,
        documents=documents,
        layout=layout,
        pattern=pattern,
        heads_q=args.heads,
        heads_kv=args.kv_heads,
        head_dim=args.head_dim,
        density=round(density, 4),
        fwd_bwd_ms=round(ring_ms, 3),
        compute_ms=round(max(comp), 3),
        exposed_comm_frac=round(max(0.0, ring_ms - max(comp)) / ring_ms, 4),
        imbalance_worker=round(max(comp) / statistics.mean(comp), 4),
        imbalance_step=round(report.step_imbalance, 4) if report else 1.0,
        analytic_worker=round(report.worker_imbalance, 4) if report else 1.0,
        blocks_this_rank=timing["blocks"],
        **(
            {"model_fwd_bwd_ms": round(model_fwd_bwd_ms(args, seq_len, world, topology, max(comp)), 3)}
            if topology and "inner_gbps" in topology
            else {}
        ),
    )


def main() -> None:
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda")
    flat_groups = RingGroups.flat(dist.group.WORLD)
    sparse_groups = build_hierarchical_groups(args.inner_size) if args.inner_size else flat_groups
    backend = get_backend(args.backend)
    commit = git_commit()
    rows = []
    for seq_len in args.seq_lens:
        groups, topology = ring_groups(args, sparse_groups, seq_len, device)
        if seq_len <= args.sdpa_max_len:
            timing = time_sdpa_ring(args, seq_len, flat_groups, device)
            rows.append(
                result_row(args, commit, world, seq_len, "zigzag", f"sdpa_{args.sdpa_impl}", 1.0, timing, None, device)
            )
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
        far_lines = far_lines_for_density(seq_len, args.heads, args.density, seed=seq_len)
        unpacked = pattern_with_density(seq_len, args.heads, args.density, seed=seq_len)
        for mixture in args.mixtures:
            patterns = mixture_patterns(args, mixture, seq_len, far_lines, unpacked)
            for kind in args.layouts:
                layout = Layout(kind, world)
                for pattern in patterns:
                    index = pattern.lists(layout, rank, device)
                    scale = args.head_dim**-0.5
                    ring_ms, comp_ms = time_ring_and_compute(
                        lambda q, k, v: ring_attention(q, k, v, index, groups, backend=args.backend),
                        lambda q, k, v, dout: compute_only(backend, q, k, v, dout, index, groups, scale),
                        ring_inputs(seq_len // world, args, device),
                        args,
                        groups,
                    )
                    timing = dict(ring_ms=ring_ms, comp_ms=comp_ms, blocks=int(count_work(index)[0].sum()))
                    row = result_row(
                        args,
                        commit,
                        world,
                        seq_len,
                        kind,
                        pattern.name,
                        pattern.density(layout),
                        timing,
                        pattern.report(layout),
                        device,
                        topology,
                        mixture=mixture,
                        documents=pattern.num_documents,
                    )
                    rows.append(row)
                    if rank == 0:
                        print(json.dumps(row), flush=True)
                    torch.cuda.empty_cache()
    if rank == 0:
        os.makedirs(os.path.dirname(args.jsonl) or ".", exist_ok=True)
        with open(args.jsonl, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(
            f"{'N':>8} {'mixture':>9} {'layout':>8} {'pattern':>10} {'LxO':>5} {'density':>7} {'fwd+bwd ms':>10} "
            f"{'compute ms':>10} {'exposed':>7} {'imb.w':>6}"
        )
        for r in rows:
            print(
                f"{r['seq_len']:>8} {r['mixture']:>9} {r['layout']:>8} {r['pattern']:>10} "
                f"{r['inner']:>2}x{r['outer']:<2} "
                f"{r['density']:>7.3f} {r['fwd_bwd_ms']:>10.2f} {r['compute_ms']:>10.2f} "
                f"{r['exposed_comm_frac']:>7.3f} {r['imbalance_worker']:>6.3f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
