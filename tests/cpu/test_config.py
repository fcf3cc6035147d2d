"""MTrainingConfig: every bad-input rule names its --mtraining-* flag and the fix."""

import json
import re

import pytest

from megatron_mtraining.config import MTrainingConfig, flag
from mtraining_kernels.budget import StaticHeadBudgets, TopPBudget

MODEL = dict(num_layers=4, num_attention_heads=8, seq_length=4096)


def _pattern_file(tmp_path, layers: int, heads: int, pair=(40, 120)) -> str:
    path = tmp_path / "pattern.json"
    path.write_text(
        json.dumps({str(layer): {str(head): list(pair) for head in range(heads)} for layer in range(layers)})
    )
    return str(path)


def test_flag_names_follow_the_field_names():
    assert flag("top_p") == "--mtraining-top-p"
    assert flag("dense_layers") == "--mtraining-dense-layers"


def test_defaults_are_valid_and_follow_the_design():
    config = MTrainingConfig()
    config.validate(**MODEL)
    assert (config.layout, config.stripe_granularity, config.last_q, config.sink_tokens, config.local_window) == (
        "striped",
        128,
        64,
        30,
        100,
    )
    assert (config.budget, config.effective_top_p, config.effective_cap) == ("top-p", 0.9, 4096)
    assert (config.backend, config.grad_wire_dtype, config.ring, config.dense, config.dense_impl) == (
        "triton",
        "fp32",
        "flat",
        False,
        "mtraining",
    )
    assert (config.block_sparse_backend, MTrainingConfig(backend="torch").block_sparse_backend) == (
        "triton",
        "torch_blocksparse",
    )
    table = config.budget_table(**{"num_layers": 4, "num_heads": 8, "seq_length": 4096})
    assert table.resolve(1) == TopPBudget(0.9, 4096)


def test_block_slashes_reach_the_top_p_budget_and_are_refused_with_static_budgets():
    table = MTrainingConfig(block_slashes=True, cap=512).budget_table(num_layers=2, num_heads=4, seq_length=8192)
    assert table.resolve(1) == TopPBudget(0.9, 512, block_slashes=True)
    with pytest.raises(
        ValueError, match="--mtraining-budget=static does not take the top-P settings --mtraining-block-slashes"
    ):
        MTrainingConfig(budget="static", sparsity=0.9, block_slashes=True)
    with pytest.raises(ValueError, match="--mtraining-block-slashes='yes' must be True or False"):
        MTrainingConfig(block_slashes="yes")


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(layout="ring"), "--mtraining-layout='ring' is unknown; use one of contiguous, zigzag, striped"),
        (dict(backend="flash"), "--mtraining-backend='flash' is unknown; use one of triton, torch, reference"),
        (
            dict(dense=True, dense_impl="flash"),
            "--mtraining-dense-impl='flash' is unknown; use one of mtraining, sdpa_cudnn, sdpa_flash",
        ),
        (
            dict(dense_impl="sdpa_cudnn"),
            "--mtraining-dense-impl=sdpa_cudnn sets how --mtraining-dense runs its layers, "
            "but --mtraining-dense is not set; add --mtraining-dense",
        ),
        (
            dict(dense=True, dense_impl="sdpa_flash", deterministic=True),
            "--mtraining-dense-impl=sdpa_flash cannot promise a bitwise-reproducible backward",
        ),
        (dict(budget="topk"), "--mtraining-budget='topk' is unknown; use one of top-p, static"),
        (dict(ring="torus"), "--mtraining-ring='torus' is unknown"),
        (dict(grad_wire_dtype="fp16"), "--mtraining-grad-wire-dtype='fp16' is unknown; use one of fp32, bf16"),
        (dict(deterministic=1), "--mtraining-deterministic must be a bool"),
        (dict(stripe_granularity=64), "--mtraining-stripe-granularity=64 must be a power of two and a multiple of 128"),
        (dict(stripe_granularity=384), "--mtraining-stripe-granularity=384 must be a power of two"),
        (dict(last_q=0), r"--mtraining-last-q=0 must be an integer in \[1, 64\]"),
        (dict(last_q=128), r"--mtraining-last-q=128 must be an integer in \[1, 64\]"),
        (dict(sink_tokens=-1), "--mtraining-sink-tokens=-1 must be an integer >= 0"),
        (dict(stats_interval=1.5), "--mtraining-stats-interval=1.5 must be an integer >= 0"),
        (dict(top_p=1.5), r"--mtraining-top-p=1.5 must be a number in \(0, 1\]"),
        (dict(top_p=0), r"--mtraining-top-p=0 must be a number in \(0, 1\]"),
        (dict(cap=0), "--mtraining-cap=0 must be an integer >= 1"),
        (dict(cap=64), "--mtraining-cap=64 is smaller than the forced entries .* use --mtraining-cap >= 100"),
        (
            dict(vertical_size=100, slash_size=200),
            "--mtraining-budget=top-p does not take the static budget settings "
            "--mtraining-vertical-size, --mtraining-slash-size; drop them or add "
            "--mtraining-budget static",
        ),
        (dict(sparsity=0.9), "--mtraining-budget=top-p does not take the static budget settings --mtraining-sparsity"),
        (
            dict(budget="static", top_p=0.9, vertical_size=64, slash_size=128),
            "--mtraining-budget=static does not take the top-P settings --mtraining-top-p",
        ),
        (dict(budget="static"), "--mtraining-budget=static needs exactly one of .* got none"),
        (
            dict(budget="static", vertical_size=64, slash_size=128, sparsity=0.9),
            "needs exactly one of .* got vertical_size/slash_size and sparsity",
        ),
        (dict(budget="static", vertical_size=64), "a static budget pair needs both sizes; add --mtraining-slash-size"),
        (
            dict(budget="static", vertical_size=16, slash_size=128),
            "--mtraining-vertical-size=16 is smaller than the --mtraining-sink-tokens=30 forced sinks",
        ),
        (
            dict(budget="static", vertical_size=64, slash_size=50),
            "--mtraining-slash-size=50 is smaller than the --mtraining-local-window=100 forced window offsets",
        ),
        (dict(budget="static", sparsity=1.0), r"--mtraining-sparsity=1.0 must be a number in \[0, 1\)"),
        (
            dict(budget="static", pattern_file="/nonexistent/pattern.json"),
            "--mtraining-pattern-file='/nonexistent/pattern.json' is not a file",
        ),
        (
            dict(dense=True, dense_layers=(1, 2)),
            "--mtraining-dense already computes every layer densely; drop --mtraining-dense-layers=1,2",
        ),
        (dict(dense_layers=(0, 1)), "--mtraining-dense-layers=.* must list 1-based layer numbers"),
        (dict(dense_layers=(2, 2)), "--mtraining-dense-layers=.* lists a layer twice"),
        (
            dict(inner_ring_size=2),
            "--mtraining-inner-ring-size=2 only applies to the hierarchical ring, but --mtraining-ring=flat",
        ),
        (dict(ring="hierarchical", inner_ring_size=0), "--mtraining-inner-ring-size=0 must be an integer >= 1"),
    ],
)
def test_settings_are_checked_on_construction(settings, message):
    with pytest.raises(ValueError, match=message):
        MTrainingConfig(**settings)


