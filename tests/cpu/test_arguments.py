"""``--mtraining-*`` flags on Megatron's own parser (megatron_mtraining.arguments).

Valid combinations parse into the expected :class:`MTrainingConfig`; contradictory or unsupported ones
are rejected before any work with a message that names the flag (argparse errors for unknown flags,
bad choices and malformed values; ``ValueError`` from :func:`validate_mtraining_args` otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from megatron_mtraining.arguments import (
    add_mtraining_args,
    hierarchical_cp_sizes,
    mtraining_config_from_args,
    validate_mtraining_args,
)

BASE = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 1024 --max-position-embeddings 1024 "
    "--micro-batch-size 1 --mtraining-backend torch"
)


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)  # as Megatron's parse_args builds it
    add_megatron_arguments(parser)
    return add_mtraining_args(parser)


def _parse(parser, extra: str = "", cp: int = 2) -> argparse.Namespace:
    return parser.parse_args(f"{BASE} --context-parallel-size {cp} {extra}".split())


def _pattern_file(tmp_path, layers: int, heads: int) -> str:
    path = tmp_path / "budgets.json"
    budgets = {str(layer): {str(head): [64, 128] for head in range(heads)} for layer in range(layers)}
    path.write_text(json.dumps(budgets))
    return str(path)


# ------------------------------------------------------------------------------------------ accepted
def test_defaults_give_the_design_settings_and_megatron_defaults_fit_mtraining(parser):
    args = _parse(parser)
    config = validate_mtraining_args(args)
    assert (
        config.layout,
        config.stripe_granularity,
        config.budget,
        config.last_q,
        config.sink_tokens,
        config.local_window,
        config.ring,
        config.dense,
        config.deterministic,
    ) == ("striped", 128, "top-p", 64, 30, 100, "flat", False, False)
    assert args.create_attention_mask_in_dataloader is False, "a dense [N, N] mask must not be built by default"
    assert args.attention_dropout == 0.0
    assert args.mtraining_loss_chunk_size == 0


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            "--mtraining-budget static --mtraining-vertical-size 64 --mtraining-slash-size 128",
            dict(budget="static", vertical_size=64, slash_size=128),
        ),
        ("--mtraining-budget static --mtraining-sparsity 0.5", dict(budget="static", sparsity=0.5)),
        ("--mtraining-top-p 0.95 --mtraining-cap 2048", dict(top_p=0.95, cap=2048)),
        ("--mtraining-layout zigzag --mtp-num-layers 1", dict(layout="zigzag")),
        (
            "--mtraining-dense-layers 1,2 --mtraining-grad-wire-dtype bf16",
            dict(dense_layers=(1, 2), grad_wire_dtype="bf16"),
        ),
        ("--mtraining-dense", dict(dense=True)),
        (
            "--mtraining-dense --mtraining-dense-impl sdpa_flash --mtraining-layout zigzag",
            dict(dense=True, dense_impl="sdpa_flash", backend="torch"),
        ),
        ("--mtraining-backend triton", dict(backend="triton", dense_impl="mtraining")),
        ("--deterministic-mode", dict(deterministic=True)),
        ("--mtraining-deterministic --mtraining-stats-interval 0", dict(deterministic=True, stats_interval=0)),
        ("--spec megatron_mtraining.spec get_gpt_layer_mtraining_spec --mtraining-loss-chunk-size 8192", {}),
        ("--mtraining-layout contiguous --cp-comm-type p2p --position-embedding-type yarn", dict(layout="contiguous")),
        (
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
            "--mtraining-keep-attention-output",
            dict(keep_attention_output=True),
        ),
    ],
)
def test_valid_combinations_are_accepted(parser, extra, expected):
    config = validate_mtraining_args(_parse(parser, extra))
    for name, value in expected.items():
        assert getattr(config, name) == value, f"{extra}: {name}={getattr(config, name)!r}"


def test_pattern_file_matching_the_model_is_accepted(parser, tmp_path):
    extra = f"--mtraining-budget static --mtraining-pattern-file {_pattern_file(tmp_path, 4, 4)}"
    assert validate_mtraining_args(_parse(parser, extra)).pattern_file.endswith("budgets.json")


@pytest.mark.parametrize(
    "extra, sizes",
    [
        ("--mtraining-ring hierarchical --hierarchical-context-parallel-sizes 2 2", [2, 2]),
        ("--mtraining-ring hierarchical --mtraining-inner-ring-size 2", [2, 2]),
        ("--mtraining-ring hierarchical --mtraining-inner-ring-size 4", [4, 1]),
        ("", None),
    ],
)
def test_hierarchical_ring_sizes(parser, extra, sizes):
    args = _parse(parser, extra, cp=4)
    assert hierarchical_cp_sizes(args, validate_mtraining_args(args)) == sizes


def test_validation_also_holds_after_megatrons_own_validation(parser):
    """CP = 1 lets Megatron's ``validate_args`` run on a CPU; ours must agree with it."""
    from megatron.training.arguments import validate_args

    args = _parse(parser, "--lr 1e-4 --train-iters 10", cp=1)
    args.rank, args.world_size = 0, 1
    validate_args(args)
    assert validate_mtraining_args(args) == mtraining_config_from_args(args)


