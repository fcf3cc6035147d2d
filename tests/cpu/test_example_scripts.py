"""The example scripts (examples/*.sh, examples/slurm/*.sbatch) and model presets (examples/models/*.sh).

Every script passes ``bash -n``. Each dry run (``--dry-run`` or ``DRY_RUN=1``, with or without a converted
checkpoint) prints the full command: ``torch.distributed.run``'s own parser reads it, and the flags after
``-m megatron_mtraining.pretrain`` are parsed by Megatron's parser with ``add_mtraining_args`` (an unknown or
malformed flag fails) and pass :func:`validate_mtraining_args`. The settings (budget, TP/PP/CP/DP, evaluation,
split, packed documents, model, tokenizer) reach their flags; every bad setting stops the script with exit
status 2 and a message naming it; a template's dry run calls no ``srun``, ``scontrol``, ``torchrun`` or Python
(fake ones on PATH record every call). Each preset's ``MODEL_ARGS`` is the converter's ``megatron_flags`` of
the public Hugging Face config. The check mode (``--check``) runs the launcher's ``--mtraining-check`` on this machine.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mtraining.config import DEFAULT_MIN_SPARSE_LENGTH
from megatron_mtraining.conversion.architecture import MODEL_ARGS_FILE, QwenArchitecture, write_model_args

REPO = Path(__file__).resolve().parents[2]
TRAIN = "examples/qwen2.5-3b_32k_to_512k.sh"
DEMO = "examples/qwen2.5-0.5b_1gpu_demo.sh"
ONE_NODE = "examples/slurm/qwen2.5-3b_512k_1node.sbatch"
MULTI_NODE = "examples/slurm/qwen2.5-3b_512k_multinode.sbatch"
TEMPLATES = (ONE_NODE, MULTI_NODE)
LAUNCHING = (TRAIN, DEMO, *TEMPLATES)
SCRIPTS = sorted(
    [*REPO.glob("examples/*.sh"), *REPO.glob("examples/slurm/*.sbatch"), *REPO.glob("examples/models/*.sh")]
)
PRESETS = sorted(REPO.glob("examples/models/*.sh"))
FAKE_COMMANDS = ("srun", "scontrol", "torchrun", "python")
TE_FLAGS = (
    "--transformer-impl",
    "--no-rope-fusion",
    "--no-gradient-accumulation-fusion",
    "--no-bias-swiglu-fusion",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
)

# config.json of the public Qwen2.5 checkpoints on the Hugging Face hub (the fields the converter reads).
_QWEN25_COMMON = dict(model_type="qwen2", rope_theta=1000000.0, rms_norm_eps=1e-06)
QWEN25 = {
    "0.5B": dict(
        _QWEN25_COMMON,
        num_hidden_layers=24,
        hidden_size=896,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "1.5B": dict(
        _QWEN25_COMMON,
        num_hidden_layers=28,
        hidden_size=1536,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
    "3B": dict(
        _QWEN25_COMMON,
        num_hidden_layers=36,
        hidden_size=2048,
        num_attention_heads=16,
        num_key_value_heads=2,
        intermediate_size=11008,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "7B": dict(
        _QWEN25_COMMON,
        num_hidden_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
}
# config.json of the public dense Qwen3 checkpoints (q/k RMSNorm, no QKV bias, explicit head_dim).
_QWEN3_COMMON = dict(
    model_type="qwen3",
    rope_theta=1000000.0,
    rms_norm_eps=1e-06,
    head_dim=128,
    attention_bias=False,
    vocab_size=151936,
    max_position_embeddings=40960,
)
QWEN3 = {
    "0.6B": dict(
        _QWEN3_COMMON,
        num_hidden_layers=28,
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=3072,
        tie_word_embeddings=True,
    ),
    "1.7B": dict(
        _QWEN3_COMMON,
        num_hidden_layers=28,
        hidden_size=2048,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=6144,
        tie_word_embeddings=True,
    ),
    "4B": dict(
        _QWEN3_COMMON,
        num_hidden_layers=36,
        hidden_size=2560,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=9728,
        tie_word_embeddings=True,
    ),
    "8B": dict(
        _QWEN3_COMMON,
        num_hidden_layers=36,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=12288,
        tie_word_embeddings=False,
    ),
}
PRESET_CONFIGS = {
    **{f"qwen2.5-{size.lower()}": (config, f"Qwen/Qwen2.5-{size}") for size, config in QWEN25.items()},
    **{f"qwen3-{size.lower()}": (config, f"Qwen/Qwen3-{size}") for size, config in QWEN3.items()},
}
# What each launching script runs by default: (model size, GPUs per node, nodes, CP, ring, inner ring size).
DEFAULT_LAYOUT = {
    TRAIN: ("3B", 8, 1, 8, "flat", None),
    DEMO: ("0.5B", 1, 1, 1, "flat", None),
    ONE_NODE: ("3B", 8, 1, 8, "flat", None),
    MULTI_NODE: ("3B", 8, 4, 32, "hierarchical", 8),
}


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    from megatron_mtraining.arguments import add_mtraining_args

    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    add_megatron_arguments(parser)
    return add_mtraining_args(parser)


@pytest.fixture
def fake_bin(tmp_path) -> Path:
    """A directory of fake ``srun``/``scontrol``/``torchrun``/``python`` that record each call in ``calls.log``.

    A record is one line: the command's name, ``WORLD_SIZE=<value>`` and its arguments, shell-quoted.
    """
    directory = tmp_path / "bin"
    directory.mkdir()
    for name in FAKE_COMMANDS:
        fake = directory / name
        log = directory / "calls.log"
        fake.write_text(
            f'#!/bin/bash\nprintf "%q " {name} "WORLD_SIZE=${{WORLD_SIZE-}}" "$@" >> "{log}"\necho >> "{log}"\n'
        )
        fake.chmod(0o755)
    return directory


def _calls(fake_bin: Path) -> list[list[str]]:
    log = fake_bin / "calls.log"
    return [shlex.split(line) for line in log.read_text().splitlines()] if log.exists() else []


def _checkpoint(directory: Path, size: str) -> Path:
    """A converted-checkpoint directory holding just the args file (what the scripts read of it)."""
    directory.mkdir()
    write_model_args(
        directory / MODEL_ARGS_FILE,
        QwenArchitecture.from_hf_config(QWEN25[size]).megatron_flags(f"/models/Qwen2.5-{size}"),
        f"Qwen2.5-{size}",
    )
    return directory


def _run(
    script: str, environment: dict[str, str], *arguments: str, path: Path | None = None, timeout: int = 60
) -> subprocess.CompletedProcess:
    """``bash script arguments`` from the repository root with only ``environment`` set (no SLURM_*, no settings)."""
    env = {
        "PATH": f"{path}:/usr/bin:/bin" if path else "/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/"),
        "LANG": "C.UTF-8",
        **environment,
    }
    return subprocess.run(
        ["bash", str(REPO / script), *arguments], env=env, capture_output=True, text=True, cwd=REPO, timeout=timeout
    )


def _dry_run(script: str, environment: dict[str, str]) -> subprocess.CompletedProcess:
    result = _run(script, environment, "--dry-run")
    assert result.returncode == 0, result.stderr
    return result


def _command_words(output: str) -> list[str]:
    line = next(line for line in output.splitlines() if "megatron_mtraining.pretrain" in line)
    return shlex.split(line)


def _launch_command(output: str) -> tuple[argparse.Namespace, list[str]]:
    """The command line of a dry run, parsed by torch.distributed.run's own parser; and the launcher's flags."""
    from torch.distributed.run import get_args_parser

    words = _command_words(output)
    assert words[1:3] == ["-m", "torch.distributed.run"], words
    torchrun = get_args_parser().parse_args(words[3:])
    assert (torchrun.module, torchrun.training_script) == (True, "megatron_mtraining.pretrain"), words
    return torchrun, torchrun.training_script_args


def _parsed(parser, flags: list[str]) -> argparse.Namespace:
    from megatron_mtraining.arguments import validate_mtraining_args

    args = parser.parse_args(flags)
    validate_mtraining_args(args)
    return args


def _comment(output: str, topic: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(f"# {topic}:"))


def _model_args(preset: Path) -> list[str]:
    """``MODEL_ARGS`` as bash defines it when sourcing ``preset``."""
    result = subprocess.run(
        ["bash", "-c", 'source "$1"; printf "%s\\0" "${MODEL_ARGS[@]}"', "_", str(preset)],
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.split("\0")[:-1]


# ------------------------------------------------------------------------------------------ syntax and presets
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: str(path.relative_to(REPO / "examples")))
def test_scripts_pass_bash_syntax_check(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_preset_has_its_public_config():
    assert sorted(preset.stem for preset in PRESETS) == sorted(PRESET_CONFIGS)


@pytest.mark.parametrize("name", sorted(PRESET_CONFIGS))
def test_preset_is_the_converters_model_args(name):
    preset = REPO / "examples" / "models" / f"{name}.sh"
    config, hub_name = PRESET_CONFIGS[name]
    expected = QwenArchitecture.from_hf_config(config).megatron_flags(hub_name)
    assert _model_args(preset) == expected, f"{preset} drifted from QwenArchitecture.megatron_flags"


@pytest.mark.parametrize("preset", PRESETS, ids=lambda path: path.stem)
def test_every_preset_runs_as_model(parser, preset):
    result = _dry_run(TRAIN, {"MODEL": preset.stem})
    assert _comment(result.stdout, "model flags").startswith(f"# model flags: examples/models/{preset.name}")
    args = _parsed(parser, _launch_command(result.stdout)[1])
    model_args = _model_args(preset)
    assert args.num_layers == int(model_args[model_args.index("--num-layers") + 1])
    assert args.tokenizer_model == model_args[model_args.index("--tokenizer-model") + 1]


# ------------------------------------------------------------------------------------------ dry runs
@pytest.mark.parametrize("how", ["--dry-run", "DRY_RUN=1"])
@pytest.mark.parametrize("with_checkpoint", [True, False], ids=["checkpoint", "no-checkpoint"])
@pytest.mark.parametrize("script", LAUNCHING, ids=lambda script: Path(script).name)
def test_dry_run_is_accepted_by_the_launcher(parser, tmp_path, script, with_checkpoint, how):
    size, gpus_per_node, nodes, cp, ring, inner_ring = DEFAULT_LAYOUT[script]
    environment = {"CHECKPOINT": str(_checkpoint(tmp_path / "ckpt", size))} if with_checkpoint else {}
    arguments = ()
    if how == "DRY_RUN=1":
        environment["DRY_RUN"] = "1"
    else:
        arguments = ("--dry-run",)
    result = _run(script, environment, *arguments)
    assert result.returncode == 0, result.stderr
    torchrun, flags = _launch_command(result.stdout)
    assert (torchrun.nproc_per_node, torchrun.nnodes, torchrun.node_rank) == (str(gpus_per_node), str(nodes), 0)
    args = _parsed(parser, flags)
    config = QWEN25[size]
    assert (args.num_layers, args.hidden_size, args.padded_vocab_size) == (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["vocab_size"],
    )
    if with_checkpoint:
        assert args.pretrained_checkpoint == environment["CHECKPOINT"]
        assert args.tokenizer_model == f"/models/Qwen2.5-{size}"
    else:
        assert args.pretrained_checkpoint is None and args.tokenizer_model == f"Qwen/Qwen2.5-{size}"
        assert "no --pretrained-checkpoint" in _comment(result.stdout, "model flags")
    assert (args.context_parallel_size, args.mtraining_ring, args.mtraining_inner_ring_size) == (cp, ring, inner_ring)
    assert args.mock_data and args.split == "98,2,0"
    assert args.eval_interval >= 1 and args.eval_iters >= 1, "Megatron needs --eval-interval with --eval-iters"
    assert args.mtraining_loss_chunk_size > 0, "long-sequence logits must not be materialised"
    assert not set(TE_FLAGS) & set(flags), "the launcher chooses the TE fallback itself"


def test_real_data_and_evaluation_settings(parser):
    result = _dry_run(
        TRAIN, {"DATA_PREFIX": "data/long_docs", "SPLIT": "90,5,5", "EVAL_INTERVAL": "50", "EVAL_ITERS": "2"}
    )
    args = _parsed(parser, _launch_command(result.stdout)[1])
    assert args.data_path == ["data/long_docs"] and not args.mock_data
    assert (args.split, args.eval_interval, args.eval_iters) == ("90,5,5", 50, 2)
    assert _comment(result.stdout, "data") == "# data: data/long_docs"


@pytest.mark.parametrize(
    "settings, expected",
    [
        (
            {},
            dict(
                mtraining_budget="top-p",
                mtraining_top_p=0.9,
                mtraining_sparsity=None,
                mtraining_block_slashes=False,
                mtraining_cap=None,
            ),
        ),
        ({"TOP_P": "0.95"}, dict(mtraining_budget="top-p", mtraining_top_p=0.95)),
        (
            {"BLOCK_SLASHES": "1", "CAP": "128"},
            dict(mtraining_budget="top-p", mtraining_top_p=0.9, mtraining_block_slashes=True, mtraining_cap=128),
        ),
        ({"BUDGET": "static"}, dict(mtraining_budget="static", mtraining_sparsity=0.95, mtraining_top_p=None)),
        ({"BUDGET": "static", "SPARSITY": "0.9"}, dict(mtraining_budget="static", mtraining_sparsity=0.9)),
        (
            {"BUDGET": "static", "VERTICAL_SIZE": "1024", "SLASH_SIZE": "8192"},
            dict(
                mtraining_budget="static",
                mtraining_vertical_size=1024,
                mtraining_slash_size=8192,
                mtraining_sparsity=None,
            ),
        ),
    ],
    ids=["top-p-default", "top-p", "top-p-blocks-cap", "static-default", "static-sparsity", "static-sizes"],
)
def test_budget_settings(parser, settings, expected):
    args = _parsed(parser, _launch_command(_dry_run(TRAIN, settings).stdout)[1])
    assert {name: getattr(args, name) for name in expected} == expected


PACKED_FLAGS = ("reset_attention_mask", "reset_position_ids", "eod_mask_loss")


@pytest.mark.parametrize(
    "settings, packed, min_sparse_length",
    [
        ({}, False, DEFAULT_MIN_SPARSE_LENGTH),
        ({"PACKED_DOCUMENTS": "0"}, False, DEFAULT_MIN_SPARSE_LENGTH),
        ({"PACKED_DOCUMENTS": "1"}, True, DEFAULT_MIN_SPARSE_LENGTH),
        ({"PACKED_DOCUMENTS": "1", "MIN_SPARSE_LENGTH": "1024"}, True, 1024),
    ],
    ids=["default", "unpacked", "packed", "packed-min-sparse-length"],
)
@pytest.mark.parametrize("script", LAUNCHING, ids=lambda script: Path(script).name)
def test_packed_document_settings(parser, script, settings, packed, min_sparse_length):
    """PACKED_DOCUMENTS=1: Megatron's document flags, and --no-rope-fusion (per-token RoPE runs unfused only);
    MIN_SPARSE_LENGTH: --mtraining-min-sparse-length. The demo and the templates pass them on."""
    result = _dry_run(script, settings)
    flags = _launch_command(result.stdout)[1]
    args = _parsed(parser, flags)
    assert {name: getattr(args, name) for name in PACKED_FLAGS} == dict.fromkeys(PACKED_FLAGS, packed)
    assert args.apply_rope_fusion is not packed, "Megatron's default, fused RoPE, unless the documents need per-token"
    assert args.mtraining_min_sparse_length == min_sparse_length
    assert ("--mtraining-min-sparse-length" in flags) == ("MIN_SPARSE_LENGTH" in settings)
    packed_comment = "; packed documents (attention within each document)"
    assert _comment(result.stdout, "data").endswith(packed_comment) == packed


@pytest.mark.parametrize(
    "settings, layout",
    [
        ({}, "striped"),
        ({"PACKED_DOCUMENTS": "1"}, "skewed"),
        ({"PACKED_DOCUMENTS": "1", "LAYOUT": "striped"}, "striped"),
        ({"LAYOUT": "zigzag"}, "zigzag"),
    ],
    ids=["default", "packed", "packed-striped", "zigzag"],
)
def test_recipe_layout(parser, settings, layout):
    """The recipe's CP layout: striped, skewed for packed documents (it also balances documents of one
    length), LAYOUT overriding either."""
    args = _parsed(parser, _launch_command(_dry_run(TRAIN, settings).stdout)[1])
    assert args.mtraining_layout == layout


def test_documented_packed_flags_are_the_settings_flags():
    """docs/user_journey.md's launcher flags for packed documents are what its script line's settings add."""
    journey = (REPO / "docs" / "user_journey.md").read_text()
    documented = "--reset-attention-mask --reset-position-ids --no-rope-fusion --eod-mask-loss"
    documented += " --mtraining-min-sparse-length 4096"
    assert documented in journey and "PACKED_DOCUMENTS=1 MIN_SPARSE_LENGTH=4096 " in journey
    flags = _launch_command(_dry_run(TRAIN, {"PACKED_DOCUMENTS": "1", "MIN_SPARSE_LENGTH": "4096"}).stdout)[1]
    assert documented in shlex.join(flags)


@pytest.mark.parametrize(
    "settings, tp, pp, cp, dp, ring, inner_ring",
    [
        ({"TP": "2"}, 2, 1, 4, 1, "flat", None),
        ({"TP": "2", "PP": "2"}, 2, 2, 2, 1, "flat", None),
        ({"CP": "4"}, 1, 1, 4, 2, "flat", None),
        ({"NNODES": "2"}, 1, 1, 16, 1, "hierarchical", 8),
        ({"NNODES": "2", "TP": "2"}, 2, 1, 8, 1, "hierarchical", 4),
        ({"NNODES": "2", "CP": "8"}, 1, 1, 8, 2, "flat", None),
        ({"NNODES": "4", "PP": "2"}, 1, 2, 16, 1, "hierarchical", 8),
    ],
    ids=["tp2", "tp2-pp2", "cp4-dp2", "2-nodes", "2-nodes-tp2", "2-nodes-dp2", "4-nodes-pp2"],
)
def test_parallel_settings(parser, settings, tp, pp, cp, dp, ring, inner_ring):
    result = _dry_run(TRAIN, settings)
    torchrun, flags = _launch_command(result.stdout)
    args = _parsed(parser, flags)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size) == (
        tp,
        pp,
        cp,
    )
    assert args.sequence_parallel == (tp > 1)
    assert (args.mtraining_ring, args.mtraining_inner_ring_size) == (ring, inner_ring)
    gpus = int(torchrun.nproc_per_node) * int(torchrun.nnodes)
    assert gpus == tp * pp * cp * dp
    assert f"= TP {tp} x PP {pp} x CP {cp} x DP {dp};" in _comment(result.stdout, "layout")


def test_model_and_tokenizer_settings(parser, tmp_path):
    args = _parsed(parser, _launch_command(_dry_run(TRAIN, {"MODEL": "qwen2.5-7b", "TOKENIZER": "/hf/tok"}).stdout)[1])
    assert (args.num_layers, args.untie_embeddings_and_output_weights, args.tokenizer_model) == (28, True, "/hf/tok")
    checkpoint = _checkpoint(tmp_path / "ckpt", "3B")
    result = _dry_run(TRAIN, {"CHECKPOINT": str(checkpoint), "TOKENIZER": "/hf/tok"})
    args = _parsed(parser, _launch_command(result.stdout)[1])
    assert (args.num_layers, args.tokenizer_model) == (36, "/hf/tok")
    assert _comment(result.stdout, "model flags") == f"# model flags: {checkpoint / MODEL_ARGS_FILE}"


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            "--mtraining-dense --mtraining-layout zigzag --mtraining-dense-impl sdpa_cudnn",
            dict(mtraining_dense=True, mtraining_layout="zigzag", mtraining_dense_impl="sdpa_cudnn"),
        ),
        ("--mtraining-keep-attention-output", dict(mtraining_keep_attention_output=True, recompute_granularity="full")),
    ],
    ids=["dense-baseline", "keep-attention-output"],
)
def test_documented_extra_args_are_accepted(parser, extra, expected):
    """docs/user_journey.md's EXTRA_ARGS examples: the dense baseline and the kept attention output."""
    assert extra in (REPO / "docs" / "user_journey.md").read_text().replace("\n", " ")
    args = _parsed(parser, _launch_command(_dry_run(TRAIN, {"EXTRA_ARGS": extra}).stdout)[1])
    assert {name: getattr(args, name) for name in expected} == expected