@pytest.mark.parametrize(
    "settings, run, message",
    [
        (
            dict(),
            dict(seq_length=4000),
            "--seq-length=4000 is not divisible by 128, which --mtraining-layout=striped "
            r"needs \(--context-parallel-size x --mtraining-stripe-granularity = 1 x 128\); "
            "use --seq-length 3968 or 4096",
        ),
        (
            dict(),
            dict(context_parallel_size=4, seq_length=4096 + 128),
            "--seq-length=4224 is not divisible by 512.* use --seq-length 4096 or 4608",
        ),
        (
            dict(layout="zigzag"),
            dict(context_parallel_size=4, seq_length=4096 + 512),
            r"not divisible by 1024, which --mtraining-layout=zigzag needs \(2 x --context-parallel-size x 128",
        ),
        (
            dict(stripe_granularity=256),
            dict(context_parallel_size=8, seq_length=5120),
            r"--seq-length=5120 is not divisible by 2048.*8 x 256\); use --seq-length 4096 or 6144",
        ),
        (
            dict(dense_layers=(1, 5)),
            dict(),
            r"--mtraining-dense-layers lists layers \[5\] but the model has "
            "--num-layers=4; layer numbers are 1-based, use 1 … 4",
        ),
        (
            dict(ring="hierarchical"),
            dict(context_parallel_size=4),
            "--mtraining-ring=hierarchical needs the inner ring size: add --mtraining-inner-ring-size L",
        ),
        (
            dict(ring="hierarchical", inner_ring_size=3),
            dict(context_parallel_size=4),
            r"--mtraining-inner-ring-size=3 does not divide --context-parallel-size=4; use one of \[1, 2, 4\]",
        ),
        (
            dict(ring="hierarchical", inner_ring_size=2),
            dict(),
            "--mtraining-ring=hierarchical needs context parallelism, but --context-parallel-size=1",
        ),
        (
            dict(),
            dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2]),
            "selects MTraining's hierarchical ring, but --mtraining-ring=flat; add --mtraining-ring hierarchical",
        ),
        (
            dict(ring="hierarchical"),
            dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 4]),
            "--hierarchical-context-parallel-sizes 2 4 multiply to 8, not --context-parallel-size=4",
        ),
        (
            dict(ring="hierarchical"),
            dict(context_parallel_size=8, hierarchical_context_parallel_sizes=[2, 2, 2]),
            "must be two sizes",
        ),
        (
            dict(ring="hierarchical", inner_ring_size=4),
            dict(context_parallel_size=8, hierarchical_context_parallel_sizes=[2, 4]),
            "--mtraining-inner-ring-size=4 contradicts --hierarchical-context-parallel-sizes 2 4",
        ),
        (
            dict(backend="reference"),
            dict(context_parallel_size=2),
            r"backend='reference' \(the test oracle\) runs on one device only, but --context-parallel-size=2",
        ),
        (
            dict(dense=True, dense_impl="sdpa_cudnn"),
            dict(context_parallel_size=2),
            "--mtraining-dense-impl=sdpa_cudnn with --context-parallel-size=2 runs the zigzag dense ring, but "
            "--mtraining-layout=striped; add --mtraining-layout zigzag",
        ),
        (dict(), dict(attention_backend="local"), "--attention-backend local replaces every custom core attention"),
        (
            dict(budget="static", vertical_size=64, slash_size=8192),
            dict(),
            "--mtraining-vertical-size/--mtraining-slash-size does not fit .* s_size=8192 is larger than the sequence",
        ),
        (
            dict(budget="static", sparsity=0.9999),
            dict(seq_length=1024),
            "--mtraining-sparsity does not fit .* sparsity=0.9999 cannot be guaranteed",
        ),
        (dict(last_q=64), dict(seq_length=32, context_parallel_size=1), "not divisible by 128"),
    ],
)
def test_settings_are_checked_against_the_run(settings, run, message):
    config = MTrainingConfig(**settings)
    with pytest.raises(ValueError, match=message):
        config.validate(**dict(MODEL, **run))


