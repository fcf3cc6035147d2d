"""The launcher's packed-document path (DESIGN.md §2.7): flags, ``get_batch`` and the forward step.

* ``--reset-attention-mask`` is accepted with either backend and refused, naming the fix, with
  an SDPA dense impl, MTP or pipeline parallelism; ``--reset-position-ids`` needs unfused RoPE and
  one pipeline stage;
* ``get_batch`` derives the documents from the whole sequences' tokens on every CP rank, before the layout
  permutation, and the forward step hands them to the model as ``packed_seq_params``;
* ``--reset-position-ids`` gives the launcher's model per-token RoPE in every layout;
* ``--mtraining-plan-turns``: accepted only where it applies; ``get_batch`` then lays the micro-batch out by the
  turns planned for its documents and hands that layout to the attention with the documents.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_arguments import _parse, parser  # noqa: F401 - parser is a fixture

from megatron_mtraining import pretrain
from megatron_mtraining.arguments import validate_mtraining_args
from megatron_mtraining.attention import PackedDocuments
from megatron_mtraining.turn_plan import planned_layout
from mtraining_kernels.documents import Documents
from mtraining_kernels.layout import Layout

SEQ_LEN = 512
EOD = 0


def test_reset_attention_mask_is_accepted_with_both_backends(parser):  # noqa: F811
    documents = "--reset-attention-mask --reset-position-ids --no-rope-fusion --eod-mask-loss"
    for backend in ("torch", "triton"):
        for layout in ("striped", "zigzag", "contiguous"):
            flags = f"{documents} --mtraining-backend {backend} --mtraining-layout {layout}"
            config = validate_mtraining_args(_parse(parser, flags))
            assert (config.backend, config.layout) == (backend, layout)
    positions_only = "--reset-position-ids --no-rope-fusion --mtraining-backend triton"
    assert validate_mtraining_args(_parse(parser, positions_only)).backend == "triton"
    inter_document = "--dataloader-inter-document-masking --no-rope-fusion --mtraining-backend triton"
    assert validate_mtraining_args(_parse(parser, inter_document)).backend == "triton"


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            "--reset-attention-mask --mtraining-backend torch --mtraining-dense --mtraining-dense-impl sdpa_cudnn "
            "--mtraining-layout zigzag",
            "--mtraining-dense-impl=sdpa_cudnn does not have; use --mtraining-dense-impl mtraining",
        ),
        (
            "--reset-attention-mask --mtraining-backend torch --mtraining-layout zigzag --mtp-num-layers 1",
            "drop --mtp-num-layers or --reset-attention-mask",
        ),
        (
            "--reset-attention-mask --mtraining-backend torch --pipeline-model-parallel-size 2",
            "--reset-attention-mask need the micro-batch's tokens and position ids on every pipeline stage",
        ),
        (
            "--reset-position-ids --no-rope-fusion --pipeline-model-parallel-size 2",
            "use --pipeline-model-parallel-size 1",
        ),
        ("--reset-position-ids --position-embedding-type rope", "add --no-rope-fusion"),
        ("--dataloader-inter-document-masking --position-embedding-type rope", "add --no-rope-fusion"),
        (
            "--dataloader-inter-document-masking --no-rope-fusion --mtraining-dense --mtraining-dense-impl sdpa_cudnn "
            "--mtraining-layout zigzag",
            "--dataloader-inter-document-masking needs a document mask",
        ),
        (
            "--dataloader-inter-document-masking --no-rope-fusion --pipeline-model-parallel-size 2",
            "--dataloader-inter-document-masking need the micro-batch's tokens",
        ),
    ],
)
def test_document_flags_are_refused_where_unsupported(parser, extra, message):  # noqa: F811
    with pytest.raises(ValueError) as error:
        validate_mtraining_args(_parse(parser, extra))
    assert message in str(error.value), str(error.value)


def _tokens(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 64, (2, SEQ_LEN), generator=gen)
    tokens[0, [99, 100, 300]] = EOD
    tokens[1, [255, SEQ_LEN - 1]] = EOD
    return tokens


@pytest.fixture
def launcher_on_cpu(monkeypatch):
    """``get_batch``'s Megatron helpers on one CPU process: TP = 1 (the broadcast passes the batch through)."""
    state = SimpleNamespace(cp_rank=0, cp_size=2)
    args = SimpleNamespace(
        reset_attention_mask=True,
        create_attention_mask_in_dataloader=False,
        context_parallel_size=state.cp_size,
        micro_batch_size=2,
        seq_length=SEQ_LEN,
        pipeline_model_parallel_size=1,
    )
    monkeypatch.setattr(pretrain, "get_args", lambda: args)
    monkeypatch.setattr(pretrain, "is_first_or_last_pipeline_stage", lambda vp_stage: True)
    monkeypatch.setattr(pretrain, "get_batch_on_this_tp_rank", lambda batch, **kwargs: batch)
    monkeypatch.setattr(pretrain, "get_tokenizer", lambda: SimpleNamespace(eod=EOD))
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, non_blocking=False: self)
    timer = SimpleNamespace(start=lambda: None, stop=lambda: None)
    monkeypatch.setattr(pretrain, "get_timers", lambda: lambda *args, **kwargs: timer)
    monkeypatch.setattr(pretrain, "get_attr_wrapped_model", lambda model, attribute: None)
    monkeypatch.setattr(
        pretrain,
        "mpu",
        SimpleNamespace(
            get_tensor_model_parallel_rank=lambda: 0,
            get_tensor_model_parallel_src_rank=lambda: 0,
            get_tensor_model_parallel_group=lambda: None,
            is_pipeline_first_stage=lambda: True,
            is_pipeline_last_stage=lambda: True,
            get_context_parallel_rank=lambda: state.cp_rank,
            get_context_parallel_world_size=lambda: state.cp_size,
        ),
    )
    return state


