"""``MTrainingAttention``: the ``core_attention`` slot of Megatron's ``SelfAttention`` (DESIGN.md §3).

Megatron hands over post-RoPE ``query [s, b, np, hn]`` and ``key``/``value [s, b, ng, hn]`` (this TP
rank's heads, this CP rank's tokens in the MTraining layout) and expects ``[s, b, np·hn]`` back. Per
call the module

1. estimates the layer's vertical-slash index on the global sequence from the last 64 queries
   (or, under recomputation, takes it from the layer's :class:`IndexCache`); dense layers use the
   full pattern instead; with ``keep_attention_output`` the cache also holds the first forward's
   output and lse, and the recomputation runs no attention forward, only its backward;
2. converts it into this rank's block/bar lists (``mtraining_kernels.index.convert_index``);
3. runs the single-device kernels (CP = 1) or the flat/hierarchical sparse ring over
   ``pg_collection.cp`` (CP > 1).

With an SDPA ``dense_impl`` (``sdpa_cudnn``/``sdpa_flash``, the dense baseline) it builds no index and runs
torch's SDPA kernels: one dense causal call (CP = 1) or the zigzag dense ring (``dense_ring``, CP > 1).

Packed documents (DESIGN.md §2.7) arrive as :class:`PackedDocuments` in ``packed_seq_params``: every
document at least ``min_sparse_length`` long gets its own index, shorter ones are attended densely, and no
score crosses a document boundary. Only the ``torch`` block-sparse backend (and the reference oracle at
CP = 1) masks documents; Triton and the SDPA dense impls refuse them.

It has no parameters, so checkpoints are the same as a dense Megatron model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_rank, get_pg_size

from mtraining_kernels.budget import LayerBudget
from mtraining_kernels.document_conversion import convert_document_index
from mtraining_kernels.document_index import DocumentIndex, estimate_document_index
from mtraining_kernels.documents import Documents
from mtraining_kernels.estimation import VerticalSlashIndex, estimate_vertical_slash
from mtraining_kernels.index import BlockBarIndex, convert_index
from mtraining_kernels.interface import dense_attention, sparse_attention
from mtraining_kernels.layout import BLOCK_SIZE, Layout
from mtraining_kernels.reference import packed_vertical_slash_mask, reference_sparse_attention, vertical_slash_mask
from mtraining_kernels.vertical_slash import full_index

from .attention_stats import AttentionStats, Stopwatch
from .config import REFERENCE_BACKEND, MTrainingConfig, flag
from .index_cache import ForwardKind, IndexCache, IndexKey, forward_kind, probe_checksum
from .ring.dense_ring import dense_ring_attention
from .ring.document_estimation import estimate_document_index_distributed
from .ring.estimation import estimate_vertical_slash_distributed
from .ring.groups import RingGroups
from .ring.sparse_ring import ring_attention

ACCEPTED_CP_COMM_TYPES = (None, "p2p", "a2a+p2p")


@dataclass(frozen=True, eq=False)
class PackedDocuments:
    """The documents of a micro-batch, handed to ``GPTModel.forward`` as ``packed_seq_params``.

    ``documents``: the boundaries of the whole sequences (``[b, N]``, global order, before the layout
    permutation), identical on every CP rank and on the tokens' device. ``layout``: the micro-batch's own layout
    when its turns were planned from these documents (``--mtraining-plan-turns``), else None (the configured
    one). The other fields are those that megatron-core reads of any ``packed_seq_params`` on the GPT path:
    ``qkv_format`` is ``"sbhd"`` (not THD, so the tensors keep their ``[s, b]`` shape), ``cp_group`` None, and
    ``max_seqlen_q``/``max_seqlen_kv`` are N (the RoPE table length).
    """

    documents: Documents
    layout: Layout | None = None
    qkv_format: str = field(default="sbhd", init=False)
    cp_group: None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.documents, Documents):
            raise ValueError(
                f"documents must be a mtraining_kernels.documents.Documents, got {type(self.documents).__name__}"
            )
        if self.layout is not None and not isinstance(self.layout, Layout):
            raise ValueError(f"layout must be a mtraining_kernels Layout or None, got {type(self.layout).__name__}")

    @property
    def max_seqlen_q(self) -> int:
        return self.documents.seq_len

    @property
    def max_seqlen_kv(self) -> int:
        return self.documents.seq_len


@dataclass(frozen=True, eq=False)
class _LayerIndex:
    """An index of one forward: the global lists (per document when packed) and this rank's block/bar lists."""

    v_idx: torch.Tensor  # [b, Hq, Vmax], or [b, m_max, Hq, Vmax] when packed
    s_idx: torch.Tensor
    block_bar: BlockBarIndex
    packed: DocumentIndex | None = None


