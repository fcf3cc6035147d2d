"""One table of invalid configurations across the project.

Each row calls a real entry point (index conversion, a backend's step launcher, the ring, the estimator,
the attention module and layer spec, the launcher's argument validation, the converters, the data
preprocessing) with one thing wrong, and states the exact exception type and a regex that must find
both the offending value and the fix in the message. Rows already tested next to their module are
repeated on purpose: the table is the one place to audit what is rejected and how.

The ring rows run on a one-rank gloo group (their checks come before any transfer); what happens
when only some ranks of a larger group are wrong is tests/distributed/test_no_hang.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Callable, NamedTuple

import pytest
import torch
from tool_modules import load_tool

from megatron_mtraining.conversion import hf_to_megatron, megatron_to_hf
from megatron_mtraining.conversion.single_process import single_process_group
from mtraining_kernels import sdpa_backend, torch_backend
from mtraining_kernels.index import convert_index
from mtraining_kernels.interface import get_backend, sparse_attention
from mtraining_kernels.layout import Layout
from mtraining_kernels.vertical_slash import full_index

preprocess_data = load_tool("preprocess_data")

SEQ_LEN, HEADS, KV_HEADS, DIM = 256, 2, 1, 64
LAUNCHER_BASE = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 1024 "
    "--max-position-embeddings 1024 --micro-batch-size 1 --mtraining-backend torch"
)


class Invalid(NamedTuple):
    """One invalid configuration: ``call(tmp_path)`` must raise exactly ``error`` matching ``message``."""

    name: str
    call: Callable[[Path], object]
    error: type[BaseException]
    message: str  # regex (re.S); must cover the offending value and the fix


# ------------------------------------------------------------------------------------------ kernels
def _index(v_idx=None, s_idx=None, layout=Layout("contiguous", 1), rank=0, seq_len=SEQ_LEN):
    """``convert_index`` with the full pattern unless an index is given."""
    full_v, full_s = full_index(1, HEADS, SEQ_LEN)
    return convert_index(full_v if v_idx is None else v_idx, full_s if s_idx is None else s_idx, layout, rank, seq_len)


def _step_arguments(dtype=torch.float32, dim=DIM, heads=HEADS, kv_heads=KV_HEADS, **replaced):
    """Valid keyword arguments of one ``block_bar_forward`` call (W = 1, full pattern, fp32 out/lse), some replaced."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, SEQ_LEN, heads, dim, generator=gen).to(dtype)
    k, v = (torch.randn(1, SEQ_LEN, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    index = convert_index(*full_index(1, heads, SEQ_LEN), Layout("contiguous", 1), 0, SEQ_LEN)
    arguments = dict(
        q=q,
        k=k,
        v=v,
        blk_ptr=index.blk_ptr[0],
        blk_col=index.blk_col,
        bar_ptr=index.bar_ptr[0],
        bar_col=index.bar_col,
        out=torch.zeros(q.shape),
        lse=torch.full((1, heads, SEQ_LEN), float("-inf")),
        causal_diag=True,
        softmax_scale=dim**-0.5,
    )
    arguments.update(replaced)
    return arguments


@contextmanager
def _triton_interpreter():
    """TRITON_INTERPRET=1 for the call, so the Triton backend's checks reach past its device check on a CPU."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def _triton_forward(**replaced):
    from mtraining_kernels import triton_backend

    with _triton_interpreter():
        triton_backend.block_bar_forward(**_step_arguments(dtype=torch.float16, **replaced))


def _unsorted_verticals():
    return torch.tensor([[[40, 10, SEQ_LEN]] * HEADS], dtype=torch.int32)


# ------------------------------------------------------------------------------------------ ring
def _ring(index_layout: Layout, index_rank: int, index_seq_len: int, grad_wire_dtype: str = "fp32"):
    """``ring_attention`` on a one-rank world with an index built for the given layout/rank/length."""
    import torch.distributed as dist

    from megatron_mtraining.ring.groups import RingGroups
    from megatron_mtraining.ring.sparse_ring import ring_attention

    q, k, v = (_step_arguments()[name] for name in ("q", "k", "v"))
    v_idx, s_idx = full_index(1, HEADS, index_seq_len)
    index = convert_index(v_idx, s_idx, index_layout, index_rank, index_seq_len)
    with single_process_group():
        ring_attention(
            q,
            k,
            v,
            index,
            RingGroups.flat(dist.group.WORLD),
            backend="torch_blocksparse",
            grad_wire_dtype=grad_wire_dtype,
        )


def _dense_ring(layout: Layout = Layout("zigzag", 1), hierarchical: bool = False):
    """``dense_ring_attention`` on a one-rank world (flat, or a hierarchical ring of 1 x 1)."""
    import torch.distributed as dist

    from megatron_mtraining.ring.dense_ring import dense_ring_attention
    from megatron_mtraining.ring.groups import RingGroups, build_hierarchical_groups

    q, k, v = (_step_arguments()[name] for name in ("q", "k", "v"))
    with single_process_group():
        groups = build_hierarchical_groups(1) if hierarchical else RingGroups.flat(dist.group.WORLD)
        dense_ring_attention(q, k, v, layout, groups, impl="flash")


def _sdpa_forward(impl: str = "flash", **replaced):
    arguments = _step_arguments(**replaced)
    sdpa_backend.attention_forward(
        arguments["q"], arguments["k"], arguments["v"], causal=True, softmax_scale=arguments["softmax_scale"], impl=impl
    )


def _hierarchical_groups(inner_size: int):
    from megatron_mtraining.ring.groups import build_hierarchical_groups

    with single_process_group():
        build_hierarchical_groups(inner_size)


# ------------------------------------------------------------------------------------------ estimator
def _estimate(budget=None, last_q: int = 64):
    from mtraining_kernels.budget import StaticBudget
    from mtraining_kernels.estimation import estimate_vertical_slash

    arguments = _step_arguments()
    estimate_vertical_slash(
        arguments["q"], arguments["k"], StaticBudget(64, 128) if budget is None else budget, last_q=last_q
    )


def _static_budget(v_size: int, s_size: int):
    from mtraining_kernels.budget import StaticBudget

    return StaticBudget(v_size, s_size)


# ------------------------------------------------------------------------------------------ attention
def _transformer_config(**changed):
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    settings.update(changed)
    return TransformerConfig(**settings)


def _attention(attn_mask_type=None, **config_changes):
    """``MTrainingAttention`` as Megatron's ``SelfAttention`` builds it, CP = TP = 1 (no process groups)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mtraining.attention import MTrainingAttention
    from megatron_mtraining.config import MTrainingConfig

    return MTrainingAttention(
        config=_transformer_config(**config_changes),
        layer_number=1,
        attn_mask_type=AttnMaskType.causal if attn_mask_type is None else attn_mask_type,
        attention_type="self",
        pg_collection=ProcessGroupCollection(tp=None, cp=None, hcp=None),
        mtraining=MTrainingConfig(backend="torch"),
    )


def _attention_call(**extra):
    query = torch.zeros(SEQ_LEN, 1, 4, 16)
    key_value = torch.zeros(SEQ_LEN, 1, 2, 16)
    return _attention()(query, key_value, key_value, extra.pop("attention_mask", None), **extra)


def _packed_sequence_call():
    from megatron.core.packed_seq_params import PackedSeqParams

    return _attention_call(packed_seq_params=PackedSeqParams(qkv_format="thd"))


def _packed_call_with_another_cp_layout():
    from megatron_mtraining.attention import PackedDocuments
    from mtraining_kernels.documents import Documents
    from mtraining_kernels.layout import Layout

    turns = (1,) * (SEQ_LEN // (2 * 128))
    packed = PackedDocuments(Documents.single(1, SEQ_LEN), Layout("skewed", 2, turns=turns))
    return _attention_call(packed_seq_params=packed)


def _padding_mask_attention():
    from megatron.core.transformer.enums import AttnMaskType

    return _attention(attn_mask_type=AttnMaskType.padding)


def _spec_with_mla():
    from megatron_mtraining.spec import get_gpt_layer_mtraining_spec

    return get_gpt_layer_mtraining_spec(argparse.Namespace(multi_latent_attention=True))


def _mtraining_config(**settings):
    from megatron_mtraining.config import MTrainingConfig

    return MTrainingConfig(**settings)


# ------------------------------------------------------------------------------------------ launcher
@lru_cache(maxsize=1)
def _launcher_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    from megatron_mtraining.arguments import add_mtraining_args

    parser = argparse.ArgumentParser(allow_abbrev=False)  # as Megatron's parse_args builds it
    add_megatron_arguments(parser)
    return add_mtraining_args(parser)


def _launcher(extra: str, cp: int = 2):
    from megatron_mtraining.arguments import validate_mtraining_args

    return validate_mtraining_args(
        _launcher_parser().parse_args(f"{LAUNCHER_BASE} --context-parallel-size {cp} {extra}".split())
    )


def _launcher_parse(extra: str):
    """Megatron's parser on ``extra``, raising ``argparse.ArgumentError`` where argparse would print and exit."""
    parser = _launcher_parser()
    parser.exit_on_error = False
    try:
        return parser.parse_args(f"{LAUNCHER_BASE} {extra}".split())
    finally:
        parser.exit_on_error = True


# ------------------------------------------------------------------------------------------ tools
def _hf_directory(tmp: Path, config_text: str) -> Path:
    directory = tmp / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(config_text)
    return directory


def _llama_config() -> str:
    return json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64})


def _word_level_tokenizer(tmp: Path) -> preprocess_data.TokenizerSource:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    folder = tmp / "tokenizer"
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "<eod>": 1}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eod>").save_pretrained(folder)
    return preprocess_data.TokenizerSource("HuggingFaceTokenizer", folder)


