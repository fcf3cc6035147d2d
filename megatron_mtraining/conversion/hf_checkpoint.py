"""Reading and checking a Hugging Face Qwen2/Qwen3 model directory before any tensor is converted.

The directory holds ``config.json`` and the weights as ``*.safetensors`` (one file, or shards listed by
``model.safetensors.index.json``); every tensor name, shape and dtype that the config implies is checked
from the safetensors headers.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .architecture import QwenArchitecture
from .checkpoint_dir import SAFETENSORS_INDEX, read_hf_config
from .tensor_map import LM_HEAD, expected_hf_shapes

FLOAT_DTYPES = ("F32", "BF16", "F16")
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)  # non-persistent buffers some old exports contain


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
            raise ValueError(
                f"--hf-dir {self.hf_dir} has no *.safetensors files (pytorch_model.bin is not read; "
                "re-save the model with save_pretrained(..., safe_serialization=True))"
            )
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
            raise ValueError(
                f"{self.hf_dir}: {len(missing)} tensors that config.json implies are missing, e.g. "
                f"{', '.join(missing[:3])}"
                + ("; an untied model (tie_word_embeddings=false) needs lm_head.weight" if LM_HEAD in missing else "")
            )
        unexpected = sorted(present - set(expected) - {LM_HEAD})
        if unexpected:
            listed = ", ".join(unexpected[:3]) + (" …" if len(unexpected) > 3 else "")
            has_qk_norms = any(
                name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")) for name in unexpected
            )
            hint = "; q_norm/k_norm are Qwen3's: is model_type 'qwen3'?" if has_qk_norms else ""
            raise ValueError(
                f"{self.hf_dir}: tensors that a {self.arch.family} model of this config does not have: "
                f"{listed} (is num_hidden_layers right?{hint})"
            )
        for name, shape in expected.items():
            tensor_slice = self._files[self._owner[name]].get_slice(name)
            found = tuple(tensor_slice.get_shape())
            if found != shape:
                raise ValueError(
                    f"{name} has shape {list(found)} but config.json (hidden_size "
                    f"{self.arch.hidden_size}, vocab_size {self.arch.vocab_size}, intermediate_size "
                    f"{self.arch.ffn_hidden_size}, heads {self.arch.num_attention_heads}/"
                    f"{self.arch.num_query_groups}, head dim {self.arch.kv_channels}) implies "
                    f"{list(shape)}; the config does not match the weights"
                )
            if tensor_slice.get_dtype() not in FLOAT_DTYPES:
                raise ValueError(f"{name} has dtype {tensor_slice.get_dtype()}; expected one of {FLOAT_DTYPES}")
        if self.arch.tie_embeddings and LM_HEAD in present:
            if not torch.equal(self.tensor(LM_HEAD), self.tensor("model.embed_tokens.weight")):
                raise ValueError(
                    f"{self.hf_dir}: config.json ties the embeddings (tie_word_embeddings=true) but "
                    "lm_head.weight differs from model.embed_tokens.weight; fix tie_word_embeddings"
                )
