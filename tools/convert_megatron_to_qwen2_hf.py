"""Convert a Megatron-Core ``torch_dist`` Qwen2 or dense Qwen3 checkpoint to a Hugging Face directory (DESIGN.md §4).

    python tools/convert_megatron_to_qwen2_hf.py --checkpoint checkpoints/qwen2.5-3b-512k \\
        --output-dir Qwen2.5-3B-512K --hf-reference Qwen2.5-3B

``--checkpoint`` is a checkpoint root (its ``latest_checkpointed_iteration.txt`` picks ``release/`` or
``iter_XXXXXXX/``) or one of those directories; it may come from any TP/PP/CP run, optimizer state
included (only the model is read). The architecture comes from the checkpoint's ``args`` (RoPE base,
YaRN, ``max_position_embeddings`` of the run; ``--qk-layernorm`` makes it Qwen3, with ``--kv-channels``
as ``head_dim``) and is checked against the stored tensors. ``--hf-reference`` (default: the run's
``--tokenizer-model`` when that is a model directory) supplies the token ids of ``config.json`` and the
tokenizer and generation files, which are copied; it must be the same model (family and shapes).

The result (``model_type`` ``qwen2`` or ``qwen3``) loads with ``transformers.AutoModelForCausalLM.from_pretrained``.
Every input is checked before anything is written; then tensors are read one layer at a time and written
in safetensors shards of at most ``--max-shard-size``; the output appears only complete (temporary
directory renamed at the end). Runs on CPU (a one-process gloo group reads the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from qwen2_mapping import (DTYPES, QwenArchitecture, TensorMapping, check_output_dir, conversion_steps,
                           parse_size, read_hf_config, resolve_checkpoint_dir, single_process_group,
                           staged_output_dir, tensor_mappings)

COPIED_REFERENCE_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                          "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                          "generation_config.json")
SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_checkpoint_args(checkpoint_dir: Path) -> argparse.Namespace:
    """The Megatron ``args`` stored in the checkpoint (written by training and by our HF → Megatron converter)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(checkpoint_dir))
    if not isinstance(common, dict) or common.get("args") is None:
        raise ValueError(f"{checkpoint_dir} stores no Megatron 'args'; the architecture is unknown (was it written "
                         "by Megatron's training loop or tools/convert_qwen2_hf_to_megatron.py?)")
    return common["args"]


def _global_shape(mapping: TensorMapping, arch: QwenArchitecture) -> tuple[int, ...]:
    return ((arch.num_layers,) if mapping.per_layer else ()) + mapping.shape(arch)


def stored_dtypes(checkpoint_dir: Path, arch: QwenArchitecture) -> dict[str, torch.dtype]:
    """dtype of every model tensor in the checkpoint; ``ValueError`` if one is missing or has the wrong shape."""
    from megatron.core import dist_checkpointing

    stored = dist_checkpointing.load_tensors_metadata(str(checkpoint_dir))
    dtypes = {}
    for mapping in tensor_mappings(arch):
        if mapping.key not in stored:
            raise ValueError(f"{checkpoint_dir} has no tensor {mapping.key}, which the checkpoint's args "
                             f"({'tied' if arch.tie_embeddings else 'untied'} embeddings) imply")
        shape = tuple(stored[mapping.key].global_shape)
        if shape != _global_shape(mapping, arch):
            raise ValueError(f"{mapping.key} has shape {list(shape)} in {checkpoint_dir} but the checkpoint's args "
                             f"imply {list(_global_shape(mapping, arch))}")
        dtypes[mapping.key] = stored[mapping.key].dtype
    return dtypes


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
    shape_fields = ("model_type", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "num_query_groups", "kv_channels", "vocab_size", "tie_embeddings")
    differing = [f"{name}: reference {getattr(ref, name)}, checkpoint {getattr(arch, name)}"
                 for name in shape_fields if getattr(ref, name) != getattr(arch, name)]
    if differing:
        raise ValueError(f"--hf-reference {reference} is a different model ({'; '.join(differing)}); give the "
                         "model the checkpoint was converted from")
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


