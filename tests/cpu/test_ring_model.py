"""The analytic ring model (tools/ring_model.py): its limits, its consistency between the flat
and the hierarchical formulas, and DESIGN.md §2.4's worked example."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_modules import load_tool

ring_model = load_tool("ring_model")
CellCosts, attention_cell_costs = ring_model.CellCosts, ring_model.attention_cell_costs
flat_ring, hierarchical_ring = ring_model.flat_ring, ring_model.hierarchical_ring

positive = st.floats(min_value=1e-6, max_value=1.0)


@st.composite
def costs(draw):
    inner = draw(st.floats(min_value=1e8, max_value=1e12))
    return CellCosts(
        compute_fwd_s=draw(positive),
        compute_bwd_s=draw(positive),
        kv_bytes=draw(st.floats(1e3, 1e9)),
        grad_bytes=draw(st.floats(1e3, 1e9)),
        inner_bytes_per_s=inner,
        outer_bytes_per_s=inner / draw(st.floats(min_value=1.0, max_value=100.0)),
        latency_s=draw(st.floats(0.0, 1e-3)),
    )


@settings(max_examples=200, deadline=None)
@given(costs(), st.integers(1, 8), st.integers(1, 8))
def test_one_level_hierarchies_are_flat_rings(c, inner, outer):
    """inner × 1 is a flat ring inside one node; 1 × outer is a flat ring whose every hop crosses nodes."""
    for got, expected in (
        (hierarchical_ring(c, inner, 1), flat_ring(c, inner, inner)),
        (hierarchical_ring(c, 1, outer), flat_ring(c, outer, 1)),
    ):
        assert got.forward_s == pytest.approx(expected.forward_s, rel=1e-12)
        assert got.backward_s == pytest.approx(expected.backward_s, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(costs(), st.integers(1, 8), st.integers(1, 8))
def test_hierarchical_forward_is_never_slower_than_flat(c, inner, outer):
    flat = flat_ring(c, inner * outer, inner)
    assert hierarchical_ring(c, inner, outer).forward_s <= flat.forward_s * (1 + 1e-12)


def test_limits():
    compute_bound = CellCosts(1.0, 2.5, kv_bytes=1.0, grad_bytes=2.0, inner_bytes_per_s=1e9, outer_bytes_per_s=1e8)
    assert flat_ring(compute_bound, 8, 4).forward_s == pytest.approx(8.0)
    assert hierarchical_ring(compute_bound, 4, 2).forward_s == pytest.approx(8.0)
    # link-bound: the flat ring pays the slow hop at every step; the hierarchy only once per outer step
    link_bound = CellCosts(1e-3, 2.5e-3, kv_bytes=1e8, grad_bytes=2e8, inner_bytes_per_s=1e12, outer_bytes_per_s=1e9)
    outer_hop, inner_hop = 0.1, 1e-4
    assert flat_ring(link_bound, 8, 4).forward_s == pytest.approx(7 * outer_hop + 1e-3)
    inner_round = 4 * 1e-3  # inner hops (0.1 ms) hide behind compute (1 ms)
    assert inner_hop < 1e-3
    assert hierarchical_ring(link_bound, 4, 2).forward_s == pytest.approx(outer_hop + inner_round)
    with pytest.raises(ValueError, match="multiple of node_size=3"):
        flat_ring(link_bound, 8, 3)


def test_design_worked_example():
    """DESIGN.md §2.4: Qwen2.5-3B, N = 512K, s = 0.95, 500 TFLOP/s, W = 8 over InfiniBand (25 GB/s)."""
    c = attention_cell_costs(
        524288,
        8,
        heads=16,
        kv_heads=2,
        head_dim=128,
        density=0.05,
        tflops=500,
        inner_bytes_per_s=300e9,
        outer_bytes_per_s=25e9,
    )
    assert c.compute_fwd_s == pytest.approx(1.76e-3, rel=0.01)
    assert c.kv_bytes == pytest.approx(67.1e6, rel=0.001)
    assert c.hop_s(c.kv_bytes, outer=True) == pytest.approx(2.68e-3, rel=0.01)
    assert c.hop_s(c.kv_bytes + c.grad_bytes, outer=True) == pytest.approx(8.05e-3, rel=0.01)
    assert c.compute_bwd_s == pytest.approx(4.40e-3, rel=0.01)


def test_model_tool_table(capsys):
    """tools/model_ring.py: every inner x outer split of each W, and the regimes the model predicts with the
    measured H200 defaults and a 10x slower inter-node link: a link-bound flat ring (N/W = 16K) loses to the
    hierarchy by more than 40 %, a compute-bound one (N/W = 128K) does not."""
    model_ring = load_tool("model_ring")

    rows = model_ring.main(["--worlds", "4", "8", "--seq-lens", "131072", "1048576"])
    assert [(r["world"], r["inner"], r["outer"]) for r in rows if r["seq_len"] == 131072] == [
        (4, 2, 2),
        (8, 2, 4),
        (8, 4, 2),
    ]
    by_key = {(r["world"], r["seq_len"], r["inner"]): r for r in rows}
    assert by_key[(8, 131072, 4)]["saving"] > 0.4
    assert abs(by_key[(8, 1048576, 4)]["saving"]) < 0.05
    assert "| 8 | 128K | 2 x 4 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        model_ring.main(["--worlds", "3"])