def test_multinode_template_prints_the_srun_line(parser):
    result = _dry_run(MULTI_NODE, {"TP": "2"})
    srun = shlex.split(result.stdout.splitlines()[0])
    assert srun[:2] == ["srun", "--ntasks-per-node=1"] and "NODE_RANK=$SLURM_NODEID" in srun[-1]
    args = _parsed(parser, _launch_command(result.stdout)[1])
    assert (args.context_parallel_size, args.mtraining_inner_ring_size) == (16, 4)


# ------------------------------------------------------------------------------------------ what each mode starts
@pytest.mark.parametrize("how", ["--dry-run", "DRY_RUN=1"])
@pytest.mark.parametrize("template", TEMPLATES, ids=lambda script: Path(script).name)
def test_template_dry_run_starts_nothing(fake_bin, tmp_path, template, how):
    """Inside a SLURM allocation, with fake srun/scontrol/torchrun/python first on PATH: none of them is called."""
    environment = {
        "CHECKPOINT": str(_checkpoint(tmp_path / "ckpt", "3B")),
        "SLURM_JOB_NODELIST": "node[01-02]",
        "SLURM_NNODES": "2",
        "SLURM_SUBMIT_DIR": str(REPO),
    }
    arguments = ("--dry-run",) if how == "--dry-run" else ()
    if how == "DRY_RUN=1":
        environment["DRY_RUN"] = "1"
    result = _run(template, environment, *arguments, path=fake_bin)
    assert result.returncode == 0, result.stderr
    assert _calls(fake_bin) == []
    assert shlex.split(result.stdout.splitlines()[0])[0] == "srun" and "--nnodes 2" in result.stdout


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda script: Path(script).name)
def test_template_real_run_calls_srun_once(fake_bin, tmp_path, template):
    """The recording fakes work: a real submission reaches srun (and, across nodes, scontrol for the first node)."""
    environment = {
        "CHECKPOINT": str(_checkpoint(tmp_path / "ckpt", "3B")),
        "MOCK_DATA": "1",
        "SLURM_JOB_NODELIST": "node[01-02]",
        "SLURM_NNODES": "2",
        "SLURM_SUBMIT_DIR": str(REPO),
    }
    result = _run(template, environment, path=fake_bin)
    assert result.returncode == 0, result.stderr
    calls = [call[0] for call in _calls(fake_bin)]
    assert calls == (["scontrol", "srun"] if template == MULTI_NODE else ["srun"])


