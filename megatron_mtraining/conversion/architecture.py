"""What a Qwen2/Qwen2.5 or dense Qwen3 model is, as each side spells it (DESIGN.md §4).

:class:`QwenArchitecture` holds the numbers that define a Qwen2 or Qwen3 dense model, read from a Hugging
Face ``config.json`` (:meth:`~QwenArchitecture.from_hf_config`) or from Megatron's parsed arguments
(:meth:`~QwenArchitecture.from_megatron_args`), and written back as a Hugging Face config
(:meth:`~QwenArchitecture.hf_config`) or as Megatron model flags (:meth:`~QwenArchitecture.megatron_flags`,
saved for the example scripts by :func:`write_model_args`). The two families differ in attention only:
Qwen2 has a QKV bias and head dim ``hidden_size / num_attention_heads``; Qwen3 has no bias, a per-head
RMSNorm of q and k before RoPE (Megatron's ``--qk-layernorm``) and an explicit ``head_dim``
(``--kv-channels``).
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

MODEL_ARGS_FILE = "megatron_model_args.sh"
MODEL_ARGS_VARIABLE = "MODEL_ARGS"
HF_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}  # model_type: causal-LM class
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
SUPPORTED_MODELS = (
    "this converter maps Qwen2/Qwen2.5 (model_type 'qwen2', Qwen2ForCausalLM) and dense Qwen3 "
    "(model_type 'qwen3', Qwen3ForCausalLM) checkpoints only"
)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # --dtype choices of the written tensors
HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
YARN_KEYS = ("rope_type", "type", "factor", "original_max_position_embeddings", "rope_theta")


def _positive_int(value, key: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}: {key}={value!r} must be a positive integer")
    return value


def _rope_settings(config: dict, source: str) -> tuple[float, dict | None]:
    """(θ, YaRN settings or None) from ``rope_parameters`` (transformers ≥ 5) or ``rope_theta``/``rope_scaling``."""
    parameters = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", parameters.get("rope_theta"))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ValueError(f"{source}: rope_theta={theta!r} must be a positive number")
    scaling = config.get("rope_scaling") or (
        parameters if parameters.get("rope_type", "default") != "default" else None
    )
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "default":
            scaling = None
        elif kind != "yarn":
            raise ValueError(
                f"{source}: RoPE scaling type {kind!r} is not mapped to Megatron; only YaRN is "
                "(drop rope_scaling or convert a checkpoint without it)"
            )
        else:
            unmapped = sorted(key for key, value in scaling.items() if key not in YARN_KEYS and value is not None)
            if unmapped:
                raise ValueError(
                    f"{source}: YaRN settings {unmapped} are not mapped to Megatron (only the factor and "
                    "original_max_position_embeddings are, with the default betas and scale)"
                )
    return float(theta), scaling


@dataclass(frozen=True)
class QwenArchitecture:
    """A Qwen2 or dense Qwen3 decoder: shapes, norm epsilon, RoPE (base θ, optional YaRN) and embedding tying.

    ``model_type`` is the Hugging Face one, ``"qwen2"`` (QKV bias) or ``"qwen3"`` (per-head q/k RMSNorm,
    no bias). ``kv_channels`` is the head dim: ``hidden_size // num_attention_heads`` for Qwen2, the
    config's ``head_dim`` for Qwen3. ``max_position_embeddings`` is the length the weights were trained
    for (the HF field).
    """

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    tie_embeddings: bool
    norm_epsilon: float
    rotary_base: int
    max_position_embeddings: int
    yarn_factor: float | None = None
    yarn_original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in HF_ARCHITECTURES:
            raise ValueError(f"model_type={self.model_type!r} is not one of {sorted(HF_ARCHITECTURES)}")
        if self.model_type == "qwen2" and self.kv_channels * self.num_attention_heads != self.hidden_size:
            raise ValueError(
                f"head dim {self.kv_channels} differs from hidden_size/num_attention_heads = "
                f"{self.hidden_size}/{self.num_attention_heads}; Qwen2 ties them"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by the "
                f"{self.num_query_groups} key/value heads (query groups)"
            )
        if (self.yarn_factor is None) != (self.yarn_original_max_position_embeddings is None):
            raise ValueError("YaRN needs both a factor and the original max position embeddings")
        if self.yarn_factor is not None and self.yarn_factor <= 1:
            raise ValueError(f"YaRN factor {self.yarn_factor} must be > 1 (it is target length / original length)")

    @property
    def family(self) -> str:
        """``Qwen2`` or ``Qwen3``, for messages."""
        return self.model_type.capitalize()

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2"

    @property
    def qk_layernorm(self) -> bool:
        return self.model_type == "qwen3"

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    # ---------------------------------------------------------------------------------- Hugging Face
    @classmethod
    def from_hf_config(cls, config: dict, source: str = "config.json") -> "QwenArchitecture":
        """Read and check a Hugging Face ``config.json`` (as a dict); ``source`` names it in errors."""
        model_type, architectures = config.get("model_type"), config.get("architectures")
        if model_type in MOE_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type={model_type!r} (architectures={architectures}) is a "
                f"mixture-of-experts model, which is not mapped; {SUPPORTED_MODELS}"
            )
        if model_type not in HF_ARCHITECTURES:
            raise ValueError(
                f"{source}: model_type={model_type!r} (architectures={architectures}) is not "
                f"supported; {SUPPORTED_MODELS}"
            )
        family, architecture = model_type.capitalize(), HF_ARCHITECTURES[model_type]
        if architecture not in (architectures or [architecture]):
            raise ValueError(
                f"{source}: architectures={architectures} has no {architecture}; only the causal-LM "
                f"head of model_type {model_type!r} is mapped"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"{source}: hidden_act={config['hidden_act']!r} is not mapped; {family} uses silu (SwiGLU)"
            )
        if config.get("use_sliding_window"):
            raise ValueError(
                f"{source}: use_sliding_window=true is not mapped; Megatron runs full causal attention "
                "here (set use_sliding_window to false if the model does not need it)"
            )
        layer_types = set(config.get("layer_types") or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise ValueError(f"{source}: layer_types {sorted(layer_types)} are not mapped; only full_attention is")
        if model_type == "qwen3" and config.get("attention_bias"):
            raise ValueError(
                f"{source}: attention_bias=true is not mapped: it adds a bias to q/k/v and o_proj, "
                "Megatron's --add-qkv-bias to q/k/v only (Qwen3 checkpoints have attention_bias=false)"
            )

        def required(key: str) -> int:
            return _positive_int(config.get(key), key, source)

        hidden = required("hidden_size")
        heads = required("num_attention_heads")
        if model_type == "qwen3":
            if "head_dim" not in config:
                raise ValueError(
                    f"{source}: Qwen3 config has no head_dim; add the model's head dim (e.g. 128), "
                    "transformers' default for a missing one depends on its version"
                )
            head_dim = required("head_dim")
        else:
            if hidden % heads:
                raise ValueError(f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads}")
            head_dim = hidden // heads
            if config.get("head_dim") not in (None, head_dim):
                raise ValueError(
                    f"{source}: head_dim={config['head_dim']} differs from hidden_size/"
                    f"num_attention_heads = {hidden}/{heads}; Qwen2 ties them"
                )
        theta, scaling = _rope_settings(config, source)
        if theta != int(theta):
            raise ValueError(f"{source}: rope_theta={theta} is not an integer; Megatron's --rotary-base is")
        max_positions = _positive_int(config.get("max_position_embeddings", 32768), "max_position_embeddings", source)
        yarn_factor = yarn_original = None
        if scaling is not None:
            if not isinstance(scaling.get("factor"), (int, float)):
                raise ValueError(f"{source}: YaRN needs a numeric factor, got {scaling.get('factor')!r}")
            yarn_factor = float(scaling["factor"])
            yarn_original = int(scaling.get("original_max_position_embeddings", max_positions))
        epsilon = config.get("rms_norm_eps")
        if not isinstance(epsilon, float) or epsilon <= 0:
            raise ValueError(f"{source}: rms_norm_eps={epsilon!r} must be a positive number (Qwen2.5, Qwen3: 1e-06)")
        return cls(
            model_type=model_type,
            num_layers=required("num_hidden_layers"),
            hidden_size=hidden,
            ffn_hidden_size=required("intermediate_size"),
            num_attention_heads=heads,
            num_query_groups=required("num_key_value_heads"),
            kv_channels=head_dim,
            vocab_size=required("vocab_size"),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            norm_epsilon=epsilon,
            rotary_base=int(theta),
            max_position_embeddings=max_positions,
            yarn_factor=yarn_factor,
            yarn_original_max_position_embeddings=yarn_original,
        )

    def hf_config(self, base: dict | None, dtype: torch.dtype) -> dict:
        """A Qwen2 or Qwen3 ``config.json`` dict: ``base`` (the original model's, for token ids) with this architecture.

        RoPE is written as ``rope_theta``/``rope_scaling``, which every transformers version reads.
        """
        config = {
            key: value
            for key, value in (base or {}).items()
            if key not in ("rope_parameters", "dtype", "head_dim", "layer_types", "attention_bias")
        }
        config.update(
            {
                "architectures": [HF_ARCHITECTURES[self.model_type]],
                "model_type": self.model_type,
                "hidden_act": "silu",
                "hidden_size": self.hidden_size,
                "intermediate_size": self.ffn_hidden_size,
                "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_query_groups,
                "vocab_size": self.vocab_size,
                "rms_norm_eps": self.norm_epsilon,
                "tie_word_embeddings": self.tie_embeddings,
                "max_position_embeddings": self.max_position_embeddings,
                "rope_theta": float(self.rotary_base),
                "rope_scaling": None
                if self.yarn_factor is None
                else {
                    "rope_type": "yarn",
                    "type": "yarn",
                    "factor": self.yarn_factor,
                    "original_max_position_embeddings": self.yarn_original_max_position_embeddings,
                },
                "use_sliding_window": False,
                "torch_dtype": HF_DTYPE_NAMES[dtype],
            }
        )
        if self.model_type == "qwen3":
            config.update({"head_dim": self.kv_channels, "attention_bias": False})
        return config

    # ---------------------------------------------------------------------------------- Megatron
    def megatron_flags(self, tokenizer_model: str) -> list[str]:
        """Megatron model flags of this architecture, with ``tokenizer_model`` as the Hugging Face tokenizer.

        Sequence-length flags (``--seq-length``, ``--max-position-embeddings``) belong to the run, not here.
        """
        flags = [
            "--num-layers",
            str(self.num_layers),
            "--hidden-size",
            str(self.hidden_size),
            "--ffn-hidden-size",
            str(self.ffn_hidden_size),
            "--num-attention-heads",
            str(self.num_attention_heads),
            "--group-query-attention",
            "--num-query-groups",
            str(self.num_query_groups),
            "--kv-channels",
            str(self.kv_channels),
            "--normalization",
            "RMSNorm",
            "--norm-epsilon",
            repr(self.norm_epsilon),
            "--swiglu",
            "--disable-bias-linear",
            "--add-qkv-bias" if self.qkv_bias else "--qk-layernorm",
            "--rotary-percent",
            "1.0",
            "--rotary-base",
            str(self.rotary_base),
        ]
        if self.yarn_factor is None:
            flags += ["--position-embedding-type", "rope"]
        else:
            flags += [
                "--position-embedding-type",
                "yarn",
                "--rotary-scaling-factor",
                repr(self.yarn_factor),
                "--yarn-original-max-position-embeddings",
                str(self.yarn_original_max_position_embeddings),
            ]
        flags += ["--make-vocab-size-divisible-by", "1", "--padded-vocab-size", str(self.vocab_size)]
        if not self.tie_embeddings:
            flags.append("--untie-embeddings-and-output-weights")
        return flags + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_model]

    @classmethod
    def from_megatron_args(cls, args: argparse.Namespace) -> "QwenArchitecture":
        """The architecture of Megatron's parsed arguments (e.g. a checkpoint's ``args``).

        ``qk_layernorm`` tells the family (set: Qwen3, unset: Qwen2); a model that is neither is refused.
        """
        model_type = "qwen3" if getattr(args, "qk_layernorm", False) else "qwen2"
        family = model_type.capitalize()
        expected = {
            "swiglu": True,
            "add_qkv_bias": model_type == "qwen2",
            "add_bias_linear": False,
            "normalization": "RMSNorm",
            "rotary_percent": 1.0,
            "qk_l2_norm": False,
            "num_experts": None,
            "rotary_interleaved": False,
            "multi_latent_attention": False,
        }
        wrong = [
            f"{name}={getattr(args, name, value)!r} ({family}: {value!r})"
            for name, value in expected.items()
            if getattr(args, name, value) != value
        ]
        if getattr(args, "position_embedding_type", None) not in ("rope", "yarn"):
            wrong.append(
                f"position_embedding_type={getattr(args, 'position_embedding_type', None)!r} "
                f"({family}: 'rope' or 'yarn')"
            )
        if wrong:
            raise ValueError(
                f"the Megatron model is not {family}-shaped: {', '.join(wrong)} (read as {family} "
                f"because qk_layernorm={model_type == 'qwen3'})"
            )
        heads = args.num_attention_heads
        if args.padded_vocab_size is None:
            raise ValueError("the Megatron arguments have no padded_vocab_size; the vocabulary size is unknown")
        max_positions = args.max_position_embeddings or args.seq_length
        if max_positions is None:
            raise ValueError("the Megatron arguments have neither max_position_embeddings nor seq_length")
        yarn = args.position_embedding_type == "yarn"
        return cls(
            model_type=model_type,
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            ffn_hidden_size=args.ffn_hidden_size,
            num_attention_heads=heads,
            num_query_groups=args.num_query_groups if args.group_query_attention else heads,
            kv_channels=args.kv_channels or args.hidden_size // heads,
            vocab_size=args.padded_vocab_size,
            tie_embeddings=not args.untie_embeddings_and_output_weights,
            norm_epsilon=args.layernorm_epsilon,
            rotary_base=args.rotary_base,
            max_position_embeddings=max_positions,
            yarn_factor=args.rotary_scaling_factor if yarn else None,
            yarn_original_max_position_embeddings=args.yarn_original_max_position_embeddings if yarn else None,
        )


def write_model_args(path: Path, flags: list[str], source: str) -> None:
    """Write ``flags`` as a bash array :data:`MODEL_ARGS_VARIABLE` for the example scripts to source."""
    use = f'python -m megatron_mtraining.pretrain "${{{MODEL_ARGS_VARIABLE}[@]}}" ...'
    lines = [
        f"# Megatron model flags of {source}, written by tools/convert_qwen2_hf_to_megatron.py.",
        f"# Use: source {MODEL_ARGS_FILE}; {use}",
        f"{MODEL_ARGS_VARIABLE}=(",
    ]
    pairs, index = [], 0
    while index < len(flags):  # one flag (and its value) per line
        takes_value = index + 1 < len(flags) and not flags[index + 1].startswith("--")
        pairs.append(flags[index : index + 1 + takes_value])
        index += 1 + takes_value
    lines += ["  " + " ".join(shlex.quote(item) for item in pair) for pair in pairs]
    Path(path).write_text("\n".join(lines + [")", ""]))