# ------------------------------------------------------------------------------------------ rejected
@pytest.mark.parametrize(
    "extra, cp, message",
    [
        (
            "--mtraining-ring hierarchical",
            4,
            "--mtraining-ring=hierarchical needs the inner ring size: add --mtraining-inner-ring-size",
        ),
        (
            "--mtraining-ring hierarchical --mtraining-inner-ring-size 3",
            4,
            "--mtraining-inner-ring-size=3 does not divide --context-parallel-size=4",
        ),
        ("--mtraining-inner-ring-size 2", 4, "only applies to the hierarchical ring"),
        ("--mtraining-ring hierarchical", 1, "needs context parallelism"),
        ("--mtraining-ring hierarchical --hierarchical-context-parallel-sizes 2 3", 4, "multiply to 6"),
        ("--hierarchical-context-parallel-sizes 2 2", 4, "add --mtraining-ring hierarchical"),
        (
            "--mtraining-top-p 0.9 --mtraining-vertical-size 64",
            2,
            "--mtraining-budget=top-p does not take the static budget settings --mtraining-vertical-size",
        ),
        (
            "--mtraining-budget static --mtraining-top-p 0.9 --mtraining-sparsity 0.9",
            2,
            "--mtraining-budget=static does not take the top-P settings",
        ),
        ("--mtraining-budget static", 2, "needs exactly one of --mtraining-vertical-size"),
    ],
)
def test_contradictory_mtraining_flags_are_rejected(parser, extra, cp, message):
    with pytest.raises(ValueError) as error:
        validate_mtraining_args(_parse(parser, extra, cp))
    assert message in str(error.value), str(error.value)


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--seq-length 1000 --max-position-embeddings 1000", "--seq-length=1000 is not divisible by 256"),
        (
            "--mtraining-layout zigzag --seq-length 768 --max-position-embeddings 768",
            "--seq-length=768 is not divisible by 512",
        ),
        ("--attention-backend local", "--attention-backend local"),
        ("--spec local", "--spec local replaces MTraining's layer spec"),
        ("--cp-comm-type a2a", "--cp-comm-type a2a is not supported"),
        ("--cp-comm-type a2a+p2p", "needs --hierarchical-context-parallel-sizes"),
        ("--attention-dropout 0.1", "--attention-dropout 0.1 is not supported"),
        ("--mtp-num-layers 1", "--mtp-num-layers 1 shifts tokens"),
        ("--position-embedding-type mrope", "--position-embedding-type mrope"),
        ("--sft", "--sft hand the attention THD packed sequences"),
        ("--hybrid-context-parallel", "use --reset-attention-mask or --dataloader-inter-document-masking"),
        ("--mtraining-loss-chunk-size -1", "--mtraining-loss-chunk-size=-1 must be >= 0"),
        ("--mtraining-loss-chunk-size 4096 --defer-embedding-wgrad-compute", "--defer-embedding-wgrad-compute"),
        ("--mtraining-dense-layers 5", "--mtraining-dense-layers lists layers [5]"),
        ("--mtraining-dense --mtraining-dense-layers 1", "drop --mtraining-dense-layers"),
        ("--mtraining-stripe-granularity 96", "--mtraining-stripe-granularity=96"),
        ("--mtraining-last-q 65", "--mtraining-last-q=65"),
        (
            "--mtraining-keep-attention-output",
            "add --recompute-granularity full or drop --mtraining-keep-attention-output",
        ),
        ("--recompute-granularity selective --mtraining-keep-attention-output", "but it is selective"),
    ],
)
def test_flags_that_conflict_with_megatron_or_the_model_are_rejected(parser, extra, message):
    with pytest.raises(ValueError) as error:
        validate_mtraining_args(_parse(parser, extra))
    assert message in str(error.value), str(error.value)


