"""Balance diagnostics (DESIGN.md §2.3): analytic counts == conversion counts, metrics, acceptance."""

import pytest
import torch
from hypothesis import given, settings
from test_index import conversion_cases, random_index
from tool_modules import load_tool

from megatron_mtraining.balance import BAR_COST, balance_report, by_step, source_work
from mtraining_kernels.index import convert_index, count_work
from mtraining_kernels.layout import BLOCK_SIZE, Layout
from mtraining_kernels.vertical_slash import full_index

realistic_pattern = load_tool("realistic_pattern").realistic_pattern


@settings(max_examples=80, deadline=None)
@given(conversion_cases(max_blocks=48))
def test_analytic_counts_equal_conversion_counts(case):
    layout, seq_len, batch, heads, v_width, s_width, seed = case
    generator = torch.Generator().manual_seed(seed)
    v_idx, s_idx = random_index(generator, batch, heads, seq_len, v_width, s_width)
    blocks, bars = source_work(v_idx, s_idx, layout, seq_len)
    world = layout.world_size
    assert blocks.shape == bars.shape == (world, world, batch, heads)
    for rank in range(world):
        listed_blocks, listed_bars = count_work(convert_index(v_idx, s_idx, layout, rank, seq_len))
        assert torch.equal(blocks[rank], listed_blocks), f"blocks: seed={seed} layout={layout} N={seq_len} rank={rank}"
        assert torch.equal(bars[rank], listed_bars), f"bars: seed={seed} layout={layout} N={seq_len} rank={rank}"


def test_analytic_counts_equal_conversion_counts_on_realistic_pattern(seed):
    seq_len, layout = 8 * 16 * BLOCK_SIZE, Layout("striped", 8)
    v_idx, s_idx = realistic_pattern(seq_len, 3, 2, far_slashes=40, far_verticals=60, seed=seed)
    blocks, bars = source_work(v_idx, s_idx, layout, seq_len)
    for rank in range(8):
        listed = count_work(convert_index(v_idx, s_idx, layout, rank, seq_len))
        assert torch.equal(blocks[rank], listed[0]) and torch.equal(bars[rank], listed[1]), f"seed={seed} rank={rank}"


def test_by_step_reads_source_rank_minus_step():
    per_source = torch.arange(9).view(3, 3)  # value 3·rank + source
    steps = by_step(per_source)
    for rank in range(3):
        for step in range(3):
            assert int(steps[rank, step]) == 3 * rank + (rank - step) % 3


def test_dense_contiguous_report_matches_hand_count():
    # full pattern, no verticals, W = 2 contiguous, nb blocks per rank:
    # rank 0: step 0 (own chunk) nb(nb+1)/2, step 1 (rank 1's future chunk) 0
    # rank 1: step 0 nb(nb+1)/2,            step 1 (rank 0's chunk) nb²
    nb, heads = 3, 2
    seq_len = 2 * nb * BLOCK_SIZE
    _, s_idx = full_index(1, heads, seq_len)
    v_idx = torch.full((1, heads, 1), seq_len, dtype=torch.int32)
    report = balance_report(v_idx, s_idx, Layout("contiguous", 2), seq_len)
    tri = nb * (nb + 1) // 2
    expected = torch.tensor([[tri, 0], [tri, nb * nb]]) * heads
    assert torch.equal(report.blocks, expected) and int(report.bars.sum()) == 0
    assert torch.equal(report.cost, expected.double())
    totals = expected.sum(1).double()
    assert report.worker_imbalance == pytest.approx(float(totals.max() / totals.mean()))
    assert report.step_imbalance == pytest.approx(2.0)  # step 1: max nb², mean nb²/2
    assert report.critical_path_ratio == pytest.approx((tri + nb * nb) / ((2 * tri + nb * nb) / 2))


