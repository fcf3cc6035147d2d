"""tools/packed_dataset.py: indexed datasets of the document mixtures, read back by Megatron.

Each mixture's dataset is read back raw (``IndexedDataset``) and through ``GPTDataset`` as the launcher builds it
from ``bench_e2e``'s own flags (``--data-path``, ``--reset-attention-mask``, ``--reset-position-ids``,
``--eod-mask-loss``): every sample's documents, as ``Documents.from_eod`` draws them, are exactly the mixture's.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import numpy
import pytest
import torch
from tool_modules import load_tool

packed_dataset = load_tool("packed_dataset")
bench = load_tool("bench_e2e")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

SEQ_LEN = 2048  # prolong scales its thresholds to N / 128K: one long document of 1024, short ones of 16 … 512


def test_mixture_names_are_none_and_document_mixtures():
    from document_mixtures import MIXTURES

    assert packed_dataset.mixture_names() == ("none", *MIXTURES)
    assert set(MIXTURES) >= {"prolong", "uniform4k", "single"}


@pytest.mark.parametrize("name", ["prolong", "uniform4k", "single"])
def test_mixture_lengths_fill_the_sequence(name):
    lengths = packed_dataset.mixture_lengths(name, 16384)
    assert sum(lengths) == 16384 and min(lengths) >= 1
    expected = {"uniform4k": [4096] * 4, "single": [16384]}
    assert name not in expected or lengths == expected[name]
    if name == "prolong":  # half the tokens in documents of >= N / 2 (scaled 64K), the rest shorter
        assert sum(length for length in lengths if length >= 8192) == 8192 and len(lengths) > 2
    with pytest.raises(ValueError, match="unknown"):
        packed_dataset.mixture_lengths("none", 16384)


def test_mask_area_by_hand():
    assert packed_dataset.mask_area([8]) == 1.0
    assert packed_dataset.mask_area([4, 4]) == 0.5
    assert packed_dataset.mask_area([1, 2, 1]) == pytest.approx(6 / 16)


@pytest.mark.parametrize("name", ["prolong", "uniform4k", "single"])
def test_written_documents_end_at_eod_with_the_mixtures_lengths(tmp_path, name):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    lengths, eod = packed_dataset.mixture_lengths(name, SEQ_LEN, seed=3), bench.eod_token(bench.QWEN25_VOCAB)
    assert eod == bench.QWEN25_VOCAB - 1
    prefix = tmp_path / "data" / name
    packed_dataset.write_mixture_dataset(prefix, lengths, sequences=3, eod=eod, seed=1)
    assert packed_dataset.read_document_lengths(prefix, eod) == [lengths] * 3
    raw = IndexedDataset(str(prefix))
    assert len(raw) == 3
    ends = numpy.cumsum(lengths) - 1
    for entry in range(3):
        tokens = numpy.asarray(raw[entry])
        assert tokens.size == SEQ_LEN and tokens.dtype == numpy.int32
        assert (numpy.flatnonzero(tokens == eod) == ends).all()  # an EOD at each document's end and nowhere else
        assert tokens.min() >= 0 and tokens.max() == eod
    assert not (numpy.asarray(raw[0]) == numpy.asarray(raw[1])).all()  # the sequences' tokens differ


def test_reader_counts_a_trailing_document_without_eod(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    builder = IndexedDatasetBuilder(get_bin_path(str(tmp_path / "x")), dtype=numpy.int32)
    tokens = numpy.array([1, 9, 2, 3, 9, 4], dtype=numpy.int32)
    builder.add_document(tokens, [tokens.size])
    builder.finalize(get_idx_path(str(tmp_path / "x")))
    assert packed_dataset.read_document_lengths(tmp_path / "x", eod=9) == [[2, 3, 1]]


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="sequences=0"):
        packed_dataset.write_mixture_dataset(tmp_path / "x", [4], sequences=0, eod=9)
    with pytest.raises(ValueError, match="eod="):
        packed_dataset.write_mixture_dataset(tmp_path / "x", [4], sequences=1, eod=2**31)


@pytest.mark.parametrize("name", ["prolong", "uniform4k"])
def test_gpt_dataset_samples_hold_exactly_the_mixture(tmp_path, name):
    """The launcher's dataset from bench_e2e's flags at CP = 1: every sample of the run's iterations (in
    GPTDataset's shuffled order) has the mixture's documents, per-document positions and no loss at EOD."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from quickstart import cpu_args

    from megatron_mtraining.pretrain import gpt_dataset_config_from_args
    from mtraining_kernels.documents import Documents

    opts = bench.parse_args(["--cp", "1", "--mixtures", name, "--warmup", "1", "--iters", "2"])
    lengths = tuple(packed_dataset.mixture_lengths(name, SEQ_LEN))
    config = bench.Config(bench.QWEN25["0.5b"], SEQ_LEN, bench.SPARSE_VARIANTS["mtraining-static"], name, lengths)
    bench.write_datasets([config], opts, tmp_path)
    schedule = bench.Schedule(opts.warmup, opts.iters, log_density=True)
    args = cpu_args(bench.launcher_flags(config, 1, schedule, opts, tmp_path))
    assert args.data_path == [str(bench.dataset_prefix(config, tmp_path))] and not args.mock_data
    assert args.reset_attention_mask and args.reset_position_ids and args.eod_mask_loss
    with contextlib.redirect_stdout(io.StringIO()):
        tokenizer = build_tokenizer(args)
        dataset, _, _ = BlendedMegatronDatasetBuilder(
            GPTDataset, [schedule.train_iters, 0, 0], lambda: True, gpt_dataset_config_from_args(args, tokenizer)
        ).build()
    assert tokenizer.eod == bench.eod_token(config.model.vocab)
    assert len(dataset) >= schedule.train_iters
    starts = torch.tensor([0, *lengths]).cumsum(0)[:-1]
    for sample in range(schedule.train_iters):
        item = dataset[sample]
        documents = Documents.from_eod(item["tokens"][None], tokenizer.eod)
        assert documents.lengths[0, : int(documents.num_documents[0])].tolist() == list(lengths), sample
        assert torch.equal(item["position_ids"], documents.position_ids[0])
        eod_positions = (item["tokens"] == tokenizer.eod).nonzero().flatten()
        assert eod_positions.tolist() == [*(starts[1:] - 1).tolist(), SEQ_LEN - 1]
        assert (item["loss_mask"][eod_positions] == 0).all() and item["loss_mask"].sum() == SEQ_LEN - len(lengths)


