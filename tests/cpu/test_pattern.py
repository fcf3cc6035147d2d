"""Online vertical-slash index estimation (DESIGN.md §2.2) on one device, and its reusable pieces."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtraining_kernels.budget import StaticBudget, StaticHeadBudgets, TopPBudget
from mtraining_kernels.estimation import (
    FIXED_POINT_ONE,
    INCOMPLETE_SCORE,
    block_diagonal_scores,
    estimate_from_last_queries,
    estimate_vertical_slash,
    estimation_logits,
    exp_fixed_point,
    index_list,
    list_width,
    probability_fixed_point,
    rank_candidates,
    slash_partial_sums,
    static_logit_fixed_point,
    top_p_counts,
    vertical_scores,
)
from mtraining_kernels.layout import LAYOUT_KINDS, Layout

SINKS, WINDOW, LAST_Q = 30, 100, 64


def valid_entries(lists: torch.Tensor, counts: torch.Tensor) -> list[list[list[int]]]:
    """The valid prefix of every [b, h] list, as Python lists."""
    return [[row[:count].tolist() for row, count in zip(rows, cnts)] for rows, cnts in zip(lists, counts)]


def reference_masses(q: torch.Tensor, k: torch.Tensor, scale: float, last_q: int):
    """fp64 top-P masses of sample 0, head 0: (vertical [N], slash [N])."""
    seq_len = q.shape[1]
    logits = q[0, seq_len - last_q :, 0].double() @ k[0, :, 0].double().T * scale
    rows, cols = torch.arange(seq_len - last_q, seq_len)[:, None], torch.arange(seq_len)[None, :]
    prob = torch.softmax(logits.masked_fill(cols > rows, float("-inf")), dim=-1) / last_q
    offsets = (rows - cols).clamp(min=0).expand_as(prob)
    slash = torch.zeros(seq_len, dtype=torch.float64).scatter_add_(
        0, offsets.reshape(-1), prob.masked_fill(cols > rows, 0).reshape(-1)
    )
    return prob.sum(dim=0), slash


# ------------------------------------------------------------------------------------ planted patterns
def planted_qk(seq_len: int, q_heads: int, plants: dict, strength: float, generator: torch.Generator):
    """q/k whose last 64 query rows are the unit vectors e_r, with planted lines per KV head.

    ``plants[kv] = (verticals, slashes)``: a vertical v gets k_v += strength·(1, …, 1), so every row
    scores ``strength`` on it; a slash s gets k_{i_r − s}[r] += strength for each row r, so exactly the
    pairs (i_r, i_r − s) score ``strength``. Everything else is noise of size 0.02.
    """
    kv_heads, dim = len(plants), LAST_Q
    q = 0.02 * torch.randn(1, seq_len, q_heads, dim, generator=generator)
    q[:, seq_len - dim :] = torch.eye(dim)[None, :, None, :]
    k = 0.02 * torch.randn(1, seq_len, kv_heads, dim, generator=generator)
    rows = torch.arange(dim)
    for kv, (verticals, slashes) in plants.items():
        head_keys = k[:, :, kv]  # view [1, N, d]
        for v in verticals:
            head_keys[:, v] += strength
        for s in slashes:
            head_keys[:, seq_len - dim + rows - s, rows] += strength
    return q, k


def draw_lines(rng: random.Random, low: int, high: int, count: int) -> list[int]:
    return sorted(rng.sample(range(low, high + 1), count))


def test_planted_lines_are_found_exactly_static(seed):
    rng, seq_len = random.Random(seed), 512
    plants = {
        kv: (draw_lines(rng, SINKS, seq_len - LAST_Q, 3), draw_lines(rng, WINDOW, seq_len - LAST_Q, 3))
        for kv in range(2)
    }
    q, k = planted_qk(seq_len, 4, plants, 8.0, torch.Generator().manual_seed(seed))
    index = estimate_vertical_slash(q, k, StaticBudget(SINKS + 3, WINDOW + 3), softmax_scale=1.0)
    assert index.v_idx.shape == (1, 4, 64) and index.s_idx.shape == (1, 4, 128)
    for head in range(4):
        verticals, slashes = plants[head // 2]  # GQA: heads 0, 1 read KV head 0
        assert index.v_idx[0, head, :33].tolist() == list(range(SINKS)) + verticals, f"seed={seed} head={head}"
        assert index.s_idx[0, head, :103].tolist() == list(range(WINDOW)) + slashes, f"seed={seed} head={head}"
    assert (index.v_idx[..., 33:] == seq_len).all() and (index.s_idx[..., 103:] == seq_len).all()
    assert (index.v_cnt == 33).all() and (index.s_cnt == 103).all()


def test_planted_lines_are_found_exactly_top_p(seed):
    """KV head 0 has only verticals, KV head 1 only slashes; each planted line carries ~1/3 of the mass."""
    rng, seq_len = random.Random(seed), 512
    verticals = draw_lines(rng, SINKS, seq_len - LAST_Q, 3)
    slashes = draw_lines(rng, WINDOW, seq_len - LAST_Q, 3)
    q, k = planted_qk(seq_len, 4, {0: (verticals, []), 1: ([], slashes)}, 14.0, torch.Generator().manual_seed(seed))
    index = estimate_vertical_slash(q, k, TopPBudget(0.9), softmax_scale=1.0)
    assert index.v_idx.shape[-1] == index.s_idx.shape[-1] == seq_len  # cap 4096 > N: width N
    for head in (0, 1):
        assert valid_entries(index.v_idx, index.v_cnt)[0][head] == list(range(SINKS)) + verticals, f"seed={seed}"
    for head in (2, 3):
        assert valid_entries(index.s_idx, index.s_cnt)[0][head] == list(range(WINDOW)) + slashes, f"seed={seed}"


def test_forced_entries_are_kept_even_when_they_score_worst(seed):
    generator = torch.Generator().manual_seed(seed)
    seq_len = 384
    q = torch.rand(1, seq_len, 2, 32, generator=generator) + 0.5  # positive rows
    k = torch.rand(1, seq_len, 1, 32, generator=generator) + 0.5
    k[:, :SINKS] = -k[:, :SINKS]  # sink columns score lowest
    rows = torch.arange(seq_len - LAST_Q, seq_len)
    k[:, (rows[:, None] - torch.arange(WINDOW)[None, :]).reshape(-1)] *= -1  # and so do offsets 0 … 99
    for budget in (StaticBudget(SINKS + 5, WINDOW + 5), TopPBudget(0.5, 128)):
        index = estimate_vertical_slash(q, k, budget)
        for v_list, s_list in zip(
            valid_entries(index.v_idx, index.v_cnt)[0], valid_entries(index.s_idx, index.s_cnt)[0]
        ):
            assert set(range(SINKS)) <= set(v_list) and set(range(WINDOW)) <= set(s_list), f"seed={seed} {budget}"
            assert len(v_list) > SINKS and len(s_list) > WINDOW, f"seed={seed} {budget}"


# ------------------------------------------------------------------------------------------------ top-P
@pytest.mark.parametrize("kind", ["vertical", "slash"])
def test_top_p_selects_the_minimal_set_of_fp64_brute_force(kind, seed):
    generator = torch.Generator().manual_seed(seed)
    seq_len, forced = 320, SINKS if kind == "vertical" else WINDOW
    q = torch.randn(1, seq_len, 1, 16, generator=generator)
    k = torch.randn(1, seq_len, 1, 16, generator=generator)
    masses = reference_masses(q, k, 1.0, LAST_Q)[0 if kind == "vertical" else 1]
    forced_mass = masses[:forced].sum()
    ranked, order = masses[forced:].sort(descending=True)
    cumulative = forced_mass + ranked.cumsum(0)
    # boundaries with a clear gap to the next candidate and a mass well above fp32 logit error
    clear = ((ranked[:-1] > 1e-4) & (ranked[:-1] - ranked[1:] > 1e-5)).nonzero().flatten()
    assert len(clear) > 3, f"seed={seed}: no clear boundary"
    chosen = int(clear[random.Random(seed).randrange(len(clear))]) + 1  # take this many candidates
    p = float(cumulative[chosen - 1] - ranked[chosen - 1] / 2)  # reached only by the last one
    expected = sorted(list(range(forced)) + (order[:chosen] + forced).tolist())

    index = estimate_vertical_slash(q, k, TopPBudget(p, cap=seq_len), softmax_scale=1.0)
    lists, counts = (index.v_idx, index.v_cnt) if kind == "vertical" else (index.s_idx, index.s_cnt)
    got = valid_entries(lists, counts)[0][0]
    assert got == expected, f"seed={seed} p={p}: {len(got)} entries, brute force {len(expected)}"
    selected_mass = masses[got].sum()
    weakest = masses[[g for g in got if g >= forced]].min()
    assert selected_mass >= p > selected_mass - weakest, f"seed={seed} p={p}"


def test_block_slashes_select_the_heaviest_block_diagonals_of_fp64_brute_force(seed):
    """``block_slashes``: slashes are 128·δ for the fewest block diagonals (δ = 0 and 1 forced by the window)
    whose fp64 mass, the estimation rows' mass in key block NB − 1 − δ, reaches p; verticals as without it."""
    generator = torch.Generator().manual_seed(seed)
    seq_len = 1024
    q = torch.randn(1, seq_len, 1, 16, generator=generator)
    k = torch.randn(1, seq_len, 1, 16, generator=generator)
    k[0, : seq_len // 2] *= 0.2  # a far half of low mass, so p is reached before every diagonal
    vertical = reference_masses(q, k, 1.0, LAST_Q)[0]
    diagonals = vertical.view(-1, 128).sum(dim=-1).flip(0)  # δ = NB − 1 − key block
    ranked, order = diagonals[2:].sort(descending=True)
    cumulative = diagonals[:2].sum() + ranked.cumsum(0)
    gaps = ((ranked[:-1] - ranked[1:] > 1e-4) & (cumulative[:-1] < 0.999)).nonzero().flatten()
    assert len(gaps) > 0, f"seed={seed}: no clear boundary"
    chosen = int(gaps[random.Random(seed).randrange(len(gaps))]) + 1
    p = float(cumulative[chosen - 1] - ranked[chosen - 1] / 2)
    expected = sorted([0, 128] + ((order[:chosen] + 2) * 128).tolist())

    index = estimate_vertical_slash(q, k, TopPBudget(p, cap=seq_len, block_slashes=True), softmax_scale=1.0)
    assert valid_entries(index.s_idx, index.s_cnt)[0][0] == expected, f"seed={seed} p={p}"
    assert index.s_idx[0, 0, len(expected) :].eq(seq_len).all()
    plain = estimate_vertical_slash(q, k, TopPBudget(p, cap=seq_len), softmax_scale=1.0)
    assert torch.equal(index.v_idx, plain.v_idx) and torch.equal(index.v_cnt, plain.v_cnt)


def test_block_diagonal_scores_add_up_over_key_subsets(seed):
    """Block-diagonal masses of some keys plus those of the rest are those of all keys (ranks' shares)."""
    generator = torch.Generator().manual_seed(seed)
    seq_len = 700  # not a multiple of 128: the first diagonal block is short
    scores = torch.randint(0, 2**40, (2, 3, seq_len), generator=generator)
    positions = torch.randperm(seq_len, generator=generator)
    whole = block_diagonal_scores(scores, torch.arange(seq_len), seq_len)
    expected = torch.stack(
        [scores[..., max(seq_len - 128 * (d + 1), 0) : seq_len - 128 * d].sum(-1) for d in range(6)], -1
    )
    assert torch.equal(whole, expected)
    part = positions[:300]
    rest = positions[300:]
    split = block_diagonal_scores(scores[..., part], part, seq_len) + block_diagonal_scores(
        scores[..., rest], rest, seq_len
    )
    assert torch.equal(split, whole)


def test_top_p_cap_limits_the_count_and_keeps_the_heaviest(seed):
    generator = torch.Generator().manual_seed(seed)
    seq_len, cap = 320, 128
    q = torch.randn(1, seq_len, 1, 16, generator=generator)
    k = torch.randn(1, seq_len, 1, 16, generator=generator)
    index = estimate_vertical_slash(q, k, TopPBudget(1.0, cap), softmax_scale=1.0)
    assert index.v_idx.shape[-1] == index.s_idx.shape[-1] == 128
    assert int(index.v_cnt) == int(index.s_cnt) == cap, f"seed={seed}"
    for masses, lists, forced in zip(reference_masses(q, k, 1.0, LAST_Q), (index.v_idx, index.s_idx), (SINKS, WINDOW)):
        picked = torch.zeros(seq_len, dtype=torch.bool)
        picked[lists[0, 0].long()] = True
        picked[:forced] = False
        unpicked = ~picked
        unpicked[:forced] = False
        assert masses[picked].min() >= masses[unpicked].max() - 1e-6, f"seed={seed}"


def test_exact_ties_are_broken_by_lower_index(seed):
    """Identical keys make every complete column and every full-length offset tie exactly."""
    generator = torch.Generator().manual_seed(seed)
    seq_len = 384
    q = torch.rand(1, seq_len, 2, 16, generator=generator) + 0.1  # positive logits: short diagonals
    k = (torch.rand(1, 1, 1, 16, generator=generator) + 0.1).expand(1, seq_len, 1, 16)  # score less
    index = estimate_vertical_slash(q, k, StaticBudget(200, 250))
    assert (index.v_idx[..., :200] == torch.arange(200)).all(), f"seed={seed}"
    assert (index.s_idx[..., :250] == torch.arange(250)).all(), f"seed={seed}"
    p = 0.3 + 0.4 * random.Random(seed).random()
    index = estimate_vertical_slash(q, k, TopPBudget(p))
    vertical, slash = reference_masses(q, k, 16**-0.5, LAST_Q)
    for lists, counts, masses in ((index.v_idx, index.v_cnt, vertical), (index.s_idx, index.s_cnt, slash)):
        count = int(counts[0, 0])
        assert (lists[0, :, :count] == torch.arange(count)).all(), f"seed={seed} p={p}"
        assert masses[:count].sum() >= p - 1e-9 > masses[: count - 1].sum() - 2e-9, f"seed={seed} p={p}"


# ------------------------------------------------------------------------------------- scores vs fp64
def test_scores_match_the_fp64_definitions(seed):
    generator = torch.Generator().manual_seed(seed)
    seq_len, last_q, scale = 256, 48, 0.3
    q = torch.randn(2, seq_len, 3, 32, generator=generator)
    k = torch.randn(2, seq_len, 1, 32, generator=generator)
    q_pos, k_pos = torch.arange(seq_len - last_q, seq_len), torch.arange(seq_len)
    logits = estimation_logits(q[:, seq_len - last_q :], q_pos, k, k_pos, scale)
    exact = torch.einsum("blhd,bnd->bhln", q[:, seq_len - last_q :].double(), k[:, :, 0].double()) * scale
    future = k_pos[None, :] > q_pos[:, None]
    exact = exact.masked_fill(future, float("-inf"))
    assert torch.equal(torch.isneginf(logits), torch.isneginf(exact))
    finite = ~torch.isneginf(exact)
    assert torch.allclose(logits.double()[finite], exact[finite], rtol=0, atol=1e-5), f"seed={seed}"

    static = static_logit_fixed_point(logits)
    v_static = vertical_scores(static, torch.isneginf(logits).any(dim=-2))
    zeroed = exact.masked_fill(~finite, 0)
    assert (v_static[..., seq_len - last_q + 1 :] == INCOMPLETE_SCORE).all()
    assert torch.allclose(
        v_static[..., : seq_len - last_q + 1].double() / FIXED_POINT_ONE,
        zeroed.sum(-2)[..., : seq_len - last_q + 1],
        rtol=0,
        atol=1e-4,
    ), f"seed={seed}"
    s_static = slash_partial_sums(static, q_pos, k_pos, seq_len).double() / FIXED_POINT_ONE
    offsets = (q_pos[:, None] - k_pos[None, :]).clamp(min=0).expand(2, 3, -1, -1).reshape(2, 3, -1)
    s_exact = torch.zeros(2, 3, seq_len, dtype=torch.float64).scatter_add_(-1, offsets, zeroed.reshape(2, 3, -1))
    assert torch.allclose(s_static, s_exact, rtol=0, atol=1e-4), f"seed={seed}"

    exp_values = exp_fixed_point(logits, logits.amax(-1))
    masses = probability_fixed_point(exp_values, exp_values.sum(-1), last_q)
    prob = torch.softmax(exact, dim=-1) / last_q
    assert torch.allclose(masses.double() / FIXED_POINT_ONE, prob, rtol=1e-5, atol=1e-9), f"seed={seed}"
    assert (masses[future.expand_as(masses)] == 0).all()
    total = vertical_scores(masses).sum(-1)
    assert torch.equal(total, slash_partial_sums(masses, q_pos, k_pos, seq_len).sum(-1))
    assert ((total - FIXED_POINT_ONE).abs() <= last_q * seq_len).all(), f"seed={seed} total={total}"


def test_exp_fixed_point_matches_fp64_exp(seed):
    """The fp32 exponential is within a few fp32 roundings of exp (of x·log2 e, mostly) before its fixed point."""
    generator = torch.Generator().manual_seed(seed)
    logits = -90 * torch.rand(1, 2, 8, 4096, generator=generator, dtype=torch.float64)
    logits[..., :5] = float("-inf")
    logits[..., 5] = 0.0  # exp(0)·2^32 exactly
    logits = logits.float()
    got = exp_fixed_point(logits, torch.zeros(1, 2, 8))
    expected = torch.exp(logits.double()) * FIXED_POINT_ONE
    assert ((got.double() - expected).abs() <= 0.5 + 2e-6 * expected).all(), f"seed={seed}"
    assert (got[..., :5] == 0).all() and (got[..., 5] == FIXED_POINT_ONE).all() and got.max() <= FIXED_POINT_ONE


# ------------------------------------------------------------------------------------------ ranking
def test_rank_candidates_orders_ties_by_index_and_merges_exactly(seed):
    generator = torch.Generator().manual_seed(seed)
    rows, count, limit, forced = 3, 500, 96, 10
    scores = torch.randint(-4, 5, (rows, count), generator=generator) * (1 << 40)  # many exact ties
    indices = torch.stack([torch.randperm(2 * count, generator=generator)[:count] for _ in range(rows)])
    ranked_scores, ranked_indices = rank_candidates(scores, indices, forced, limit)
    for row in range(rows):
        pairs = sorted(
            zip(scores[row].tolist(), indices[row].tolist()),
            key=lambda pair: (pair[1] >= forced, -pair[0] * (pair[1] >= forced), pair[1]),
        )[:limit]
        assert ranked_indices[row].tolist() == [i for _, i in pairs], f"seed={seed} row={row}"
        assert ranked_scores[row].tolist() == [s for s, _ in pairs], f"seed={seed} row={row}"
    # ranking the union of per-part top lists (as ranks would) gives the global top list
    parts = torch.randint(0, 4, (count,), generator=generator)
    local = [rank_candidates(scores[:, parts == r], indices[:, parts == r], forced, limit) for r in range(4)]
    merged = rank_candidates(torch.cat([s for s, _ in local], -1), torch.cat([i for _, i in local], -1), forced, limit)
    assert torch.equal(merged[0], ranked_scores) and torch.equal(merged[1], ranked_indices), f"seed={seed}"
    # candidates already ascending (all N of a sequence) may skip the sort by index: the same ranking
    ascending = indices.sort(dim=-1).values
    in_order = scores.gather(-1, indices.argsort(dim=-1))
    skipped = rank_candidates(in_order, ascending, forced, limit, indices_ascending=True)
    assert torch.equal(skipped[0], ranked_scores) and torch.equal(skipped[1], ranked_indices), f"seed={seed}"


def test_top_p_counts_and_index_list_edges():
    masses = torch.tensor([[40, 30, 20, 5, 5, 0]])  # forced first (2 entries), total 100
    total = torch.tensor([100])
    assert top_p_counts(masses, 2, total, 0.5, 6).tolist() == [2]  # forced mass 70 already reaches 50
    assert top_p_counts(masses, 2, total, 0.9, 6).tolist() == [3]
    assert top_p_counts(masses, 2, total, 0.91, 6).tolist() == [4]  # ceil(91) needs the fourth
    assert top_p_counts(masses, 2, total, 1.0, 6).tolist() == [5]  # zero-mass entries are never needed
    assert top_p_counts(masses, 2, total, 1.0, 4).tolist() == [4]  # capped
    lists, counts = index_list(torch.tensor([[7, 3, 9, 1]]), torch.tensor([3]), 4, 10)
    assert lists.tolist() == [[3, 7, 9, 10]] and counts.tolist() == [3] and lists.dtype == torch.int32
    with pytest.raises(ValueError, match="4 ranked candidates cannot fill a list of width 64"):
        index_list(torch.tensor([[7, 3, 9, 1]]), torch.tensor([3]), 64, 10)
    assert [list_width(w, 1000) for w in (1, 64, 65, 130, 990)] == [64, 64, 128, 192, 1000]


# ------------------------------------------------------------------------------- invariance / identity
@pytest.mark.parametrize("budget", [StaticBudget(97, 230), TopPBudget(0.9, 200)], ids=["static", "top-p"])
def test_estimation_is_bitwise_invariant_to_batch_threads_and_strides(budget, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 384, 4, 32, generator=generator).bfloat16()
    k = torch.randn(3, 384, 2, 32, generator=generator).bfloat16()
    batched = estimate_vertical_slash(q, k, budget)
    for sample in range(3):
        alone = estimate_vertical_slash(q[sample : sample + 1], k[sample : sample + 1], budget)
        for got, want in zip(alone, batched):
            assert torch.equal(got, want[sample : sample + 1]), f"seed={seed} sample={sample}"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        strided = estimate_vertical_slash(q.transpose(1, 2).contiguous().transpose(1, 2), k, budget)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(strided, batched)), f"seed={seed}"


