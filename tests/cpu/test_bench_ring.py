"""tools/bench_ring.py: the model column (the analytic ring time it prints next to an emulated measurement),
and its compute-only rings (the library's ring steps over exchanges that move nothing)."""

from argparse import Namespace

import pytest
from tool_modules import load_tool

bench_ring = load_tool("bench_ring")

ARGS = Namespace(heads=16, kv_heads=2, head_dim=128)


def topology(inner, outer, node_size, gbps, slowdown):
    return dict(inner=inner, outer=outer, emulated_node_size=node_size, inner_gbps=gbps, outer_slowdown=slowdown)


@pytest.mark.parametrize("inner, outer, node_size", [(2, 1, 1), (1, 2, 1), (4, 2, 4), (8, 1, 4)])
def test_fast_links_predict_the_measured_compute(inner, outer, node_size):
    """With links far faster than compute every hop hides, so the model returns the compute it was given."""
    world = inner * outer
    got = bench_ring.model_fwd_bwd_ms(ARGS, 131072, world, topology(inner, outer, node_size, 1e6, 1.0), 100.0)
    assert got == pytest.approx(100.0, rel=1e-3)


def test_slow_links_add_exposed_time_and_the_hierarchy_hides_some():
    """W = 8 at 128K with a 10x slower outer link: the flat ring (nodes of 4) is link-bound, the hierarchy less."""
    flat = bench_ring.model_fwd_bwd_ms(ARGS, 131072, 8, topology(8, 1, 4, 338.0, 10.0), 5.7)
    hierarchical = bench_ring.model_fwd_bwd_ms(ARGS, 131072, 8, topology(4, 2, 4, 338.0, 10.0), 5.7)
    assert flat > 2 * 5.7 and 5.7 < hierarchical < flat


def _compute_only_rank(rank, world_size):
    """On rank 0 only, the benchmark's compute-only sparse and SDPA rings; returns the sparse kernel calls'
    (kernel, source, causal_diag) in order."""
    import torch
    import torch.distributed as dist

    from megatron_mtraining.ring.groups import RingGroups
    from mtraining_kernels import torch_backend
    from mtraining_kernels.index import convert_index
    from mtraining_kernels.layout import Layout
    from mtraining_kernels.vertical_slash import full_index

    if rank != 0:  # a compute-only ring that sent or received anything would wait for this rank forever
        return None
    groups = RingGroups.flat(dist.group.WORLD)
    n, calls = 512, []
    q, dout = torch.randn(1, n // world_size, 2, 16), torch.randn(1, n // world_size, 2, 16)
    k, v = torch.randn(1, n // world_size, 1, 16), torch.randn(1, n // world_size, 1, 16)
    index = convert_index(*full_index(1, 2, n), Layout("striped", world_size), rank, n)

    def source(blk_ptr):
        return next(s for s in range(world_size) if blk_ptr.data_ptr() == index.blk_ptr[s].data_ptr())

    class Recording:
        def block_bar_forward(self, *args, causal_diag, **kwargs):
            calls.append(("forward", source(args[3]), causal_diag))
            torch_backend.block_bar_forward(*args, causal_diag=causal_diag, **kwargs)

        def block_bar_backward(self, *args, causal_diag, **kwargs):
            calls.append(("backward", source(args[6]), causal_diag))
            torch_backend.block_bar_backward(*args, causal_diag=causal_diag, **kwargs)

    bench_ring.compute_only(Recording(), q, k, v, dout, index, groups, 0.25)
    bench_ring.sdpa_compute_only("flash", q, k, v, dout, groups, 0.25)
    return calls


def test_compute_only_runs_every_step_of_the_ring_without_communication(distributed):
    calls, idle = distributed(_compute_only_rank, 2, timeout=120)
    assert idle is None
    assert calls == [("forward", 0, True), ("forward", 1, False), ("backward", 0, True), ("backward", 1, False)]
