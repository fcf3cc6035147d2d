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
from pathlib import Path

from megatron_mtraining.conversion import megatron_to_hf
from megatron_mtraining.conversion.architecture import DTYPES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--checkpoint",
        required=True,
        type=Path,
        help="Megatron checkpoint root (with latest_checkpointed_iteration.txt) or its release/iter_XXXXXXX directory",
    )
    parser.add_argument("--output-dir", required=True, type=Path, help="Hugging Face directory to create")
    parser.add_argument(
        "--hf-reference",
        type=Path,
        default=None,
        help="original Hugging Face model directory: token ids and tokenizer files (default: the "
        "checkpoint's --tokenizer-model when it is a model directory)",
    )
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="dtype of the written tensors")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output-dir")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        arch = megatron_to_hf.convert(
            args.checkpoint,
            args.output_dir,
            hf_reference=args.hf_reference,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
        )
    except ValueError as error:
        raise SystemExit(f"convert_megatron_to_qwen2_hf: error: {error}") from None
    print(
        f"wrote {args.output_dir} ({arch.family}, {arch.num_layers} layers, max_position_embeddings "
        f"{arch.max_position_embeddings}, rope_theta {arch.rotary_base}"
        f"{f', YaRN x{arch.yarn_factor}' if arch.yarn_factor else ''}); load it with "
        "transformers.AutoModelForCausalLM.from_pretrained"
    )


if __name__ == "__main__":
    main()
