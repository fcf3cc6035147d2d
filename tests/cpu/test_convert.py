"""Qwen2/Qwen3 checkpoint conversion, Hugging Face ⇄ Megatron ``torch_dist`` (megatron_mtraining/conversion/,
tools/convert_*.py, DESIGN.md §4).

Tiny random models (2 layers, hidden 64, 4 query heads in 2 KV groups, SwiGLU; every weight, bias and
norm drawn at random so logits are O(1)) are built with ``transformers``: Qwen2 (QKV bias) tied (one
safetensors file), untied (sharded, with an index) and tied with YaRN; Qwen3 (per-head q/k RMSNorm, no
bias, head_dim 32 ≠ hidden/heads = 16) tied and untied. Every conversion runs on this CPU-only machine
through the tools alone (no test-side patches). Then:

* the launcher's own model (``mtraining_model_config`` → ``GPTModelBuilder``; MTraining spec, full
  pattern, ``torch_blocksparse``) built from the written args file loads the checkpoint with no missing
  or unexpected key and gives the Hugging Face fp32 logits (max |Δ| ≤ 1e-4; YaRN and Qwen3's q/k norm
  included);
* a TP = 2 load on two gloo ranks gives the TP = 1 logits;
* HF → Megatron → HF is bit-exact (fp32 and bf16; every tensor, the architecture and the token ids of
  config.json) and loads with ``AutoModelForCausalLM`` as the same model class;
* both command lines (``main``) convert on CPU, and leave no CPU patch behind;
* the args file reproduces the Qwen2.5 sizes of DESIGN.md §4 and Qwen3 sizes through Megatron's own
  parser and config builders, and the checkpoint's stored ``args`` reproduce the architecture;
* the QKV interleave puts whole query groups in order (q rows, then k, then v);
* bad input (a Llama model, Qwen3 MoE, wrong shapes, paths) is refused before anything is written, and
  a failed write leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from megatron_cpu import megatron_on_cpu
from tool_modules import load_tool

from megatron_mtraining.conversion import hf_to_megatron, megatron_to_hf
from megatron_mtraining.conversion.architecture import (
    MODEL_ARGS_FILE,
    MODEL_ARGS_VARIABLE,
    QwenArchitecture,
    write_model_args,
)
from megatron_mtraining.conversion.megatron_checkpoint import read_checkpoint_args
from megatron_mtraining.conversion.single_process import single_process_group, torch_dist_writer_on_cpu
from megatron_mtraining.conversion.tensor_map import interleave_qkv, split_qkv

to_megatron_tool = load_tool("convert_qwen2_hf_to_megatron")
to_hf_tool = load_tool("convert_megatron_to_qwen2_hf")

SEQ_LEN = 256
VOCAB = 320
BATCH = 2
LOGITS_ATOL = 1e-4  # acceptance bound; observed ~1e-5 at logit std ~4 (fp32 sums in another order)
CPU_FLAGS = [
    "--transformer-impl",
    "local",
    "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion",
    "--no-bias-swiglu-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
]
RUN_FLAGS = [
    "--micro-batch-size",
    "1",
    "--seq-length",
    str(SEQ_LEN),
    "--max-position-embeddings",
    str(SEQ_LEN),
    "--mtraining-dense",
    "--mtraining-backend",
    "torch",
]
MODELS = {
    "tied": dict(tied=True),
    "untied": dict(tied=False),
    "tied-yarn": dict(tied=True, yarn=True),
    "qwen3-tied": dict(tied=True, model_type="qwen3"),
    "qwen3-untied": dict(tied=False, model_type="qwen3"),
}
QWEN3_HEAD_DIM = 32  # differs from hidden_size / num_attention_heads = 16, as --kv-channels allows
MODULE_SEED = int.from_bytes(os.urandom(4), "little")

# Qwen2.5 sizes of DESIGN.md §4 and Qwen3 dense sizes: model_type, layers, hidden, heads, kv groups, ffn, head dim,
# vocab, tied.
QWEN_SIZES = {
    "Qwen2.5-0.5B": ("qwen2", 24, 896, 14, 2, 4864, 64, 151936, True),
    "Qwen2.5-1.5B": ("qwen2", 28, 1536, 12, 2, 8960, 128, 151936, True),
    "Qwen2.5-3B": ("qwen2", 36, 2048, 16, 2, 11008, 128, 151936, True),
    "Qwen2.5-7B": ("qwen2", 28, 3584, 28, 4, 18944, 128, 152064, False),
    "Qwen3-0.6B": ("qwen3", 28, 1024, 16, 8, 3072, 128, 151936, True),
    "Qwen3-4B": ("qwen3", 36, 2560, 32, 8, 9728, 128, 151936, True),
    "Qwen3-8B": ("qwen3", 36, 4096, 32, 8, 12288, 128, 151936, False),
}


# ------------------------------------------------------------------------------------------ models and helpers
def _hf_config(tied: bool, yarn: bool = False, model_type: str = "qwen2"):
    """A tiny Qwen2Config, or a Qwen3Config (head_dim :data:`QWEN3_HEAD_DIM`, no attention bias)."""
    from transformers import Qwen2Config, Qwen3Config

    rope = {"rope_type": "default", "rope_theta": 1e6}
    if yarn:
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": SEQ_LEN // 4, "rope_theta": 1e6}
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=tied,
        rope_parameters=rope,
        bos_token_id=3,
        eos_token_id=5,
    )
    if model_type == "qwen3":
        return Qwen3Config(**shape, head_dim=QWEN3_HEAD_DIM, attention_bias=False)
    return Qwen2Config(**shape)


def _random_hf_model(tied: bool, seed: int, yarn: bool = False, model_type: str = "qwen2"):
    """A Qwen2/Qwen3ForCausalLM whose every parameter is random: weights ~ N(0, 1/fan_in), biases and norms (q/k
    norms included) off their init."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_hf_config(tied, yarn, model_type)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")) or param.dim() == 1:
                param.copy_(0.5 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / math.sqrt(param.shape[1]))
    return model


