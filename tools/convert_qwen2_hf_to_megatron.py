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
:func:`torch_dist_writer_on_cpu` keeps its few CUDA calls on the CPU for the duration of the save.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import queue
import shutil
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator
from unittest import mock

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from qwen2_mapping import (DTYPES, EXTRA_STATE_KEYS, LM_HEAD, MODEL_ARGS_FILE, RELEASE_DIR, TRACKER_FILE,
                           QwenArchitecture, check_output_dir, conversion_steps, expected_hf_shapes, read_hf_config,
                           single_process_group, staged_output_dir, write_model_args)

SAFETENSORS_INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "BF16", "F16")
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)     # non-persistent buffers some old exports contain
CHECKPOINT_CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


class HFCheckpoint:
    """A checked Hugging Face Qwen2/Qwen3 directory: config, architecture and lazy tensor reads.

    Use as a context manager (it keeps the safetensors files open). Construction reads only
    ``config.json`` and the safetensors headers, plus the embedding and ``lm_head`` when a tied model
    carries an ``lm_head`` (they must be equal).
    """

    def __init__(self, hf_dir: Path):
        self.hf_dir = Path(hf_dir)
        self.config = read_hf_config(self.hf_dir, "--hf-dir")
        self.arch = QwenArchitecture.from_hf_config(self.config, str(self.hf_dir / "config.json"))
        self._stack = ExitStack()
        try:
            self._files = {path: self._open(path) for path in self._safetensors_files()}
            self._owner = self._tensor_owners()
            self._check_tensors()
        except BaseException:
            self._stack.close()
            raise

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def tensor(self, name: str) -> torch.Tensor:
        return self._files[self._owner[name]].get_tensor(name)

    def _safetensors_files(self) -> list[Path]:
        index = self.hf_dir / SAFETENSORS_INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as error:
                raise ValueError(f"{index} is not a safetensors index ({error!r}); re-download it") from None
            files = [self.hf_dir / name for name in sorted(set(weight_map.values()))]
            missing = [str(path) for path in files if not path.is_file()]
            if missing:
                raise ValueError(f"{index} lists shards that are missing: {', '.join(missing)}; re-download them")
            return files
        files = sorted(self.hf_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"--hf-dir {self.hf_dir} has no *.safetensors files (pytorch_model.bin is not read; "
                             "re-save the model with save_pretrained(..., safe_serialization=True))")
        return files

    def _open(self, path: Path):
        try:
            return self._stack.enter_context(safe_open(str(path), framework="pt"))
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{path} is not a readable safetensors file ({error}); re-download it") from None

    def _tensor_owners(self) -> dict[str, Path]:
        owners: dict[str, Path] = {}
        for path, handle in self._files.items():
            for name in handle.keys():
                if name in owners:
                    raise ValueError(f"tensor {name} is in both {owners[name]} and {path}; keep one copy")
                owners[name] = path
        return owners

    def _check_tensors(self) -> None:
        expected = expected_hf_shapes(self.arch)
        present = {name for name in self._owner if not name.endswith(IGNORED_HF_SUFFIXES)}
        missing = sorted(set(expected) - present)
        if missing:
            raise ValueError(f"{self.hf_dir}: {len(missing)} tensors that config.json implies are missing, e.g. "
                             f"{', '.join(missing[:3])}" + ("; an untied model (tie_word_embeddings=false) needs "
                                                            "lm_head.weight" if LM_HEAD in missing else ""))
        unexpected = sorted(present - set(expected) - {LM_HEAD})
        if unexpected:
            listed = ", ".join(unexpected[:3]) + (" …" if len(unexpected) > 3 else "")
            has_qk_norms = any(name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight"))
                               for name in unexpected)
            hint = "; q_norm/k_norm are Qwen3's: is model_type 'qwen3'?" if has_qk_norms else ""
            raise ValueError(f"{self.hf_dir}: tensors that a {self.arch.family} model of this config does not have: "
                             f"{listed} (is num_hidden_layers right?{hint})")
        for name, shape in expected.items():
            tensor_slice = self._files[self._owner[name]].get_slice(name)
            found = tuple(tensor_slice.get_shape())
            if found != shape:
                raise ValueError(f"{name} has shape {list(found)} but config.json (hidden_size "
                                 f"{self.arch.hidden_size}, vocab_size {self.arch.vocab_size}, intermediate_size "
                                 f"{self.arch.ffn_hidden_size}, heads {self.arch.num_attention_heads}/"
                                 f"{self.arch.num_query_groups}, head dim {self.arch.kv_channels}) implies "
                                 f"{list(shape)}; the config does not match the weights")
            if tensor_slice.get_dtype() not in FLOAT_DTYPES:
                raise ValueError(f"{name} has dtype {tensor_slice.get_dtype()}; expected one of {FLOAT_DTYPES}")
        if self.arch.tie_embeddings and LM_HEAD in present:
            if not torch.equal(self.tensor(LM_HEAD), self.tensor("model.embed_tokens.weight")):
                raise ValueError(f"{self.hf_dir}: config.json ties the embeddings (tie_word_embeddings=true) but "
                                 "lm_head.weight differs from model.embed_tokens.weight; fix tie_word_embeddings")