@dataclass(frozen=True, eq=False)
class _Checkpointed:
    """What the first forward of a recomputed layer keeps for the replay."""

    index: _LayerIndex | None  # the estimated index (sparse layers only)
    output: tuple[torch.Tensor, torch.Tensor] | None  # (out, lse) with keep_attention_output


@lru_cache(maxsize=4)
def _full_pattern_index(
    batch: int, heads: int, seq_len: int, layout: Layout, rank: int, device: torch.device
) -> _LayerIndex:
    """The full causal pattern as an index (dense layers); shared by all dense layers of a shape. Valid by
    construction, so its conversion skips the content checks (a host read)."""
    v_idx, s_idx = full_index(batch, heads, seq_len, device=device)
    return _LayerIndex(v_idx, s_idx, convert_index(v_idx, s_idx, layout, rank, seq_len, check_contents=False))


def _resolve_cp_comm_type(cp_comm_type, layer_number: int) -> str | None:
    if isinstance(cp_comm_type, (list, tuple)):
        if not 1 <= layer_number <= len(cp_comm_type):
            raise ValueError(
                f"cp_comm_type has {len(cp_comm_type)} entries but layer_number={layer_number}; "
                "give one entry per layer"
            )
        cp_comm_type = cp_comm_type[layer_number - 1]
    if cp_comm_type not in ACCEPTED_CP_COMM_TYPES:
        raise ValueError(
            f"--cp-comm-type {cp_comm_type!r} is not supported by MTraining's ring; use p2p "
            "(flat or hierarchical ring) or a2a+p2p with --hierarchical-context-parallel-sizes"
        )
    return cp_comm_type


