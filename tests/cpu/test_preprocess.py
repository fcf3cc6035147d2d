"""tools/preprocess_data.py: JSONL and plain text → Megatron indexed dataset, read back through ``GPTDataset``.

* A SentencePiece model trained here on the text below, and a byte-level BPE ``tokenizers`` tokenizer
  built here: random documents (in several blocks, two worker processes) come back from Megatron's
  ``IndexedDataset`` and ``GPTDataset`` as exactly the expected ids (document ids + EOD, input order;
  each ``GPTDataset`` sample is the right window of the documents in ``GPTDataset``'s order).
* The Hugging Face ids and EOD equal those of Megatron's own ``HuggingFaceTokenizer`` on the same
  directory (the launcher's ``--tokenizer-type HuggingFaceTokenizer``).
* The summary counts documents, tokens and documents reaching the target length.
* Bad input (empty, non-UTF-8, malformed JSON, missing key, existing output) is refused with a message
  naming the file and line, and leaves no output behind.
"""

from __future__ import annotations

import io
import json
import os
import random
import sys
from pathlib import Path

import numpy
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import preprocess_data  # noqa: E402
from preprocess_data import DocumentTokenizer, TokenizerSource, preprocess  # noqa: E402

# Bundled training text for the tokenizers (written for these tests).
CORPUS = """\
Sparse attention keeps a few key columns and a few diagonals of the score matrix.
The vertical lines are tokens that every later query looks at, like the first words of a document.
The slash lines are fixed distances between a query and a key, like the local window around each word.
Each rank of the ring holds one stripe of the sequence and passes its keys and values to the next rank.
A striped layout gives every rank the same amount of sparse work at every step of the ring.
The index is estimated from the last sixty-four queries, once per layer and head, before the ring starts.
Long documents are rare, so a corpus for half a million tokens needs books, code and long reports.
Checkpoints move between Hugging Face and Megatron without changing a single bit of the weights.
Über naïve café façades, the smörgåsbord of Unicode text must survive tokenisation: 東京, Αθήνα, Кыїв.
"""
SEQ_LEN = 32
EOD = "<|endoftext|>"


def _lines() -> list[str]:
    return [line for line in CORPUS.splitlines() if line]


def _random_documents(rng: random.Random, count: int) -> list[str]:
    lines = _lines()
    return [" ".join(rng.choice(lines) for _ in range(rng.randint(1, 6))) for _ in range(count)]


def _sentencepiece_tokenizer(directory: Path) -> TokenizerSource:
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_lines() * 3), model_writer=model, vocab_size=160, model_type="bpe",
        character_coverage=1.0, unk_id=0, eos_id=1, bos_id=-1, pad_id=-1, hard_vocab_limit=False, minloglevel=2)
    path = directory / "tiny.model"
    path.write_bytes(model.getvalue())
    return TokenizerSource(path)


def _huggingface_tokenizer(directory: Path) -> TokenizerSource:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(_lines(), trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer_dir = directory / "hf_tokenizer"
    tokenizer_dir.mkdir()
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD, "model_max_length": 1 << 20}))
    return TokenizerSource(tokenizer_dir)


def _expected_ids(kind: str, source: TokenizerSource, text: str) -> numpy.ndarray:
    """Ids straight from the tokenizer library, plus its end-of-document id."""
    if kind == "sentencepiece":
        import sentencepiece

        processor = sentencepiece.SentencePieceProcessor(model_file=str(source.path))
        return numpy.array(processor.encode(text) + [processor.eos_id()])
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(source.path / "tokenizer.json"))
    return numpy.array(tokenizer.encode(text).ids + [tokenizer.token_to_id(EOD)])


def _megatron_tokenizer(kind: str, source: TokenizerSource):
    """Megatron's own tokenizer of ``source``, as the launcher builds it (``--tokenizer-type`` of ``kind``)."""
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(tokenizer_path=str(source.path), metadata_path={"library": kind})