def _hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def sourced_model_args(args_file: Path) -> list[str]:
    """The ``MODEL_ARGS`` array of ``args_file`` as bash sees it after ``source``."""
    script = f'source {shlex.quote(str(args_file))}; printf "%s\\0" "${{{MODEL_ARGS_VARIABLE}[@]}}"'
    output = subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True).stdout
    return output.split("\0")[:-1]


def _parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    from megatron_mtraining.arguments import add_mtraining_args

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return add_mtraining_args(parser)


def _launcher_model(model_flags: list[str], tp: int = 1):
    """The GPTModel the launcher builds for these flags (MTraining spec, full pattern), on CPU."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_mtraining.arguments import validate_mtraining_args
    from megatron_mtraining.pretrain import mtraining_model_config

    args = _parser().parse_args(model_flags + CPU_FLAGS + RUN_FLAGS + ["--tensor-model-parallel-size", str(tp)])
    args.params_dtype = torch.float32
    model_config = mtraining_model_config(args, validate_mtraining_args(args))
    return GPTModelBuilder(model_config).build_model(ProcessGroupCollection.use_mpu_process_groups()).eval()


def _megatron_logits(checkpoint: Path, tokens: torch.Tensor, tp: int = 1) -> torch.Tensor:
    """Full-vocabulary logits of the launcher's model loaded from ``checkpoint`` (call inside megatron_on_cpu)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    from megatron_mtraining.attention import MTrainingAttention

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model = _launcher_model(sourced_model_args(checkpoint / MODEL_ARGS_FILE), tp)
    assert all(isinstance(layer.self_attention.core_attention, MTrainingAttention) for layer in model.decoder.layers)
    loaded = dist_checkpointing.load(
        {"model": model.sharded_state_dict()}, str(checkpoint / "release"), strict="raise_all"
    )
    model.load_state_dict(loaded["model"])
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, positions, None)
    if tp > 1:  # vocab-parallel output: gather the TP shards
        group = parallel_state.get_tensor_model_parallel_group()
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    parallel_state.destroy_model_parallel()
    return logits


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per model: its HF directory, the converted checkpoint, the HF directory converted back (all fp32)."""
    root = tmp_path_factory.mktemp("convert")
    dirs = {}
    for index, (name, kind) in enumerate(MODELS.items()):
        hf_dir = root / f"hf-{name}"
        model = _random_hf_model(seed=MODULE_SEED + index, **kind)
        model.save_pretrained(hf_dir, max_shard_size="200KB" if name == "untied" else "5GB")
        (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
        hf_to_megatron.convert(hf_dir, root / f"mcore-{name}", dtype="fp32")
        megatron_to_hf.convert(
            root / f"mcore-{name}",
            root / f"back-{name}",
            hf_reference=hf_dir,
            dtype="fp32",
            max_shard_size="150KB" if name == "untied" else "5GB",
        )
        dirs[name] = {"hf": hf_dir, "mcore": root / f"mcore-{name}", "back": root / f"back-{name}"}
    return dirs


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(MODULE_SEED))


@pytest.fixture(scope="module")
def tp1_logits(workdir, tokens) -> dict[str, torch.Tensor]:
    logits = {}
    with single_process_group(), megatron_on_cpu():
        for name in MODELS:
            logits[name] = _megatron_logits(workdir[name]["mcore"], tokens)
    return logits


# ------------------------------------------------------------------------------------------ logits
@pytest.mark.parametrize("name", list(MODELS))
def test_megatron_logits_equal_hf_logits(workdir, tokens, tp1_logits, name):
    reference = _hf_logits(workdir[name]["hf"], tokens)
    assert reference.std() > 1.0, "logits too small for a meaningful comparison"
    difference = (tp1_logits[name] - reference).abs().max().item()
    assert difference <= LOGITS_ATOL, f"{name}: max |Δ logits| = {difference:.3g} (seed={MODULE_SEED})"


def _tp2_logits(rank, world_size, checkpoints, tokens):
    with megatron_on_cpu():
        return {name: _megatron_logits(path, tokens, tp=world_size) for name, path in checkpoints.items()}


def test_tp2_load_gives_tp1_logits(workdir, tokens, tp1_logits, distributed):
    checkpoints = {name: workdir[name]["mcore"] for name in ("tied", "untied", "qwen3-untied")}
    per_rank = distributed(_tp2_logits, 2, checkpoints, tokens)
    for name in checkpoints:
        for rank, logits in enumerate(per_rank):
            difference = (logits[name] - tp1_logits[name]).abs().max().item()
            assert difference <= LOGITS_ATOL, (
                f"{name} rank {rank}: TP=2 vs TP=1 max |Δ| = {difference:.3g} (seed={MODULE_SEED})"
            )


# ------------------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_megatron_hf_round_trip_is_bit_exact(workdir, tokens, name):
    original, back = _tensors(workdir[name]["hf"]), _tensors(workdir[name]["back"])
    assert sorted(back) == sorted(original)
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), f"{name}: {key} differs"
    original_config = json.loads((workdir[name]["hf"] / "config.json").read_text())
    back_config = json.loads((workdir[name]["back"] / "config.json").read_text())
    assert QwenArchitecture.from_hf_config(back_config) == QwenArchitecture.from_hf_config(original_config)
    assert (back_config["bos_token_id"], back_config["eos_token_id"]) == (3, 5), "token ids of the reference"
    assert (workdir[name]["back"] / "tokenizer_config.json").read_bytes() == (
        workdir[name]["hf"] / "tokenizer_config.json"
    ).read_bytes()
    assert back_config["architectures"] == original_config["architectures"]
    assert torch.equal(_hf_logits(workdir[name]["back"], tokens), _hf_logits(workdir[name]["hf"], tokens))


def test_sharded_output_has_an_index(workdir):
    back = workdir["untied"]["back"]
    index = json.loads((back / "model.safetensors.index.json").read_text())
    files = sorted(path.name for path in back.glob("*.safetensors"))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    assert set(index["weight_map"]) == set(_tensors(back))


def test_bf16_round_trip_is_bit_exact(tmp_path):
    model = _random_hf_model(tied=False, seed=MODULE_SEED + 7).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    hf_to_megatron.convert(tmp_path / "hf", tmp_path / "mcore", dtype="bf16")
    megatron_to_hf.convert(tmp_path / "mcore", tmp_path / "back", dtype="bf16")  # reference: --tokenizer-model
    original, back = _tensors(tmp_path / "hf"), _tensors(tmp_path / "back")
    assert sorted(back) == sorted(original)
    assert all(back[key].dtype == torch.bfloat16 and torch.equal(back[key], original[key]) for key in original)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["torch_dtype"] == "bfloat16"


# ------------------------------------------------------------------------------------------ architecture
@pytest.mark.parametrize("size", list(QWEN_SIZES))
def test_args_file_reproduces_qwen_architectures(tmp_path, size):
    from megatron.training.argument_utils import core_transformer_config_from_args, gpt_config_from_args

    model_type, layers, hidden, heads, groups, ffn, head_dim, vocab, tied = QWEN_SIZES[size]
    hf_config = {
        "architectures": [f"{model_type.capitalize()}ForCausalLM"],
        "model_type": model_type,
        "hidden_act": "silu",
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "sliding_window": 32768,
        "use_sliding_window": False,
    }
    if model_type == "qwen3":
        hf_config.update(head_dim=head_dim, attention_bias=False)
    arch = QwenArchitecture.from_hf_config(hf_config)
    write_model_args(tmp_path / MODEL_ARGS_FILE, arch.megatron_flags("/models/Qwen"), size)
    args = _parser().parse_args(
        sourced_model_args(tmp_path / MODEL_ARGS_FILE)
        + CPU_FLAGS
        + ["--seq-length", "32768", "--max-position-embeddings", "32768"]
    )
    args.params_dtype = torch.bfloat16
    config = core_transformer_config_from_args(args)
    model = gpt_config_from_args(args, config)
    assert (
        config.num_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_query_groups,
        config.ffn_hidden_size,
        config.kv_channels,
    ) == (layers, hidden, heads, groups, ffn, head_dim)
    assert (
        config.normalization,
        config.layernorm_epsilon,
        config.gated_linear_unit,
        config.add_bias_linear,
        config.activation_func,
    ) == ("RMSNorm", 1e-6, True, False, torch.nn.functional.silu)
    assert (config.add_qkv_bias, config.qk_layernorm) == (model_type == "qwen2", model_type == "qwen3")
    assert (model.vocab_size, model.should_pad_vocab, model.share_embeddings_and_output_weights) == (vocab, False, tied)
    assert (model.position_embedding_type, model.rotary_base, model.rotary_percent) == ("rope", 1_000_000, 1.0)
    assert (args.tokenizer_type, args.tokenizer_model) == ("HuggingFaceTokenizer", "/models/Qwen")
    assert QwenArchitecture.from_megatron_args(args) == arch


def test_context_extension_options_reach_megatrons_config(tmp_path):
    from megatron.training.argument_utils import core_transformer_config_from_args

    base = QwenArchitecture.from_hf_config(_hf_config(tied=True).to_dict())
    for arch, rope in (
        (hf_to_megatron.extend_context(base, rotary_base=10_000_000), "rope"),
        (hf_to_megatron.extend_context(base, yarn_factor=16.0), "yarn"),
    ):
        write_model_args(tmp_path / MODEL_ARGS_FILE, arch.megatron_flags("/tok"), "test")
        flags = sourced_model_args(tmp_path / MODEL_ARGS_FILE) + CPU_FLAGS + ["--seq-length", str(SEQ_LEN)]
        args = _parser().parse_args(flags)
        args.params_dtype = torch.float32
        assert args.position_embedding_type == rope and QwenArchitecture.from_megatron_args(args) == arch
        if rope == "yarn":
            config = core_transformer_config_from_args(args)
            assert (config.yarn_rotary_scaling_factor, config.yarn_original_max_position_embeddings) == (16.0, SEQ_LEN)
        else:
            assert args.rotary_base == 10_000_000
    with pytest.raises(ValueError, match="alternative context extensions"):
        hf_to_megatron.extend_context(base, rotary_base=10_000_000, yarn_factor=4.0)


@pytest.mark.parametrize("name", list(MODELS))
def test_checkpoint_stores_megatron_args_of_the_architecture(workdir, name):
    with single_process_group():
        stored = read_checkpoint_args(workdir[name]["mcore"] / "release")
    hf_config = json.loads((workdir[name]["hf"] / "config.json").read_text())
    assert QwenArchitecture.from_megatron_args(stored) == QwenArchitecture.from_hf_config(hf_config)
    assert (stored.tensor_model_parallel_size, stored.pipeline_model_parallel_size) == (1, 1)
    assert (workdir[name]["mcore"] / "latest_checkpointed_iteration.txt").read_text() == "release"


def test_qkv_interleave_keeps_query_groups_whole(seed):
    """Rows of group g: its 2 query heads, then its key head, then its value head; a TP split gives whole groups."""
    arch = QwenArchitecture.from_hf_config(_hf_config(tied=True).to_dict())
    d, hidden = arch.kv_channels, arch.hidden_size
    q = torch.randn(arch.num_attention_heads * d, hidden)
    k, v = torch.randn(arch.num_query_groups * d, hidden), torch.randn(arch.num_query_groups * d, hidden)
    fused = interleave_qkv(q, k, v, arch)
    group_rows = (arch.heads_per_group + 2) * d
    for g in range(arch.num_query_groups):
        block = fused[g * group_rows : (g + 1) * group_rows]
        expected = torch.cat(
            [
                q[g * arch.heads_per_group * d : (g + 1) * arch.heads_per_group * d],
                k[g * d : (g + 1) * d],
                v[g * d : (g + 1) * d],
            ]
        )
        assert torch.equal(block, expected), f"group {g} (seed={seed})"
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, arch), (q, k, v)))
    bias = torch.randn(q.shape[0] + 2 * k.shape[0])
    assert torch.equal(interleave_qkv(*split_qkv(bias, arch), arch), bias)


# ------------------------------------------------------------------------------------------ command line
def test_command_lines_convert_on_cpu_both_ways(workdir, tmp_path, monkeypatch, capsys):
    """``main`` of each tool on a CPU (CUDA hidden even where present): Qwen3 HF → Megatron → HF, bit-exact."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cuda_names = (torch.cuda.current_device, torch.cuda.synchronize, filesystem_async._results_queue)
    hf_dir = workdir["qwen3-untied"]["hf"]
    to_megatron_tool.main(["--hf-dir", str(hf_dir), "--output-dir", str(tmp_path / "mcore"), "--dtype", "fp32"])
    assert "wrote" in capsys.readouterr().out
    assert (torch.cuda.current_device, torch.cuda.synchronize, filesystem_async._results_queue) == cuda_names, (
        "the CPU patches of the torch_dist writer must be undone"
    )
    assert "--qk-layernorm" in sourced_model_args(tmp_path / "mcore" / MODEL_ARGS_FILE)
    to_hf_tool.main(
        ["--checkpoint", str(tmp_path / "mcore"), "--output-dir", str(tmp_path / "back"), "--dtype", "fp32"]
    )
    original, back = _tensors(hf_dir), _tensors(tmp_path / "back")
    assert sorted(back) == sorted(original) and all(torch.equal(back[key], original[key]) for key in original)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.head_dim == QWEN3_HEAD_DIM


