"""tools/bench_ring.py's model column: the analytic ring time it prints next to an emulated measurement."""

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
