"""Budgets of the online index estimation: dataclasses, JSON tables, flag settings, sparsity conversion."""

import json
import random

import pytest
import torch

from megatron_mtraining.budget import BudgetTable
from mtraining_kernels.budget import StaticBudget, StaticHeadBudgets, TopPBudget
from mtraining_kernels.estimation import estimate_vertical_slash, list_widths, resolve_budget
from mtraining_kernels.reference import sparsity, vertical_slash_mask


def random_table(rng: random.Random, num_layers: int, num_heads: int) -> BudgetTable:
    rows = tuple(
        tuple(StaticBudget(rng.randint(30, 900), rng.randint(100, 900)) for _ in range(num_heads))
        for _ in range(num_layers)
    )
    return BudgetTable(num_layers, num_heads, per_head=rows)


# ---------------------------------------------------------------------------------------- dataclasses
@pytest.mark.parametrize(
    "v_size, s_size, bad",
    [
        (0, 200, "v_size=0"),
        (-3, 200, "v_size=-3"),
        (100, 1.5, "s_size=1.5"),
        (True, 200, "v_size=True"),
        (100, "200", "s_size='200'"),
    ],
)
def test_static_budget_rejects_non_positive_integers(v_size, s_size, bad):
    with pytest.raises(ValueError, match=bad):
        StaticBudget(v_size, s_size)


@pytest.mark.parametrize(
    "p, bad",
    [
        (0, "p=0"),
        (0.0, "p=0.0"),
        (-0.5, "p=-0.5"),
        (1.01, "p=1.01"),
        (float("nan"), "p=nan"),
        (True, "p=True"),
        ("0.9", "p='0.9'"),
    ],
)
def test_top_p_rejects_p_outside_unit_interval(p, bad):
    with pytest.raises(ValueError, match=bad):
        TopPBudget(p)


def test_top_p_defaults_and_cap_rules():
    budget = TopPBudget(1)
    assert budget.cap == 4096 and budget.effective_cap(1000) == 1000 and budget.effective_cap(8192) == 4096
    for cap in (0, -1, 2.5):
        with pytest.raises(ValueError, match=f"cap={cap}"):
            TopPBudget(0.9, cap)
    with pytest.raises(ValueError, match="cap=64 .*sink_tokens=30, local_window=100.*cap >= 100"):
        TopPBudget(0.9, 64).validate_for(1024, 30, 100)
    TopPBudget(0.9, 100).validate_for(50, 30, 100)  # a cap above N is a ceiling, not an error


@pytest.mark.parametrize(
    "v_size, s_size, match",
    [
        (1025, 200, "v_size=1025 is larger than the sequence \\(seq_len=1024\\)"),
        (100, 2000, "s_size=2000 is larger than the sequence"),
        (29, 200, "v_size=29 is smaller than the 30 forced sink columns \\(sink_tokens=30\\).*v_size >= 30"),
        (100, 99, "s_size=99 is smaller than the 100 forced local-window offsets.*s_size >= 100"),
    ],
)
def test_static_budget_must_fit_sequence_and_forced_entries(v_size, s_size, match):
    with pytest.raises(ValueError, match=match):
        StaticBudget(v_size, s_size).validate_for(1024, 30, 100)
    StaticBudget(30, 100).validate_for(1024, 30, 100)
    StaticBudget(1024, 1024).validate_for(1024, 30, 100)


def test_head_budgets_name_the_offending_head():
    heads = StaticHeadBudgets(torch.tensor([100, 100, 20]), torch.tensor([200, 200, 200]))
    assert heads.num_heads == 3
    with pytest.raises(ValueError, match="head 2: v_size=20 is smaller"):
        heads.validate_for(1024, 30, 100)
    with pytest.raises(ValueError, match="v_size has 2 heads but s_size has 3"):
        StaticHeadBudgets(torch.tensor([100, 100]), torch.tensor([200, 200, 200]))
    with pytest.raises(ValueError, match="int64"):
        StaticHeadBudgets(torch.tensor([100.0]), torch.tensor([200]))


