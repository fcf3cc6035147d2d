"""Reading a Megatron-Core ``torch_dist`` checkpoint of a Qwen2/Qwen3 model: its stored ``args``, the
metadata of every model tensor, and one layer's tensors at a time (any TP/PP/CP layout it was saved in).

Every read runs inside a process group (:func:`~megatron_mtraining.conversion.single_process.single_process_group`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .architecture import QwenArchitecture
from .tensor_map import TensorMapping, tensor_mappings


def read_checkpoint_args(checkpoint_dir: Path) -> argparse.Namespace:
    """The Megatron ``args`` stored in the checkpoint (written by training and by our HF → Megatron converter)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(checkpoint_dir))
    if not isinstance(common, dict) or common.get("args") is None:
        raise ValueError(
            f"{checkpoint_dir} stores no Megatron 'args'; the architecture is unknown (was it written "
            "by Megatron's training loop or tools/convert_qwen2_hf_to_megatron.py?)"
        )
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
            raise ValueError(
                f"{checkpoint_dir} has no tensor {mapping.key}, which the checkpoint's args "
                f"({'tied' if arch.tie_embeddings else 'untied'} embeddings) imply"
            )
        shape = tuple(stored[mapping.key].global_shape)
        if shape != _global_shape(mapping, arch):
            raise ValueError(
                f"{mapping.key} has shape {list(shape)} in {checkpoint_dir} but the checkpoint's args "
                f"imply {list(_global_shape(mapping, arch))}"
            )
        dtypes[mapping.key] = stored[mapping.key].dtype
    return dtypes


def load_step(
    checkpoint_dir: Path,
    strategy,
    arch: QwenArchitecture,
    layer: int | None,
    mappings: list[TensorMapping],
    dtypes: dict[str, torch.dtype],
) -> dict[str, torch.Tensor]:
    """Megatron tensors of one layer (or of the non-layer tensors), read from the checkpoint into NaN-filled buffers."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    request = {}
    for mapping in mappings:
        if layer is None:
            buffer = torch.full(mapping.shape(arch), torch.nan, dtype=dtypes[mapping.key])
            request[mapping.key] = ShardedTensor.from_rank_offsets(mapping.key, buffer, replica_id=0)
        else:  # a leading axis of 1 (not prepend_axis_num) lets a single rank read one layer of the stack
            buffer = torch.full((1,) + mapping.shape(arch), torch.nan, dtype=dtypes[mapping.key])
            request[mapping.key] = ShardedTensor.from_rank_offsets(
                mapping.key, buffer, (0, layer, arch.num_layers), replica_id=0
            )
    loaded = dist_checkpointing.load(
        request, str(checkpoint_dir), sharded_strategy=strategy, validate_access_integrity=False
    )
    return {key: loaded[key] if layer is None else loaded[key][0] for key in request}