class MTrainingAttention(MegatronModule):
    """Causal vertical-slash sparse core attention over the CP group (parameter-free).

    Built by Megatron's ``Attention`` with ``config, layer_number, attn_mask_type, attention_type,
    cp_comm_type, softmax_scale, pg_collection``; the MTraining settings arrive through the layer spec
    (``mtraining=``, default :class:`MTrainingConfig()`). ``last_stats`` describes the latest training
    forward and ``estimations`` counts index estimations (replays reuse the cache and do not count).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        cp_comm_type: str | list[str] | None = None,
        softmax_scale: float | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        mtraining: MTrainingConfig | None = None,
        **kwargs,
    ):
        super().__init__(config=config)
        self.mtraining = MTrainingConfig() if mtraining is None else mtraining
        if not isinstance(self.mtraining, MTrainingConfig):
            raise ValueError(f"mtraining must be an MTrainingConfig, got {type(self.mtraining).__name__}")
        if isinstance(layer_number, bool) or not isinstance(layer_number, int) or layer_number < 1:
            raise ValueError(f"layer_number={layer_number!r} must be Megatron's 1-based global layer number")
        if config.attention_dropout:
            raise ValueError(
                f"MTraining attention has no dropout, but attention_dropout={config.attention_dropout}; "
                "set --attention-dropout 0"
            )
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(
                f"MTraining attention is causal only, got attn_mask_type={attn_mask_type}; use AttnMaskType.causal"
            )
        if attention_type != "self":
            raise ValueError(f"MTraining attention is self-attention only, got attention_type={attention_type!r}")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.dense = self.mtraining.is_dense_layer(layer_number)
        self.index_cache = IndexCache(owner=f"MTrainingAttention(layer {layer_number})")
        self.last_stats: AttentionStats | None = None
        self.estimations = 0

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp", "hcp"])
        self.cp_group = pg_collection.cp
        self.cp_size, self.cp_rank = get_pg_size(self.cp_group), get_pg_rank(self.cp_group)
        self.tp_size, self.tp_rank = get_pg_size(pg_collection.tp), get_pg_rank(pg_collection.tp)
        self.layout = self.mtraining.layout_for(self.cp_size)
        self.ring_groups = self._ring_groups(pg_collection.hcp, cp_comm_type) if self.cp_size > 1 else None
        self.mtraining.check_parallelism(
            self.cp_size, hierarchical=self.ring_groups is not None and self.ring_groups.outer is not None
        )
        self._budgets: dict[int, LayerBudget] = {}

    def _ring_groups(self, hcp, cp_comm_type) -> RingGroups:
        comm_type = _resolve_cp_comm_type(cp_comm_type, self.layer_number)
        if hcp is None:
            if comm_type == "a2a+p2p":
                raise ValueError(
                    "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes; set it or use p2p"
                )
            if self.mtraining.ring == "hierarchical":
                raise ValueError(
                    f"{flag('ring')}=hierarchical needs the inner/outer CP groups "
                    "(pg_collection.hcp); set --hierarchical-context-parallel-sizes L O"
                )
            return RingGroups.flat(self.cp_group)
        if self.mtraining.ring != "hierarchical":
            raise ValueError(
                f"pg_collection.hcp is set (--hierarchical-context-parallel-sizes), which selects the "
                f"hierarchical ring, but {flag('ring')}={self.mtraining.ring}; add {flag('ring')} "
                "hierarchical or drop the hierarchical sizes"
            )
        if len(hcp) != 2:
            raise ValueError(
                f"pg_collection.hcp has {len(hcp)} levels; MTraining's ring needs exactly two "
                "[inner, outer] (--hierarchical-context-parallel-sizes L O)"
            )
        return RingGroups.hierarchical(self.cp_group, hcp[0], hcp[1])

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """``query [s, b, np, hn]``, ``key``/``value [s, b, ng, hn]`` (post-RoPE, layout order) → ``[s, b, np·hn]``."""
        self._check_call(query, key, value, attention_mask, attn_mask_type, attention_bias)
        local_len, batch, heads, head_dim = query.shape
        q, k, v = (t.permute(1, 0, 2, 3) for t in (query, key, value))  # [b, s, heads, d]
        seq_len = local_len * self.cp_size
        documents = self._documents(packed_seq_params, batch, seq_len, query.device)
        layout = self._call_layout(packed_seq_params)
        layout.validate(seq_len, BLOCK_SIZE)
        mt = self.mtraining
        estimates = mt.sdpa_impl is None and not self.dense
        kind = forward_kind() if estimates or mt.keep_attention_output else ForwardKind.PLAIN
        cache_key = IndexKey(seq_len, batch, heads, layout)
        replayed = self.index_cache.pop(cache_key, probe_checksum(q)) if kind is ForwardKind.REPLAY else None
        replay_output = None if replayed is None else replayed.output
        if mt.sdpa_impl is not None:
            index = None
            out, lse = self._sdpa_attention(q, k, v, seq_len, replay_output)
        else:
            if replayed is not None and estimates:
                index = replayed.index
            elif documents is not None:
                index = self._document_layer_index(q, k, documents, layout)
            else:
                index = self._layer_index(q, k, seq_len)
            out, lse = self._sparse_attention(q, k, v, seq_len, index, replay_output)
        if kind is ForwardKind.CHECKPOINTED:
            self.index_cache.push(
                cache_key,
                probe_checksum(q),
                _Checkpointed(index if estimates else None, (out, lse) if mt.keep_attention_output else None),
            )
        return out.permute(1, 0, 2, 3).reshape(local_len, batch, heads * head_dim)

    def _sparse_attention(self, q, k, v, seq_len: int, index: _LayerIndex, replay_output):
        """(out ``[b, s, heads, d]``, lse) through the ring (CP > 1) or the single-device kernels."""
        mt = self.mtraining
        if self.cp_size > 1:
            return ring_attention(
                q,
                k,
                v,
                index.block_bar,
                self.ring_groups,
                backend=mt.block_sparse_backend,
                softmax_scale=self.softmax_scale,
                deterministic=mt.deterministic,
                grad_wire_dtype=mt.grad_wire_dtype,
                return_lse=True,
                replay_output=replay_output,
            )
        if mt.backend == REFERENCE_BACKEND:  # plain autograd (keep_attention_output is refused)
            if index.packed is not None:
                mask = packed_vertical_slash_mask(index.packed)
            else:
                mask = vertical_slash_mask(index.v_idx, index.s_idx, seq_len)
            out, lse = reference_sparse_attention(q, k, v, mask, softmax_scale=self.softmax_scale)
            return out.to(q.dtype), lse
        return sparse_attention(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            index.block_bar,
            softmax_scale=self.softmax_scale,
            backend=mt.block_sparse_backend,
            deterministic=mt.deterministic,
            return_lse=True,
            replay_output=replay_output,
        )

    def _check_call(self, query, key, value, attention_mask, attn_mask_type, attention_bias):
        if attention_mask is not None:
            raise ValueError(
                f"MTraining attention is causal by construction and takes no attention_mask, got a "
                f"tensor of shape {tuple(attention_mask.shape)}; build batches without one "
                "(--no-create-attention-mask-in-dataloader)"
            )
        if attn_mask_type not in (None, AttnMaskType.causal):
            raise ValueError(f"MTraining attention is causal only, got attn_mask_type={attn_mask_type}")
        if attention_bias is not None:
            raise ValueError("MTraining attention does not support attention_bias; drop it")
        if query.dim() != 4 or key.dim() != 4 or key.shape != value.shape:
            raise ValueError(
                f"expected query [s, b, np, hn] and key/value [s, b, ng, hn], got "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        if key.shape[:2] != query.shape[:2] or key.shape[3] != query.shape[3]:
            raise ValueError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)} on [s, b, ·, hn]")
        heads = query.shape[2]
        if heads * self.tp_size != self.config.num_attention_heads:
            raise ValueError(
                f"query has {heads} heads on each of {self.tp_size} TP ranks, but the model has "
                f"{self.config.num_attention_heads}"
            )

    def _documents(self, packed_seq_params, batch: int, seq_len: int, device: torch.device) -> Documents | None:
        """The documents of this call (None when unpacked), checked against the batch and the settings."""
        if packed_seq_params is None:
            return None
        if not isinstance(packed_seq_params, PackedDocuments):
            raise ValueError(
                f"MTraining attention does not support packed sequences as {type(packed_seq_params).__name__} "
                f"(qkv_format={getattr(packed_seq_params, 'qkv_format', None)!r}); hand the documents as "
                "megatron_mtraining.attention.PackedDocuments, or train on unpacked sequences"
            )
        mt = self.mtraining
        if mt.sdpa_impl is not None:
            raise ValueError(
                f"{flag('dense_impl')}={mt.dense_impl} has no document mask, so it cannot attend packed documents; "
                f"use {flag('dense_impl')} mtraining"
            )
        documents = packed_seq_params.documents
        if (documents.batch_size, documents.seq_len) != (batch, seq_len):
            raise ValueError(
                f"the packed documents describe [b, N]={(documents.batch_size, documents.seq_len)} but the call "
                f"has [b, N]={(batch, seq_len)}; build them from this micro-batch's whole sequences"
            )
        if documents.starts.device != device:
            raise ValueError(
                f"the packed documents are on {documents.starts.device} but query is on {device}; "
                "build them on the tokens' device"
            )
        return documents

    def _call_layout(self, packed_seq_params) -> Layout:
        """The layout of this call: the micro-batch's planned one (``PackedDocuments.layout``) or the configured."""
        planned = getattr(packed_seq_params, "layout", None)
        if planned is None:
            return self.layout
        if planned.world_size != self.cp_size or planned.kind != "skewed":
            raise ValueError(
                f"the micro-batch's layout {planned!r} is not a skewed layout of the {self.cp_size} CP ranks; plan "
                "its turns with megatron_mtraining.turn_plan for the CP size"
            )
        return planned

    def _sdpa_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, replay_output):
        """Dense causal attention on torch's SDPA kernels, no index: (out ``[b, s, heads, d]``, lse)."""
        if self.training:
            self.last_stats = AttentionStats(self.layer_number, True, None, None, self.layout, seq_len, None)
        mt = self.mtraining
        if self.cp_size > 1:
            return dense_ring_attention(
                q,
                k,
                v,
                self.layout,
                self.ring_groups,
                impl=mt.sdpa_impl,
                softmax_scale=self.softmax_scale,
                grad_wire_dtype=mt.grad_wire_dtype,
                return_lse=True,
                replay_output=replay_output,
            )
        return dense_attention(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            impl=mt.sdpa_impl,
            softmax_scale=self.softmax_scale,
            return_lse=True,
            replay_output=replay_output,
        )

    # ------------------------------------------------------------------ index
    def _layer_index(self, q: torch.Tensor, k: torch.Tensor, seq_len: int) -> _LayerIndex:
        """The index of a first forward: the full pattern (dense layers) or freshly estimated."""
        batch, _, heads, _ = q.shape
        if self.dense:
            index = _full_pattern_index(batch, heads, seq_len, self.layout, self.cp_rank, q.device)
            if self.training:
                self.last_stats = AttentionStats(
                    self.layer_number, True, index.v_idx, index.s_idx, self.layout, seq_len, None
                )
            return index
        stopwatch = Stopwatch(q.device)
        with torch.no_grad():
            estimated = self._estimate(q.detach(), k.detach(), seq_len)
        stopwatch.stop()
        self.estimations += 1
        # the estimators' lists are valid by construction: no content checks, whose host read would stall the step
        block_bar = convert_index(
            estimated.v_idx, estimated.s_idx, self.layout, self.cp_rank, seq_len, check_contents=False
        )
        index = _LayerIndex(estimated.v_idx, estimated.s_idx, block_bar)
        if self.training:
            self.last_stats = AttentionStats(
                self.layer_number, False, index.v_idx, index.s_idx, self.layout, seq_len, stopwatch
            )
        return index

    def _document_layer_index(
        self, q: torch.Tensor, k: torch.Tensor, documents: Documents, layout: Layout
    ) -> _LayerIndex:
        """The packed index of a first forward: every document dense (dense layers) or estimated per document."""
        stopwatch, clamped = None, 0
        if self.dense:
            index = DocumentIndex.dense(documents, q.shape[2])
        else:
            stopwatch = Stopwatch(q.device)
            with torch.no_grad():
                index, clamped = self._estimate_documents(q.detach(), k.detach(), documents, layout)
            stopwatch.stop()
            self.estimations += 1
        if self.training:
            self.last_stats = AttentionStats(
                self.layer_number,
                self.dense,
                None,
                None,
                layout,
                documents.seq_len,
                stopwatch,
                documents=index,
                clamped_documents=clamped,
            )
        return _LayerIndex(index.v_idx, index.s_idx, convert_document_index(index, layout, self.cp_rank), index)

    def _estimate_documents(
        self, q: torch.Tensor, k: torch.Tensor, documents: Documents, layout: Layout
    ) -> tuple[DocumentIndex, int]:
        """(the per-document index, the number of documents whose static budget was clamped to their length)."""
        mt = self.mtraining
        budget = self._layer_budget(documents.seq_len, q.shape[2])
        options = dict(
            min_sparse_length=mt.min_sparse_length,
            softmax_scale=self.softmax_scale,
            last_q=mt.last_q,
            sink_tokens=mt.sink_tokens,
            local_window=mt.local_window,
        )
        if self.cp_size == 1:
            return estimate_document_index(q, k, documents, budget, **options)
        return estimate_document_index_distributed(q, k, documents, budget, layout, self.cp_group, **options)

    def _estimate(self, q: torch.Tensor, k: torch.Tensor, seq_len: int) -> VerticalSlashIndex:
        mt = self.mtraining
        budget = self._layer_budget(seq_len, q.shape[2])
        options = dict(
            softmax_scale=self.softmax_scale, last_q=mt.last_q, sink_tokens=mt.sink_tokens, local_window=mt.local_window
        )
        if self.cp_size == 1:
            return estimate_vertical_slash(q, k, budget, **options)
        return estimate_vertical_slash_distributed(q, k, budget, self.layout, self.cp_group, **options)

    def _layer_budget(self, seq_len: int, heads: int) -> LayerBudget:
        """This layer's budgets for this TP rank's query heads (global heads tp_rank·Hq … (tp_rank+1)·Hq − 1)."""
        if seq_len not in self._budgets:
            table = self.mtraining.budget_table(
                num_layers=self.config.num_layers, num_heads=self.config.num_attention_heads, seq_length=seq_len
            )
            first = self.tp_rank * heads
            self._budgets[seq_len] = table.resolve(self.layer_number, range(first, first + heads))
        return self._budgets[seq_len]