def _gpt_dataset(prefix: Path, tokenizer, num_samples: int, cache: Path, seed: int):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(random_seed=seed, sequence_length=SEQ_LEN, blend=([str(prefix)], None),
                              split="100,0,0", tokenizer=tokenizer, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, path_to_cache=str(cache))
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, None, None], lambda: True, config).build()
    return train


def _write_inputs(directory: Path, documents: list[str]) -> list[Path]:
    """The documents as a JSONL file (with a blank line and an empty record) followed by one plain-text file."""
    jsonl = directory / "docs.jsonl"
    records = [json.dumps({"text": text, "id": index}, ensure_ascii=index % 2 == 0)
               for index, text in enumerate(documents[:-1])]
    records.insert(1, "")
    records.insert(3, json.dumps({"text": ""}))
    jsonl.write_text("\n".join(records) + "\n\n", encoding="utf-8")
    plain = directory / "last.txt"
    plain.write_text(documents[-1], encoding="utf-8")
    return [jsonl, plain]


@pytest.mark.parametrize("kind", ["sentencepiece", "huggingface"])
def test_documents_read_back_exactly_through_gpt_dataset(kind, tmp_path, seed, monkeypatch):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    rng = random.Random(seed)
    source = _sentencepiece_tokenizer(tmp_path) if kind == "sentencepiece" else _huggingface_tokenizer(tmp_path)
    documents = _random_documents(rng, 24)
    expected = [_expected_ids(kind, source, text) for text in documents]
    monkeypatch.setattr(preprocess_data, "BLOCK_BYTES", 300)       # several blocks in flight
    target = int(numpy.median([len(ids) - 1 for ids in expected]))
    summary = preprocess(_write_inputs(tmp_path, documents), source, tmp_path / "out" / "docs", workers=2,
                         target_length=target)

    assert (summary.documents, summary.skipped_empty) == (len(documents), 1), f"seed={seed}"
    assert summary.tokens == sum(map(len, expected)), f"seed={seed}"
    at_target = [ids for ids in expected if len(ids) - 1 >= target]
    assert summary.documents_at_target == len(at_target) >= 1, f"seed={seed}"
    assert summary.tokens_in_documents_at_target == sum(map(len, at_target)), f"seed={seed}"

    indexed = IndexedDataset(str(tmp_path / "out" / "docs"))
    assert indexed.index.dtype == numpy.uint16, f"small vocabulary must be stored as uint16 (seed={seed})"
    assert len(indexed) == len(documents)
    for position, ids in enumerate(expected):
        assert numpy.array_equal(indexed[position], ids), f"document {position} differs (seed={seed})"

    tokenizer = _megatron_tokenizer(kind, source)
    assert tokenizer.eod == expected[0][-1], f"Megatron's {kind} tokenizer has another end-of-document id"
    stream = numpy.concatenate(expected)
    dataset = _gpt_dataset(tmp_path / "out" / "docs", tokenizer, (len(stream) - 1) // SEQ_LEN, tmp_path / "cache",
                           seed)
    in_dataset_order = numpy.concatenate([expected[d] for d in dataset.document_index])
    assert len(dataset) == (len(stream) - 1) // SEQ_LEN, f"one epoch expected (seed={seed})"
    for sample_index in range(len(dataset)):
        sample = dataset[sample_index]
        text = torch.cat([sample["tokens"], sample["labels"][-1:]]).numpy()
        window = int(dataset.shuffle_index[sample_index])
        assert numpy.array_equal(text, in_dataset_order[window * SEQ_LEN:(window + 1) * SEQ_LEN + 1]), (
            f"GPTDataset sample {sample_index} (window {window}) differs (seed={seed})")