def test_resolved_budgets_are_kept_but_follow_in_place_changes():
    """``resolve_budget`` keeps its result per budget; a head budget written in place is resolved (and checked)
    again, and a refused budget is refused on every call."""
    uniform = StaticBudget(100, 200)
    first = resolve_budget(uniform, 3, 1024, 30, 100)
    assert resolve_budget(StaticBudget(100, 200), 3, 1024, 30, 100) is first  # equal values, the same result
    assert first.v_size.tolist() == [100] * 3 and first.s_size.tolist() == [200] * 3
    heads = StaticHeadBudgets(torch.tensor([100, 100, 100]), torch.tensor([200, 200, 200]))
    assert resolve_budget(heads, 3, 1024, 30, 100) is heads
    assert list_widths(heads, 1024) == (128, 256)
    heads.v_size[2] = 20  # below the 30 sinks
    for _ in range(2):
        with pytest.raises(ValueError, match="head 2: v_size=20 is smaller"):
            resolve_budget(heads, 3, 1024, 30, 100)
    heads.v_size[2] = 300
    assert resolve_budget(heads, 3, 1024, 30, 100) is heads
    assert list_widths(heads, 1024) == (320, 256)
    with pytest.raises(ValueError, match="budget=.* must be a StaticBudget"):
        resolve_budget({"v_size": 100}, 3, 1024, 30, 100)


def test_estimated_counts_are_the_callers_own(seed):
    """The static counts come from a kept copy of the budget's sizes: writing the returned counts changes
    neither that copy nor the next index."""
    generator = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, 256, 2, 16, generator=generator), torch.randn(1, 256, 1, 16, generator=generator)
    budget = StaticBudget(64, 128)
    first = estimate_vertical_slash(q, k, budget)
    first.v_cnt.fill_(-1)
    first.s_cnt.fill_(-1)
    again = estimate_vertical_slash(q, k, budget)
    assert again.v_cnt.tolist() == [[64, 64]] and again.s_cnt.tolist() == [[128, 128]], f"seed={seed}"


# --------------------------------------------------------------------------------------------- tables
def test_json_round_trip_file_and_mapping(tmp_path, seed):
    rng = random.Random(seed)
    table = random_table(rng, num_layers=3, num_heads=5)
    path = tmp_path / "pattern.json"
    table.save_json(path)
    with open(path) as handle:
        raw = json.load(handle)
    assert sorted(raw) == ["0", "1", "2"] and sorted(raw["0"]) == ["0", "1", "2", "3", "4"], f"seed={seed}"
    assert BudgetTable.from_json(path, num_layers=3, num_heads=5) == table, f"seed={seed}"
    assert BudgetTable.from_json(str(path), num_layers=3, num_heads=5) == table, f"seed={seed}"
    assert BudgetTable.from_json(raw, num_layers=3, num_heads=5) == table, f"seed={seed}"


