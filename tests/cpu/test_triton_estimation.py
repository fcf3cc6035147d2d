"""The Triton estimation kernels run by Triton's CPU interpreter (TRITON_INTERPRET=1) against the PyTorch
definitions in mtraining_kernels.estimation (DESIGN.md §2.2), tiny shapes: the logits within fp32 rounding
and bit for bit whichever keys share a tile, the integer scores of given logits bit for bit.

On a machine with CUDA this module is skipped (the interpreter flag would also reach the GPU
tests' kernels); tests/gpu/test_estimation_gpu.py covers the same comparisons on the device.
"""

import importlib
import os
from unittest import mock

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' @triton.jit
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter tests run only on machines without CUDA"
)
pytest.importorskip("triton")

from mtraining_kernels import estimation, triton_estimation, triton_selection
from mtraining_kernels.budget import StaticHeadBudgets, TopPBudget
from mtraining_kernels.layout import Layout

_interpreted = type(triton_estimation._key_tile_kernel).__name__ == "InterpretedFunction"
if os.environ.get("TRITON_INTERPRET") == "1" and not _interpreted:
    importlib.reload(triton_estimation)  # imported earlier in this process without the interpreter flag

RULES = estimation._fixed_point_rules()


def bits(x: torch.Tensor) -> torch.Tensor:
    """The fp32 bit patterns (tells −0 from +0 and compares −inf exactly)."""
    return x.view(torch.int32)


def torch_scores(logits, q_positions, k_positions, seq_len, top_p, row_max=None, row_sums=None):
    """(V, partial S) of the PyTorch path, optionally with row stats over more keys than ``logits`` holds."""
    if not top_p:
        values, vertical = estimation._values_and_vertical_scores(logits, False)
    else:
        exp_values = estimation.exp_fixed_point(logits, row_max)
        values = estimation.probability_fixed_point(exp_values, row_sums, logits.shape[-2])
        vertical = estimation.vertical_scores(values)
    return vertical, estimation.slash_partial_sums(values, q_positions, k_positions, seq_len)


def triton_scores(source, q_positions, k_positions, seq_len, top_p, row_max=None, row_sums=None):
    """(V, partial S) of the Triton passes over ``source``: stored logits or ``QueryKeyTiles``."""
    if not top_p:
        return triton_estimation.static_scores(source, q_positions, k_positions, seq_len, RULES)
    return triton_estimation.top_p_scores(source, q_positions, k_positions, seq_len, row_max, row_sums, RULES)


def draw_qk(gen, batch, seq_len, q_heads, kv_heads, dim, dtype):
    q = torch.randn(batch, seq_len, q_heads, dim, generator=gen).to(dtype)
    k = torch.randn(batch, seq_len, kv_heads, dim, generator=gen).to(dtype)
    return q, k