def test_cost_counts_a_bar_as_one_128th_of_a_block():
    # one head, sink column 0 only, window offset 0: rank 0 of 1 has 4 diagonal blocks and
    # bars for query blocks 1..3 (column 0 is in block 0, never active for them)
    seq_len = 4 * BLOCK_SIZE
    v_idx = torch.tensor([[[0]]], dtype=torch.int32)
    s_idx = torch.tensor([[[0]]], dtype=torch.int32)
    report = balance_report(v_idx, s_idx, Layout("contiguous", 1), seq_len)
    assert int(report.blocks) == 4 and int(report.bars) == 3
    assert float(report.cost) == pytest.approx(4 + 3 * BAR_COST) and BAR_COST == 1 / 128


def test_realistic_pattern_shape_forced_entries_and_seed(seed):
    seq_len = 64 * BLOCK_SIZE
    v_idx, s_idx = realistic_pattern(seq_len, 3, 2, far_slashes=50, far_verticals=70, seed=seed)
    assert v_idx.shape == (2, 3, 128) and s_idx.shape == (2, 3, 192) and v_idx.dtype == torch.int32
    for idx, forced, total in ((v_idx, 30, 100), (s_idx, 100, 150)):
        valid = idx < seq_len
        assert bool((valid.sum(-1) == total).all()), f"seed={seed}"
        assert bool((idx[..., :forced] == torch.arange(forced, dtype=torch.int32)).all()), f"seed={seed}"
        assert bool((idx[..., 1:total] > idx[..., : total - 1]).all()), f"not ascending: seed={seed}"
        assert bool((idx[..., total:] == seq_len).all()), f"sentinel padding: seed={seed}"
    again = realistic_pattern(seq_len, 3, 2, far_slashes=50, far_verticals=70, seed=seed)
    other = realistic_pattern(seq_len, 3, 2, far_slashes=50, far_verticals=70, seed=seed + 1)
    assert torch.equal(again[0], v_idx) and torch.equal(again[1], s_idx)
    assert not torch.equal(other[0], v_idx) and not torch.equal(other[1], s_idx)
    assert not torch.equal(v_idx[0, 0], v_idx[0, 1]), "heads must draw independent patterns"


def test_bad_inputs_raise_value_error():
    v_idx = torch.zeros(1, 2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="not divisible"):
        source_work(v_idx, v_idx, Layout("zigzag", 4), 1024 + 128)
    with pytest.raises(ValueError, match="disagree on"):
        source_work(v_idx, v_idx[:, :1], Layout("zigzag", 4), 1024)
    with pytest.raises(ValueError, match="outside"):
        source_work(v_idx - 1, v_idx, Layout("zigzag", 4), 1024)
    with pytest.raises(ValueError, match="int32"):
        source_work(v_idx.float(), v_idx, Layout("zigzag", 4), 1024)
    with pytest.raises(ValueError, match="too short"):
        realistic_pattern(1024, 2)


def test_striped_balances_a_realistic_512k_pattern_and_zigzag_does_not(seed):
    seq_len, world, heads = 512 * 1024, 8, 4
    v_idx, s_idx = realistic_pattern(seq_len, heads, seed=seed)
    reports = {
        kind: balance_report(v_idx, s_idx, Layout(kind, world), seq_len) for kind in ("contiguous", "zigzag", "striped")
    }
    print(f"\nN={seq_len} W={world} heads={heads} seed={seed}")
    for kind, report in reports.items():
        print(
            f"{kind:>10}: worker max/mean {report.worker_imbalance:.4f}  step max/mean "
            f"{report.step_imbalance:.4f}  critical path/ideal {report.critical_path_ratio:.4f}"
        )
    striped, zigzag = reports["striped"], reports["zigzag"]
    assert striped.worker_imbalance <= 1.05 and striped.step_imbalance <= 1.05, f"seed={seed}"
    assert striped.critical_path_ratio <= 1.05, f"seed={seed}"
    assert zigzag.step_imbalance > striped.step_imbalance, f"seed={seed}"
    assert zigzag.critical_path_ratio > striped.critical_path_ratio, f"seed={seed}"
    assert reports["contiguous"].worker_imbalance > 1.5, f"seed={seed}"