def _sample(tokens: torch.Tensor) -> dict:
    documents = Documents.from_eod(tokens, EOD)
    return {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1, dims=1),
        "loss_mask": torch.ones(tokens.shape),
        "position_ids": documents.position_ids,
    }


@pytest.mark.parametrize("kind", ["striped", "contiguous"])
def test_get_batch_derives_the_documents_before_the_layout_permutation(launcher_on_cpu, kind, seed):
    tokens = _tokens(seed)
    expected = Documents.from_eod(tokens, EOD)
    layout = Layout(kind, 2)
    for rank in range(2):
        launcher_on_cpu.cp_rank = rank
        *local, packed = pretrain.get_batch(iter([_sample(tokens)]), None, layout, EOD)
        positions = layout.global_positions(SEQ_LEN, rank)
        assert torch.equal(local[0], tokens[:, positions])
        assert torch.equal(local[4], expected.position_ids[:, positions])
        assert isinstance(packed, PackedDocuments) and torch.equal(packed.documents.starts, expected.starts)
    *_, unpacked = pretrain.get_batch(iter([_sample(tokens)]), None, layout)
    assert unpacked is None


def test_get_batch_takes_the_datasets_cu_seqlens_with_inter_document_masking(launcher_on_cpu, seed):
    """``--dataloader-inter-document-masking``: the boundaries are the dataset's ``cu_seqlens`` (padded with N per
    sample, as GPTDataset collates them), not the EOD tokens (these tokens have none where the documents end)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 64, (2, SEQ_LEN), generator=gen)
    lengths = [[130, 1, 200, SEQ_LEN - 331], [SEQ_LEN]]
    starts = [[sum(row[:d]) for d in range(len(row))] for row in lengths]
    cu_seqlens = torch.full((2, 6), SEQ_LEN, dtype=torch.int32)
    for sample, row in enumerate(starts):
        cu_seqlens[sample, : len(row)] = torch.tensor(row)
    expected = Documents(torch.tensor([starts[0], [0, SEQ_LEN, SEQ_LEN, SEQ_LEN]]), SEQ_LEN)
    sample = {**_sample(tokens), "position_ids": expected.position_ids, "cu_seqlens": cu_seqlens}
    sample["max_seqlen"] = torch.tensor([SEQ_LEN - 331, SEQ_LEN])
    layout = Layout("striped", 2)
    for rank in range(2):
        launcher_on_cpu.cp_rank = rank
        *local, packed = pretrain.get_batch(iter([sample]), None, layout, inter_document_masking=True)
        assert torch.equal(packed.documents.starts, expected.starts), f"seed={seed} rank={rank}"
        assert torch.equal(local[4], expected.position_ids[:, layout.global_positions(SEQ_LEN, rank)])


def test_forward_step_hands_the_documents_to_the_model(launcher_on_cpu, seed):
    from megatron_mtraining.config import MTrainingConfig

    calls = []

    def model(*args, **kwargs):
        calls.append(kwargs)
        return torch.zeros(2, SEQ_LEN // 2)

    pretrain.MTrainingForwardStep(MTrainingConfig(backend="torch"), 0)(iter([_sample(_tokens(seed))]), model)
    packed = calls[0]["packed_seq_params"]
    assert isinstance(packed, PackedDocuments)
    assert torch.equal(packed.documents.starts, Documents.from_eod(_tokens(seed), EOD).starts)


@pytest.mark.parametrize("layout", ["striped", "zigzag"])
def test_reset_position_ids_gives_the_launchers_model_per_token_rope(parser, layout):  # noqa: F811
    args = _parse(
        parser, f"--reset-position-ids --no-rope-fusion --mtraining-layout {layout} --position-embedding-type rope"
    )
    args.params_dtype, args.padded_vocab_size = torch.float32, 128
    model_config = pretrain.mtraining_model_config(args, validate_mtraining_args(args))
    hooks = [
        hook for hook in model_config.pre_wrap_hooks if getattr(hook, "func", None) is pretrain._install_layout_rope
    ]
    assert [hook.args[1] for hook in hooks] == [True]


PLAN = "--reset-attention-mask --reset-position-ids --no-rope-fusion --mtraining-layout skewed --mtraining-plan-turns"
STATIC = "--mtraining-budget static --mtraining-vertical-size 64 --mtraining-slash-size 128"


def test_plan_turns_is_accepted_with_packed_documents_and_a_static_budget(parser):  # noqa: F811
    config = validate_mtraining_args(_parse(parser, f"{PLAN} {STATIC}"))
    assert config.plan_turns and config.layout == "skewed"


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            "--mtraining-budget static --mtraining-sparsity 0.9 --mtraining-layout striped",
            "use --mtraining-layout skewed",
        ),
        ("--mtraining-budget top-p", "use --mtraining-budget static or drop --mtraining-plan-turns"),
        (
            f"{STATIC} --mtraining-stripe-granularity 256",
            "with --mtraining-stripe-granularity 128",
        ),
    ],
)
def test_plan_turns_is_refused_where_it_does_not_apply(parser, extra, message):  # noqa: F811
    with pytest.raises(ValueError) as error:
        validate_mtraining_args(_parse(parser, f"{PLAN} {extra}"))
    assert message in str(error.value), str(error.value)
    unpacked = f"--mtraining-layout skewed --mtraining-plan-turns {STATIC}"
    with pytest.raises(ValueError, match="add --reset-attention-mask --reset-position-ids"):
        validate_mtraining_args(_parse(parser, unpacked))


def _planner(documents: Documents) -> Layout:
    return planned_layout(
        documents, 2, vertical_size=40, slash_size=200, min_sparse_length=128, sink_tokens=4, local_window=16
    )


def test_get_batch_lays_a_packed_micro_batch_out_by_its_planned_turns(launcher_on_cpu):
    """2048 tokens (8 rounds at CP = 2) whose documents plan turns of their own, neither striped's nor skewed's."""
    tokens = torch.randint(1, 64, (2, 2048), generator=torch.Generator().manual_seed(0))
    tokens[0, [299, 300, 900, 1300]] = EOD
    tokens[1, [255, 2047]] = EOD
    layout = _planner(Documents.from_eod(tokens, EOD))
    assert layout.turns == (0, 1, 1, 0, 0, 0, 1, 0), layout.turns
    for rank in range(2):
        launcher_on_cpu.cp_rank = rank
        *local, packed = pretrain.get_batch(iter([_sample(tokens)]), None, Layout("skewed", 2), EOD, False, _planner)
        assert packed.layout == layout
        assert torch.equal(local[0], tokens[:, layout.global_positions(2048, rank)])
    *_, unpacked = pretrain.get_batch(iter([_sample(tokens)]), None, Layout("skewed", 2), None, False, _planner)
    assert unpacked is None


def test_forward_step_plans_from_the_static_budget(launcher_on_cpu, monkeypatch, seed):
    from megatron_mtraining.config import MTrainingConfig

    args = pretrain.get_args()
    monkeypatch.setattr(args, "num_layers", 2, raising=False)
    monkeypatch.setattr(args, "num_attention_heads", 4, raising=False)
    calls = []

    def model(*args, **kwargs):
        calls.append(kwargs)
        return torch.zeros(2, SEQ_LEN // 2)

    mtraining = MTrainingConfig(
        backend="torch",
        layout="skewed",
        plan_turns=True,
        budget="static",
        vertical_size=40,
        slash_size=200,
        sink_tokens=4,
        local_window=16,
        last_q=16,
        min_sparse_length=128,
    )
    pretrain.MTrainingForwardStep(mtraining, 0)(iter([_sample(_tokens(seed))]), model)
    packed = calls[0]["packed_seq_params"]
    assert packed.layout == _planner(Documents.from_eod(_tokens(seed), EOD))