@pytest.mark.parametrize(
    "batch, seq_len, q_heads, kv_heads, dim, rows, dtype, scale",
    [
        (1, 320, 4, 2, 64, 64, torch.bfloat16, None),  # GQA 2:1, 5 key tiles
        (2, 200, 2, 2, 32, 37, torch.float32, 0.1),  # MHA, b = 2, L < 64, a scale that is no fp32 number
        (1, 192, 2, 1, 128, 64, torch.float16, None),  # d = 128
        (1, 130, 2, 1, 12, 20, torch.float32, None),  # d below the dot's 16, N not a multiple of the tile
    ],
)
def test_logits_are_a_function_of_each_pair(seed, batch, seq_len, q_heads, kv_heads, dim, rows, dtype, scale):
    gen = torch.Generator().manual_seed(seed)
    q, k = draw_qk(gen, batch, seq_len, q_heads, kv_heads, dim, dtype)
    q_positions = torch.arange(seq_len - rows, seq_len)
    scale = dim**-0.5 if scale is None else scale
    q_rows = q[:, seq_len - rows :]
    got = triton_estimation.estimation_logits(q_rows, q_positions, k, torch.arange(seq_len), scale)
    expected = estimation._torch_estimation_logits(
        q_rows.double(), q_positions, k.double(), torch.arange(seq_len), scale
    )
    assert got.shape == (batch, q_heads, rows, seq_len)
    assert torch.equal(torch.isneginf(got), torch.isneginf(expected)), f"seed={seed}: causal mask"
    finite = torch.isfinite(expected)
    error = (got[finite].double() - expected[finite]).abs().max().item()
    assert error < 1e-5, f"seed={seed}: logits {error:.3g} from the fp64 definition"
    # The interpreter's dot is numpy's matmul, whose BLAS rounds a column by its place in the tile; small
    # integers make every sum exact, so the bits compare the kernel's key placement, not OpenBLAS's order.
    # tests/gpu/test_estimation_gpu.py checks the bit identity of real-valued logits on tensor cores.
    q_ints = torch.randint(-4, 5, q_rows.shape, generator=gen).to(dtype)
    k_ints = torch.randint(-4, 5, k.shape, generator=gen).to(dtype)
    in_order = triton_estimation.estimation_logits(q_ints, q_positions, k_ints, torch.arange(seq_len), scale)
    order = torch.randperm(seq_len, generator=gen)
    shuffled = triton_estimation.estimation_logits(q_ints, q_positions, k_ints[:, order], order, scale)
    assert torch.equal(bits(shuffled), bits(in_order[..., order])), f"seed={seed}: the keys' tiles changed some logits"


@pytest.mark.parametrize("top_p", [False, True], ids=["static", "top_p"])
@pytest.mark.parametrize("key_order", ["ascending", "shuffled"])
def test_fused_scores_are_the_scores_of_the_same_logits(seed, top_p, key_order):
    """The passes recompute their tiles of logits from q and k (consecutive keys: diagonals gathered per tile;
    shuffled: pair by pair); their integers equal the PyTorch scoring of the stored logits."""
    gen = torch.Generator().manual_seed(seed)
    seq_len, rows = 200, 64
    q, k = draw_qk(gen, 1, seq_len, 4, 2, 32, torch.bfloat16)
    q_positions = torch.arange(seq_len - rows, seq_len)
    order = torch.arange(seq_len) if key_order == "ascending" else torch.randperm(seq_len, generator=gen)
    source = triton_estimation.QueryKeyTiles(q[:, seq_len - rows :], k[:, order], 0.3)
    logits = triton_estimation.estimation_logits(source.q_rows, q_positions, source.k, order, 0.3)
    stats = {}
    if top_p:
        row_max = triton_estimation.row_maxima(source, q_positions, order)
        assert torch.equal(row_max, logits.amax(dim=-1)), f"seed={seed}: row maxima differ"
        row_sums = triton_estimation.exp_row_sums(source, q_positions, order, row_max, RULES)
        assert torch.equal(row_sums, estimation.exp_fixed_point(logits, row_max).sum(dim=-1)), f"seed={seed}: Z"
        stats = dict(row_max=row_max, row_sums=row_sums)
    expected = torch_scores(logits, q_positions, order, seq_len, top_p, **stats)
    got = triton_scores(source, q_positions, order, seq_len, top_p, **stats)
    for name, a, b in zip(("V", "S"), got, expected):
        assert torch.equal(a, b), f"seed={seed} {key_order} {name}: {int((a != b).sum())} scores differ"


