"""Megatron-Core ``torch_dist`` Qwen2 or dense Qwen3 checkpoint → Hugging Face directory (DESIGN.md §4).

The architecture comes from the checkpoint's ``args``; a reference Hugging Face directory (the model the
checkpoint was converted from) supplies the token ids of ``config.json`` and the tokenizer and
generation files. Every input is checked before anything is written; then tensors are read one layer
at a time and written in safetensors shards of a bounded size; the output appears only complete
(temporary directory renamed at the end).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from .architecture import DTYPES, QwenArchitecture
from .checkpoint_dir import (
    SAFETENSORS_INDEX,
    check_output_dir,
    read_hf_config,
    resolve_checkpoint_dir,
    staged_output_dir,
)
from .megatron_checkpoint import load_step, read_checkpoint_args, stored_dtypes
from .single_process import single_process_group
from .tensor_map import conversion_steps

COPIED_REFERENCE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


def _default_reference(args: argparse.Namespace) -> Path | None:
    tokenizer_model = getattr(args, "tokenizer_model", None)
    if tokenizer_model and (Path(tokenizer_model) / "config.json").is_file():
        return Path(tokenizer_model)
    return None


def reference_config(reference: Path | None, arch: QwenArchitecture) -> dict | None:
    """The reference model's ``config.json``, checked to have ``arch``'s shapes (RoPE and length may differ)."""
    if reference is None:
        return None
    config = read_hf_config(reference, "--hf-reference")
    ref = QwenArchitecture.from_hf_config(config, str(Path(reference) / "config.json"))
    shape_fields = (
        "model_type",
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "vocab_size",
        "tie_embeddings",
    )
    differing = [
        f"{name}: reference {getattr(ref, name)}, checkpoint {getattr(arch, name)}"
        for name in shape_fields
        if getattr(ref, name) != getattr(arch, name)
    ]
    if differing:
        raise ValueError(
            f"--hf-reference {reference} is a different model ({'; '.join(differing)}); give the "
            "model the checkpoint was converted from"
        )
    return config


def plan_shards(arch: QwenArchitecture, dtype: torch.dtype, max_shard_bytes: int) -> list[list[str]]:
    """Hugging Face tensor names in checkpoint order, grouped greedily into shards of at most ``max_shard_bytes``."""
    shards: list[list[str]] = [[]]
    filled = 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    for layer, mappings in conversion_steps(arch):
        for mapping in mappings:
            for name, shape in zip(mapping.hf_tensor_names(layer), mapping.hf_shapes(arch)):
                size = itemsize * torch.Size(shape).numel()
                if shards[-1] and filled + size > max_shard_bytes:
                    shards.append([])
                    filled = 0
                shards[-1].append(name)
                filled += size
    return shards


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]


def convert(
    checkpoint: Path,
    output_dir: Path,
    *,
    hf_reference: Path | None = None,
    dtype: str = "bf16",
    max_shard_size: str = "5GB",
    overwrite: bool = False,
) -> QwenArchitecture:
    """Write the Hugging Face directory of ``checkpoint`` to ``output_dir``; return the architecture.

    Every input and option is checked before anything is written (``ValueError`` naming the problem).
    """
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    out_dtype, max_bytes, output_dir = DTYPES[dtype], parse_size(max_shard_size), Path(output_dir)
    checkpoint_dir = resolve_checkpoint_dir(Path(checkpoint))
    with single_process_group():
        args = read_checkpoint_args(checkpoint_dir)
        arch = QwenArchitecture.from_megatron_args(args)
        dtypes = stored_dtypes(checkpoint_dir, arch)
        reference = Path(hf_reference) if hf_reference is not None else _default_reference(args)
        base_config = reference_config(reference, arch)
        if reference is None:
            print(
                "note: no --hf-reference (and the run's --tokenizer-model is not a model directory here): "
                "config.json gets no token ids and no tokenizer files are copied",
                file=sys.stderr,
            )
        protected = {"--checkpoint": checkpoint_dir} | ({} if reference is None else {"--hf-reference": reference})
        check_output_dir(output_dir, overwrite, protected)
        shards = plan_shards(arch, out_dtype, max_bytes)
        file_of = {name: file for names, file in zip(shards, _shard_names(len(shards))) for name in names}
        strategy = TorchDistLoadShardedStrategy(cache_metadata=True)
        with staged_output_dir(output_dir) as staging:
            pending: dict[str, dict[str, torch.Tensor]] = {}
            steps = conversion_steps(arch)
            for layer, mappings in tqdm(steps, unit="step", desc="converting"):
                loaded = load_step(checkpoint_dir, strategy, arch, layer, mappings, dtypes)
                for mapping in mappings:
                    hf_tensors = mapping.to_hf(loaded[mapping.key], arch)
                    for name, hf_tensor in zip(mapping.hf_tensor_names(layer), hf_tensors):
                        pending.setdefault(file_of[name], {})[name] = hf_tensor.to(out_dtype).contiguous()
                for file, names in zip(_shard_names(len(shards)), shards):
                    if file in pending and len(pending[file]) == len(names):
                        save_file(pending.pop(file), str(staging / file), metadata={"format": "pt"})
            _write_metadata(staging, arch, base_config, reference, out_dtype, file_of)
    return arch


def _write_metadata(
    directory: Path,
    arch: QwenArchitecture,
    base_config: dict | None,
    reference: Path | None,
    dtype: torch.dtype,
    file_of: dict[str, str],
) -> None:
    (directory / "config.json").write_text(json.dumps(arch.hf_config(base_config, dtype), indent=2) + "\n")
    if len(set(file_of.values())) > 1:
        total = sum((directory / file).stat().st_size for file in set(file_of.values()))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(file_of.items()))}
        (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    for name in COPIED_REFERENCE_FILES if reference is not None else ():
        if (reference / name).is_file():
            shutil.copy2(reference / name, directory / name)


def parse_size(text: str) -> int:
    """Bytes of a size such as ``5GB``, ``500MB`` or ``1000000`` (decimal units, as Hugging Face uses)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    cleaned = text.strip().upper()
    for suffix, factor in units.items():
        if cleaned.endswith(suffix) and cleaned[: -len(suffix)].strip().replace(".", "", 1).isdigit():
            return math.floor(float(cleaned[: -len(suffix)]) * factor)
    if cleaned.isdigit():
        return int(cleaned)
    raise ValueError(f"size {text!r} is not understood; use e.g. 5GB, 500MB or a number of bytes")
