"""mtraining_kernels: vertical-slash sparse attention kernels, index conversion, layouts and the
pure-PyTorch reference. No torch.distributed and no Megatron in this package."""

from .layout import LAYOUT_KINDS, Layout, global_positions, shard, unshard
from .reference import reference_sparse_attention, vertical_slash_mask

__all__ = [
    "LAYOUT_KINDS",
    "Layout",
    "global_positions",
    "reference_sparse_attention",
    "shard",
    "unshard",
    "vertical_slash_mask",
]