def test_real_run_executes_the_printed_command(fake_bin, tmp_path):
    environment = {
        "CHECKPOINT": str(_checkpoint(tmp_path / "ckpt", "3B")),
        "MOCK_DATA": "1",
        "SAVE_DIR": str(tmp_path / "save"),
    }
    printed = _command_words(_dry_run(TRAIN, environment).stdout)
    result = _run(TRAIN, environment, path=fake_bin)
    assert result.returncode == 0, result.stderr
    (call,) = _calls(fake_bin)
    assert call[1] == "WORLD_SIZE=", "torchrun sets the world size of its workers"
    assert call[:1] + call[2:] == printed and (tmp_path / "save").is_dir()


# ------------------------------------------------------------------------------------------ bad settings
@pytest.mark.parametrize(
    "script, settings, message",
    [
        (TRAIN, {"TP": "two"}, "TP=two must be an integer"),
        (TRAIN, {"SEQ_LEN": "512k"}, "SEQ_LEN=512k must be an integer"),
        (TRAIN, {"GPUS_PER_NODE": "08"}, "GPUS_PER_NODE=08 must be an integer"),
        (TRAIN, {"EVAL_INTERVAL": "0"}, "EVAL_INTERVAL=0 must be an integer >= 1"),
        (TRAIN, {"EVAL_ITERS": "-1"}, "EVAL_ITERS=-1 must be an integer >= 0"),
        (TRAIN, {"LR": "fast"}, "LR=fast must be a number"),
        (TRAIN, {"TP": "3"}, "TP=3 must divide GPUS_PER_NODE=8"),
        (TRAIN, {"PP": "3"}, "TP=1 x PP=3 must divide the 8 GPUs"),
        (TRAIN, {"CP": "3"}, "CP=3 must divide GPUs / (TP x PP)"),
        (TRAIN, {"CP": "0"}, "CP=0 must be an integer >= 1"),
        (TRAIN, {"CP": "4", "GLOBAL_BATCH_SIZE": "3"}, "GLOBAL_BATCH_SIZE=3 must be a multiple of DP=2"),
        (TRAIN, {"NNODES": "3", "CP": "12"}, "CP=12 = 12 GPUs per CP group"),
        (TRAIN, {"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2 must be below NNODES=2"),
        (TRAIN, {"BUDGET": "dense"}, "BUDGET=dense is not a budget"),
        (
            TRAIN,
            {"BUDGET": "static", "SPARSITY": "0.9", "VERTICAL_SIZE": "1024", "SLASH_SIZE": "8192"},
            "SPARSITY=0.9 and VERTICAL_SIZE/SLASH_SIZE both set",
        ),
        (TRAIN, {"BUDGET": "static", "VERTICAL_SIZE": "1024"}, "needs both VERTICAL_SIZE and SLASH_SIZE"),
        (TRAIN, {"BUDGET": "static", "SPARSITY": "1"}, "SPARSITY=1 must be in [0, 1)"),
        (TRAIN, {"BUDGET": "static", "TOP_P": "0.9"}, "TOP_P=0.9 is a top-p setting"),
        (TRAIN, {"BUDGET": "static", "BLOCK_SLASHES": "1"}, "BLOCK_SLASHES=1 is a top-p setting"),
        (TRAIN, {"BUDGET": "static", "CAP": "128"}, "CAP=128 is a top-p setting"),
        (TRAIN, {"BLOCK_SLASHES": "yes"}, "BLOCK_SLASHES=yes must be 0 or 1"),
        (TRAIN, {"CAP": "0"}, "CAP=0 must be an integer >= 1"),
        (TRAIN, {"SPARSITY": "0.9"}, "SPARSITY=0.9 is a static-budget setting; add BUDGET=static"),
        (TRAIN, {"TOP_P": "0"}, "TOP_P=0 must be in (0, 1]"),
        (TRAIN, {"MODEL": "qwen2.5-70b"}, "MODEL=qwen2.5-70b is not a model preset"),
        (TRAIN, {"SPLIT": "98,2"}, "SPLIT=98,2 must be three integer percentages"),
        (TRAIN, {"SPLIT": "90,5,4"}, "SPLIT=90,5,4 must add up to 100"),
        (TRAIN, {"SPLIT": "0,50,50"}, "SPLIT=0,50,50 leaves no training data"),
        (TRAIN, {"SPLIT": "100,0,0"}, "SPLIT=100,0,0 has no validation share but EVAL_ITERS=1"),
        (TRAIN, {"MOCK_DATA": "yes"}, "MOCK_DATA=yes must be 0 or 1"),
        (TRAIN, {"PACKED_DOCUMENTS": "yes"}, "PACKED_DOCUMENTS=yes must be 0 or 1"),
        (TRAIN, {"LAYOUT": "ring"}, "LAYOUT=ring must be striped, skewed, zigzag or contiguous"),
        (TRAIN, {"PACKED_DOCUMENTS": "1", "MIN_SPARSE_LENGTH": "4k"}, "MIN_SPARSE_LENGTH=4k must be an integer >= 1"),
        (TRAIN, {"PACKED_DOCUMENTS": "1", "MIN_SPARSE_LENGTH": "0"}, "MIN_SPARSE_LENGTH=0 must be an integer >= 1"),
        (
            TRAIN,
            {"MIN_SPARSE_LENGTH": "1024"},
            "MIN_SPARSE_LENGTH=1024 is a packed-documents setting, but PACKED_DOCUMENTS=0; add PACKED_DOCUMENTS=1",
        ),
        (
            TRAIN,
            {"PACKED_DOCUMENTS": "0", "MIN_SPARSE_LENGTH": "1024"},
            "MIN_SPARSE_LENGTH=1024 is a packed-documents setting, but PACKED_DOCUMENTS=0",
        ),
        (TRAIN, {"DRY_RUN": "yes"}, "DRY_RUN=yes must be 0 or 1"),
        (TRAIN, {"CHECK": "1"}, "--dry-run (DRY_RUN=1) and --check (CHECK=1) together"),
        (TRAIN, {"CHECKPOINT": "/nonexistent"}, "CHECKPOINT=/nonexistent has no megatron_model_args.sh"),
        (DEMO, {"NGPUS": "2", "GPUS_PER_NODE": "4"}, "NGPUS=2 and GPUS_PER_NODE=4 disagree"),
        (DEMO, {"BUDGET": "topp"}, "BUDGET=topp is not a budget"),
        (DEMO, {"MIN_SPARSE_LENGTH": "1024"}, "MIN_SPARSE_LENGTH=1024 is a packed-documents setting"),
        (ONE_NODE, {"TP": "3"}, "TP=3 must divide GPUS_PER_NODE=8"),
        (ONE_NODE, {"CHECK": "1"}, "--dry-run (DRY_RUN=1) and --check (CHECK=1) together"),
        (ONE_NODE, {"PACKED_DOCUMENTS": "2"}, "PACKED_DOCUMENTS=2 must be 0 or 1"),
        (MULTI_NODE, {"CP": "12"}, "CP=12 must divide GPUs / (TP x PP)"),
        (MULTI_NODE, {"DRY_RUN": "yes"}, "DRY_RUN=yes must be 0 or 1"),
        (MULTI_NODE, {"MIN_SPARSE_LENGTH": "1024"}, "MIN_SPARSE_LENGTH=1024 is a packed-documents setting"),
    ],
)
def test_bad_setting_stops_before_anything_runs(fake_bin, script, settings, message):
    result = _run(script, settings, "--dry-run", path=fake_bin)
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert message in result.stderr
    assert _calls(fake_bin) == []


def test_unknown_model_lists_the_presets():
    result = _run(TRAIN, {"MODEL": "qwen2.5-70b"}, "--dry-run")
    assert result.returncode == 2
    assert all(preset.stem in result.stderr for preset in PRESETS)


@pytest.mark.parametrize("script", LAUNCHING, ids=lambda script: Path(script).name)
def test_unknown_argument_prints_the_usage(script):
    result = _run(script, {}, "--bogus")
    assert result.returncode == 2 and "usage" in result.stderr and result.stdout == ""


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"MOCK_DATA": "1"}, "set CHECKPOINT"),
        ({"CHECKPOINT": "{checkpoint}"}, "set DATA_PREFIX"),
    ],
    ids=["no-checkpoint", "no-data"],
)
def test_real_run_needs_checkpoint_and_data(fake_bin, tmp_path, settings, message):
    checkpoint = str(_checkpoint(tmp_path / "ckpt", "3B"))
    result = _run(TRAIN, {name: value.format(checkpoint=checkpoint) for name, value in settings.items()}, path=fake_bin)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert _calls(fake_bin) == []


