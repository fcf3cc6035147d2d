"""Qwen2/Qwen2.5 and dense Qwen3 checkpoints, Hugging Face ⇄ Megatron-Core ``torch_dist`` (DESIGN.md §4).

* :mod:`.architecture` — :class:`~.architecture.QwenArchitecture` (HF config ⇄ Megatron flags and args)
  and the model-args file the example scripts source.
* :mod:`.tensor_map` — every checkpoint tensor, its Hugging Face sources and the QKV/gate-up conversions.
* :mod:`.checkpoint_dir` — the directories read and written: HF ``config.json``, checkpoint root, staged output.
* :mod:`.single_process` — Megatron's ``dist_checkpointing`` in one CPU process.
* :mod:`.hf_checkpoint` — reading and checking a Hugging Face model directory.
* :mod:`.megatron_checkpoint` — reading a ``torch_dist`` checkpoint's args and tensors.
* :mod:`.hf_to_megatron`, :mod:`.megatron_to_hf` — the two conversions (``convert``), called by
  ``tools/convert_qwen2_hf_to_megatron.py`` and ``tools/convert_megatron_to_qwen2_hf.py``.
"""