def test_cpu_writer_patches_apply_only_without_cuda_and_are_undone(monkeypatch):
    before = (torch.cuda.current_device, torch.cuda.synchronize)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with torch_dist_writer_on_cpu():
        assert (torch.cuda.current_device, torch.cuda.synchronize) == before, "nothing may change where CUDA is"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="write failed"), torch_dist_writer_on_cpu():
        assert torch.cuda.current_device() == "cpu" and torch.cuda.synchronize() is None
        raise RuntimeError("write failed")
    assert (torch.cuda.current_device, torch.cuda.synchronize) == before


def test_command_line_refuses_a_llama_model_before_writing(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).save_pretrained(tmp_path / "llama")
    with pytest.raises(
        SystemExit,
        match=r"model_type='llama' \(architectures=\['LlamaForCausalLM'\]\) is not "
        r"supported; .*'qwen2', Qwen2ForCausalLM\) and dense Qwen3 \(model_type "
        r"'qwen3', Qwen3ForCausalLM\)",
    ):
        to_megatron_tool.main(["--hf-dir", str(tmp_path / "llama"), "--output-dir", str(tmp_path / "out")])
    assert sorted(os.listdir(tmp_path)) == ["llama"], "nothing may be written for a refused model"


# ------------------------------------------------------------------------------------------ bad input
def _copy(source: Path, target: Path, **config_changes) -> Path:
    """A copy of the HF directory ``source`` whose config.json has ``config_changes`` (a ``None`` value deletes)."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(config_changes)
    config = {key: value for key, value in config.items() if value is not None}
    (target / "config.json").write_text(json.dumps(config))
    return target


def _edit_tensors(directory: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# case: (source model, config.json changes, tensor edit, expected message)
BAD_HF_INPUTS = {
    "llama": (
        "tied",
        dict(model_type="llama", architectures=["LlamaForCausalLM"]),
        None,
        r"model_type='llama' \(architectures=\['LlamaForCausalLM'\]\) is not supported; this converter maps "
        r"Qwen2/Qwen2.5 .* and dense Qwen3",
    ),
    "qwen3-moe": (
        "qwen3-tied",
        dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"]),
        None,
        r"model_type='qwen3_moe' .* is a mixture-of-experts model, which is not mapped",
    ),
    "architecture-of-other-family": (
        "qwen3-tied",
        dict(architectures=["Qwen2ForCausalLM"]),
        None,
        r"architectures=\['Qwen2ForCausalLM'\] has no Qwen3ForCausalLM",
    ),
    "sliding-window": ("tied", dict(use_sliding_window=True), None, "use_sliding_window=true is not mapped"),
    "linear-rope": (
        "tied",
        dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}),
        None,
        "RoPE scaling type 'linear' is not mapped",
    ),
    "vocab-mismatch": (
        "tied",
        dict(vocab_size=VOCAB + 64),
        None,
        r"has shape \[320, 64\] but config.json .* implies \[384, 64\]",
    ),
    "hidden-mismatch": ("tied", dict(intermediate_size=96), None, "the config does not match the weights"),
    "untied-without-lm-head": ("tied", dict(tie_word_embeddings=False), None, "needs lm_head.weight"),
    "tied-lm-head-differs": (
        "tied",
        {},
        lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}),
        "lm_head.weight differs from model.embed_tokens.weight",
    ),
    "extra-layer-tensor": (
        "tied",
        {},
        lambda t: t.update({"model.layers.2.mlp.down_proj.weight": torch.zeros(64, 160)}),
        "does not have: model.layers.2.mlp.down_proj.weight",
    ),
    "qwen3-attention-bias": (
        "qwen3-tied",
        dict(attention_bias=True),
        None,
        "attention_bias=true is not mapped: it adds a bias to q/k/v and o_proj",
    ),
    "qwen3-without-head-dim": ("qwen3-tied", dict(head_dim=None), None, "Qwen3 config has no head_dim; add"),
    "qwen3-head-dim-mismatch": (
        "qwen3-tied",
        dict(head_dim=16),
        None,
        r"q_proj.weight has shape \[128, 64\] but config.json .* head dim 16\) implies "
        r"\[64, 64\]",
    ),
    "qwen3-read-as-qwen2": (
        "qwen3-tied",
        dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
        None,
        r"head_dim=32 differs from hidden_size/num_attention_heads = 64/4; Qwen2 ties them",
    ),
    "qwen2-read-as-qwen3": (
        "tied",
        dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=16),
        None,
        r"missing, e.g. model.layers.0.self_attn.k_norm.weight",
    ),
    "qwen3-norms-in-qwen2": (
        "tied",
        {},
        lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}),
        r"Qwen2 model of this config does not have: model.layers.0.self_attn.q_norm.weight .*"
        r"q_norm/k_norm are Qwen3's: is model_type 'qwen3'\?",
    ),
}


@pytest.mark.parametrize("case", list(BAD_HF_INPUTS))
def test_bad_hf_input_is_refused_before_writing(workdir, tmp_path, case):
    source, config_changes, tensor_edit, message = BAD_HF_INPUTS[case]
    hf_dir = _copy(workdir[source]["hf"], tmp_path / "hf", **config_changes)
    if tensor_edit is not None:
        _edit_tensors(hf_dir, tensor_edit)
    with pytest.raises(ValueError, match=message):
        hf_to_megatron.convert(hf_dir, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["hf"], "nothing may be written for bad input"


def test_bad_options_are_refused_before_writing(workdir, tmp_path):
    hf_dir = workdir["tied"]["hf"]
    with pytest.raises(ValueError, match=r"--yarn-factor 0.5 must be > 1"):
        hf_to_megatron.convert(hf_dir, tmp_path / "out", yarn_factor=0.5)
    with pytest.raises(ValueError, match=r"--yarn-original-max-position-embeddings needs --yarn-factor"):
        hf_to_megatron.convert(hf_dir, tmp_path / "out", yarn_original_max_position_embeddings=4096)
    with pytest.raises(ValueError, match=r"--dtype 'fp16' is not supported; use one of bf16, fp32"):
        hf_to_megatron.convert(hf_dir, tmp_path / "out", dtype="fp16")
    assert os.listdir(tmp_path) == []


def test_missing_and_corrupt_files_are_refused(workdir, tmp_path):
    with pytest.raises(ValueError, match=r"--hf-dir \S*nowhere is not a directory"):
        hf_to_megatron.convert(tmp_path / "nowhere", tmp_path / "out")
    hf_dir = _copy(workdir["tied"]["hf"], tmp_path / "no-config")
    (hf_dir / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json"):
        hf_to_megatron.convert(hf_dir, tmp_path / "out")
    hf_dir = _copy(workdir["tied"]["hf"], tmp_path / "garbage")
    (hf_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        hf_to_megatron.convert(hf_dir, tmp_path / "out")
    hf_dir = _copy(workdir["tied"]["hf"], tmp_path / "truncated")
    data = (hf_dir / "model.safetensors").read_bytes()
    (hf_dir / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        hf_to_megatron.convert(hf_dir, tmp_path / "out")
    hf_dir = _copy(workdir["untied"]["hf"], tmp_path / "missing-shard")
    next(hf_dir.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="lists shards that are missing"):
        hf_to_megatron.convert(hf_dir, tmp_path / "out")
    hf_dir = _copy(workdir["tied"]["hf"], tmp_path / "bin-only")
    (hf_dir / "model.safetensors").rename(hf_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        hf_to_megatron.convert(hf_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_overwrite_and_failed_write_leaves_nothing(workdir, tmp_path, monkeypatch):
    output = tmp_path / "out"
    output.mkdir()
    (output / "old-file").write_text("previous checkpoint")
    with pytest.raises(ValueError, match="not empty.*--overwrite"):
        hf_to_megatron.convert(workdir["tied"]["hf"], output)
    hf_to_megatron.convert(workdir["tied"]["hf"], output, dtype="fp32", overwrite=True)
    assert sorted(os.listdir(output)) == sorted([MODEL_ARGS_FILE, "latest_checkpointed_iteration.txt", "release"])

    def failing_save(*args, **kwargs):
        raise RuntimeError("disk full")

    from megatron.core import dist_checkpointing

    monkeypatch.setattr(dist_checkpointing, "save", failing_save)
    with pytest.raises(RuntimeError, match="disk full"):
        hf_to_megatron.convert(workdir["tied"]["hf"], tmp_path / "second", dtype="fp32")
    assert sorted(os.listdir(tmp_path)) == ["out"], "the temporary directory of a failed write must be removed"


def test_overwrite_never_replaces_an_input(workdir, tmp_path):
    hf_dir = _copy(workdir["tied"]["hf"], tmp_path / "models" / "hf")
    for output in (hf_dir, hf_dir.parent):
        with pytest.raises(ValueError, match=r"--output-dir \S+ holds --hf-dir \S+, which the conversion reads"):
            hf_to_megatron.convert(hf_dir, output, overwrite=True)
    checkpoint = tmp_path / "mcore"
    shutil.copytree(workdir["tied"]["mcore"], checkpoint)
    with pytest.raises(ValueError, match=r"--output-dir \S+ holds --checkpoint \S+, which the conversion reads"):
        megatron_to_hf.convert(checkpoint, checkpoint, hf_reference=hf_dir, overwrite=True)
    with pytest.raises(ValueError, match=r"--output-dir \S+ holds --hf-reference \S+, which the conversion reads"):
        megatron_to_hf.convert(checkpoint, hf_dir, hf_reference=hf_dir, overwrite=True)
    assert _tensors(hf_dir).keys() == _tensors(workdir["tied"]["hf"]).keys()
    assert (checkpoint / "release" / "metadata.json").is_file()


def test_bad_megatron_input_is_refused(workdir, tmp_path):
    with pytest.raises(ValueError, match=r"--checkpoint \S*nowhere is not a directory"):
        megatron_to_hf.convert(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(ValueError, match="is not a Megatron torch_dist checkpoint"):
        megatron_to_hf.convert(tmp_path, tmp_path / "out")
    with pytest.raises(ValueError, match="is a different model"):
        megatron_to_hf.convert(workdir["tied"]["mcore"], tmp_path / "out", hf_reference=workdir["untied"]["hf"])
    with pytest.raises(
        ValueError,
        match=r"is a different model \(model_type: reference qwen2, checkpoint qwen3; "
        r"kv_channels: reference 16, checkpoint 32",
    ):
        megatron_to_hf.convert(workdir["qwen3-tied"]["mcore"], tmp_path / "out", hf_reference=workdir["tied"]["hf"])
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not empty"):
        megatron_to_hf.convert(workdir["tied"]["mcore"], tmp_path / "taken")
    with pytest.raises(ValueError, match="size '5 gigs' is not understood"):
        megatron_to_hf.convert(workdir["tied"]["mcore"], tmp_path / "out", max_shard_size="5 gigs")
    assert not (tmp_path / "out").exists()
    args = _parser().parse_args(sourced_model_args(workdir["tied"]["mcore"] / MODEL_ARGS_FILE))
    args.swiglu = False
    with pytest.raises(ValueError, match="not Qwen2-shaped: swiglu=False"):
        QwenArchitecture.from_megatron_args(args)
    args = _parser().parse_args(sourced_model_args(workdir["qwen3-tied"]["mcore"] / MODEL_ARGS_FILE))
    args.add_qkv_bias = True
    with pytest.raises(
        ValueError,
        match=r"not Qwen3-shaped: add_qkv_bias=True \(Qwen3: False\) \(read as Qwen3 "
        r"because qk_layernorm=True\)",
    ):
        QwenArchitecture.from_megatron_args(args)