def test_resolve_uses_one_based_layer_numbers_and_head_ranges(seed):
    rng = random.Random(seed)
    table = random_table(rng, num_layers=4, num_heads=6)
    raw = table.to_json()
    for layer_number in range(1, 5):
        resolved = table.resolve(layer_number, heads=range(2, 5))  # a tensor-parallel rank's heads
        expected = [raw[str(layer_number - 1)][str(h)] for h in range(2, 5)]
        assert isinstance(resolved, StaticHeadBudgets)
        assert resolved.v_size.tolist() == [v for v, _ in expected], f"seed={seed} layer_number={layer_number}"
        assert resolved.s_size.tolist() == [s for _, s in expected], f"seed={seed} layer_number={layer_number}"
    assert table.resolve(1).num_heads == 6
    for bad in (0, 5, True):
        with pytest.raises(ValueError, match=f"layer_number={bad}.*1-based"):
            table.resolve(bad)
    for heads in (range(4, 8), range(0), range(0, 6, 2)):
        with pytest.raises(ValueError, match="heads=range"):
            table.resolve(1, heads)
    top_p = BudgetTable.uniform(TopPBudget(0.95, 2048), num_layers=4, num_heads=6)
    assert top_p.resolve(3, range(0, 3)) == TopPBudget(0.95, 2048)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda raw: raw.pop("2"), "has layer keys for 2 layers but the model has 3.*missing \\[2\\]"),
        (
            lambda raw: raw.update({"3": raw["0"]}),
            "has layer keys for 4 layers but the model has 3.*unexpected \\[3\\]",
        ),
        (lambda raw: raw["1"].pop("4"), "layer 1 has head keys for 4 heads but the model has 5"),
        (lambda raw: raw["0"].update({"7": [100, 100]}), "layer 0 has head keys for 6 heads.*unexpected \\[7\\]"),
        (lambda raw: raw["2"].update({"3": [100, 200, 3]}), "layer 2 head 3: \\[100, 200, 3\\] must be a pair"),
        (lambda raw: raw["2"].update({"1": [100.5, 200]}), "layer 2 head 1: v_size=100.5"),
        (lambda raw: raw["1"].update({"0": [0, 200]}), "layer 1 head 0: v_size=0"),
        (lambda raw: raw.update({"01": raw.pop("1")}), "layer key '01' is not a non-negative integer"),
        (lambda raw: raw["0"].update({"x": raw["0"].pop("0")}), "head key 'x'"),
        (lambda raw: raw.update({"0": [1, 2]}), "layer 0 must map head ids"),
    ],
)
def test_json_for_a_different_model_or_malformed_is_rejected(tmp_path, seed, edit, match):
    raw = random_table(random.Random(seed), num_layers=3, num_heads=5).to_json()
    edit(raw)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=match):
        BudgetTable.from_json(path, num_layers=3, num_heads=5)
    with pytest.raises(ValueError, match="pattern file .*bad.json"):
        BudgetTable.from_json(path, num_layers=3, num_heads=5)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must be an object"):
        BudgetTable.from_json(path, num_layers=3, num_heads=5)


def test_table_validation_names_layer_and_head():
    rows = ((StaticBudget(100, 200),) * 2, (StaticBudget(100, 200), StaticBudget(100, 5000)))
    table = BudgetTable(2, 2, per_head=rows)
    table.validate_for(8192, 30, 100)
    with pytest.raises(ValueError, match="layer 1 \\(0-based\\) head 1: s_size=5000 is larger than the sequence"):
        table.validate_for(4096, 30, 100)
    with pytest.raises(ValueError, match="cap=50"):
        BudgetTable.uniform(TopPBudget(0.9, 50), num_layers=2, num_heads=2).validate_for(4096, 30, 100)
    with pytest.raises(ValueError, match="exactly one of per_head"):
        BudgetTable(2, 2, per_head=rows, top_p=TopPBudget(0.9))
    with pytest.raises(ValueError, match="per_head must be 3 layers x 2 heads"):
        BudgetTable(3, 2, per_head=rows)
    with pytest.raises(ValueError, match="top-P table"):
        BudgetTable.uniform(TopPBudget(0.9), num_layers=2, num_heads=2).to_json()


def test_settings_from_flags(tmp_path):
    table = BudgetTable.from_settings(mode="top-p", top_p=0.95, num_layers=2, num_heads=3)
    assert table.top_p == TopPBudget(0.95, 4096)
    table = BudgetTable.from_settings(mode="top-p", top_p=0.9, cap=1024, num_layers=2, num_heads=3)
    assert table.top_p == TopPBudget(0.9, 1024)
    table = BudgetTable.from_settings(mode="static", v_size=500, s_size=700, num_layers=2, num_heads=3)
    assert table == BudgetTable.uniform(StaticBudget(500, 700), num_layers=2, num_heads=3)
    path = tmp_path / "p.json"
    table.save_json(path)
    assert BudgetTable.from_settings(mode="static", pattern_file=path, num_layers=2, num_heads=3) == table