@pytest.mark.parametrize("budget", [StaticBudget(97, 230), TopPBudget(0.9, 200)], ids=["static", "top-p"])
def test_the_last_queries_alone_give_the_same_index(budget, seed):
    """``estimate_from_last_queries`` (what the per-document estimation calls, copying only the last rows)
    equals ``estimate_vertical_slash`` on the whole q bit for bit, for L = 64 and a shorter L."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 384, 4, 32, generator=generator).bfloat16()
    k = torch.randn(2, 384, 2, 32, generator=generator).bfloat16()
    for last_q in (64, 17):
        whole = estimate_vertical_slash(q, k, budget, last_q=last_q)
        rows = estimate_from_last_queries(q[:, 384 - last_q :].clone(), k, budget)
        assert all(torch.equal(a, b) for a, b in zip(rows, whole)), f"seed={seed} L={last_q}"
    with pytest.raises(ValueError, match="L=65 .*one tile"):
        estimate_from_last_queries(torch.randn(2, 65, 4, 32), k, budget)
    with pytest.raises(ValueError, match=r"must agree on \[b, ·, ·, d\]"):
        estimate_from_last_queries(q[:, -64:, :, :16], k, budget)


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("mode", ["static", "top-p"])
def test_pieces_over_key_shards_rebuild_the_index_bitwise(kind, mode, seed):
    """Simulates the distributed recipe on one process: the result equals the single-device index."""
    generator = torch.Generator().manual_seed(seed)
    world, seq_len, batch, q_heads = 4, 512, 2, 4
    layout = Layout(kind, world, 64)
    q = torch.randn(batch, seq_len, q_heads, 32, generator=generator).bfloat16()
    k = torch.randn(batch, seq_len, 2, 32, generator=generator).bfloat16()
    budget = StaticBudget(100, 160) if mode == "static" else TopPBudget(0.8, 256)
    q_pos = torch.arange(seq_len - LAST_Q, seq_len)
    q_last, scale = q[:, seq_len - LAST_Q :], 32**-0.5
    shards = [layout.global_positions(seq_len, rank) for rank in range(world)]
    logits = [estimation_logits(q_last, q_pos, k[:, pos], pos, scale) for pos in shards]
    full = estimation_logits(q_last, q_pos, k, torch.arange(seq_len), scale)
    for pos, part in zip(shards, logits):
        assert torch.equal(part, full[..., pos]), f"seed={seed} {kind}"
    if mode == "static":
        values = [static_logit_fixed_point(part) for part in logits]
        v_parts = [vertical_scores(v, torch.isneginf(part).any(-2)) for v, part in zip(values, logits)]
    else:
        row_max = torch.stack([part.amax(-1) for part in logits]).amax(0)  # all-reduce(MAX)
        exp_values = [exp_fixed_point(part, row_max) for part in logits]
        row_sums = torch.stack([e.sum(-1) for e in exp_values]).sum(0)  # all-reduce(SUM)
        values = [probability_fixed_point(e, row_sums, LAST_Q) for e in exp_values]
        v_parts = [vertical_scores(v) for v in values]
    s_scores = sum(slash_partial_sums(v, q_pos, pos, seq_len) for v, pos in zip(values, shards))
    offset_owner = torch.randint(0, world, (seq_len,), generator=generator)  # any split of offsets
    candidates = {
        "v": [(scores, pos.expand_as(scores)) for scores, pos in zip(v_parts, shards)],
        "s": [
            (s_scores[..., offset_owner == r], torch.arange(seq_len)[offset_owner == r].expand(batch, q_heads, -1))
            for r in range(world)
        ],
    }
    index = estimate_vertical_slash(q, k, budget)
    for name, forced, lists, counts in (
        ("v", SINKS, index.v_idx, index.v_cnt),
        ("s", WINDOW, index.s_idx, index.s_cnt),
    ):
        width = lists.shape[-1]
        local = [rank_candidates(scores, idx, forced, width) for scores, idx in candidates[name]]
        ranked_scores, ranked_indices = rank_candidates(
            torch.cat([s for s, _ in local], -1), torch.cat([i for _, i in local], -1), forced, width
        )
        if mode == "static":
            want_counts = torch.full((batch, q_heads), budget.v_size if name == "v" else budget.s_size)
        else:
            total = sum(v.sum(-1) for v in v_parts)
            want_counts = top_p_counts(ranked_scores, forced, total, budget.p, budget.cap)
        rebuilt = index_list(ranked_indices, want_counts, width, seq_len)
        assert torch.equal(rebuilt[0], lists) and torch.equal(rebuilt[1], counts), f"seed={seed} {kind} {name}"


# ------------------------------------------------------------------------------------ property test
@st.composite
def estimation_cases(draw):
    seq_len = draw(st.sampled_from([64, 100, 128, 200, 256]))
    kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    sinks = draw(st.integers(0, min(SINKS, seq_len)))
    window = draw(st.integers(0, min(WINDOW, seq_len)))
    q_heads = kv_heads * group
    if draw(st.booleans()):
        v_size = [draw(st.integers(max(sinks, 1), seq_len)) for _ in range(q_heads)]
        s_size = [draw(st.integers(max(window, 1), seq_len)) for _ in range(q_heads)]
        budget = StaticHeadBudgets(torch.tensor(v_size), torch.tensor(s_size))
    else:
        budget = TopPBudget(draw(st.floats(0.01, 1.0)), draw(st.integers(max(sinks, window, 1), 300)))
    return dict(
        batch=draw(st.integers(1, 2)),
        seq_len=seq_len,
        q_heads=q_heads,
        kv_heads=kv_heads,
        dim=draw(st.sampled_from([8, 16])),
        last_q=draw(st.integers(1, min(LAST_Q, seq_len))),
        sinks=sinks,
        window=window,
        budget=budget,
        spread=draw(st.sampled_from([0.1, 1.0, 5.0])),
        seed=draw(st.integers(0, 2**31)),
    )


@settings(max_examples=60, deadline=None)
@given(estimation_cases())
def test_index_invariants(case):
    generator = torch.Generator().manual_seed(case["seed"])
    b, n, budget = case["batch"], case["seq_len"], case["budget"]
    q = case["spread"] * torch.randn(b, n, case["q_heads"], case["dim"], generator=generator)
    k = torch.randn(b, n, case["kv_heads"], case["dim"], generator=generator)
    index = estimate_vertical_slash(
        q, k, budget, last_q=case["last_q"], sink_tokens=case["sinks"], local_window=case["window"]
    )
    if isinstance(budget, TopPBudget):
        widths = (list_width(budget.cap, n),) * 2
        assert ((index.v_cnt <= min(budget.cap, n)) & (index.s_cnt <= min(budget.cap, n))).all(), case
    else:
        widths = (list_width(int(budget.v_size.max()), n), list_width(int(budget.s_size.max()), n))
        assert torch.equal(index.v_cnt, budget.v_size.int().expand(b, -1)), case
        assert torch.equal(index.s_cnt, budget.s_size.int().expand(b, -1)), case
    for lists, counts, width, forced in (
        (index.v_idx, index.v_cnt, widths[0], case["sinks"]),
        (index.s_idx, index.s_cnt, widths[1], case["window"]),
    ):
        assert lists.shape == (b, case["q_heads"], width) and lists.dtype == counts.dtype == torch.int32, case
        assert width == n or width % 64 == 0, case
        assert ((counts >= max(forced, 1)) & (counts <= width)).all(), case
        slots = torch.arange(width)
        valid = slots < counts[..., None]
        assert (lists[~valid] == n).all(), case  # sentinel N after the count
        assert ((lists[valid] >= 0) & (lists[valid] < n)).all(), case
        assert (lists[..., 1:] > lists[..., :-1])[valid[..., 1:]].all(), case  # strictly ascending
        assert (lists[..., :forced] == torch.arange(forced, dtype=torch.int32)).all(), case  # forced present


# --------------------------------------------------------------------------------------- bad input
def _qk(n=256, hq=4, hkv=2, d=16):
    return torch.randn(1, n, hq, d), torch.randn(1, n, hkv, d)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda q, k: estimate_vertical_slash(q[0], k, StaticBudget(64, 128)), "q must be a floating-point tensor"),
        (lambda q, k: estimate_vertical_slash(q.long(), k, StaticBudget(64, 128)), "q must be a floating-point"),
        (lambda q, k: estimate_vertical_slash(q, k[:, :128], StaticBudget(64, 128)), "must agree on \\[b, N"),
        (
            lambda q, k: estimate_vertical_slash(q[:, :, :3], k, StaticBudget(64, 128)),
            "Hq=3 are not divisible by KV heads Hkv=2",
        ),
        (lambda q, k: estimate_vertical_slash(q, k, StaticBudget(64, 128), last_q=0), "last_q=0"),
        (lambda q, k: estimate_vertical_slash(q, k, StaticBudget(64, 128), last_q=65), "last_q=65 .*64-row tile"),
        (
            lambda q, k: estimate_vertical_slash(
                q[:, :48], k[:, :48], StaticBudget(40, 40), last_q=64, sink_tokens=4, local_window=4
            ),
            "last_q=64 .*N=48",
        ),
        (lambda q, k: estimate_vertical_slash(q, k, StaticBudget(64, 300), sink_tokens=257), "sink_tokens=257"),
        (lambda q, k: estimate_vertical_slash(q, k, StaticBudget(64, 300), local_window=300), "local_window=300"),
        (lambda q, k: estimate_vertical_slash(q, k, StaticBudget(64, 128), softmax_scale=-1.0), "softmax_scale=-1.0"),
        (lambda q, k: estimate_vertical_slash(q, k, StaticBudget(300, 128)), "v_size=300 is larger than the sequence"),
        (lambda q, k: estimate_vertical_slash(q, k, StaticBudget(20, 128)), "v_size=20 is smaller than the 30"),
        (lambda q, k: estimate_vertical_slash(q, k, StaticBudget(64, 99)), "s_size=99 is smaller than the 100"),
        (lambda q, k: estimate_vertical_slash(q, k, TopPBudget(0.9, 64)), "cap=64 is smaller"),
        (
            lambda q, k: estimate_vertical_slash(
                q, k, StaticHeadBudgets(torch.tensor([64] * 3), torch.tensor([128] * 3))
            ),
            "budget has 3 heads but q has Hq=4",
        ),
        (
            lambda q, k: estimate_vertical_slash(
                q, k, StaticHeadBudgets(torch.tensor([64, 64, 64, 10]), torch.tensor([128] * 4))
            ),
            "head 3: v_size=10",
        ),
        (lambda q, k: estimate_vertical_slash(q, k, (64, 128)), "budget=\\(64, 128\\) must be a StaticBudget"),
    ],
)
def test_bad_input_raises_naming_the_value(call, match):
    q, k = _qk()
    with pytest.raises(ValueError, match=match):
        call(q, k)


def test_full_budget_selects_everything():
    q, k = _qk(n=192)
    index = estimate_vertical_slash(q, k, StaticBudget(192, 192))
    assert (index.v_idx == torch.arange(192, dtype=torch.int32)).all()
    assert (index.s_idx == torch.arange(192, dtype=torch.int32)).all()
    index = estimate_vertical_slash(q, k, TopPBudget(1.0), sink_tokens=192, local_window=192)
    assert (index.v_cnt == 192).all() and (index.s_cnt == 192).all()