def test_pattern_file_for_another_model_is_rejected(parser, tmp_path):
    extra = f"--mtraining-budget static --mtraining-pattern-file {_pattern_file(tmp_path, 3, 4)}"
    with pytest.raises(ValueError, match="--mtraining-pattern-file does not fit --num-layers=4"):
        validate_mtraining_args(_parse(parser, extra))


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--mtraining-bogus 1", "unrecognized arguments: --mtraining-bogus"),
        ("--mtraining-lay striped", "unrecognized arguments: --mtraining-lay"),  # no abbreviations
        ("--mtraining-layout diagonal", "argument --mtraining-layout: invalid choice: 'diagonal'"),
        ("--mtraining-ring star", "argument --mtraining-ring: invalid choice: 'star'"),
        ("--mtraining-top-p high", "argument --mtraining-top-p: invalid float value: 'high'"),
        ("--mtraining-dense-layers 1,x", "argument --mtraining-dense-layers: '1,x' is not a comma-separated list"),
        ("--mtraining-backend reference", "argument --mtraining-backend: invalid choice: 'reference'"),
        (
            "--mtraining-kernel torch_blocksparse",
            "argument --mtraining-kernel: removed: split into --mtraining-backend "
            "(the block-sparse kernels) and --mtraining-dense-impl (how "
            "--mtraining-dense layers run); replace --mtraining-kernel "
            "torch_blocksparse with --mtraining-backend torch; old values: ",
        ),
        (
            "--mtraining-kernel sdpa_cudnn",
            "replace --mtraining-kernel sdpa_cudnn with --mtraining-dense-impl sdpa_cudnn (with --mtraining-dense)",
        ),
        (
            "--mtraining-kernel",
            "reference → nothing (the plain-autograd test oracle is MTrainingConfig(backend='reference') in Python)",
        ),
    ],
)
def test_argparse_errors_name_the_flag(parser, capsys, extra, message):
    with pytest.raises(SystemExit):
        _parse(parser, extra)
    assert message in capsys.readouterr().err


def test_launcher_rejects_bad_flags_before_megatrons_own_checks():
    """Megatron's validate_args would fail on ``args.spec[0]`` (None) with a TypeError; ours comes first."""
    command = [
        sys.executable,
        "-m",
        "megatron_mtraining.pretrain",
        *BASE.split(),
        "--context-parallel-size",
        "2",
        "--attention-backend",
        "local",
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=dict(os.environ, RANK="0", WORLD_SIZE="2")
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "megatron_mtraining.pretrain: error: --attention-backend local" in result.stderr, result.stderr[-2000:]
