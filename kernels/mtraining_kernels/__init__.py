"""mtraining_kernels: vertical-slash sparse attention kernels, index conversion, layouts and the
pure-PyTorch reference. No torch.distributed and no Megatron in this package."""

from .document_index import DocumentIndex
from .documents import Documents
from .index import BlockBarIndex, convert_index
from .interface import get_backend, sparse_attention, torch_block_sparse_attention
from .layout import LAYOUT_KINDS, Layout, global_positions, shard, unshard
from .reference import reference_sparse_attention, vertical_slash_mask

__all__ = [
    "BlockBarIndex",
    "DocumentIndex",
    "Documents",
    "LAYOUT_KINDS",
    "Layout",
    "convert_index",
    "get_backend",
    "global_positions",
    "reference_sparse_attention",
    "shard",
    "sparse_attention",
    "torch_block_sparse_attention",
    "unshard",
    "vertical_slash_mask",
]