def extend_context(arch: QwenArchitecture, rotary_base: int | None = None, yarn_factor: float | None = None,
                   yarn_original_max_position_embeddings: int | None = None) -> QwenArchitecture:
    """``arch`` with a new RoPE base θ, or with YaRN (factor, original length; default the model's length)."""
    if rotary_base is not None and yarn_factor is not None:
        raise ValueError("--rotary-base and --yarn-factor are alternative context extensions; pass one of them")
    if yarn_original_max_position_embeddings is not None and yarn_factor is None:
        raise ValueError("--yarn-original-max-position-embeddings needs --yarn-factor")
    if rotary_base is not None:
        if rotary_base < 1:
            raise ValueError(f"--rotary-base {rotary_base} must be a positive integer, e.g. 10000000")
        return dataclasses.replace(arch, rotary_base=rotary_base)
    if yarn_factor is not None:
        if yarn_factor <= 1:
            raise ValueError(f"--yarn-factor {yarn_factor} must be > 1 (target length / original length, e.g. 16)")
        if yarn_original_max_position_embeddings is not None and yarn_original_max_position_embeddings < 1:
            raise ValueError(f"--yarn-original-max-position-embeddings {yarn_original_max_position_embeddings} must "
                             "be a positive integer, e.g. 32768")
        original = yarn_original_max_position_embeddings or arch.max_position_embeddings
        return dataclasses.replace(arch, yarn_factor=yarn_factor, yarn_original_max_position_embeddings=original)
    return arch


def checkpoint_args(model_flags: list[str], arch: QwenArchitecture) -> argparse.Namespace:
    """Megatron's parsed arguments for ``model_flags`` at TP = PP = 1: the ``args`` a Megatron loader reads."""
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    length = str(arch.max_position_embeddings)
    return parser.parse_args(model_flags + ["--seq-length", length, "--max-position-embeddings", length,
                                            "--ckpt-format", "torch_dist"])


def _sharded_state_dict(arch: QwenArchitecture, staged: dict[tuple[str, int | None], torch.Tensor]) -> dict:
    """The model's sharded state dict as GPTModel (TP = PP = 1) builds it: same keys, shapes and layer stacking."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    model = {}
    for (key, layer), data in staged.items():
        if layer is None:
            model[key] = ShardedTensor.from_rank_offsets(key, data, replica_id=0)
        else:
            model[f"{key}.{layer}"] = ShardedTensor.from_rank_offsets(key, data, (0, layer, arch.num_layers),
                                                                      replica_id=0, prepend_axis_num=1)
    for key in EXTRA_STATE_KEYS:
        for layer in range(arch.num_layers):
            model[f"{key}.{layer}"] = ShardedObject(key, None, (arch.num_layers,), (layer,), replica_id=0)
    return model


def _stage(directory: Path, index: int, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as ``dtype`` in a memory-mapped file of its own (file-backed, so it does not pin memory)."""
    staged = torch.from_file(str(directory / f"{index:05d}.bin"), shared=True, size=tensor.numel(), dtype=dtype)
    return staged.view(tensor.shape).copy_(tensor)


def convert(hf_dir: Path, output_dir: Path, *, dtype: str = "bf16", rotary_base: int | None = None,
            yarn_factor: float | None = None, yarn_original_max_position_embeddings: int | None = None,
            overwrite: bool = False) -> QwenArchitecture:
    """Write the ``torch_dist`` checkpoint and args file of ``hf_dir`` to ``output_dir``; return the architecture.

    Every input and option is checked before anything is written (``ValueError`` naming the problem).
    """
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    output_dir, hf_dir = Path(output_dir), Path(hf_dir).resolve()
    with HFCheckpoint(hf_dir) as hf:
        arch = extend_context(hf.arch, rotary_base, yarn_factor, yarn_original_max_position_embeddings)
        check_output_dir(output_dir, overwrite, {"--hf-dir": hf_dir})
        if importlib.util.find_spec("psutil") is None:
            raise ValueError("Megatron's torch_dist writer needs psutil (a dependency of this project); "
                             "pip install psutil")
        model_flags = arch.megatron_flags(str(hf_dir))
        args = checkpoint_args(model_flags, arch)
        with staged_output_dir(output_dir) as staging, single_process_group(), torch_dist_writer_on_cpu():
            staged = _convert_tensors(hf, arch, staging / ".staging", DTYPES[dtype])
            _save(arch, staged, args, staging / RELEASE_DIR)
            shutil.rmtree(staging / ".staging")
            (staging / TRACKER_FILE).write_text(RELEASE_DIR)
            write_model_args(staging / MODEL_ARGS_FILE, model_flags, str(hf_dir))
    return arch


