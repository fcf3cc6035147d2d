"""Megatron-facing sequence layout: batch selection for ``get_batch`` and layout-aware RoPE (DESIGN.md §3).

Megatron hard-codes the zigzag split in ``get_batch_on_this_cp_rank`` (data) and in
``get_pos_emb_on_this_cp_rank`` (RoPE). MTraining replaces both with the layout formulas of
``mtraining_kernels.layout.Layout`` (striped, zigzag or contiguous), once per micro-batch:

* :func:`select_layout_positions` picks this CP rank's positions of tokens, labels, loss mask and
  position ids (the loss is a sum over tokens, so the order does not change it);
* :class:`LayoutRotaryEmbedding` wraps the model's rotary module (RoPE or YaRN) and returns the table
  rows at this rank's global positions, or (``per_token_positions``, Megatron's ``--reset-position-ids``)
  at each token's own position id, restarting per document; :func:`install_layout_rope` puts it into a
  model.

For zigzag both give exactly Megatron's split.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding, RotaryEmbedding
from torch import nn

from mtraining_kernels.layout import Layout

# keys of Megatron batches that describe packed sequences (not split along the sequence)
PACKED_SEQUENCE_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size", "hybrid_cp_group")


def select_layout_positions(batch: dict[str, Any], layout: Layout, cp_rank: int) -> dict[str, Any]:
    """This CP rank's part of a micro-batch, in ``layout`` order.

    Every tensor value ``[b, N, ...]`` (tokens, labels, loss_mask, position_ids) becomes
    ``[b, N/W, ...]`` holding global positions ``layout.global_positions(N, cp_rank)``; ``None`` and
    non-tensor values pass through. Attention masks and packed-sequence metadata are refused:
    MTraining attention is causal by construction and v1 has no packed sequences.
    """
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a mtraining_kernels.Layout, got {type(layout).__name__}")
    if batch.get("attention_mask") is not None:
        raise ValueError(
            "the batch carries an attention_mask, but MTraining attention is causal and takes none; "
            "build batches without it (--no-create-attention-mask-in-dataloader)"
        )
    packed = [key for key in PACKED_SEQUENCE_KEYS if batch.get(key) is not None]
    if packed:
        raise ValueError(
            f"the batch describes packed sequences ({', '.join(packed)}), which MTraining v1 does not "
            "support; train on unpacked sequences"
        )
    tensors = {key: value for key, value in batch.items() if isinstance(value, torch.Tensor)}
    lengths = {key: value.shape[1] for key, value in tensors.items() if value.dim() >= 2}
    if len(lengths) != len(tensors) or len(set(lengths.values())) > 1:
        shapes = {key: tuple(value.shape) for key, value in tensors.items()}
        raise ValueError(f"every tensor of the batch must be [b, N, ...] with one N, got {shapes}")
    if layout.world_size == 1 or not tensors:
        return dict(batch)
    seq_len = next(iter(lengths.values()))
    layout.validate(seq_len)
    positions = layout.global_positions(seq_len, cp_rank)
    selected = dict(batch)
    for key, value in tensors.items():
        selected[key] = value.index_select(1, positions.to(value.device))
    return selected


class LayoutRotaryEmbedding(nn.Module):
    """The model's rotary module, returning its table at this CP rank's global positions (layout order).

    Same call as Megatron's ``RotaryEmbedding.forward(max_seq_len, offset=0, packed_seq=False,
    cp_group=None)`` and the same result type: a table ``[N/W, 1, 1, dim]`` for RoPE, the pair
    ``(table, mscale)`` for YaRN. ``max_seq_len`` is the global length N. ``get_rotary_seq_len`` and
    ``get_cos_sin`` are those of the wrapped module.

    With ``per_token_positions`` the table is gathered at ``position_ids [b, N/W]``, this rank's position
    ids in layout order (set by :func:`install_layout_rope`'s hook from ``GPTModel.forward``'s
    ``position_ids`` on every call), and is ``[N/W, b, 1, dim]``.
    """

    def __init__(
        self,
        rotary: RotaryEmbedding,
        layout: Layout,
        cp_group: dist.ProcessGroup | None,
        per_token_positions: bool = False,
    ):
        super().__init__()
        if isinstance(rotary, LayoutRotaryEmbedding):
            rotary = rotary.rotary
        if isinstance(rotary, MultimodalRotaryEmbedding) or not isinstance(rotary, RotaryEmbedding):
            raise ValueError(
                f"LayoutRotaryEmbedding wraps RotaryEmbedding or YarnRotaryEmbedding (position embedding "
                f"rope or yarn), got {type(rotary).__name__}"
            )
        if not isinstance(layout, Layout):
            raise ValueError(f"layout must be a mtraining_kernels.Layout, got {type(layout).__name__}")
        cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
        if cp_size != layout.world_size:
            raise ValueError(
                f"layout is for {layout.world_size} CP ranks but the CP group has {cp_size}; build the "
                "layout with the CP size"
            )
        self.rotary = rotary
        self.layout = layout
        self.cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
        self._last: tuple[tuple[int, int], Any] | None = None  # (max_seq_len, offset) → result
        self.per_token_positions = per_token_positions
        self.position_ids: torch.Tensor | None = None  # [b, N/W] of the current call (per_token_positions)
        self.hook = None  # install_layout_rope's pre-hook handle (per_token_positions)

    def forward(
        self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: dist.ProcessGroup | None = None
    ):
        if packed_seq:
            raise ValueError("LayoutRotaryEmbedding does not support packed sequences in v1")
        if cp_group is not None and dist.get_world_size(cp_group) != self.layout.world_size:
            raise ValueError(
                f"cp_group has {dist.get_world_size(cp_group)} ranks but the layout has {self.layout.world_size}"
            )
        if self.per_token_positions:
            return self._at_position_ids(self.rotary.get_emb(max_seq_len, offset), max_seq_len)
        if self._last is not None and self._last[0] == (max_seq_len, offset):
            return self._last[1]
        table = self.rotary.get_emb(max_seq_len, offset)
        if isinstance(table, tuple):  # YaRN: (table, mscale)
            result = (self._select(table[0], max_seq_len), table[1])
        else:
            result = self._select(table, max_seq_len)
        self._last = ((max_seq_len, offset), result)
        return result

    def _select(self, table: torch.Tensor, seq_len: int) -> torch.Tensor:
        return table.index_select(0, self.layout.global_positions(seq_len, self.cp_rank, device=table.device))

    def _at_position_ids(self, table, seq_len: int):
        """``table [N, 1, 1, dim]`` (or YaRN's pair) gathered at :attr:`position_ids`: ``[N/W, b, 1, dim]``."""
        positions = self.position_ids
        local_len = seq_len // self.layout.world_size
        if positions is None or positions.dim() != 2 or positions.shape[1] != local_len:
            raise ValueError(
                f"per-token RoPE positions (--reset-position-ids) need this rank's position_ids [b, {local_len}] "
                f"from GPTModel.forward, got {None if positions is None else tuple(positions.shape)}; pass the "
                "micro-batch's position_ids (pipeline stages without them are not supported)"
            )
        if isinstance(table, tuple):  # YaRN: (table, mscale)
            return self._at_position_ids(table[0], seq_len), table[1]
        rows = table[:, 0, 0].index_select(0, positions.reshape(-1).to(table.device))  # [b·N/W, dim]
        return rows.view(*positions.shape, -1).transpose(0, 1)[:, :, None, :]

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.rotary.get_rotary_seq_len(*args, **kwargs)

    def get_cos_sin(self, *args, **kwargs):
        return self.rotary.get_cos_sin(*args, **kwargs)


def _position_ids_of_call(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of ``GPTModel``: hand the call's ``position_ids`` to its per-token RoPE."""
    module.rotary_pos_emb.position_ids = kwargs["position_ids"] if "position_ids" in kwargs else args[1]


def install_layout_rope(
    model: nn.Module, layout: Layout, cp_group: dist.ProcessGroup | None, per_token_positions: bool = False
) -> LayoutRotaryEmbedding:
    """Replace ``model.rotary_pos_emb`` (looking through ``.module`` wrappers) with a :class:`LayoutRotaryEmbedding`.

    With ``per_token_positions`` a forward pre-hook on the model hands every call's ``position_ids`` to it.
    Idempotent: installing again re-wraps the original rotary module (and replaces the hook). Returns the
    installed module.
    """
    target = model
    while not hasattr(target, "rotary_pos_emb") and isinstance(getattr(target, "module", None), nn.Module):
        target = target.module
    if not hasattr(target, "rotary_pos_emb"):
        raise ValueError(
            f"{type(model).__name__} has no rotary_pos_emb; the layout's RoPE needs "
            "--position-embedding-type rope or yarn"
        )
    previous = target.rotary_pos_emb
    if isinstance(previous, LayoutRotaryEmbedding) and previous.hook is not None:
        previous.hook.remove()
    rotary = LayoutRotaryEmbedding(previous, layout, cp_group, per_token_positions)
    target.rotary_pos_emb = rotary
    if per_token_positions:
        rotary.hook = target.register_forward_pre_hook(_position_ids_of_call, with_kwargs=True)
    return rotary
