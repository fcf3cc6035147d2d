"""Every tensor of a Qwen2/Qwen3 ``torch_dist`` checkpoint and how it maps to Hugging Face tensors (DESIGN.md §4).

:data:`TENSOR_MAP` names each tensor under its Transformer Engine key (the local spec saves under the
same keys), its Hugging Face sources and the conversion between them: a copy, the per-query-group QKV
interleave (:func:`interleave_qkv`, :func:`split_qkv`) or the gate/up concatenation. In ``torch_dist``
the per-layer tensors are one global tensor with a leading ``[num_layers]`` axis; here every tensor is
handled one layer at a time (shape without that axis).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .architecture import QwenArchitecture

COPY, QKV, GATE_UP = "copy", "qkv", "gate_up"


@dataclass(frozen=True)
class TensorMapping:
    """One ``torch_dist`` tensor and its Hugging Face sources (``{layer}`` is filled in per layer)."""

    key: str
    hf_names: tuple[str, ...]
    kind: str

    @property
    def per_layer(self) -> bool:
        return self.key.startswith("decoder.layers.")

    def hf_tensor_names(self, layer: int | None) -> list[str]:
        return [name.format(layer=layer) for name in self.hf_names]

    def shape(self, arch: QwenArchitecture) -> tuple[int, ...]:
        """Shape of one layer's (or the only) tensor in Megatron's layout."""
        h, d = arch.hidden_size, arch.kv_channels
        qkv_rows = (arch.num_attention_heads + 2 * arch.num_query_groups) * d
        return {
            "embedding.word_embeddings.weight": (arch.vocab_size, h),
            "output_layer.weight": (arch.vocab_size, h),
            "decoder.final_layernorm.weight": (h,),
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (h,),
            "decoder.layers.self_attention.linear_qkv.weight": (qkv_rows, h),
            "decoder.layers.self_attention.linear_qkv.bias": (qkv_rows,),
            "decoder.layers.self_attention.linear_proj.weight": (h, arch.num_attention_heads * d),
            "decoder.layers.self_attention.q_layernorm.weight": (d,),
            "decoder.layers.self_attention.k_layernorm.weight": (d,),
            "decoder.layers.mlp.linear_fc1.layer_norm_weight": (h,),
            "decoder.layers.mlp.linear_fc1.weight": (2 * arch.ffn_hidden_size, h),
            "decoder.layers.mlp.linear_fc2.weight": (h, arch.ffn_hidden_size),
        }[self.key]

    def hf_shapes(self, arch: QwenArchitecture) -> list[tuple[int, ...]]:
        """Shapes of the Hugging Face sources, in ``hf_names`` order."""
        shape = self.shape(arch)
        if self.kind == GATE_UP:
            return [(arch.ffn_hidden_size, arch.hidden_size)] * 2
        if self.kind == QKV:
            q_rows, kv_rows = arch.num_attention_heads * arch.kv_channels, arch.num_query_groups * arch.kv_channels
            return [(rows,) + shape[1:] for rows in (q_rows, kv_rows, kv_rows)]
        return [shape]

    def to_megatron(self, hf_tensors: list[torch.Tensor], arch: QwenArchitecture) -> torch.Tensor:
        """Megatron's tensor from the Hugging Face sources (``hf_names`` order)."""
        if self.kind == QKV:
            return interleave_qkv(*hf_tensors, arch)
        if self.kind == GATE_UP:
            return torch.cat(hf_tensors, dim=0)
        return hf_tensors[0]

    def to_hf(self, tensor: torch.Tensor, arch: QwenArchitecture) -> list[torch.Tensor]:
        """The Hugging Face tensors (``hf_names`` order) of Megatron's tensor; inverse of :meth:`to_megatron`."""
        if self.kind == QKV:
            return list(split_qkv(tensor, arch))
        if self.kind == GATE_UP:
            return list(tensor.chunk(2, dim=0))
        return [tensor]