@contextmanager
def torch_dist_writer_on_cpu() -> Iterator[None]:
    """Let Megatron's ``torch_dist`` writer save from this one-process gloo group without CUDA; restored on exit.

    With CUDA nothing is replaced. Without it, for the duration of the block: ``torch.cuda.current_device``
    → ``"cpu"`` (the writer broadcasts its failure flag as a tensor on the current device),
    ``torch.cuda.synchronize`` → no-op (called after the copy to host memory, where the tensors already
    are), and the write-results queue → an in-process ``queue.Queue`` (a synchronous save writes from
    threads of this process; the stock queue would start a ``multiprocessing`` manager process).
    """
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    with (mock.patch.object(torch.cuda, "current_device", lambda: "cpu"),
          mock.patch.object(torch.cuda, "synchronize", lambda device=None: None),
          mock.patch.object(filesystem_async, "_results_queue", queue.Queue())):
        yield


def _convert_tensors(hf: HFCheckpoint, arch: QwenArchitecture, staging: Path,
                     dtype: torch.dtype) -> dict[tuple[str, int | None], torch.Tensor]:
    staging.mkdir()
    staged = {}
    steps = conversion_steps(arch)
    with tqdm(total=sum(len(mappings) for _, mappings in steps), unit="tensor", desc="converting") as progress:
        for layer, mappings in steps:
            for mapping in mappings:
                tensor = mapping.to_megatron([hf.tensor(name) for name in mapping.hf_tensor_names(layer)], arch)
                staged[(mapping.key, layer)] = _stage(staging, len(staged), tensor, dtype)
                progress.update()
    return staged


def _save(arch: QwenArchitecture, staged: dict, args: argparse.Namespace, checkpoint_dir: Path) -> None:
    from megatron.core import dist_checkpointing

    checkpoint_dir.mkdir()
    print(f"writing the torch_dist checkpoint to {checkpoint_dir} ...", file=sys.stderr)
    state_dict = {"model": _sharded_state_dict(arch, staged), "args": args, "checkpoint_version": 3.0, "iteration": 0}
    dist_checkpointing.save(state_dict, str(checkpoint_dir), content_metadata=dict(CHECKPOINT_CONTENT_METADATA))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", required=True, type=Path,
                        help="Hugging Face model directory (config.json, *.safetensors, tokenizer files)")
    parser.add_argument("--output-dir", required=True, type=Path, help="checkpoint root to create")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="dtype of the written tensors")
    parser.add_argument("--rotary-base", type=int, default=None,
                        help="new RoPE base θ for context extension (e.g. 10000000); default: the model's")
    parser.add_argument("--yarn-factor", type=float, default=None,
                        help="use YaRN with this factor (target length / original length)")
    parser.add_argument("--yarn-original-max-position-embeddings", type=int, default=None,
                        help="YaRN's original length (default: the model's max_position_embeddings)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output-dir")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        arch = convert(args.hf_dir, args.output_dir, dtype=args.dtype, rotary_base=args.rotary_base,
                       yarn_factor=args.yarn_factor,
                       yarn_original_max_position_embeddings=args.yarn_original_max_position_embeddings,
                       overwrite=args.overwrite)
    except ValueError as error:
        raise SystemExit(f"convert_qwen2_hf_to_megatron: error: {error}") from None
    print(f"wrote {args.output_dir} ({arch.family}, {arch.num_layers} layers, hidden {arch.hidden_size}, vocab "
          f"{arch.vocab_size}, {'tied' if arch.tie_embeddings else 'untied'} embeddings). Train with:\n"
          f"  source {args.output_dir / MODEL_ARGS_FILE}\n"
          f"  ... -m megatron_mtraining.pretrain \"${{MODEL_ARGS[@]}}\" --pretrained-checkpoint {args.output_dir} ...")


if __name__ == "__main__":
    main()
