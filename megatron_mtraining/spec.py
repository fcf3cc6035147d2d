"""Megatron layer spec with MTraining's core attention (DESIGN.md §3).

``get_gpt_layer_mtraining_spec`` is Megatron's own GPT layer spec — the local one (torch norms, no
Apex needed) or the Transformer Engine one — with ``core_attention`` swapped for
:class:`~megatron_mtraining.attention.MTrainingAttention`. Use it from Python or as
``--spec megatron_mtraining.spec get_gpt_layer_mtraining_spec`` (Megatron then calls it with its model
config and ``vp_stage``; the MTraining settings come from ``mtraining=``, which a launcher binds with
``functools.partial``).
"""

from __future__ import annotations

from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec

from .attention import MTrainingAttention
from .config import MTrainingConfig

TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")


def _use_transformer_engine(config, transformer_impl: str) -> bool:
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl={transformer_impl!r} is unknown; use one of {TRANSFORMER_IMPLS}")
    if transformer_impl == "transformer_engine" and not HAVE_TE:
        raise ValueError(
            "transformer_impl='transformer_engine' but Transformer Engine does not import; install "
            "it (pip install 'megatron-mtraining[te]') or use transformer_impl='local'"
        )
    if transformer_impl == "auto":
        wanted = getattr(config, "transformer_impl", "transformer_engine") if config is not None else None
        return HAVE_TE and wanted in (None, "transformer_engine")
    return transformer_impl == "transformer_engine"


def get_gpt_layer_mtraining_spec(
    config=None,
    vp_stage: int | None = None,
    *,
    transformer_impl: str = "auto",
    mtraining: MTrainingConfig | None = None,
) -> ModuleSpec:
    """A ``TransformerLayer`` spec whose self-attention core is :class:`MTrainingAttention`.

    ``config`` (a ``TransformerConfig`` or Megatron's ``GPTModelConfig``, optional) supplies
    ``normalization`` (default RMSNorm), ``qk_layernorm`` and ``transformer_impl``. With
    ``transformer_impl="auto"`` the TE spec is used when TE imports and the config does not ask for
    ``local``. ``vp_stage`` is accepted for Megatron's builder; every stage gets the same layer spec.
    ``mtraining`` defaults to ``MTrainingConfig()``.
    """
    if config is not None and getattr(config, "multi_latent_attention", False):
        raise ValueError(
            "MTraining attention replaces the core of SelfAttention; multi-latent attention (MLA) "
            "is not supported, drop --multi-latent-attention"
        )
    if mtraining is not None and not isinstance(mtraining, MTrainingConfig):
        raise ValueError(f"mtraining must be an MTrainingConfig, got {type(mtraining).__name__}")
    qk_layernorm = bool(getattr(config, "qk_layernorm", False))
    if _use_transformer_engine(config, transformer_impl):
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    else:
        normalization = getattr(config, "normalization", "RMSNorm") if config is not None else "RMSNorm"
        spec = get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    params = {} if mtraining is None else {"mtraining": mtraining}
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(module=MTrainingAttention, params=params)
    return spec
