"""Index conversion (DESIGN.md §2.6): vectorised == loops, and the lists reproduce the §2.1 mask."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtraining_kernels.index import BlockBarIndex, block_lists_by_key, convert_index, convert_index_slow, count_work
from mtraining_kernels.layout import BLOCK_SIZE, Layout
from mtraining_kernels.reference import vertical_slash_mask
from mtraining_kernels.vertical_slash import full_index

FIELDS = ("blk_ptr", "blk_col", "bar_ptr", "bar_col", "key_ptr", "key_qblock")


def random_index(
    generator: torch.Generator, batch: int, heads: int, seq_len: int, v_width: int, s_width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random valid index; per row a random number of entries (possibly none or the whole width).

    Slash candidates mix uniform offsets, exact multiples of 128 (t = 0, one block only) and small
    offsets (the window region), so every branch of the band rule occurs.
    """

    def draw(width: int, candidates) -> torch.Tensor:
        out = torch.full((batch, heads, width), seq_len, dtype=torch.int32)
        for b in range(batch):
            for h in range(heads):
                pool = candidates().unique()
                count = int(torch.randint(0, min(width, pool.numel()) + 1, (1,), generator=generator))
                pick = pool[torch.randperm(pool.numel(), generator=generator)[:count]].sort().values
                out[b, h, :count] = pick.to(torch.int32)
        return out

    def vertical_candidates():
        return torch.randint(0, seq_len, (3 * v_width + 1,), generator=generator)

    def slash_candidates():
        num_blocks = seq_len // BLOCK_SIZE
        return torch.cat(
            [
                torch.randint(0, seq_len, (s_width + 1,), generator=generator),
                torch.randint(0, num_blocks, (s_width // 2 + 1,), generator=generator) * BLOCK_SIZE,
                torch.randint(0, min(seq_len, 300), (s_width // 2 + 1,), generator=generator),
            ]
        )

    return draw(v_width, vertical_candidates), draw(s_width, slash_candidates)


@st.composite
def conversion_cases(draw, max_blocks: int):
    kind = draw(st.sampled_from(("contiguous", "zigzag", "striped", "skewed")))
    world = draw(st.integers(1, 4))
    granularity = draw(st.sampled_from((128, 256))) if kind in ("striped", "skewed") else 128
    layout = Layout(kind, world, granularity)
    unit = layout.unit(BLOCK_SIZE)
    seq_len = unit * draw(st.integers(1, max(1, max_blocks * BLOCK_SIZE // unit)))
    batch = draw(st.integers(1, 2))
    heads = draw(st.sampled_from((1, 2, 3, 5)))
    v_width = draw(st.integers(1, 24))
    s_width = draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    return layout, seq_len, batch, heads, v_width, s_width, seed


def check_structure(index: BlockBarIndex, batch: int, heads: int) -> None:
    """CSR invariants of the §2.6 contract (shapes, dtypes, offsets, ascending columns, sub-tile pairs)."""
    world, nb = index.world_size, index.num_local_blocks
    local_len = index.seq_len // world
    assert nb == local_len // BLOCK_SIZE
    for ptr, col, limit in ((index.blk_ptr, index.blk_col, 2 * nb), (index.bar_ptr, index.bar_col, local_len)):
        assert ptr.shape == (world, batch, heads, nb + 1) and ptr.dtype == torch.int32
        assert col.dim() == 1 and col.dtype == torch.int32
        flat = ptr.view(-1, nb + 1).long()
        assert int(flat[0, 0]) == 0 and int(flat[-1, -1]) == col.numel()
        assert torch.equal(flat[1:, 0], flat[:-1, -1]), "a row group does not start where the previous ended"
        assert bool((flat[:, 1:] >= flat[:, :-1]).all())
        for start, end in zip(flat[:, :-1].flatten().tolist(), flat[:, 1:].flatten().tolist()):
            row = col[start:end].long()
            assert bool((row[1:] > row[:-1]).all()), "columns must be strictly ascending per row"
        assert col.numel() == 0 or (int(col.min()) >= 0 and int(col.max()) < limit)
    tiles = index.blk_col.view(-1, 2).long()
    assert bool((tiles[:, 0] % 2 == 0).all()) and bool((tiles[:, 1] == tiles[:, 0] + 1).all())


def expand_to_mask(index: BlockBarIndex, batch: int, heads: int) -> torch.Tensor:
    """Paint every listed sub-tile and bar onto ``[b, Hq, N_loc query rows (local), N key columns (global)]``.

    Entries are counted, so an overlap of two list entries shows as 2. The causal mask is applied
    only to the diagonal block (source == rank, sub-tiles 2i, 2i+1 of query block i).
    """
    layout, seq_len, rank, world = index.layout, index.seq_len, index.rank, index.world_size
    nb, local_len = index.num_local_blocks, seq_len // world
    # columns in source-major local order: source w's local column l sits at w·N_loc + l
    painted = torch.zeros(batch, heads, local_len, world * local_len, dtype=torch.int8)
    causal_tile = torch.ones(BLOCK_SIZE, BLOCK_SIZE, dtype=torch.int8).tril().view(BLOCK_SIZE, 2, 64)
    for w in range(world):
        for b in range(batch):
            for h in range(heads):
                for i in range(nb):
                    rows = slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
                    start, end = index.blk_ptr[w, b, h, i], index.blk_ptr[w, b, h, i + 1]
                    for tile in index.blk_col[start:end].tolist():
                        cols = slice(w * local_len + tile * 64, w * local_len + (tile + 1) * 64)
                        diagonal = w == rank and tile // 2 == i
                        painted[b, h, rows, cols] += causal_tile[:, tile % 2] if diagonal else 1
                    start, end = index.bar_ptr[w, b, h, i], index.bar_ptr[w, b, h, i + 1]
                    for column in index.bar_col[start:end].tolist():
                        painted[b, h, rows, w * local_len + column] += 1
    key_positions = torch.cat([layout.global_positions(seq_len, w) for w in range(world)])
    in_global_order = torch.empty_like(painted)
    in_global_order[..., key_positions] = painted
    return in_global_order


@settings(max_examples=150, deadline=None)
@given(conversion_cases(max_blocks=32))
def test_vectorised_conversion_equals_loops(case):
    layout, seq_len, batch, heads, v_width, s_width, seed = case
    generator = torch.Generator().manual_seed(seed)
    v_idx, s_idx = random_index(generator, batch, heads, seq_len, v_width, s_width)
    if seed % 2:
        v_idx, s_idx = v_idx.long(), s_idx.long()
    for rank in range(layout.world_size):
        fast = convert_index(v_idx, s_idx, layout, rank, seq_len)
        slow = convert_index_slow(v_idx, s_idx, layout, rank, seq_len)
        for field in FIELDS:
            assert torch.equal(getattr(fast, field), getattr(slow, field)), (
                f"{field} differs: seed={seed} layout={layout} N={seq_len} rank={rank}"
            )
        check_structure(fast, batch, heads)
        assert (fast.seq_len, fast.world_size, fast.rank, fast.layout) == (seq_len, layout.world_size, rank, layout)


@settings(max_examples=40, deadline=None)
@given(conversion_cases(max_blocks=16))
def test_block_lists_by_key_transpose_every_step(case):
    """index.key_lists(w) lists, per (b, h, key block j), exactly the query blocks i whose step-w list holds
    j, ascending, and counts the W steps whose lists it holds; the per-step build (a slice of blk_col, as a
    launcher without the index does it) agrees."""
    layout, seq_len, batch, heads, v_width, s_width, seed = case
    generator = torch.Generator().manual_seed(seed)
    v_idx, s_idx = random_index(generator, batch, heads, seq_len, v_width, s_width)
    index = convert_index(v_idx, s_idx, layout, layout.world_size - 1, seq_len)
    nb = index.num_local_blocks
    for w in range(layout.world_size):
        key_ptr, key_qblock, steps = index.key_lists(w)
        assert steps == layout.world_size
        first, last = int(index.blk_ptr[w].reshape(-1)[0]), int(index.blk_ptr[w].reshape(-1)[-1])
        step_ptr, step_qblock = block_lists_by_key(index.blk_ptr[w], index.blk_col, first, last)
        for b in range(batch):
            for h in range(heads):
                expected = {j: [] for j in range(nb)}
                for i in range(nb):
                    start, end = index.blk_ptr[w, b, h, i], index.blk_ptr[w, b, h, i + 1]
                    for tile in index.blk_col[start:end].tolist()[::2]:
                        expected[tile // 2].append(i)
                for j in range(nb):
                    got = key_qblock[key_ptr[b, h, j] : key_ptr[b, h, j + 1]].tolist()
                    step = step_qblock[step_ptr[b, h, j] : step_ptr[b, h, j + 1]].tolist()
                    assert got == step == expected[j], f"seed={seed} {layout} w={w} b={b} h={h} key block {j}"
        assert key_ptr.shape == index.blk_ptr[w].shape and key_ptr.dtype == torch.int32


def test_step_lists_are_each_sources_slices_made_once():
    """index.step_lists(w) is (blk_ptr[w], blk_col, bar_ptr[w], bar_col), and a second call returns the same views
    (the launchers call it per step); key_lists(w) likewise."""
    seq_len, layout = 8 * BLOCK_SIZE, Layout("striped", 2)
    v_idx, s_idx = random_index(torch.Generator().manual_seed(3), 1, 2, seq_len, 6, 4)
    index = convert_index(v_idx, s_idx, layout, 1, seq_len)
    for w in range(layout.world_size):
        lists = index.step_lists(w)
        expected = (index.blk_ptr[w], index.blk_col, index.bar_ptr[w], index.bar_col)
        assert all(torch.equal(got, want) for got, want in zip(lists, expected, strict=True))
        assert index.step_lists(w) is lists and index.key_lists(w) is index.key_lists(w)
        assert torch.equal(index.key_lists(w).ptr, index.key_ptr[w])
    assert not torch.equal(index.step_lists(0)[0], index.step_lists(1)[0])  # each source its own rows


@settings(max_examples=30, deadline=None)
@given(conversion_cases(max_blocks=16))
def test_lists_reproduce_reference_mask_rows(case):
    layout, seq_len, batch, heads, v_width, s_width, seed = case
    generator = torch.Generator().manual_seed(seed)
    v_idx, s_idx = random_index(generator, batch, heads, seq_len, v_width, s_width)
    reference = vertical_slash_mask(v_idx, s_idx, seq_len)
    for rank in range(layout.world_size):
        painted = expand_to_mask(convert_index(v_idx, s_idx, layout, rank, seq_len), batch, heads)
        assert int(painted.max()) <= 1, f"blocks/bars overlap: seed={seed} layout={layout} N={seq_len} rank={rank}"
        expected = reference[:, :, layout.global_positions(seq_len, rank), :]
        assert torch.equal(painted.bool(), expected), (
            f"mask rows differ: seed={seed} layout={layout} N={seq_len} rank={rank}"
        )


@pytest.mark.parametrize("kind", ["contiguous", "zigzag", "striped"])
def test_full_pattern_lists_every_causal_block_and_no_bars(kind):
    layout, seq_len = Layout(kind, 3), 3 * 2 * BLOCK_SIZE * 2
    _, s_idx = full_index(1, 2, seq_len)
    v_idx = torch.arange(0, seq_len, 97, dtype=torch.int32).expand(1, 2, -1).contiguous()
    for rank in range(3):
        index = convert_index(v_idx, s_idx, layout, rank, seq_len)
        assert index.bar_col.numel() == 0, f"verticals inside active blocks became bars (rank {rank})"
        query_blocks = layout.global_blocks(seq_len, rank)
        expected = sum(
            int((layout.global_blocks(seq_len, w)[None, :] <= query_blocks[:, None]).sum()) for w in range(3)
        )
        blocks, bars = count_work(index)
        assert int(blocks[:, 0, 0].sum()) == expected and int(bars.sum()) == 0


@pytest.mark.parametrize("kind", ["contiguous", "zigzag", "striped"])
def test_empty_index_keeps_exactly_the_diagonal_blocks(kind):
    layout, seq_len = Layout(kind, 2), 2 * 2 * BLOCK_SIZE * 3
    empty = torch.full((2, 3, 4), seq_len, dtype=torch.int32)
    for rank in range(2):
        index = convert_index(empty, empty, layout, rank, seq_len)
        nb = index.num_local_blocks
        blocks, bars = count_work(index)
        assert bool(blocks[rank].eq(nb).all() & blocks[1 - rank].eq(0).all() & bars.eq(0).all())
        first = index.blk_ptr[rank, 0, 0, 0]
        assert index.blk_col[first : first + 2 * nb].tolist() == list(range(2 * nb))
        assert index.source_for_step(0) == rank and index.source_for_step(1) == 1 - rank


def test_vertical_in_own_block_or_in_active_block_is_not_a_bar():
    # one rank, 4 blocks; slash 0 only (window): active = diagonal + distance 0 (s=0 hits only δ=0)
    seq_len = 4 * BLOCK_SIZE
    layout = Layout("contiguous", 1)
    v_idx = torch.tensor([[[5, 130, 300, seq_len]]], dtype=torch.int32)
    s_idx = torch.tensor([[[0, seq_len]]], dtype=torch.int32)
    index = convert_index(v_idx, s_idx, layout, 0, seq_len)
    ptr = index.bar_ptr[0, 0, 0].tolist()
    rows = [index.bar_col[ptr[i] : ptr[i + 1]].tolist() for i in range(4)]
    # query block 0: 5 is in its own (diagonal) block, 130 and 300 are non-causal
    assert rows == [[], [5], [5, 130], [5, 130, 300]], rows
    # slash 1 switches on distances 0 and 1: the vertical's block one behind is active, no bar there
    s_idx = torch.tensor([[[0, 1]]], dtype=torch.int32)
    index = convert_index(v_idx, s_idx, layout, 0, seq_len)
    ptr = index.bar_ptr[0, 0, 0].tolist()
    rows = [index.bar_col[ptr[i] : ptr[i + 1]].tolist() for i in range(4)]
    assert rows == [[], [], [5], [5, 130]], rows


ARGUMENT_ERRORS = [
    (dict(v_idx=torch.zeros(2, 3, dtype=torch.int32)), "must be \\[b, Hq, width\\]"),
    (dict(v_idx=torch.zeros(1, 2, 3)), "dtype torch.float32"),
    (dict(s_idx=torch.zeros(1, 3, 3, dtype=torch.int32)), "disagree on \\[b, Hq\\]"),
    (dict(seq_len=3 * BLOCK_SIZE), "not divisible by 512"),
    (dict(seq_len=1000), "not divisible"),
    (dict(rank=2), "rank=2 is outside \\[0, 2\\)"),
    (dict(rank=-1), "rank=-1"),
    (dict(layout=Layout("striped", 2, 64)), "multiple of 128"),
    (dict(layout="striped"), "must be a mtraining_kernels.Layout"),
]
CONTENT_ERRORS = [
    (dict(v_idx=torch.tensor([[[5, 3, 1024], [0, 1, 2]]], dtype=torch.int32)), "ascending and distinct"),
    (dict(v_idx=torch.tensor([[[5, 5, 1024], [0, 1, 2]]], dtype=torch.int32)), "ascending and distinct"),
    (dict(s_idx=torch.tensor([[[-1, 3, 1024], [0, 1, 2]]], dtype=torch.int32)), "outside \\[0, 1024\\]"),
    (dict(s_idx=torch.tensor([[[0, 3, 1025], [0, 1, 2]]], dtype=torch.int32)), "outside \\[0, 1024\\]"),
]


def conversion_arguments(change: dict) -> tuple:
    """(v_idx, s_idx, layout, rank, seq_len) of a valid zigzag W = 2 conversion, with ``change`` applied."""
    args = dict(
        v_idx=torch.tensor([[[0, 7, 1024], [3, 1024, 1024]]], dtype=torch.int32),
        s_idx=torch.tensor([[[0, 1, 1024], [0, 200, 1024]]], dtype=torch.int32),
        layout=Layout("zigzag", 2),
        rank=1,
        seq_len=1024,
    )
    args.update(change)
    return args["v_idx"], args["s_idx"], args["layout"], args["rank"], args["seq_len"]


@pytest.mark.parametrize("change, message", ARGUMENT_ERRORS + CONTENT_ERRORS)
@pytest.mark.parametrize("convert", [convert_index, convert_index_slow])
def test_bad_inputs_raise_value_error(convert, change, message):
    with pytest.raises(ValueError, match=message):
        convert(*conversion_arguments(change))


@pytest.mark.parametrize("change, message", ARGUMENT_ERRORS)
def test_unchecked_conversion_still_refuses_bad_arguments(change, message):
    """``check_contents=False`` drops only the value checks: types, shapes and the layout are checked still."""
    with pytest.raises(ValueError, match=message):
        convert_index(*conversion_arguments(change), check_contents=False)


@pytest.mark.parametrize("change, message", CONTENT_ERRORS)
def test_only_the_unchecked_conversion_takes_bad_values(change, message):
    """The default refuses an index with bad values; ``check_contents=False`` trusts it (its lists are then
    meaningless)."""
    with pytest.raises(ValueError, match=message):
        convert_index(*conversion_arguments(change))
    assert isinstance(convert_index(*conversion_arguments(change), check_contents=False), BlockBarIndex)


@settings(max_examples=40, deadline=None)
@given(conversion_cases(max_blocks=16))
def test_unchecked_conversion_equals_the_checked_one(case):
    layout, seq_len, batch, heads, v_width, s_width, seed = case
    v_idx, s_idx = random_index(torch.Generator().manual_seed(seed), batch, heads, seq_len, v_width, s_width)
    for rank in range(layout.world_size):
        checked = convert_index(v_idx, s_idx, layout, rank, seq_len)
        unchecked = convert_index(v_idx, s_idx, layout, rank, seq_len, check_contents=False)
        for field in FIELDS:
            assert torch.equal(getattr(unchecked, field), getattr(checked, field)), f"{field}: seed={seed}"


@pytest.mark.gpu
def test_conversion_on_cuda_equals_cpu(seed):
    generator = torch.Generator().manual_seed(seed)
    seq_len, layout = 8 * 4 * BLOCK_SIZE * 2, Layout("striped", 4)
    v_idx, s_idx = random_index(generator, 2, 5, seq_len, 64, 64)
    for rank in range(4):
        on_gpu = convert_index(v_idx.cuda(), s_idx.cuda(), layout, rank, seq_len)
        on_cpu = convert_index(v_idx, s_idx, layout, rank, seq_len)
        for field in FIELDS:
            value = getattr(on_gpu, field)
            assert value.is_cuda and torch.equal(value.cpu(), getattr(on_cpu, field)), f"{field}: seed={seed}"
