"""Hugging Face Qwen2/Qwen2.5 or dense Qwen3 directory → Megatron-Core ``torch_dist`` checkpoint root (DESIGN.md §4).

The root holds ``latest_checkpointed_iteration.txt`` (``release``), ``release/`` (the ``torch_dist``
checkpoint, with the ``args`` a Megatron loader reads; any TP/PP loads it) and ``megatron_model_args.sh``
(the model flags for the example scripts). Context extension changes RoPE only (:func:`extend_context`).

Every input is checked first; then tensors are read one at a time, converted and staged each in its own
memory-mapped file inside the output's temporary directory, so the process holds about one tensor in
anonymous memory. The output appears only complete (temporary directory renamed at the end).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import shutil
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from .architecture import DTYPES, MODEL_ARGS_FILE, QwenArchitecture, write_model_args
from .checkpoint_dir import RELEASE_DIR, TRACKER_FILE, check_output_dir, staged_output_dir
from .hf_checkpoint import HFCheckpoint
from .single_process import single_process_group, torch_dist_writer_on_cpu
from .tensor_map import EXTRA_STATE_KEYS, conversion_steps

CHECKPOINT_CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def extend_context(
    arch: QwenArchitecture,
    rotary_base: int | None = None,
    yarn_factor: float | None = None,
    yarn_original_max_position_embeddings: int | None = None,
) -> QwenArchitecture:
    """``arch`` with a new RoPE base θ, or with YaRN (factor, original length; default the model's length)."""
    if rotary_base is not None and yarn_factor is not None:
        raise ValueError("--rotary-base and --yarn-factor are alternative context extensions; pass one of them")
    if yarn_original_max_position_embeddings is not None and yarn_factor is None:
        raise ValueError("--yarn-original-max-position-embeddings needs --yarn-factor")
    if rotary_base is not None:
        if rotary_base < 1:
            raise ValueError(f"--rotary-base {rotary_base} must be a positive integer, e.g. 10000000")
        return dataclasses.replace(arch, rotary_base=rotary_base)
    if yarn_factor is not None:
        if yarn_factor <= 1:
            raise ValueError(f"--yarn-factor {yarn_factor} must be > 1 (target length / original length, e.g. 16)")
        if yarn_original_max_position_embeddings is not None and yarn_original_max_position_embeddings < 1:
            raise ValueError(
                f"--yarn-original-max-position-embeddings {yarn_original_max_position_embeddings} must "
                "be a positive integer, e.g. 32768"
            )
        original = yarn_original_max_position_embeddings or arch.max_position_embeddings
        return dataclasses.replace(arch, yarn_factor=yarn_factor, yarn_original_max_position_embeddings=original)
    return arch


def checkpoint_args(model_flags: list[str], arch: QwenArchitecture) -> argparse.Namespace:
    """Megatron's parsed arguments for ``model_flags`` at TP = PP = 1: the ``args`` a Megatron loader reads."""
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    length = str(arch.max_position_embeddings)
    return parser.parse_args(
        model_flags + ["--seq-length", length, "--max-position-embeddings", length, "--ckpt-format", "torch_dist"]
    )


def _sharded_state_dict(arch: QwenArchitecture, staged: dict[tuple[str, int | None], torch.Tensor]) -> dict:
    """The model's sharded state dict as GPTModel (TP = PP = 1) builds it: same keys, shapes and layer stacking."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    model = {}
    for (key, layer), data in staged.items():
        if layer is None:
            model[key] = ShardedTensor.from_rank_offsets(key, data, replica_id=0)
        else:
            model[f"{key}.{layer}"] = ShardedTensor.from_rank_offsets(
                key, data, (0, layer, arch.num_layers), replica_id=0, prepend_axis_num=1
            )
    for key in EXTRA_STATE_KEYS:
        for layer in range(arch.num_layers):
            model[f"{key}.{layer}"] = ShardedObject(key, None, (arch.num_layers,), (layer,), replica_id=0)
    return model


def _stage(directory: Path, index: int, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as ``dtype`` in a memory-mapped file of its own (file-backed, so it does not pin memory)."""
    staged = torch.from_file(str(directory / f"{index:05d}.bin"), shared=True, size=tensor.numel(), dtype=dtype)
    return staged.view(tensor.shape).copy_(tensor)


def convert(
    hf_dir: Path,
    output_dir: Path,
    *,
    dtype: str = "bf16",
    rotary_base: int | None = None,
    yarn_factor: float | None = None,
    yarn_original_max_position_embeddings: int | None = None,
    overwrite: bool = False,
) -> QwenArchitecture:
    """Write the ``torch_dist`` checkpoint and args file of ``hf_dir`` to ``output_dir``; return the architecture.

    Every input and option is checked before anything is written (``ValueError`` naming the problem).
    """
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    output_dir, hf_dir = Path(output_dir), Path(hf_dir).resolve()
    with HFCheckpoint(hf_dir) as hf:
        arch = extend_context(hf.arch, rotary_base, yarn_factor, yarn_original_max_position_embeddings)
        check_output_dir(output_dir, overwrite, {"--hf-dir": hf_dir})
        if importlib.util.find_spec("psutil") is None:
            raise ValueError(
                "Megatron's torch_dist writer needs psutil (a dependency of this project); pip install psutil"
            )
        model_flags = arch.megatron_flags(str(hf_dir))
        args = checkpoint_args(model_flags, arch)
        with staged_output_dir(output_dir) as staging, single_process_group(), torch_dist_writer_on_cpu():
            staged = _convert_tensors(hf, arch, staging / ".staging", DTYPES[dtype])
            _save(arch, staged, args, staging / RELEASE_DIR)
            shutil.rmtree(staging / ".staging")
            (staging / TRACKER_FILE).write_text(RELEASE_DIR)
            write_model_args(staging / MODEL_ARGS_FILE, model_flags, str(hf_dir))
    return arch


def _convert_tensors(
    hf: HFCheckpoint, arch: QwenArchitecture, staging: Path, dtype: torch.dtype
) -> dict[tuple[str, int | None], torch.Tensor]:
    staging.mkdir()
    staged = {}
    steps = conversion_steps(arch)
    with tqdm(total=sum(len(mappings) for _, mappings in steps), unit="tensor", desc="converting") as progress:
        for layer, mappings in steps:
            for mapping in mappings:
                tensor = mapping.to_megatron([hf.tensor(name) for name in mapping.hf_tensor_names(layer)], arch)
                staged[(mapping.key, layer)] = _stage(staging, len(staged), tensor, dtype)
                progress.update()
    return staged


def _save(arch: QwenArchitecture, staged: dict, args: argparse.Namespace, checkpoint_dir: Path) -> None:
    from megatron.core import dist_checkpointing

    checkpoint_dir.mkdir()
    print(f"writing the torch_dist checkpoint to {checkpoint_dir} ...", file=sys.stderr)
    state_dict = {"model": _sharded_state_dict(arch, staged), "args": args, "checkpoint_version": 3.0, "iteration": 0}
    dist_checkpointing.save(state_dict, str(checkpoint_dir), content_metadata=dict(CHECKPOINT_CONTENT_METADATA))
