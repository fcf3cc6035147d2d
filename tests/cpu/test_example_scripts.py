"""The example scripts (examples/*.sh, examples/slurm/*.sbatch): syntax, and dry runs the launcher accepts.

Every script passes ``bash -n``. Each dry run prints the full command: ``torch.distributed.run``'s own
parser reads it, and the flags after ``-m megatron_mtraining.pretrain`` are parsed by Megatron's parser with ``add_mtraining_args`` (an unknown
or malformed flag fails) and pass :func:`validate_mtraining_args`, with the Qwen2.5 model flags of an
args file written by the converter's own writer. The parallel layout matches the node shape: a flat CP
ring on one node, a hierarchical ring (inner = GPUs per node, outer = nodes) across nodes.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from qwen2_mapping import MODEL_ARGS_FILE, QwenArchitecture, write_model_args  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*REPO.glob("examples/*.sh"), *REPO.glob("examples/slurm/*.sbatch")])
QWEN25 = {"3B": dict(num_hidden_layers=36, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
                     intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True),
          "0.5B": dict(num_hidden_layers=24, hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)}


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    from megatron_mtraining.arguments import add_mtraining_args

    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    add_megatron_arguments(parser)
    return add_mtraining_args(parser)


def _checkpoint(directory: Path, size: str) -> Path:
    """A converted-checkpoint directory holding just the args file (what the scripts read of it)."""
    config = {"model_type": "qwen2", "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
              **QWEN25[size]}
    directory.mkdir()
    write_model_args(directory / MODEL_ARGS_FILE, QwenArchitecture.from_hf_config(config).megatron_flags(
        "/models/Qwen2.5"), f"Qwen2.5-{size}")
    return directory


def _dry_run(script: str, environment: dict[str, str], *arguments: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    env.update(environment)
    return subprocess.run(["bash", str(REPO / script), *arguments], env=env, capture_output=True, text=True,
                          cwd=REPO, timeout=60)


def _launch_command(output: str) -> tuple[argparse.Namespace, list[str]]:
    """The command line of a dry run, parsed by torch.distributed.run's own parser; and the launcher's flags."""
    from torch.distributed.run import get_args_parser

    line = next(line for line in output.splitlines() if "megatron_mtraining.pretrain" in line)
    words = shlex.split(line)
    assert words[1:3] == ["-m", "torch.distributed.run"], line
    torchrun = get_args_parser().parse_args(words[3:])
    assert (torchrun.module, torchrun.training_script) == (True, "megatron_mtraining.pretrain"), line
    return torchrun, torchrun.training_script_args


def _parsed(parser, flags: list[str]) -> argparse.Namespace:
    from megatron_mtraining.arguments import validate_mtraining_args

    args = parser.parse_args(flags)
    validate_mtraining_args(args)
    return args


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_scripts_pass_bash_syntax_check(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_3b_single_node_dry_run_is_accepted_by_the_launcher(parser, tmp_path):
    checkpoint = _checkpoint(tmp_path / "ckpt", "3B")
    result = _dry_run("examples/qwen2.5-3b_32k_to_512k.sh", {"CHECKPOINT": str(checkpoint), "DATA_PREFIX": "data/x"},
                      "--dry-run")
    assert result.returncode == 0, result.stderr
    torchrun, flags = _launch_command(result.stdout)
    assert (torchrun.nproc_per_node, torchrun.nnodes) == ("8", "1")
    args = _parsed(parser, flags)
    assert (args.num_layers, args.hidden_size, args.padded_vocab_size, args.layernorm_epsilon) == (36, 2048, 151936,
                                                                                                  1e-6)
    assert (args.seq_length, args.context_parallel_size, args.tensor_model_parallel_size) == (524288, 8, 1)
    assert (args.mtraining_ring, args.mtraining_layout, args.mtraining_kernel) == ("flat", "striped", "triton")
    assert args.pretrained_checkpoint == str(checkpoint) and args.data_path == ["data/x"]
    assert args.mtraining_loss_chunk_size > 0, "512K x 152K-vocabulary logits must not be materialised"


def test_documented_dense_baseline_is_accepted(parser, tmp_path):
    """docs/user_journey.md's dense baseline: the 3B script with the cuDNN zigzag ring in EXTRA_ARGS."""
    checkpoint = _checkpoint(tmp_path / "ckpt", "3B")
    extra = "--mtraining-dense --mtraining-layout zigzag --mtraining-kernel sdpa_cudnn"
    assert extra in (REPO / "docs" / "user_journey.md").read_text().replace("\n", " ")
    result = _dry_run("examples/qwen2.5-3b_32k_to_512k.sh", {"CHECKPOINT": str(checkpoint), "DATA_PREFIX": "data/x",
                                                              "EXTRA_ARGS": extra}, "--dry-run")
    assert result.returncode == 0, result.stderr
    args = _parsed(parser, _launch_command(result.stdout)[1])
    assert (args.mtraining_dense, args.mtraining_layout, args.mtraining_kernel) == (True, "zigzag", "sdpa_cudnn")


