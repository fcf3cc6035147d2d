import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtraining_kernels.layout import LAYOUT_KINDS, Layout, global_positions, shard, unshard


@st.composite
def layouts_and_lengths(draw):
    kind = draw(st.sampled_from(LAYOUT_KINDS))
    world = draw(st.integers(1, 6))
    gran = 2 ** draw(st.integers(4, 8))
    layout = Layout(kind, world, gran)
    rounds = draw(st.integers(1, 5))
    if kind == "skewed" and draw(st.booleans()):  # turns of its own per round
        layout = Layout(
            kind, world, gran, turns=draw(st.lists(st.integers(0, world - 1), min_size=rounds, max_size=rounds))
        )
    return layout, layout.unit() * rounds


@settings(max_examples=150, deadline=None)
@given(layouts_and_lengths(), st.integers(1, 3))
def test_shard_unshard_round_trip(case, batch):
    layout, n = case
    x = torch.randn(batch, n, 3)
    parts = [layout.shard(x, r, dim=1) for r in range(layout.world_size)]
    assert all(p.shape == (batch, n // layout.world_size, 3) for p in parts)
    assert torch.equal(layout.unshard(parts, dim=1), x)


@settings(max_examples=150, deadline=None)
@given(layouts_and_lengths())
def test_positions_are_a_permutation_and_agree_with_shard(case):
    layout, n = case
    positions = [layout.global_positions(n, r) for r in range(layout.world_size)]
    assert torch.equal(torch.cat(positions).sort().values, torch.arange(n))
    seq = torch.arange(n)
    for r, pos in enumerate(positions):
        assert torch.equal(layout.shard(seq, r, dim=0), pos)
        rank, local = layout.to_local(pos, n)
        assert torch.equal(rank, torch.full_like(pos, r))
        assert torch.equal(local, torch.arange(n // layout.world_size))
        assert torch.equal(layout.to_global(r, local, n), pos)
        # local order is ascending global order in every layout (the kernels' diagonal step, the conversion
        # and the distributed estimator's candidate ranking rely on it)
        assert bool((pos[1:] > pos[:-1]).all()), f"{layout} rank {r}"


@settings(max_examples=150, deadline=None)
@given(layouts_and_lengths())
def test_each_run_of_a_chunk_is_consecutive(case):
    """Every ``run_length`` positions of a rank's chunk, from local position 0, are consecutive global positions
    (the estimation's Triton passes rely on it to skip their per-tile check)."""
    layout, n = case
    run = layout.run_length(n)
    assert (n // layout.world_size) % run == 0, f"{layout} N={n}: runs of {run} do not tile a chunk"
    for r in range(layout.world_size):
        runs = layout.global_positions(n, r).view(-1, run)
        assert torch.equal(runs - runs[:, :1], torch.arange(run).expand_as(runs)), f"{layout} N={n} rank {r}"


def test_formulas_match_design_table_examples():
    # N = 16, W = 2: zigzag chunks of 4 → rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert global_positions("zigzag", 16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert global_positions("zigzag", 16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert global_positions("contiguous", 8, 2, 1).tolist() == [4, 5, 6, 7]
    # striped g = 16, W = 2, N = 64: rank 1 holds runs 1 and 3.
    assert global_positions("striped", 64, 2, 1, granularity=16).tolist() == (list(range(16, 32)) + list(range(48, 64)))


def test_skewed_turns_default_to_the_round_index():
    world, gran, rounds = 4, 16, 9
    turned = Layout("skewed", world, gran, turns=[j % world for j in range(rounds)])
    for rank in range(world):
        assert torch.equal(
            turned.global_positions(rounds * world * gran, rank),
            Layout("skewed", world, gran).global_positions(rounds * world * gran, rank),
        )


def test_skewed_turns_place_each_round():
    # W = 2, g = 16, N = 96: round 0 turned by 1 puts run 0 on rank 1; round 1 by 0, round 2 by 1
    layout = Layout("skewed", 2, 16, turns=(1, 0, 1))
    assert (layout.global_positions(96, 0)[::16] // 16).tolist() == [1, 2, 5]
    assert (layout.global_positions(96, 1)[::16] // 16).tolist() == [0, 3, 4]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"kind": "striped", "world_size": 2, "turns": (0,)},
            "turns are a skewed layout's; the striped layout takes none",
        ),
        ({"kind": "skewed", "world_size": 2, "turns": (0, 2)}, r"turns must be .* integers in \[0, 2\).*got \[2\]"),
        ({"kind": "skewed", "world_size": 2, "turns": ()}, "non-empty"),
    ],
)
def test_bad_turns(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)


def test_repr_tells_turns_apart():
    """Ranks compare layouts by their repr: other turns give another repr, no turns the dataclass's own."""
    assert repr(Layout("skewed", 2, 16)) == "Layout(kind='skewed', world_size=2, granularity=16)"
    first, same, other = (Layout("skewed", 2, 16, turns=turns) for turns in ((0, 1, 1), [0, 1, 1], (0, 1, 0)))
    assert repr(first) == repr(same) and first == same and repr(first) != repr(other)
    assert "turns=<3 rounds, sha256 " in repr(first)


def test_turns_fit_one_length():
    layout = Layout("skewed", 2, 16, turns=(0, 1, 1))
    with pytest.raises(ValueError, match=r"seq_len=128 does not match the layout's 3 turns .* N = 96"):
        layout.global_positions(128, 0)


def test_functional_forms(seed):
    x = torch.randn(2, 512, 4)
    parts = [shard(x, "striped", 4, r) for r in range(4)]
    assert torch.equal(unshard(parts, "striped"), x), f"seed={seed}"


def test_skewed_layout_turns_each_round_by_one_rank():
    """Run c on rank (c + c // W) mod W: rank 1 of W = 4 holds runs 1, 4, 11, 14 (one per round, ascending)."""
    layout = Layout("skewed", 4, 16)
    runs = layout.global_positions(256, 1)[::16] // 16
    assert runs.tolist() == [1, 4, 11, 14]
    owners = [int(layout.to_local(torch.tensor([16 * c]), 256)[0]) for c in range(16)]
    assert owners == [(c + c // 4) % 4 for c in range(16)]
    assert Layout("skewed", 2).global_blocks(128 * 8, 0).tolist() == [0, 3, 4, 7]


def test_global_blocks_striped_and_zigzag():
    assert Layout("striped", 4).global_blocks(128 * 8, 1).tolist() == [1, 5]
    assert Layout("zigzag", 2).global_blocks(128 * 8, 0).tolist() == [0, 1, 6, 7]
    with pytest.raises(ValueError, match="granularity=64 is not a multiple of the block size 128"):
        Layout("striped", 2, 64).global_blocks(1024, 0)


@pytest.mark.parametrize(
    "kind, world, gran, n, message",
    [
        ("striped", 4, 128, 1000, "seq_len=1000 is not divisible by 512"),
        ("zigzag", 3, 128, 100, "seq_len=100 is not divisible by 6"),
        ("contiguous", 3, 128, 10, "seq_len=10 is not divisible by 3"),
    ],
)
def test_bad_lengths_name_the_value_and_the_fix(kind, world, gran, n, message):
    with pytest.raises(ValueError, match=message) as err:
        Layout(kind, world, gran).validate(n)
    assert "use " in str(err.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="diagonal", world_size=2), "layout kind 'diagonal' is unknown"),
        (dict(kind="striped", world_size=0), "world_size=0 must be an integer >= 1"),
        (dict(kind="striped", world_size=2, granularity=8), "granularity=8 must be a power of two >= 16"),
        (dict(kind="striped", world_size=2, granularity=96), "granularity=96 must be a power of two"),
    ],
)
def test_bad_layouts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)


def test_bad_rank():
    with pytest.raises(ValueError, match=r"rank=2 is outside \[0, 2\)"):
        Layout("striped", 2).global_positions(512, 2)


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("extra", [16, -16])
def test_unshard_refuses_parts_of_unequal_length(kind, extra):
    layout = Layout(kind, 2, granularity=16)
    x = torch.arange(2 * 64 * 3).view(2, 64, 3)
    parts = [layout.shard(x, r) for r in range(2)]
    parts[1] = torch.cat([parts[1], parts[1][:, :extra]], dim=1) if extra > 0 else parts[1][:, :extra]
    expected = re.escape(f"parts have unequal lengths {[32, 32 + extra]} along dim 1")
    with pytest.raises(ValueError, match=expected):
        layout.unshard(parts)
    with pytest.raises(ValueError, match=r"unequal lengths"):
        unshard([p.transpose(0, 1) for p in parts], kind, dim=0, granularity=16)