@pytest.mark.parametrize("top_p", [False, True], ids=["static", "top_p"])
def test_scores_of_all_keys_are_bit_equal(seed, top_p):
    gen = torch.Generator().manual_seed(seed)
    seq_len, rows = 330, 64
    q, k = draw_qk(gen, 2, seq_len, 4, 1, 32, torch.bfloat16)
    q_positions, k_positions = torch.arange(seq_len - rows, seq_len), torch.arange(seq_len)
    logits = estimation._torch_estimation_logits(q[:, seq_len - rows :], q_positions, k, k_positions, 0.3)
    stats = {}
    if top_p:
        row_max = logits.amax(dim=-1)
        row_sums = triton_estimation.exp_row_sums(logits, q_positions, k_positions, row_max, RULES)
        expected_sums = estimation.exp_fixed_point(logits, row_max).sum(dim=-1)
        assert torch.equal(row_sums, expected_sums), f"seed={seed}: row sums Z differ"
        stats = dict(row_max=row_max, row_sums=row_sums)
    expected = torch_scores(logits, q_positions, k_positions, seq_len, top_p, **stats)
    got = triton_scores(logits, q_positions, k_positions, seq_len, top_p, **stats)
    for name, a, b in zip(("V", "S"), got, expected):
        assert a.dtype == torch.int64 and a.shape == b.shape, f"{name}: {a.dtype} {tuple(a.shape)}"
        assert torch.equal(a, b), f"seed={seed} {name}: {int((a != b).sum())} scores differ"
    if not top_p:
        assert (got[0][..., seq_len - rows + 1 :] == estimation.INCOMPLETE_SCORE).all(), f"seed={seed}"


@pytest.mark.parametrize("kind", ["striped", "zigzag", "contiguous", "shuffled"])
@pytest.mark.parametrize("top_p", [False, True], ids=["static", "top_p"])
def test_scores_of_a_key_split_add_up_exactly(seed, kind, top_p):
    """Each rank's shard of keys (runs of consecutive positions, or a random half of the keys in random
    order): V per shard and the sum of the partial S over the shards equal the single-device scores."""
    gen = torch.Generator().manual_seed(seed)
    seq_len, rows = 512, 64
    shards = (
        torch.randperm(seq_len, generator=gen).chunk(2)
        if kind == "shuffled"
        else [Layout(kind, 2, granularity=64).global_positions(seq_len, rank) for rank in range(2)]
    )
    q, k = draw_qk(gen, 1, seq_len, 2, 2, 16, torch.float16)
    q_positions, k_positions = torch.arange(seq_len - rows, seq_len), torch.arange(seq_len)
    logits = estimation._torch_estimation_logits(q[:, seq_len - rows :], q_positions, k, k_positions, 0.25)
    stats = {}
    if top_p:
        row_max = logits.amax(dim=-1)
        stats = dict(row_max=row_max, row_sums=estimation.exp_fixed_point(logits, row_max).sum(dim=-1))
    expected_v, expected_s = torch_scores(logits, q_positions, k_positions, seq_len, top_p, **stats)
    summed_s = torch.zeros_like(expected_s)
    for rank, positions in enumerate(shards):
        local_v, local_s = triton_scores(
            logits[..., positions].contiguous(), q_positions, positions, seq_len, top_p, **stats
        )
        assert torch.equal(local_v, expected_v[..., positions]), f"seed={seed} {kind} rank {rank}: V differs"
        summed_s += local_s
    assert torch.equal(summed_s, expected_s), f"seed={seed} {kind}: partial S do not add up to S"


@pytest.mark.parametrize(
    "kind, granularity, skips_check",
    [
        ("contiguous", 128, True),
        ("zigzag", 128, True),
        ("striped", 64, True),
        ("skewed", 128, True),
        ("striped", 32, False),
    ],
)
@pytest.mark.parametrize("top_p", [False, True], ids=["static", "top_p"])
def test_runs_of_consecutive_keys_give_the_same_scores(seed, kind, granularity, skips_check, top_p, monkeypatch):
    """Each rank's shard of a layout, its run length given: the same integers as without it. The passes skip
    their per-tile position check where every 64-key tile lies in one run, and keep it for runs of 32."""
    gen = torch.Generator().manual_seed(seed)
    seq_len, rows = 512, 64
    layout = Layout(kind, 2, granularity=granularity)
    q, k = draw_qk(gen, 1, seq_len, 2, 1, 16, torch.float16)
    q_positions = torch.arange(seq_len - rows, seq_len)
    flags = []
    run_pass = triton_estimation._run_pass
    monkeypatch.setattr(
        triton_estimation,
        "_run_pass",
        lambda *args, **kwargs: flags.append(kwargs.get("consecutive_keys", False)) or run_pass(*args, **kwargs),
    )
    for rank in range(2):
        positions = layout.global_positions(seq_len, rank)
        keys = k[:, positions]
        arguments = (q[:, seq_len - rows :], q_positions, keys, positions, 0.3, top_p, seq_len)
        told = estimation.scores_of_keys(
            *arguments, implementation="triton", consecutive_key_run=layout.run_length(seq_len)
        )
        flags_told, flags[:] = flags[-1], []
        untold = estimation.scores_of_keys(*arguments, implementation="triton")
        assert flags_told is skips_check and flags[-1] is False, f"{kind}: {flags_told}, {flags}"
        for name, a, b in zip(("V", "S"), told, untold):
            assert torch.equal(a, b), f"seed={seed} {kind} rank {rank} {name}: {int((a != b).sum())} scores differ"


