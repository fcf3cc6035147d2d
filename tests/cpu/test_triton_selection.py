"""The selection kernel (kernels/mtraining_kernels/triton_selection.py) run by Triton's CPU interpreter: each row's
first entries by (key desc, position asc) are those of a stable sort, on keys built to stress every level."""

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' @triton.jit
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter tests run only on machines without CUDA"
)
pytest.importorskip("triton")

from mtraining_kernels import triton_selection
from mtraining_kernels.budget import StaticHeadBudgets, TopPBudget
from mtraining_kernels.estimation import FORCED_KEY, INCOMPLETE_SCORE, rank_candidates, select_index

if type(triton_selection._selection_kernel).__name__ != "InterpretedFunction":
    importlib.reload(triton_selection)  # imported earlier without the interpreter flag


def sorted_selection(keys: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """The definition: a stable sort by key descending, the first counts[r] positions, ascending, padded with n."""
    rows, num_entries = keys.shape
    order = torch.argsort(-keys, dim=-1, stable=True)
    expected = torch.full((rows, width), num_entries, dtype=torch.int32)
    for row in range(rows):
        count = int(counts[row])
        expected[row, :count] = order[row, :count].sort().values.int()
    return expected


def draw_keys(generator: torch.Generator, kind: str, rows: int, num_entries: int) -> torch.Tensor:
    if kind == "wide":  # every bit varies: the first pass reads the sign bit's digit
        return torch.randint(-(2**62), 2**62, (rows, num_entries), generator=generator) * 2
    if kind == "narrow":  # scores of one magnitude: the top bits are every key's, skipped
        return torch.randint(0, 2**36, (rows, num_entries), generator=generator) + 2**45
    if kind == "clustered":  # a first pass leaves a few keys tied, copied aside, and several passes follow on them
        return (torch.randint(0, 32, (rows, num_entries), generator=generator) << 40) + torch.randint(
            0, 2**16, (rows, num_entries), generator=generator
        )
    if kind == "offset":  # one class holds half the row, one level more a few: copied at the last level
        return 3 * 2**44 + (torch.randn(rows, num_entries, generator=generator, dtype=torch.float64) * 2**36).long()
    if kind == "one_class":  # no level leaves few keys: nothing is copied, the last passes read the row; ties
        return 2**45 + torch.randint(0, 40, (rows, num_entries), generator=generator) * 2**10
    if kind == "ties":  # a few values: the threshold's value is shared, the first ties by position are taken
        return torch.randint(-3, 3, (rows, num_entries), generator=generator) * (1 << 40)
    if kind == "equal":  # nothing varies
        return torch.full((rows, num_entries), 7, dtype=torch.long)
    keys = torch.randint(-5, 5, (rows, num_entries), generator=generator) * 2**60  # the ranking's extreme keys
    keys[:, : min(num_entries, 7)] = FORCED_KEY
    keys[:, -min(num_entries, 3) :] = INCOMPLETE_SCORE
    return keys


@pytest.mark.parametrize("kind", ["wide", "narrow", "clustered", "offset", "one_class", "ties", "equal", "extreme"])
@pytest.mark.parametrize(
    "num_entries",
    [1, 70, triton_selection.ENTRIES_PER_STEP + 300, triton_selection.CHUNKS * triton_selection.ENTRIES_PER_STEP + 300],
    ids=["one", "short", "chunks_shorter_than_a_step", "chunks_of_two_steps"],
)
def test_top_positions_are_the_stable_sorts_first_entries(seed, kind, num_entries):
    generator = torch.Generator().manual_seed(seed)
    rows = 3
    keys = draw_keys(generator, kind, rows, num_entries)
    width = max(1, num_entries // 3)
    counts = torch.randint(0, width + 1, (rows,), generator=generator)
    counts[0], counts[-1] = width, 0  # a full row and an empty one
    num_forced = int(torch.randint(0, 2 * width + 1, (), generator=generator))  # fewer or more than a row takes
    got = triton_selection.top_positions(keys, counts, width, num_forced)
    assert got.dtype == torch.int32
    forced_keys = torch.where(torch.arange(num_entries) < num_forced, FORCED_KEY, keys)
    expected = sorted_selection(forced_keys, counts, width)
    assert torch.equal(got, expected), f"seed={seed} {kind} n={num_entries} forced={num_forced}"


class RecordedLaunches:
    """Stands in for the selection kernel: records each launch as (stage, grid) and runs it."""

    def __init__(self, monkeypatch):
        self.launches, self.kernel = [], triton_selection._selection_kernel
        monkeypatch.setattr(triton_selection, "_selection_kernel", self)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((kwargs["STAGE"], grid))
            return self.kernel[grid](*args, **kwargs)

        return launch

    def assert_one_selection(self, rows: int) -> None:
        """One selection of ``rows`` rows: its stages in order, each of CHUNKS programs per row."""
        expected = [(stage, (rows, triton_selection.CHUNKS)) for stage in range(triton_selection.LEVELS + 1)]
        assert self.launches == expected, f"one selection of {rows} rows, got launches {self.launches}"


def test_two_groups_in_one_selection_are_each_groups_own(seed, monkeypatch):
    """Rows of two groups (other lengths, widths, forced counts) selected together, in the same launches: each
    group's positions are its own sort's, as if selected alone."""
    generator = torch.Generator().manual_seed(seed)
    first_keys = draw_keys(generator, "clustered", 3, 300)
    second_keys = draw_keys(generator, "ties", 6, triton_selection.ENTRIES_PER_STEP + 70)  # another length
    groups = [
        triton_selection.SelectionRows(first_keys, torch.tensor([64, 0, 17]), 64, 5),
        triton_selection.SelectionRows(second_keys, torch.randint(0, 129, (6,), generator=generator), 128, 100),
    ]
    launches = RecordedLaunches(monkeypatch)
    got = triton_selection.top_positions_of_groups(groups)
    launches.assert_one_selection(9)
    for number, (chosen, (keys, counts, width, num_forced)) in enumerate(zip(got, groups)):
        forced_keys = torch.where(torch.arange(keys.shape[1]) < num_forced, FORCED_KEY, keys)
        expected = sorted_selection(forced_keys, counts, width)
        assert torch.equal(chosen, expected), f"seed={seed}: group {number} differs from its own selection"


@pytest.mark.parametrize("ascending", [True, False])
def test_rank_candidates_with_the_kernel_equals_the_sort(seed, ascending):
    """The Triton ranking keeps the same candidates in the same order, forced entries first."""
    generator = torch.Generator().manual_seed(seed)
    rows, count, limit, forced = 4, 900, 130, 12
    scores = torch.randint(-6, 6, (rows, count), generator=generator) * (1 << 38)  # exact ties across the limit
    scores[1] = torch.randint(-(2**50), 2**50, (count,), generator=generator)
    if ascending:
        indices = torch.arange(count).expand(rows, count)
    else:
        indices = torch.stack([torch.randperm(2 * count, generator=generator)[:count] for _ in range(rows)])
    expected = rank_candidates(scores, indices, forced, limit, ascending, implementation="torch")
    got = rank_candidates(scores, indices, forced, limit, ascending, implementation="triton")
    for name, a, b in zip(("scores", "indices"), got, expected):
        assert torch.equal(a, b), f"seed={seed} ascending={ascending}: ranked {name} differ"


def test_static_lists_by_selection_equal_the_sorted_lists(seed, monkeypatch):
    """A static budget's lists straight from the kernel (no ranking sort, no list sort) are the sorted path's; the
    vertical and the slash rows are selected together."""
    launches = RecordedLaunches(monkeypatch)
    generator = torch.Generator().manual_seed(seed)
    batch, heads, seq_len = 2, 3, 700
    v_scores = torch.randint(-(2**45), 2**45, (batch, heads, seq_len), generator=generator)
    s_scores = torch.randint(-4, 4, (batch, heads, seq_len), generator=generator) << 36  # ties at every limit
    candidates = torch.arange(seq_len).expand(batch, heads, seq_len)
    budget = StaticHeadBudgets(torch.tensor([40, 100, 64]), torch.tensor([150, 101, 200]))
    lists = {
        implementation: select_index(
            v_scores, candidates, s_scores, candidates, budget, None, seq_len, 5, 30, True, implementation
        )
        for implementation in ("torch", "triton")
    }
    launches.assert_one_selection(2 * batch * heads)
    for name, got, expected in zip(lists["triton"]._fields, lists["triton"], lists["torch"]):
        assert torch.equal(got, expected), f"seed={seed}: {name} differs"


def test_top_p_lists_rank_both_kinds_with_one_selection(seed, monkeypatch):
    """A top-P budget ranks the vertical and the slash candidates (the counts come from the ranked masses): with
    Triton both rankings are one selection, and the lists are the sorted path's."""
    launches = RecordedLaunches(monkeypatch)
    generator = torch.Generator().manual_seed(seed)
    batch, heads, seq_len = 2, 3, 700
    v_scores = torch.randint(0, 2**40, (batch, heads, seq_len), generator=generator)
    s_scores = torch.randint(0, 4, (batch, heads, seq_len), generator=generator) << 36  # ties at every limit
    candidates = torch.arange(seq_len).expand(batch, heads, seq_len)
    budget = TopPBudget(0.15, cap=200)
    lists = {
        implementation: select_index(
            v_scores, candidates, s_scores, candidates, budget, v_scores.sum(-1), seq_len, 5, 30, True, implementation
        )
        for implementation in ("torch", "triton")
    }
    launches.assert_one_selection(2 * batch * heads)
    for name, got, expected in zip(lists["triton"]._fields, lists["triton"], lists["torch"]):
        assert torch.equal(got, expected), f"seed={seed}: {name} differs"


@pytest.mark.parametrize(
    "keys, counts, width, word",
    [
        (torch.zeros(2, 8, dtype=torch.int32), torch.ones(2), 4, "int64"),
        (torch.zeros(2, 2, 8, dtype=torch.long), torch.ones(2), 4, r"\[R, n\]"),
        (torch.zeros(2, 8, dtype=torch.long), torch.ones(3), 4, "counts"),
        (torch.zeros(2, 8, dtype=torch.long), torch.ones(2), 9, "width=9"),
    ],
)
def test_bad_selection_input_raises_value_error_naming_it(keys, counts, width, word):
    with pytest.raises(ValueError, match=word):
        triton_selection.top_positions(keys, counts, width)


def test_three_groups_or_two_devices_raise_value_error():
    rows = triton_selection.SelectionRows(torch.zeros(2, 8, dtype=torch.long), torch.ones(2), 4)
    with pytest.raises(ValueError, match="3 groups"):
        triton_selection.top_positions_of_groups([rows] * 3)
    with pytest.raises(ValueError, match="one device"):
        triton_selection.top_positions_of_groups([rows, rows._replace(keys=rows.keys.to("meta"))])