def test_huggingface_ids_match_megatrons_tokenizer(tmp_path, seed):
    """Our ids and EOD are what the launcher's --tokenizer-type HuggingFaceTokenizer produces for the same directory."""
    source = _huggingface_tokenizer(tmp_path)
    ours = DocumentTokenizer(source)
    megatron = _megatron_tokenizer("huggingface", source)
    assert ours.eod_id == megatron.eod
    for text in _random_documents(random.Random(seed), 8):
        assert ours.encode(text).tolist() == megatron.tokenize(text) + [megatron.eod], f"seed={seed} text={text!r}"


def test_token_dtype_follows_gpt_dataset():
    assert preprocess_data.token_dtype(65536) == numpy.uint16
    assert preprocess_data.token_dtype(151936) == numpy.int32


def test_explicit_eod_token_is_used_and_unknown_one_refused(tmp_path):
    source = _huggingface_tokenizer(tmp_path)
    file_source = TokenizerSource(source.path / "tokenizer.json", eod_token=EOD)
    assert DocumentTokenizer(file_source).eod_id == DocumentTokenizer(source).eod_id
    with pytest.raises(ValueError, match="'<eos>' is not in"):
        DocumentTokenizer(TokenizerSource(source.path, eod_token="<eos>"))
    (source.path / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="--eod-token"):
        DocumentTokenizer(source)


@pytest.mark.parametrize("name, content, message", [
    ("empty.jsonl", b"", r"empty.jsonl is empty"),
    ("latin1.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n', r"latin1.jsonl:2: not valid UTF-8"),
    ("latin1.txt", b"line one\nline two caf\xe9\n", r"latin1.txt:2: not valid UTF-8"),
    ("broken.jsonl", b'{"text": "fine"}\n{"text": \n', r"broken.jsonl:2: not a JSON object"),
    ("nokey.jsonl", b'{"text": "fine"}\n{"body": "x"}\n', r"nokey.jsonl:2: no key 'text'"),
    ("number.jsonl", b'{"text": 7}\n', r"number.jsonl:1: 'text' is a int"),
    ("allempty.jsonl", b'{"text": ""}\n', r"no non-empty documents"),
])
def test_bad_input_is_refused_and_leaves_nothing_behind(tmp_path, name, content, message):
    source = _huggingface_tokenizer(tmp_path)
    bad = tmp_path / name
    bad.write_bytes(content)
    output = tmp_path / "out"
    output.mkdir()
    with pytest.raises(ValueError, match=message):
        preprocess([bad], source, output / "docs", workers=1)
    assert os.listdir(output) == [], "a failed run must not leave output or temporary files"


def test_existing_output_needs_overwrite(tmp_path):
    source = _huggingface_tokenizer(tmp_path)
    documents = tmp_path / "input.jsonl"
    documents.write_text(json.dumps({"text": "The ring passes keys."}) + "\n")
    preprocess([documents], source, tmp_path / "docs", workers=1)
    before = (tmp_path / "docs.bin").read_bytes()
    with pytest.raises(ValueError, match="already exist.*--overwrite"):
        preprocess([documents], source, tmp_path / "docs", workers=1)
    documents.write_text(json.dumps({"text": "A different document."}) + "\n")
    preprocess([documents], source, tmp_path / "docs", workers=1, overwrite=True)
    assert (tmp_path / "docs.bin").read_bytes() != before
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith((".docs", "docs."))) == [
        "docs.bin", "docs.idx"]


def test_command_line_prints_the_summary(tmp_path, capsys):
    source = _huggingface_tokenizer(tmp_path)
    (tmp_path / "a.txt").write_text("Each rank holds one stripe of the sequence.")
    preprocess_data.main(["--input", str(tmp_path / "a.txt"), "--tokenizer", str(source.path), "--output-prefix",
                          str(tmp_path / "a"), "--workers", "1", "--target-length", "4"])
    report = capsys.readouterr().out
    assert "documents: 1 (skipped 0 empty)" in report and "documents with >= 4 tokens" in report
    with pytest.raises(SystemExit, match="already exist"):
        preprocess_data.main(["--input", str(tmp_path / "a.txt"), "--tokenizer", str(source.path),
                              "--output-prefix", str(tmp_path / "a")])