def test_real_template_run_with_a_bad_setting_never_reaches_srun(fake_bin, tmp_path):
    environment = {"CHECKPOINT": str(_checkpoint(tmp_path / "ckpt", "3B")), "MOCK_DATA": "1", "TP": "3"}
    result = _run(MULTI_NODE, environment, path=fake_bin)
    assert result.returncode == 2 and "TP=3" in result.stderr
    assert _calls(fake_bin) == []


# ------------------------------------------------------------------------------------------ check mode
@pytest.mark.parametrize("how", ["--check", "CHECK=1"])
@pytest.mark.parametrize("script", LAUNCHING, ids=lambda script: Path(script).name)
def test_check_runs_the_launchers_check_on_the_printed_flags(fake_bin, script, how):
    """``--check`` / ``CHECK=1``: the command is printed, then ``WORLD_SIZE=<GPUs> python -m ... --mtraining-check``."""
    environment = {"CHECK": "1"} if how == "CHECK=1" else {}
    result = _run(script, environment, *(("--check",) if how == "--check" else ()), path=fake_bin)
    assert result.returncode == 0, result.stderr
    torchrun, flags = _launch_command(result.stdout)
    (call,) = _calls(fake_bin)
    gpus = int(torchrun.nproc_per_node) * int(torchrun.nnodes)
    assert call == ["python", f"WORLD_SIZE={gpus}", "-m", "megatron_mtraining.pretrain", "--mtraining-check", *flags]


