"""Convert a Hugging Face Qwen2/Qwen2.5 or dense Qwen3 checkpoint into a Megatron-Core ``torch_dist`` checkpoint
(DESIGN.md §4).

    python tools/convert_qwen2_hf_to_megatron.py --hf-dir Qwen2.5-3B --output-dir checkpoints/qwen2.5-3b-mcore

Runs on a CPU-only machine or on a GPU node alike (it uses no GPU). The output directory holds

* ``latest_checkpointed_iteration.txt`` (``release``) and ``release/``, the ``torch_dist`` checkpoint.
  Megatron reshards it at load, so any TP/PP loads it: ``--pretrained-checkpoint <output-dir>`` (or
  ``--load <output-dir> --finetune --no-load-optim --no-load-rng``). Its ``args`` reproduce the model.
* ``megatron_model_args.sh``, the matching Megatron model flags as a bash array ``MODEL_ARGS`` that the
  example scripts source (the tokenizer is ``--hf-dir``). Qwen2 gets ``--add-qkv-bias``; Qwen3
  (``model_type: qwen3``) gets ``--qk-layernorm`` (its per-head q/k RMSNorm) and ``--kv-channels`` from
  its ``head_dim``. Qwen2/Qwen3 MoE and other model types are refused.

Context extension changes RoPE only (no weights): ``--rotary-base`` sets a new base θ (ABF), or
``--yarn-factor F`` selects Megatron's YaRN with the original length ``--yarn-original-max-position-embeddings``
(default: the model's ``max_position_embeddings``). Both go into the args file and the checkpoint's args.

Every input is checked first (paths, config.json, architecture, tensor names/shapes/dtypes, output
directory, options); only then are tensors read one at a time from the safetensors files, converted
(per-query-group QKV interleave, gate/up concatenation) and staged each in its own memory-mapped file
inside the output's temporary directory, so the process holds about one tensor in anonymous memory.
The output appears only complete (temporary directory renamed at the end).

Megatron's ``torch_dist`` writer runs in a one-process gloo group. Without CUDA,
``megatron_mtraining.conversion.single_process.torch_dist_writer_on_cpu`` keeps its few CUDA calls on the
CPU for the duration of the save.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_mtraining.conversion import hf_to_megatron
from megatron_mtraining.conversion.architecture import DTYPES, MODEL_ARGS_FILE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--hf-dir",
        required=True,
        type=Path,
        help="Hugging Face model directory (config.json, *.safetensors, tokenizer files)",
    )
    parser.add_argument("--output-dir", required=True, type=Path, help="checkpoint root to create")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="dtype of the written tensors")
    parser.add_argument(
        "--rotary-base",
        type=int,
        default=None,
        help="new RoPE base θ for context extension (e.g. 10000000); default: the model's",
    )
    parser.add_argument(
        "--yarn-factor", type=float, default=None, help="use YaRN with this factor (target length / original length)"
    )
    parser.add_argument(
        "--yarn-original-max-position-embeddings",
        type=int,
        default=None,
        help="YaRN's original length (default: the model's max_position_embeddings)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output-dir")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        arch = hf_to_megatron.convert(
            args.hf_dir,
            args.output_dir,
            dtype=args.dtype,
            rotary_base=args.rotary_base,
            yarn_factor=args.yarn_factor,
            yarn_original_max_position_embeddings=args.yarn_original_max_position_embeddings,
            overwrite=args.overwrite,
        )
    except ValueError as error:
        raise SystemExit(f"convert_qwen2_hf_to_megatron: error: {error}") from None
    print(
        f"wrote {args.output_dir} ({arch.family}, {arch.num_layers} layers, hidden {arch.hidden_size}, vocab "
        f"{arch.vocab_size}, {'tied' if arch.tie_embeddings else 'untied'} embeddings). Train with:\n"
        f"  source {args.output_dir / MODEL_ARGS_FILE}\n"
        f'  ... -m megatron_mtraining.pretrain "${{MODEL_ARGS[@]}}" --pretrained-checkpoint {args.output_dir} ...'
    )


if __name__ == "__main__":
    main()