def _preprocess(tmp: Path, name: str, content: bytes):
    path = tmp / name
    path.write_bytes(content)
    return preprocess_data.preprocess([path], _word_level_tokenizer(tmp), tmp / "out" / "data")


# ------------------------------------------------------------------------------------------ the table
ROWS = [
    # --- kernels: index conversion
    Invalid(
        "index: slash offset past N",
        lambda tmp: _index(s_idx=torch.tensor([[[0, SEQ_LEN + 5]] * HEADS], dtype=torch.int32)),
        ValueError,
        r"s_idx holds values outside \[0, 256\] .*max 261.*unused slots hold the sentinel N=256",
    ),
    Invalid(
        "index: verticals not ascending",
        lambda tmp: _index(v_idx=_unsorted_verticals()),
        ValueError,
        r"v_idx valid entries must be ascending and distinct.*sort and deduplicate the index",
    ),
    Invalid(
        "index: float index",
        lambda tmp: _index(v_idx=torch.zeros(1, HEADS, 1)),
        ValueError,
        r"v_idx has dtype torch\.float32; use torch\.int32",
    ),
    Invalid(
        "index: v_idx/s_idx disagree on heads",
        lambda tmp: _index(v_idx=torch.full((1, HEADS + 1, 1), SEQ_LEN, dtype=torch.int32)),
        ValueError,
        r"v_idx \(1, 3, 1\) and s_idx \(1, 2, 256\) disagree on \[b, Hq\]",
    ),
    Invalid(
        "index: length the layout cannot split",
        lambda tmp: _index(layout=Layout("striped", 2), seq_len=1000),
        ValueError,
        r"seq_len=1000 is not divisible by 256 .*striped.*world_size=2.*use 768 or 1024",
    ),
    Invalid(
        "index: rank outside the layout",
        lambda tmp: _index(layout=Layout("striped", 2), rank=2, seq_len=512),
        ValueError,
        r"rank=2 is outside \[0, 2\) for world_size=2",
    ),
    Invalid(
        "layout: stripe granularity not a power of two",
        lambda tmp: Layout("striped", 2, 96),
        ValueError,
        r"granularity=96 must be a power of two >= 16 \(the default is 128\)",
    ),
    # --- kernels: launchers
    Invalid(
        "torch backend: q length not whole blocks",
        lambda tmp: torch_backend.block_bar_forward(**_step_arguments(q=torch.zeros(1, 200, HEADS, DIM))),
        ValueError,
        r"q length 200 must be a positive multiple of the block size 128",
    ),
    Invalid(
        "torch backend: GQA heads not divisible",
        lambda tmp: torch_backend.block_bar_forward(**_step_arguments(heads=3, kv_heads=2)),
        ValueError,
        r"query heads 3 must be a multiple of KV heads 2",
    ),
    Invalid(
        "torch backend: integer inputs",
        lambda tmp: torch_backend.block_bar_forward(**_step_arguments(dtype=torch.int32)),
        ValueError,
        r"q has dtype torch\.int32; use one of \(torch\.bfloat16, torch\.float16, torch\.float32",
    ),
    Invalid(
        "torch backend: lse buffer of another length",
        lambda tmp: torch_backend.block_bar_forward(**_step_arguments(lse=torch.zeros(1, HEADS, 128))),
        ValueError,
        r"lse must have shape \(1, 2, 256\) \(the running lse \[b, Hq, Nq\]\), got \(1, 2, 128\)",
    ),
    Invalid(
        "torch backend: int64 work lists",
        lambda tmp: torch_backend.block_bar_forward(**_step_arguments(blk_ptr=_index().blk_ptr[0].long())),
        ValueError,
        r"blk_ptr must be an int32 tensor \[b, Hq, nb\+1\].*got torch\.int64",
    ),
    Invalid(
        "torch backend: zero softmax scale",
        lambda tmp: torch_backend.block_bar_forward(**_step_arguments(softmax_scale=0.0)),
        ValueError,
        r"softmax_scale=0\.0 must be a finite positive number \(usually head_dim \*\* -0\.5\)",
    ),
    Invalid(
        "triton backend: fp32 inputs",
        lambda tmp: _triton_forward(q=torch.zeros(1, SEQ_LEN, HEADS, DIM)),
        ValueError,
        r"q has dtype torch\.float32; the triton backend takes.*use backend='torch_blocksparse'",
    ),
    Invalid(
        "triton backend: head dim 96",
        lambda tmp: _triton_forward(dim=96),
        ValueError,
        r"q head dim 96 is unsupported by the triton backend; use one of \(64, 128\)",
    ),
    Invalid(
        "backend name",
        lambda tmp: get_backend("cuda"),
        ValueError,
        r"backend='cuda' is unknown; use one of \['torch_blocksparse', 'triton'\]",
    ),
    Invalid(
        "single-device attention with a ring index",
        lambda tmp: sparse_attention(
            *(_step_arguments()[n] for n in "qkv"), _index(layout=Layout("striped", 2), seq_len=512)
        ),
        ValueError,
        r"index was built for world_size=2; .*build it with Layout\(kind, 1\) and rank 0",
    ),
    Invalid(
        "sdpa backend: cuDNN on CPU tensors",
        lambda tmp: _sdpa_forward("cudnn"),
        ValueError,
        r"impl='cudnn' needs CUDA tensors, got CPU tensors; move them to a GPU or use impl='flash'",
    ),
    Invalid(
        "sdpa backend: unknown impl",
        lambda tmp: _sdpa_forward("math"),
        ValueError,
        r"impl='math' is unknown; use one of \('cudnn', 'flash'\)",
    ),
    Invalid(
        "sdpa backend: integer inputs",
        lambda tmp: _sdpa_forward(dtype=torch.int32),
        ValueError,
        r"q has dtype torch\.int32; on CPU use one of \(torch\.float32",
    ),
    # --- ring
    Invalid(
        "ring: index for another rank and world",
        lambda tmp: _ring(Layout("striped", 2), 1, 2 * SEQ_LEN),
        ValueError,
        r"index was built for world_size=2, rank=1 but this is CP rank 0 of 1; "
        r"build it with this rank's layout",
    ),
    Invalid(
        "ring: index for another length",
        lambda tmp: _ring(Layout("striped", 1), 0, 2 * SEQ_LEN),
        ValueError,
        r"index was built for seq_len=512, inputs have 256 x 1 tokens; convert the index for N=256",
    ),
    Invalid(
        "ring: unknown dK/dV wire dtype",
        lambda tmp: _ring(Layout("striped", 1), 0, SEQ_LEN, "fp16"),
        ValueError,
        r"grad_wire_dtype='fp16' is not one of \['bf16', 'fp32'\]",
    ),
    Invalid(
        "ring: SDPA dense ring on the striped layout",
        lambda tmp: _dense_ring(Layout("striped", 1)),
        ValueError,
        r"the SDPA dense ring needs the zigzag layout, got Layout\(kind='striped'.*; use "
        r"Layout\('zigzag', world_size\)",
    ),
    Invalid(
        "ring: SDPA dense ring on a hierarchical ring",
        lambda tmp: _dense_ring(hierarchical=True),
        ValueError,
        r"the SDPA dense ring is flat only, got RingGroups with an outer ring \(a hierarchical ring\); "
        r"pass flat RingGroups \(outer=None\)",
    ),
    Invalid(
        "ring: inner ring size does not divide the CP group",
        lambda tmp: _hierarchical_groups(3),
        ValueError,
        r"inner_size=3 does not divide the CP size 1; pick a divisor",
    ),
    # --- estimator and budgets
    Invalid(
        "estimator: last_q beyond one tile",
        lambda tmp: _estimate(last_q=65),
        ValueError,
        r"last_q=65 must be an integer in \[1, 64\]",
    ),
    Invalid(
        "estimator: vertical budget below the forced sinks",
        lambda tmp: _estimate(_static_budget(8, 128)),
        ValueError,
        r"v_size=8 is smaller than the 30 forced sink columns.*use v_size >= 30",
    ),
    Invalid(
        "estimator: budget longer than the sequence",
        lambda tmp: _estimate(_static_budget(64, 4096)),
        ValueError,
        r"s_size=4096 is larger than the sequence \(seq_len=256\); use s_size <= 256",
    ),
    # --- spec and attention module
    Invalid(
        "attention: dropout",
        lambda tmp: _attention(attention_dropout=0.1),
        ValueError,
        r"attention_dropout=0\.1; set --attention-dropout 0",
    ),
    Invalid(
        "attention: padding mask type",
        lambda tmp: _padding_mask_attention(),
        ValueError,
        r"causal only, got attn_mask_type=AttnMaskType\.padding; use AttnMaskType\.causal",
    ),
    Invalid(
        "attention: mask tensor passed in",
        lambda tmp: _attention_call(attention_mask=torch.ones(1, 1, SEQ_LEN, SEQ_LEN, dtype=torch.bool)),
        ValueError,
        r"takes no attention_mask, got a tensor of shape \(1, 1, 256, 256\).*"
        r"--no-create-attention-mask-in-dataloader",
    ),
    Invalid(
        "attention: packed sequences",
        lambda tmp: _packed_sequence_call(),
        ValueError,
        r"does not support packed sequences as PackedSeqParams.*PackedDocuments.*train on unpacked sequences",
    ),
    Invalid(
        "attention: a micro-batch layout planned for another CP size",
        lambda tmp: _packed_call_with_another_cp_layout(),
        ValueError,
        r"the micro-batch's layout Layout\(kind='skewed', world_size=2, .*turns=<.*\) is not a skewed layout of the 1 "
        r"CP ranks; plan its turns with megatron_mtraining.turn_plan for the CP size",
    ),
    Invalid(
        "spec: multi-latent attention",
        lambda tmp: _spec_with_mla(),
        ValueError,
        r"multi-latent attention \(MLA\) is not supported, drop --multi-latent-attention",
    ),
    Invalid(
        "config: top-P outside (0, 1]",
        lambda tmp: _mtraining_config(top_p=1.5),
        ValueError,
        r"--mtraining-top-p=1\.5 must be a number in \(0, 1\]; use e\.g\. 0\.9",
    ),
    Invalid(
        "config: SDPA dense implementation without --mtraining-dense",
        lambda tmp: _mtraining_config(dense_impl="sdpa_flash"),
        ValueError,
        r"--mtraining-dense-impl=sdpa_flash sets how --mtraining-dense runs its layers, but "
        r"--mtraining-dense is not set; add --mtraining-dense, or drop --mtraining-dense-impl",
    ),
    # --- launcher (Megatron's parser + --mtraining-* flags)
    Invalid(
        "launcher: static budget with top-P settings",
        lambda tmp: _launcher("--mtraining-budget static --mtraining-top-p 0.9 --mtraining-sparsity 0.9"),
        ValueError,
        r"--mtraining-budget=static does not take the top-P settings --mtraining-top-p; drop them "
        r"or add --mtraining-budget top-p",
    ),
    Invalid(
        "launcher: --attention-backend local with CP = 2",
        lambda tmp: _launcher("--attention-backend local"),
        ValueError,
        r"--attention-backend local replaces every custom core attention.*drop it",
    ),
    Invalid(
        "launcher: sequence not divisible by CP x stripe",
        lambda tmp: _launcher("--seq-length 1000 --max-position-embeddings 1000"),
        ValueError,
        r"--seq-length=1000 is not divisible by 256.*use --seq-length 768 or 1024",
    ),
    Invalid(
        "launcher: hierarchical sizes do not multiply to CP",
        lambda tmp: _launcher("--mtraining-ring hierarchical --hierarchical-context-parallel-sizes 2 3", cp=4),
        ValueError,
        r"--hierarchical-context-parallel-sizes 2 3 multiply to 6, not --context-parallel-size=4; "
        r"choose sizes whose product is the CP size",
    ),
    Invalid(
        "launcher: inner ring size does not divide CP",
        lambda tmp: _launcher("--mtraining-ring hierarchical --mtraining-inner-ring-size 3", cp=4),
        ValueError,
        r"--mtraining-inner-ring-size=3 does not divide --context-parallel-size=4; use one of "
        r"\[1, 2, 4\]",
    ),
    Invalid(
        "launcher: unsupported --cp-comm-type",
        lambda tmp: _launcher("--cp-comm-type a2a"),
        ValueError,
        r"--cp-comm-type a2a is not supported by MTraining's ring.*use p2p",
    ),
    Invalid(
        "launcher: SDPA dense implementation without --mtraining-dense",
        lambda tmp: _launcher("--mtraining-dense-impl sdpa_cudnn --mtraining-layout zigzag"),
        ValueError,
        r"--mtraining-dense-impl=sdpa_cudnn sets how --mtraining-dense runs its layers, but "
        r"--mtraining-dense is not set; add --mtraining-dense, or drop --mtraining-dense-impl for "
        r"sparse attention",
    ),
    Invalid(
        "launcher: SDPA dense implementation with the striped layout at CP = 2",
        lambda tmp: _launcher("--mtraining-dense-impl sdpa_cudnn --mtraining-dense"),
        ValueError,
        r"--mtraining-dense-impl=sdpa_cudnn with --context-parallel-size=2 runs the zigzag dense "
        r"ring, but --mtraining-layout=striped; add --mtraining-layout zigzag",
    ),
    Invalid(
        "launcher: SDPA dense implementation with the hierarchical ring",
        lambda tmp: _launcher(
            "--mtraining-dense-impl sdpa_flash --mtraining-dense --mtraining-layout zigzag "
            "--mtraining-ring hierarchical --mtraining-inner-ring-size 2",
            cp=4,
        ),
        ValueError,
        r"--mtraining-dense-impl=sdpa_flash runs the flat ring only, but a hierarchical ring was "
        r"requested \(--mtraining-ring=hierarchical or --hierarchical-context-parallel-sizes\); "
        r"use --mtraining-ring flat and drop the hierarchical sizes",
    ),
    Invalid(
        "launcher: SDPA dense implementation with --hierarchical-context-parallel-sizes",
        lambda tmp: _launcher(
            "--mtraining-dense-impl sdpa_cudnn --mtraining-dense --mtraining-layout zigzag "
            "--hierarchical-context-parallel-sizes 2 2",
            cp=4,
        ),
        ValueError,
        r"--mtraining-dense-impl=sdpa_cudnn runs the flat ring only.*use --mtraining-ring flat and "
        r"drop the hierarchical sizes",
    ),
    Invalid(
        "launcher: SDPA dense implementation with --deterministic-mode",
        lambda tmp: _launcher(
            "--mtraining-dense-impl sdpa_cudnn --mtraining-dense --mtraining-layout zigzag --deterministic-mode"
        ),
        ValueError,
        r"--mtraining-dense-impl=sdpa_cudnn cannot promise a bitwise-reproducible backward "
        r"\(--mtraining-deterministic, also implied by --deterministic-mode\); drop it or use "
        r"--mtraining-dense-impl mtraining",
    ),
    Invalid(
        "launcher: the removed --mtraining-kernel",
        lambda tmp: _launcher_parse("--mtraining-kernel sdpa_flash"),
        argparse.ArgumentError,
        r"argument --mtraining-kernel: removed: split into --mtraining-backend .* and "
        r"--mtraining-dense-impl .*; replace --mtraining-kernel sdpa_flash with "
        r"--mtraining-dense-impl sdpa_flash \(with --mtraining-dense\)",
    ),
    # --- tools
    Invalid(
        "converter: not a Qwen2 or Qwen3 config",
        lambda tmp: hf_to_megatron.convert(_hf_directory(tmp, _llama_config()), tmp / "out"),
        ValueError,
        r"model_type='llama' \(architectures=\['LlamaForCausalLM'\]\) is not supported; this "
        r"converter maps Qwen2/Qwen2\.5 .* and dense Qwen3 \(model_type 'qwen3', Qwen3ForCausalLM\) "
        r"checkpoints only",
    ),
    Invalid(
        "converter: config.json is not JSON",
        lambda tmp: hf_to_megatron.convert(_hf_directory(tmp, "{not json"), tmp / "out"),
        ValueError,
        r"config\.json is not valid JSON .*; re-download it",
    ),
    Invalid(
        "converter back to HF: unknown dtype",
        lambda tmp: megatron_to_hf.convert(tmp, tmp / "out", dtype="fp8"),
        ValueError,
        r"--dtype 'fp8' is not supported; use one of bf16, fp32",
    ),
    Invalid(
        "preprocess: empty input",
        lambda tmp: _preprocess(tmp, "empty.jsonl", b""),
        ValueError,
        r"--input \S*empty\.jsonl is empty; drop it from --input",
    ),
    Invalid(
        "preprocess: input not UTF-8",
        lambda tmp: _preprocess(tmp, "latin1.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n'),
        ValueError,
        r"latin1\.jsonl:2: not valid UTF-8 \(byte 30\); re-encode the file as UTF-8",
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_invalid_configuration_is_rejected_with_value_and_fix(row: Invalid, tmp_path):
    with pytest.raises(Exception) as caught:
        row.call(tmp_path)
    assert caught.type is row.error, f"{row.name}: raised {caught.type.__name__}: {caught.value}"
    assert re.search(row.message, str(caught.value), re.S), (
        f"{row.name}: message does not match {row.message!r}:\n{caught.value}"
    )


def test_table_covers_every_area():
    """At least 20 rows, and every area the issue names has some."""
    areas = (
        "index",
        "torch backend",
        "triton backend",
        "ring",
        "estimator",
        "attention",
        "spec",
        "launcher",
        "converter",
        "preprocess",
    )
    assert len(ROWS) >= 20
    missing = [area for area in areas if not any(row.name.startswith(area) for row in ROWS)]
    assert not missing, f"no rows for {missing}"
    assert len({row.name for row in ROWS}) == len(ROWS), "row names must be unique (they are the test ids)"