def _load_step(checkpoint_dir: Path, strategy, arch: QwenArchitecture, layer: int | None,
               mappings: list[TensorMapping], dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """Megatron tensors of one layer (or of the non-layer tensors), read from the checkpoint into NaN-filled buffers."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    request = {}
    for mapping in mappings:
        if layer is None:
            buffer = torch.full(mapping.shape(arch), torch.nan, dtype=dtypes[mapping.key])
            request[mapping.key] = ShardedTensor.from_rank_offsets(mapping.key, buffer, replica_id=0)
        else:     # a leading axis of 1 (not prepend_axis_num) lets a single rank read one layer of the stack
            buffer = torch.full((1,) + mapping.shape(arch), torch.nan, dtype=dtypes[mapping.key])
            request[mapping.key] = ShardedTensor.from_rank_offsets(mapping.key, buffer, (0, layer, arch.num_layers),
                                                                   replica_id=0)
    loaded = dist_checkpointing.load(request, str(checkpoint_dir), sharded_strategy=strategy,
                                     validate_access_integrity=False)
    return {key: loaded[key] if layer is None else loaded[key][0] for key in request}


def convert(checkpoint: Path, output_dir: Path, *, hf_reference: Path | None = None, dtype: str = "bf16",
            max_shard_size: str = "5GB", overwrite: bool = False) -> QwenArchitecture:
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
            print("note: no --hf-reference (and the run's --tokenizer-model is not a model directory here): "
                  "config.json gets no token ids and no tokenizer files are copied", file=sys.stderr)
        protected = {"--checkpoint": checkpoint_dir} | ({} if reference is None else {"--hf-reference": reference})
        check_output_dir(output_dir, overwrite, protected)
        shards = plan_shards(arch, out_dtype, max_bytes)
        file_of = {name: file for names, file in zip(shards, _shard_names(len(shards))) for name in names}
        strategy = TorchDistLoadShardedStrategy(cache_metadata=True)
        with staged_output_dir(output_dir) as staging:
            pending: dict[str, dict[str, torch.Tensor]] = {}
            steps = conversion_steps(arch)
            for layer, mappings in tqdm(steps, unit="step", desc="converting"):
                loaded = _load_step(checkpoint_dir, strategy, arch, layer, mappings, dtypes)
                for mapping in mappings:
                    hf_tensors = mapping.to_hf(loaded[mapping.key], arch)
                    for name, hf_tensor in zip(mapping.hf_tensor_names(layer), hf_tensors):
                        pending.setdefault(file_of[name], {})[name] = hf_tensor.to(out_dtype).contiguous()
                for file, names in zip(_shard_names(len(shards)), shards):
                    if file in pending and len(pending[file]) == len(names):
                        save_file(pending.pop(file), str(staging / file), metadata={"format": "pt"})
            _write_metadata(staging, arch, base_config, reference, out_dtype, file_of)
    return arch


def _write_metadata(directory: Path, arch: QwenArchitecture, base_config: dict | None, reference: Path | None,
                    dtype: torch.dtype, file_of: dict[str, str]) -> None:
    (directory / "config.json").write_text(json.dumps(arch.hf_config(base_config, dtype), indent=2) + "\n")
    if len(set(file_of.values())) > 1:
        total = sum((directory / file).stat().st_size for file in set(file_of.values()))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(file_of.items()))}
        (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    for name in COPIED_REFERENCE_FILES if reference is not None else ():
        if (reference / name).is_file():
            shutil.copy2(reference / name, directory / name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path,
                        help="Megatron checkpoint root (with latest_checkpointed_iteration.txt) or its "
                             "release/iter_XXXXXXX directory")
    parser.add_argument("--output-dir", required=True, type=Path, help="Hugging Face directory to create")
    parser.add_argument("--hf-reference", type=Path, default=None,
                        help="original Hugging Face model directory: token ids and tokenizer files (default: the "
                             "checkpoint's --tokenizer-model when it is a model directory)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="dtype of the written tensors")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output-dir")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        arch = convert(args.checkpoint, args.output_dir, hf_reference=args.hf_reference, dtype=args.dtype,
                       max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    except ValueError as error:
        raise SystemExit(f"convert_megatron_to_qwen2_hf: error: {error}") from None
    print(f"wrote {args.output_dir} ({arch.family}, {arch.num_layers} layers, max_position_embeddings "
          f"{arch.max_position_embeddings}, rope_theta {arch.rotary_base}"
          f"{f', YaRN x{arch.yarn_factor}' if arch.yarn_factor else ''}); load it with "
          "transformers.AutoModelForCausalLM.from_pretrained")


if __name__ == "__main__":
    main()