# These run the launcher's own --mtraining-check (megatron_mtraining/launch_check.py) in this Python.
@pytest.mark.parametrize("script", LAUNCHING, ids=lambda script: Path(script).name)
def test_check_mode_accepts_every_scripts_command(tmp_path, script):
    size = DEFAULT_LAYOUT[script][0]
    checkpoint = _checkpoint(tmp_path / "ckpt", size)
    result = _run(script, {"PYTHON": sys.executable, "CHECKPOINT": str(checkpoint)}, "--check", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    torchrun, _ = _launch_command(result.stdout)
    gpus = int(torchrun.nproc_per_node) * int(torchrun.nnodes)
    assert f"the command is valid for WORLD_SIZE={gpus} ranks" in result.stdout
    tp, pp, cp, dp = re.search(r"TP (\d+) x PP (\d+) x CP (\d+) x DP (\d+)", _comment(result.stdout, "layout")).groups()
    assert f"ranks        {gpus} = TP {tp} × PP {pp} × CP {cp} × DP {dp}" in result.stdout, (
        "the launcher resolves the layout the script states"
    )
    assert f"pretrained {checkpoint};" in result.stdout
    assert f"tokenizer    HuggingFaceTokenizer /models/Qwen2.5-{size}" in result.stdout


@pytest.mark.parametrize("script", [TRAIN, DEMO], ids=lambda script: Path(script).name)
def test_check_mode_accepts_packed_documents(script):
    settings = {"PYTHON": sys.executable, "PACKED_DOCUMENTS": "1", "MIN_SPARSE_LENGTH": "1024"}
    result = _run(script, settings, "--check", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {"--reset-attention-mask", "--mtraining-min-sparse-length"} <= set(_command_words(result.stdout))
    assert "the command is valid for WORLD_SIZE=" in result.stdout


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"SEQ_LEN": "100000"}, "--seq-length=100000 is not divisible"),
        ({"PP": "8"}, "Number of layers should be divisible by the pipeline-model-parallel size"),
        (
            {"PACKED_DOCUMENTS": "1", "PP": "2"},
            "--reset-attention-mask, --reset-position-ids need the micro-batch's tokens and position ids",
        ),
        ({"PACKED_DOCUMENTS": "1", "MIN_SPARSE_LENGTH": "32"}, "--mtraining-min-sparse-length=32 must be an integer"),
    ],
    ids=["mtraining-seq-length", "megatron-pipeline", "packed-pipeline", "packed-min-sparse-length"],
)
def test_check_mode_rejects_a_command_the_launcher_cannot_run(settings, message):
    """Settings the script accepts but MTraining (SEQ_LEN: CP x stripe granularity; packed documents with PP > 1 or
    a MIN_SPARSE_LENGTH below the estimation's 64 queries) or Megatron (36 layers over PP 8) does not: the check
    exits non-zero with the launcher's message."""
    result = _run(TRAIN, {"PYTHON": sys.executable, **settings}, "--check", timeout=300)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-3000:]