def test_documented_kept_attention_output_is_accepted(parser, tmp_path):
    """docs/user_journey.md's --mtraining-keep-attention-output in EXTRA_ARGS: the 3B script recomputes fully."""
    checkpoint = _checkpoint(tmp_path / "ckpt", "3B")
    extra = "--mtraining-keep-attention-output"
    assert f'EXTRA_ARGS="{extra}"' in (REPO / "docs" / "user_journey.md").read_text()
    result = _dry_run("examples/qwen2.5-3b_32k_to_512k.sh", {"CHECKPOINT": str(checkpoint), "DATA_PREFIX": "data/x",
                                                              "EXTRA_ARGS": extra}, "--dry-run")
    assert result.returncode == 0, result.stderr
    args = _parsed(parser, _launch_command(result.stdout)[1])
    assert args.mtraining_keep_attention_output and args.recompute_granularity == "full"


def test_multinode_sbatch_dry_run_uses_the_hierarchical_ring(parser, tmp_path):
    checkpoint = _checkpoint(tmp_path / "ckpt", "3B")
    result = _dry_run("examples/slurm/qwen2.5-3b_512k_multinode.sbatch",
                      {"CHECKPOINT": str(checkpoint), "DATA_PREFIX": "data/x", "DRY_RUN": "1"})
    assert result.returncode == 0, result.stderr
    srun = shlex.split(result.stdout.splitlines()[0])
    assert srun[:2] == ["srun", "--ntasks-per-node=1"] and "NODE_RANK=$SLURM_NODEID" in srun[-1]
    torchrun, flags = _launch_command(result.stdout)
    assert (torchrun.nproc_per_node, torchrun.nnodes, torchrun.node_rank) == ("8", "4", 0)
    args = _parsed(parser, flags)
    assert args.context_parallel_size == 32
    assert (args.mtraining_ring, args.mtraining_inner_ring_size) == ("hierarchical", 8), "inner ring = GPUs per node"


def test_single_node_sbatch_and_tp2_dry_run(parser, tmp_path):
    checkpoint = _checkpoint(tmp_path / "ckpt", "3B")
    result = _dry_run("examples/slurm/qwen2.5-3b_512k_1node.sbatch",
                      {"CHECKPOINT": str(checkpoint), "DATA_PREFIX": "data/x", "DRY_RUN": "1", "TP": "2",
                       "EXTRA_ARGS": "--mtraining-top-p 0.95 --mtraining-cap 2048"})
    assert result.returncode == 0, result.stderr
    args = _parsed(parser, _launch_command(result.stdout)[1])
    assert (args.tensor_model_parallel_size, args.context_parallel_size, args.sequence_parallel) == (2, 4, True)
    assert (args.mtraining_ring, args.mtraining_top_p, args.mtraining_cap) == ("flat", 0.95, 2048)


@pytest.mark.parametrize("gpus", ["1", "2"])
def test_small_demo_dry_run(parser, tmp_path, gpus):
    checkpoint = _checkpoint(tmp_path / "ckpt", "0.5B")
    result = _dry_run("examples/qwen2.5-0.5b_1gpu_demo.sh", {"CHECKPOINT": str(checkpoint), "NGPUS": gpus},
                      "--dry-run")
    assert result.returncode == 0, result.stderr
    torchrun, flags = _launch_command(result.stdout)
    assert torchrun.nproc_per_node == gpus
    args = _parsed(parser, flags)
    assert (args.num_attention_heads, args.seq_length, args.context_parallel_size) == (14, 65536, int(gpus))
    assert args.mock_data and args.data_path is None


def test_missing_inputs_are_reported(tmp_path):
    result = _dry_run("examples/qwen2.5-3b_32k_to_512k.sh", {"DATA_PREFIX": "data/x"}, "--dry-run")
    assert result.returncode != 0 and "set CHECKPOINT" in result.stderr
    result = _dry_run("examples/qwen2.5-3b_32k_to_512k.sh", {"CHECKPOINT": str(tmp_path), "DATA_PREFIX": "x"},
                      "--dry-run")
    assert result.returncode != 0 and "megatron_model_args.sh not found" in result.stderr
    checkpoint = _checkpoint(tmp_path / "ckpt", "3B")
    result = _dry_run("examples/qwen2.5-3b_32k_to_512k.sh", {"CHECKPOINT": str(checkpoint)}, "--dry-run")
    assert result.returncode != 0 and "set DATA_PREFIX" in result.stderr
    result = _dry_run("examples/qwen2.5-3b_32k_to_512k.sh", {"CHECKPOINT": str(checkpoint), "MOCK_DATA": "1"},
                      "--bogus")
    assert result.returncode == 2 and "usage" in result.stderr