@pytest.mark.parametrize("top_p", [False, True], ids=["static", "top_p"])
def test_rounding_edge_cases_match(seed, top_p):
    """Crafted logits: exact halves of 2^-32 (round half to even), tiny and huge values, the static
    clamp (±2^24, +inf) and masked (−inf) entries outside the causal triangle."""
    gen = torch.Generator().manual_seed(seed)
    seq_len, rows = 160, 64
    choices = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 3.0]) * 2.0**-32
    kinds = torch.randint(0, 4, (1, 1, rows, seq_len), generator=gen)
    logits = torch.where(
        kinds == 0,
        choices[torch.randint(0, 6, kinds.shape, generator=gen)],
        torch.randn(kinds.shape, generator=gen) * 10.0 ** torch.randint(-12, 3, kinds.shape, generator=gen),
    )
    if not top_p:
        logits[kinds == 3] = torch.tensor([3.0e7, -(2.0**24) - 1, float("inf")])[
            torch.randint(0, 3, ((kinds == 3).sum(),), generator=gen)
        ]
    q_positions, k_positions = torch.arange(seq_len - rows, seq_len), torch.arange(seq_len)
    logits[..., k_positions[None, :] > q_positions[:, None]] = float("-inf")
    stats = {}
    if top_p:
        row_max = logits.amax(dim=-1)
        stats = dict(row_max=row_max, row_sums=estimation.exp_fixed_point(logits, row_max).sum(dim=-1))
    expected = torch_scores(logits, q_positions, k_positions, seq_len, top_p, **stats)
    got = triton_scores(logits, q_positions, k_positions, seq_len, top_p, **stats)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), f"seed={seed}"


@pytest.mark.parametrize(
    "budget",
    [
        StaticHeadBudgets(torch.tensor([40, 64, 33, 90]), torch.tensor([110, 128, 101, 200])),
        TopPBudget(0.9, 128),
        TopPBudget(0.9, 128, block_slashes=True),
    ],
    ids=["static", "top_p", "top_p_block_slashes"],
)
def test_estimated_index_is_the_selection_of_the_same_logits(seed, budget):
    """The Triton path's index is the PyTorch path's when that path is handed the same (Triton) logits."""
    gen = torch.Generator().manual_seed(seed)
    q, k = draw_qk(gen, 1, 384, 4, 1, 32, torch.bfloat16)
    k[:, 200:203] += 2.0  # some strong columns
    got = estimation.estimate_vertical_slash(q, k, budget, implementation="triton")
    with mock.patch.object(estimation, "_torch_estimation_logits", triton_estimation.estimation_logits):
        expected = estimation.estimate_vertical_slash(q, k, budget, implementation="torch")
    for name, a, b in zip(estimation.VerticalSlashIndex._fields, got, expected):
        assert torch.equal(a, b), f"seed={seed} {name}: the Triton path selects a different index"