_LAYER = "model.layers.{layer}."
TENSOR_MAP = (
    TensorMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), COPY),
    TensorMapping(
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight", (_LAYER + "input_layernorm.weight",), COPY
    ),
    TensorMapping(
        "decoder.layers.self_attention.linear_qkv.weight",
        tuple(_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
        QKV,
    ),
    TensorMapping(
        "decoder.layers.self_attention.linear_qkv.bias", tuple(_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"), QKV
    ),
    TensorMapping("decoder.layers.self_attention.q_layernorm.weight", (_LAYER + "self_attn.q_norm.weight",), COPY),
    TensorMapping("decoder.layers.self_attention.k_layernorm.weight", (_LAYER + "self_attn.k_norm.weight",), COPY),
    TensorMapping("decoder.layers.self_attention.linear_proj.weight", (_LAYER + "self_attn.o_proj.weight",), COPY),
    TensorMapping(
        "decoder.layers.mlp.linear_fc1.layer_norm_weight", (_LAYER + "post_attention_layernorm.weight",), COPY
    ),
    TensorMapping(
        "decoder.layers.mlp.linear_fc1.weight",
        (_LAYER + "mlp.gate_proj.weight", _LAYER + "mlp.up_proj.weight"),
        GATE_UP,
    ),
    TensorMapping("decoder.layers.mlp.linear_fc2.weight", (_LAYER + "mlp.down_proj.weight",), COPY),
    TensorMapping("decoder.final_layernorm.weight", ("model.norm.weight",), COPY),
    TensorMapping("output_layer.weight", ("lm_head.weight",), COPY),
)
# Per-layer ``ShardedObject``s every GPTModel layer saves and loads (``None`` for local-spec layers,
# Transformer Engine's FP8 metadata otherwise).
EXTRA_STATE_KEYS = tuple(
    f"decoder.layers.{module}._extra_state"
    for module in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
)
LM_HEAD = "lm_head.weight"
QKV_BIAS_KEY = "decoder.layers.self_attention.linear_qkv.bias"
QK_LAYERNORM_KEYS = (
    "decoder.layers.self_attention.q_layernorm.weight",
    "decoder.layers.self_attention.k_layernorm.weight",
)


def tensor_mappings(arch: QwenArchitecture) -> list[TensorMapping]:
    """The tensors of ``arch``'s checkpoint: :data:`TENSOR_MAP` less what ``arch`` lacks.

    The QKV bias is Qwen2's only, the q/k norms are Qwen3's only, the output layer is there only when untied.
    """
    left_out = {QKV_BIAS_KEY} if not arch.qkv_bias else set()
    left_out |= set(QK_LAYERNORM_KEYS) if not arch.qk_layernorm else set()
    left_out |= {"output_layer.weight"} if arch.tie_embeddings else set()
    return [m for m in TENSOR_MAP if m.key not in left_out]


def conversion_steps(arch: QwenArchitecture) -> list[tuple[int | None, list[TensorMapping]]]:
    """``(layer or None, mappings)`` in checkpoint order: embedding, each layer, final norm and output layer."""
    mappings = tensor_mappings(arch)
    steps = [(None, [m for m in mappings if m.key.startswith("embedding.")])]
    steps += [(layer, [m for m in mappings if m.per_layer]) for layer in range(arch.num_layers)]
    return steps + [(None, [m for m in mappings if not m.per_layer and not m.key.startswith("embedding.")])]


def expected_hf_shapes(arch: QwenArchitecture) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name of ``arch`` (without a tied ``lm_head``) and its shape."""
    return {
        name: shape
        for layer, mappings in conversion_steps(arch)
        for m in mappings
        for name, shape in zip(m.hf_tensor_names(layer), m.hf_shapes(arch))
    }


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: QwenArchitecture) -> torch.Tensor:
    """Megatron's fused QKV rows (weight ``[rows, hidden]`` or bias ``[rows]``) from the separate projections.

    For each query group g in order: its ``heads_per_group * d`` q rows, then its d k rows, then its
    d v rows, so that a tensor-parallel row split gives every rank whole groups.
    """
    g, d = arch.num_query_groups, arch.kv_channels
    trailing = q.shape[1:]
    grouped = [
        q.reshape(g, arch.heads_per_group * d, *trailing),
        k.reshape(g, d, *trailing),
        v.reshape(g, d, *trailing),
    ]
    return torch.cat(grouped, dim=1).reshape(-1, *trailing)


def split_qkv(qkv: torch.Tensor, arch: QwenArchitecture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) projections of Megatron's fused QKV rows; inverse of :func:`interleave_qkv`."""
    g, d = arch.num_query_groups, arch.kv_channels
    trailing = qkv.shape[1:]
    q, k, v = qkv.reshape(g, (arch.heads_per_group + 2) * d, *trailing).split([arch.heads_per_group * d, d, d], dim=1)
    return tuple(part.reshape(-1, *trailing).contiguous() for part in (q, k, v))