@pytest.mark.parametrize(
    "settings, match",
    [
        (
            dict(mode="static", top_p=0.9, v_size=100, s_size=200),
            "top-P settings \\{'top_p': 0.9\\} and static settings",
        ),
        (dict(mode="top-p", top_p=0.9, cap=1024, pattern_file="x.json"), "given together"),
        (dict(mode="top-p", v_size=100, s_size=200), "mode 'top-p' does not take static settings .*'v_size': 100"),
        (dict(mode="static", cap=1024), "mode 'static' does not take top-P settings \\{'cap': 1024\\}"),
        (dict(mode="top-p", cap=1024), "needs top_p"),
        (dict(mode="static", v_size=100), "needs pattern_file or both v_size and s_size; got v_size=100, s_size=None"),
        (
            dict(mode="static", v_size=100, s_size=200, pattern_file="x.json"),
            "pattern_file='x.json' and a uniform pair",
        ),
        (dict(mode="dense"), "budget mode 'dense' is unknown"),
        (dict(mode="top-p", top_p=1.5), "p=1.5"),
    ],
)
def test_settings_reject_conflicts(settings, match):
    with pytest.raises(ValueError, match=match):
        BudgetTable.from_settings(num_layers=2, num_heads=3, **settings)


# --------------------------------------------------------------------------------------- sparsity
@pytest.mark.parametrize("seq_len, target", [(2048, 0.5), (4096, 0.5), (4096, 0.7), (6144, 0.8)])
def test_sparsity_conversion_is_a_guaranteed_bound(seq_len, target, seed):
    """Any index with the converted budgets has sparsity >= target, including the costliest one."""
    budget = StaticBudget.for_sparsity(target, seq_len)
    budget.validate_for(seq_len, 30, 100)
    extra = budget.s_size - 100
    # costliest: the leftmost columns, and each extra slash (2a·B + 1) opening two new block diagonals
    worst_v = torch.arange(budget.v_size, dtype=torch.int32)
    worst_s = torch.cat([torch.arange(100), 256 * torch.arange(1, extra + 1) + 1]).int()
    worst = float(sparsity(vertical_slash_mask(worst_v.view(1, 1, -1), worst_s.view(1, 1, -1), seq_len)))
    assert target <= worst <= target + 0.1, f"{budget} gives worst-case sparsity {worst} for target {target}"
    generator = torch.Generator().manual_seed(seed)

    def pick(forced, size):
        """The first ``forced`` indices and ``size - forced`` random others, sorted: int32 ``[1, 1, size]``."""
        others = forced + torch.randperm(seq_len - forced, generator=generator)[: size - forced]
        return torch.cat([torch.arange(forced), others]).sort().values.int().view(1, 1, -1)

    random_mask = vertical_slash_mask(pick(30, budget.v_size), pick(100, budget.s_size), seq_len)
    assert float(sparsity(random_mask)) >= target, f"seed={seed} {budget}"


def test_sparsity_conversion_is_monotone_and_validated():
    sizes = [StaticBudget.for_sparsity(s, 1 << 16) for s in (0.5, 0.8, 0.9, 0.95)]
    assert all(a.v_size >= b.v_size and a.s_size >= b.s_size for a, b in zip(sizes, sizes[1:])), sizes
    assert sizes[0].v_size > sizes[-1].v_size and sizes[0].s_size > sizes[-1].s_size, sizes
    table = BudgetTable.for_sparsity(0.9, 1 << 16, num_layers=2, num_heads=2)
    assert table.resolve(2).v_size.tolist() == [sizes[2].v_size] * 2
    with pytest.raises(ValueError, match="sparsity=0.9 cannot be guaranteed at seq_len=1024.*use sparsity <= 0."):
        StaticBudget.for_sparsity(0.9, 1024)
    for bad in (1.0, -0.1, True):
        with pytest.raises(ValueError, match=f"sparsity={bad}"):
            StaticBudget.for_sparsity(bad, 4096)
    with pytest.raises(ValueError, match="seq_len=1000 must be a multiple of block_size=128.*use 896 or 1024"):
        StaticBudget.for_sparsity(0.5, 1000)
    with pytest.raises(ValueError, match="local_window=1"):
        StaticBudget.for_sparsity(0.5, 4096, local_window=1)