@pytest.mark.parametrize(
    "budget, passes",
    [
        (StaticHeadBudgets(torch.tensor([40, 64, 33, 90]), torch.tensor([110, 128, 101, 200])), 1),
        (TopPBudget(0.9, 128), 3),
        (TopPBudget(0.9, 128, block_slashes=True), 3),
    ],
    ids=["static", "top_p", "top_p_block_slashes"],
)
def test_an_estimation_launches_its_passes_then_one_selection(seed, budget, passes, monkeypatch):
    """Kernel launches of one estimation, in order: the scores passes (static: one; top-P: row maxima, row sums,
    scores), then one selection (its stages) for the vertical and the slash lists together (on a GPU every launch
    is host time and a gap on the device)."""
    launches = []
    kernel_type = type(triton_estimation._key_tile_kernel)
    launch = kernel_type.run

    def recorded_launch(kernel, *args, **kwargs):
        launches.append(kernel.fn.__name__)
        return launch(kernel, *args, **kwargs)

    monkeypatch.setattr(kernel_type, "run", recorded_launch)
    q, k = draw_qk(torch.Generator().manual_seed(seed), 1, 384, 4, 1, 32, torch.bfloat16)
    estimation.estimate_vertical_slash(q, k, budget, implementation="triton")
    selection = ["_selection_kernel"] * (triton_selection.LEVELS + 1)
    assert launches == ["_key_tile_kernel"] * passes + selection, launches


def _logits_inputs():
    q_rows, k = torch.randn(1, 64, 2, 16), torch.randn(1, 128, 1, 16)
    return dict(
        q_rows=q_rows, q_positions=torch.arange(64, 128), k=k, k_positions=torch.arange(128), softmax_scale=0.25
    )


@pytest.mark.parametrize(
    "change, word",
    [
        (lambda a: a.update(q_rows=torch.randn(1, 65, 2, 16), q_positions=torch.arange(63, 128)), "L<=64"),
        (lambda a: a.update(k=torch.randn(1, 128, 1, 8)), "q_rows"),
        (lambda a: a.update(k=torch.randn(1, 128, 3, 16)), "multiple of Hkv"),
        (lambda a: a.update(k_positions=torch.arange(127)), "positions"),
    ],
)
def test_bad_logits_input_raises_value_error_naming_it(change, word):
    args = _logits_inputs()
    change(args)
    with pytest.raises(ValueError, match=word):
        triton_estimation.estimation_logits(**args)


@pytest.mark.parametrize(
    "call, word",
    [
        (lambda logits, qp, kp: triton_estimation.static_scores(logits.double(), qp, kp, 128, RULES), "fp32"),
        (lambda logits, qp, kp: triton_estimation.static_scores(logits.transpose(-1, -2), qp, kp, 128, RULES), "fp32"),
        (
            lambda logits, qp, kp: triton_estimation.static_scores(logits[..., ::2], qp, kp[::2], 128, RULES),
            "unit stride",
        ),
        (lambda logits, qp, kp: triton_estimation.static_scores(logits, qp, kp[:-1], 128, RULES), "k_positions"),
        (
            lambda logits, qp, kp: triton_estimation.exp_row_sums(logits, qp, kp, logits.amax(-1)[..., :-1], RULES),
            "row_max",
        ),
        (
            lambda logits, qp, kp: triton_estimation.top_p_scores(
                logits, qp, kp, 128, logits.amax(-1), torch.ones(1, 2, 1), RULES
            ),
            "row_sums",
        ),
    ],
)
def test_bad_score_input_raises_value_error_naming_it(call, word):
    args = _logits_inputs()
    logits = estimation._torch_estimation_logits(*args.values())
    with pytest.raises(ValueError, match=word):
        call(logits, args["q_positions"], args["k_positions"])


def test_the_kernel_constants_reach_a_device_once():
    """The constants of the rules are copied to a device once per process, not on every estimation call (on a
    GPU each copy of a pageable tensor was a host sync), and they hold the rules' values, every one an fp32."""
    first = triton_estimation._constants(RULES, torch.device("cpu"))
    assert triton_estimation._constants(RULES, torch.device("cpu")) is first
    assert first.dtype == torch.float32
    rules = (float(RULES.one), RULES.static_logit_limit, RULES.exp_input_floor, RULES.log2_e, *RULES.exp2_coefficients)
    assert first.tolist() == list(rules)
    unrounded = RULES._replace(log2_e=1.4426950408889634)  # not an fp32 value: a path would round it
    with pytest.raises(ValueError, match="must be fp32 values"):
        triton_estimation._constants(unrounded, torch.device("cpu"))