def test_inter_document_masking_gives_the_documents_the_eod_tokens_give(tmp_path):
    """``--dataloader-inter-document-masking``: GPTDataset's ``cu_seqlens`` (one indexed-dataset entry per document,
    each ending with EOD, as tools/preprocess_data.py writes them) read by ``Documents.from_padded_cu_seqlens``
    give the same documents as the EOD tokens, for samples that cut documents anywhere."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from quickstart import cpu_args

    from megatron_mtraining.pretrain import gpt_dataset_config_from_args
    from mtraining_kernels.documents import Documents

    vocab, prefix = 1024, str(tmp_path / "documents")
    eod = bench.eod_token(vocab)
    rng = numpy.random.default_rng(0)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.int32)
    for length in rng.integers(1, 700, size=40):
        tokens = rng.integers(0, eod, size=int(length), dtype=numpy.int32)
        tokens[-1] = eod
        builder.add_document(tokens, [tokens.size])
    builder.finalize(get_idx_path(prefix))
    flags = "--num-layers 1 --hidden-size 64 --num-attention-heads 2 --micro-batch-size 1 --global-batch-size 1"
    flags += f" --seq-length 512 --max-position-embeddings 512 --train-iters 6 --lr 1e-4 --data-path {prefix}"
    flags += f" --split 100,0,0 --tokenizer-type NullTokenizer --vocab-size {vocab} --no-rope-fusion"
    flags += " --dataloader-inter-document-masking --reset-position-ids --eod-mask-loss --transformer-impl local"
    args = cpu_args(flags.split())
    with contextlib.redirect_stdout(io.StringIO()):
        tokenizer = build_tokenizer(args)
        dataset, _, _ = BlendedMegatronDatasetBuilder(
            GPTDataset, [6, 0, 0], lambda: True, gpt_dataset_config_from_args(args, tokenizer)
        ).build()
    for sample in range(6):
        item = dataset[sample]
        from_dataset = Documents.from_padded_cu_seqlens(item["cu_seqlens"][None], 512)
        from_eod = Documents.from_eod(item["tokens"][None], eod)
        assert torch.equal(from_dataset.starts, from_eod.starts), sample
        assert int(from_dataset.num_documents[0]) > 1, sample
        assert torch.equal(item["position_ids"], from_dataset.position_ids[0]), sample