def test_pattern_file_must_match_the_model(tmp_path):
    config = MTrainingConfig(budget="static", pattern_file=_pattern_file(tmp_path, layers=3, heads=8))
    with pytest.raises(
        ValueError,
        match=re.escape(f"{flag('pattern_file')} does not fit --num-layers=4")
        + ".*has layer keys for 3 layers but the model has 4",
    ):
        config.validate(**MODEL)
    config = MTrainingConfig(budget="static", pattern_file=_pattern_file(tmp_path, layers=4, heads=6))
    with pytest.raises(ValueError, match="layer 0 has head keys for 6 heads but the model has 8"):
        config.validate(**MODEL)
    config = MTrainingConfig(budget="static", pattern_file=_pattern_file(tmp_path, 4, 8, pair=(20, 120)))
    with pytest.raises(ValueError, match="v_size=20 is smaller than the 30 forced sink columns"):
        config.validate(**MODEL)


def test_valid_combinations_pass_and_resolve_budgets(tmp_path):
    MTrainingConfig(ring="hierarchical", inner_ring_size=2).validate(**MODEL, context_parallel_size=4)
    MTrainingConfig(ring="hierarchical").validate(
        **MODEL, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2]
    )
    MTrainingConfig(layout="zigzag", dense=True, backend="torch").validate(**MODEL, context_parallel_size=2)
    MTrainingConfig(layout="zigzag", dense=True, dense_impl="sdpa_cudnn").validate(**MODEL, context_parallel_size=2)
    MTrainingConfig(dense=True, dense_impl="sdpa_flash").validate(**MODEL)  # CP = 1: any layout
    MTrainingConfig(dense_layers=[1, 4]).validate(**MODEL)
    MTrainingConfig(budget="top-p", top_p=0.95, cap=256).validate(**MODEL, context_parallel_size=32)

    sparsity = MTrainingConfig(budget="static", sparsity=0.8)
    sparsity.validate(**MODEL)
    layer_budget = sparsity.budget_table(num_layers=4, num_heads=8, seq_length=4096).resolve(2)
    assert isinstance(layer_budget, StaticHeadBudgets) and layer_budget.num_heads == 8

    path = tmp_path / "per_head.json"
    path.write_text(
        json.dumps({str(layer): {str(head): [30 + layer, 100 + head] for head in range(8)} for layer in range(4)})
    )
    per_head = MTrainingConfig(budget="static", pattern_file=str(path))
    per_head.validate(**MODEL)
    tp_rank_1 = per_head.budget_table(num_layers=4, num_heads=8, seq_length=4096).resolve(3, range(4, 8))
    assert tp_rank_1.v_size.tolist() == [32] * 4 and tp_rank_1.s_size.tolist() == [104, 105, 106, 107]


def test_dense_layers_are_one_based():
    config = MTrainingConfig(dense_layers=(1, 3))
    assert [config.is_dense_layer(n) for n in (1, 2, 3, 4)] == [True, False, True, False]
    assert all(MTrainingConfig(dense=True).is_dense_layer(n) for n in (1, 2, 3, 4))


def test_layout_for_uses_the_granularity():
    layout = MTrainingConfig(stripe_granularity=256).layout_for(4)
    assert (layout.kind, layout.world_size, layout.granularity) == ("striped", 4, 256)
