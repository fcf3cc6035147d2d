"""tools/preprocess_data.py: JSONL and plain text → Megatron indexed dataset, with the launcher's own tokenizer.

* The launcher's tokenizer is built here as ``python -m megatron_mtraining.pretrain`` builds it: its
  tokenizer flags parsed by Megatron's parser (with ``add_mtraining_args``), then Megatron's
  ``build_tokenizer``. For a byte-level BPE trained here and saved as a Hugging Face folder (as
  ``PreTrainedTokenizerFast`` and as ``Qwen2Tokenizer``, the class of Qwen2.5's folders, which rebuilds
  the pipeline with its own normaliser and pre-tokeniser) and for a SentencePiece model trained here,
  varied documents (unicode, decomposed accents, whitespace runs, special tokens as text, digits, a long
  one, an empty one) read back from ``IndexedDataset`` as exactly that tokenizer's ``tokenize(text)`` and
  ``eod``, in input order; Megatron tokenizer flags given to both change the ids the same way.
* Random documents also come back through ``GPTDataset`` as the right windows.
* The summary counts documents, tokens and documents reaching the target length; the command line
  prints it and none of Megatron's Transformer Engine / Apex warnings, but still shows errors.
* A bad tokenizer (missing path, folder without tokenizer files, unknown type, ...) and bad input
  (empty, non-UTF-8, malformed JSON, missing key, existing output) are refused with a message naming
  the value, before any input is read, and leave no output behind.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch
from tool_modules import load_tool

REPO = Path(__file__).resolve().parents[2]
preprocess_data = load_tool("preprocess_data")
DocumentTokenizer, TokenizerSource = preprocess_data.DocumentTokenizer, preprocess_data.TokenizerSource
preprocess = preprocess_data.preprocess

# Bundled training text for the tokenizers (written for these tests).
CORPUS = """\
Sparse attention keeps a few key columns and a few diagonals of the score matrix.
The vertical lines are tokens that every later query looks at, like the first words of a document.
The slash lines are fixed distances between a query and a key, like the local window around each word.
Each rank of the ring holds one stripe of the sequence and passes its keys and values to the next rank.
A striped layout gives every rank the same amount of sparse work at every step of the ring.
The index is estimated from the last 64 queries, once per layer and head, before the ring starts.
A 512K sequence holds 524288 tokens in 4096 stripes of 128 tokens; 2048 hidden units, 16 heads.
Long documents are rare, so a corpus for half a million tokens needs books, code and long reports.
Checkpoints move between Hugging Face and Megatron without changing a single bit of the weights.
Über naïve café façades, the smörgåsbord of Unicode text must survive tokenisation: 東京, Αθήνα, Кыїв.
"""
SEQ_LEN = 32
EOD = "<|endoftext|>"
HF = "HuggingFaceTokenizer"
SP = "SentencePieceTokenizer"
VARIED_DOCUMENTS = [
    "The ring passes 64 keys to rank 1024 in 2048 steps.",
    "Über naïve café façades: 東京, Αθήνα, Кыїв — 🙂 ½ ﬁ Ⅻ",
    "Cafe\u0301 and e\u0301te\u0301, decomposed accents",
    "  two leading spaces, three   inside,\ttabs\t\tand trailing  ",
    "lines\n\n\nwith blank lines\r\nand a CRLF\n",
    f"special tokens as text: {EOD} </s> <s> <unk> <mask>{EOD}end",
    "don't, I'LL, we've",
    " ",
    "",
    " ".join(CORPUS.splitlines()) * 30,
]


def _lines() -> list[str]:
    return [line for line in CORPUS.splitlines() if line]


def _random_documents(rng: random.Random, count: int) -> list[str]:
    lines = _lines()
    return [" ".join(rng.choice(lines) for _ in range(rng.randint(1, 6))) for _ in range(count)]


def _sentencepiece_model(directory: Path) -> Path:
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_lines() * 3),
        model_writer=model,
        vocab_size=160,
        model_type="bpe",
        character_coverage=1.0,
        unk_id=0,
        eos_id=1,
        bos_id=-1,
        pad_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    path = directory / "tiny.model"
    path.write_bytes(model.getvalue())
    return path


def _huggingface_folder(directory: Path, tokenizer_class: str, eos_token: str | None = EOD) -> Path:
    """A byte-level BPE trained on the corpus, saved by ``transformers.<tokenizer_class>`` as a model folder."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        _lines(),
        trainers.BpeTrainer(vocab_size=400, special_tokens=[EOD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    folder = directory / tokenizer_class
    getattr(transformers, tokenizer_class)(tokenizer_object=tokenizer, eos_token=eos_token).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("tokenizers")
    return {
        "sentencepiece": _sentencepiece_model(directory),
        "PreTrainedTokenizerFast": _huggingface_folder(directory, "PreTrainedTokenizerFast"),
        "Qwen2Tokenizer": _huggingface_folder(directory, "Qwen2Tokenizer"),
    }


@pytest.fixture(scope="module")
def launcher_parser() -> argparse.ArgumentParser:
    """The launcher's parser: Megatron's arguments and MTraining's (as in tests/cpu/test_example_scripts.py)."""
    from megatron.training.arguments import add_megatron_arguments

    from megatron_mtraining.arguments import add_mtraining_args

    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    add_megatron_arguments(parser)
    return add_mtraining_args(parser)


def _launcher_tokenizer(parser: argparse.ArgumentParser, flags: list[str]):
    """The launcher's ``get_tokenizer()`` for ``flags``: Megatron's ``build_tokenizer`` of the parsed args."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    args = parser.parse_args(flags)
    args.rank = 0  # set by Megatron's validate_args; read when build_tokenizer pads the vocabulary
    return build_tokenizer(args)


def _launcher_ids(tokenizer, documents: list[str]) -> list[numpy.ndarray]:
    return [numpy.array(tokenizer.tokenize(text) + [tokenizer.eod]) for text in documents if text]


def _write_inputs(directory: Path, documents: list[str]) -> list[Path]:
    """The documents as a JSONL file (with a blank line and an empty record) followed by one plain-text file."""
    jsonl = directory / "docs.jsonl"
    records = [
        json.dumps({"text": text, "id": index}, ensure_ascii=index % 2 == 0)
        for index, text in enumerate(documents[:-1])
    ]
    records.insert(1, "")
    records.insert(3, json.dumps({"text": ""}))
    jsonl.write_text("\n".join(records) + "\n\n", encoding="utf-8")
    plain = directory / "last.txt"
    plain.write_bytes(documents[-1].encode("utf-8"))
    return [jsonl, plain]


def _read_back(prefix: Path) -> list[numpy.ndarray]:
    """Every document of ``<prefix>.bin/.idx`` as Megatron's ``IndexedDataset`` reads it (copied out of its mmap)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    indexed = IndexedDataset(str(prefix))
    assert indexed.index.dtype == numpy.uint16, "a small vocabulary must be stored as uint16"
    return [numpy.array(indexed[position]) for position in range(len(indexed))]


# tokenizer, launcher's --tokenizer-type, further launcher tokenizer flags (they must change the ids),
# and whether preprocess_data gets the tokenizer as the --tokenizer shorthand (else as the launcher's flags)
TOKENIZER_CASES = {
    "huggingface-fast-shorthand": ("PreTrainedTokenizerFast", HF, [], True),
    "huggingface-qwen2-shorthand": ("Qwen2Tokenizer", HF, [], True),
    "huggingface-qwen2-special-token": ("Qwen2Tokenizer", HF, ["--tokenizer-special-tokens", "<mask>"], False),
    "sentencepiece-shorthand": ("sentencepiece", SP, [], True),
    "sentencepiece-llama2-whitespace": (
        "sentencepiece",
        "Llama2Tokenizer",
        ["--no-tokenizer-sentencepiece-ignore-extra-whitespaces"],
        False,
    ),
}


@pytest.mark.parametrize("case", TOKENIZER_CASES)
def test_documents_are_the_launcher_tokenizers_ids(case, tokenizers, launcher_parser, tmp_path):
    name, tokenizer_type, options, shorthand = TOKENIZER_CASES[case]
    model = str(tokenizers[name])
    type_and_model = ["--tokenizer-type", tokenizer_type, "--tokenizer-model", model]
    launcher = _launcher_tokenizer(launcher_parser, type_and_model + options)
    expected = _launcher_ids(launcher, VARIED_DOCUMENTS)
    if options:  # else the options would go untested: both sides would agree without them
        without_options = _launcher_ids(_launcher_tokenizer(launcher_parser, type_and_model), VARIED_DOCUMENTS)
        assert any(not numpy.array_equal(ids, other) for ids, other in zip(expected, without_options))

    flags = ["--tokenizer", model] if shorthand else type_and_model + options
    preprocess_data.main(
        [
            "--input",
            *map(str, _write_inputs(tmp_path, VARIED_DOCUMENTS)),
            *flags,
            "--output-prefix",
            str(tmp_path / "docs"),
            "--workers",
            "1",
        ]
    )

    documents = _read_back(tmp_path / "docs")
    assert len(documents) == len(expected)
    texts = [text for text in VARIED_DOCUMENTS if text]
    for position, (ids, launcher_ids) in enumerate(zip(documents, expected)):
        assert ids.tolist() == launcher_ids.tolist(), f"document {position} ({texts[position][:40]!r}) differs"
    assert max(map(len, documents)) > 2000, "the long document must be long"


def test_documents_read_back_exactly_through_gpt_dataset(tokenizers, launcher_parser, tmp_path, seed, monkeypatch):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    model = str(tokenizers["Qwen2Tokenizer"])
    tokenizer = _launcher_tokenizer(launcher_parser, ["--tokenizer-type", HF, "--tokenizer-model", model])
    documents = _random_documents(random.Random(seed), 24)
    expected = _launcher_ids(tokenizer, documents)
    monkeypatch.setattr(preprocess_data, "BLOCK_BYTES", 300)  # several blocks in flight
    target = int(numpy.median([len(ids) - 1 for ids in expected]))
    summary = preprocess(
        _write_inputs(tmp_path, documents),
        TokenizerSource(HF, Path(model)),
        tmp_path / "out" / "docs",
        workers=2,
        target_length=target,
    )

    assert (summary.documents, summary.skipped_empty) == (len(documents), 1), f"seed={seed}"
    assert summary.tokens == sum(map(len, expected)), f"seed={seed}"
    at_target = [ids for ids in expected if len(ids) - 1 >= target]
    assert summary.documents_at_target == len(at_target) >= 1, f"seed={seed}"
    assert summary.tokens_in_documents_at_target == sum(map(len, at_target)), f"seed={seed}"
    for position, (ids, launcher_ids) in enumerate(zip(_read_back(tmp_path / "out" / "docs"), expected, strict=True)):
        assert numpy.array_equal(ids, launcher_ids), f"document {position} differs (seed={seed})"

    stream = numpy.concatenate(expected)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=SEQ_LEN,
        blend=([str(tmp_path / "out" / "docs")], None),
        split="100,0,0",
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(tmp_path / "cache"),
    )
    dataset, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [(len(stream) - 1) // SEQ_LEN, None, None], lambda: True, config
    ).build()
    in_dataset_order = numpy.concatenate([expected[d] for d in dataset.document_index])
    assert len(dataset) == (len(stream) - 1) // SEQ_LEN, f"one epoch expected (seed={seed})"
    for sample_index in range(len(dataset)):
        sample = dataset[sample_index]
        text = torch.cat([sample["tokens"], sample["labels"][-1:]]).numpy()
        window = int(dataset.shuffle_index[sample_index])
        assert numpy.array_equal(text, in_dataset_order[window * SEQ_LEN : (window + 1) * SEQ_LEN + 1]), (
            f"GPTDataset sample {sample_index} (window {window}) differs (seed={seed})"
        )


def test_token_dtype_follows_gpt_dataset():
    assert preprocess_data.token_dtype(65536) == numpy.uint16
    assert preprocess_data.token_dtype(151936) == numpy.int32


def test_eod_token_is_the_tokenizers_and_checked(tokenizers, tmp_path):
    folder = tokenizers["PreTrainedTokenizerFast"]
    assert (
        DocumentTokenizer(TokenizerSource(HF, folder, eod_token=EOD)).eod_id
        == DocumentTokenizer(TokenizerSource(HF, folder)).eod_id
    )
    with pytest.raises(ValueError, match=r"--eod-token '<eos>' is not the end-of-document token .*'<\|endoftext\|>'"):
        DocumentTokenizer(TokenizerSource(HF, folder, eod_token="<eos>"))
    without_eos = _huggingface_folder(tmp_path, "PreTrainedTokenizerFast", eos_token=None)
    with pytest.raises(ValueError, match="has no end-of-document token.*eos_token in tokenizer_config.json"):
        DocumentTokenizer(TokenizerSource(HF, without_eos))


def _bad_tokenizer_flags(tokenizers: dict[str, Path], directory: Path) -> dict[str, tuple[list[str], str]]:
    """Tokenizer flags preprocess_data must refuse, with the message that says why."""
    empty = directory / "empty_folder"
    empty.mkdir()
    corrupt = directory / "corrupt.model"
    corrupt.write_text("not a SentencePiece model")
    folder, model = str(tokenizers["PreTrainedTokenizerFast"]), str(tokenizers["sentencepiece"])
    missing = str(directory / "Qwen2.5-3B")
    return {
        "missing path": (["--tokenizer", missing], rf"--tokenizer {missing} does not exist; .*huggingface-cli"),
        "missing model": (
            ["--tokenizer-type", SP, "--tokenizer-model", f"{missing}.model"],
            rf"--tokenizer-model {missing}\.model does not exist",
        ),
        "no tokenizer files": (
            ["--tokenizer-type", HF, "--tokenizer-model", str(empty)],
            rf"--tokenizer-model {empty} holds no tokenizer files \(none of tokenizer.json",
        ),
        "unknown type": (
            ["--tokenizer-type", "WordPiece", "--tokenizer-model", folder],
            "--tokenizer-type WordPiece is not one preprocess_data builds; .* HuggingFaceTokenizer",
        ),
        "type without text": (
            ["--tokenizer-type", "NullTokenizer", "--tokenizer-model", folder],
            "--tokenizer-type NullTokenizer is not one",
        ),
        "tokenizer.json file": (
            ["--tokenizer", f"{folder}/tokenizer.json"],
            rf"--tokenizer {folder}/tokenizer\.json is a file; .* give the one that holds it",
        ),
        "folder as sentencepiece": (
            ["--tokenizer-type", SP, "--tokenizer-model", folder],
            rf"--tokenizer-model {folder} is a directory; .* \.model file",
        ),
        "sentencepiece as folder": (
            ["--tokenizer-type", HF, "--tokenizer-model", model],
            rf"--tokenizer-model {model} is a file; .* SentencePiece \.model with "
            rf"--tokenizer-type {SP}",
        ),
        "corrupt model": (["--tokenizer", str(corrupt)], rf"Megatron's {SP} cannot load {corrupt}"),
        "both forms": (["--tokenizer", folder, "--tokenizer-type", HF], "--tokenizer is short for .* give either"),
        "model without type": (["--tokenizer-model", folder], "give the launcher's --tokenizer-type and"),
        "no tokenizer": ([], "give the launcher's --tokenizer-type and"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing path",
        "missing model",
        "no tokenizer files",
        "unknown type",
        "type without text",
        "tokenizer.json file",
        "folder as sentencepiece",
        "sentencepiece as folder",
        "corrupt model",
        "both forms",
        "model without type",
        "no tokenizer",
    ],
)
def test_bad_tokenizer_is_refused_before_reading(case, tokenizers, tmp_path, monkeypatch):
    flags, message = _bad_tokenizer_flags(tokenizers, tmp_path)[case]
    (tmp_path / "a.txt").write_text("Each rank holds one stripe of the sequence.")
    output = tmp_path / "out"
    output.mkdir()

    def fail_reading(*args):
        raise AssertionError("an input was read before the tokenizer was checked")

    monkeypatch.setattr(preprocess_data, "read_documents", fail_reading)
    with pytest.raises(SystemExit, match=f"preprocess_data: error: {message}"):
        preprocess_data.main(
            ["--input", str(tmp_path / "a.txt"), *flags, "--output-prefix", str(output / "a"), "--workers", "1"]
        )
    assert os.listdir(output) == []


def test_unknown_tokenizer_option_is_refused(tokenizers):
    with pytest.raises(ValueError, match=r"unknown tokenizer options \['special_token'\]"):
        DocumentTokenizer(TokenizerSource(HF, tokenizers["Qwen2Tokenizer"], options={"special_token": ["<mask>"]}))


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.jsonl", b"", r"empty.jsonl is empty"),
        ("latin1.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n', r"latin1.jsonl:2: not valid UTF-8"),
        ("latin1.txt", b"line one\nline two caf\xe9\n", r"latin1.txt:2: not valid UTF-8"),
        ("broken.jsonl", b'{"text": "fine"}\n{"text": \n', r"broken.jsonl:2: not a JSON object"),
        ("nokey.jsonl", b'{"text": "fine"}\n{"body": "x"}\n', r"nokey.jsonl:2: no key 'text'"),
        ("number.jsonl", b'{"text": 7}\n', r"number.jsonl:1: 'text' is a int"),
        ("allempty.jsonl", b'{"text": ""}\n', r"no non-empty documents"),
    ],
)
def test_bad_input_is_refused_and_leaves_nothing_behind(tokenizers, tmp_path, name, content, message):
    bad = tmp_path / name
    bad.write_bytes(content)
    output = tmp_path / "out"
    output.mkdir()
    with pytest.raises(ValueError, match=message):
        preprocess([bad], TokenizerSource(HF, tokenizers["PreTrainedTokenizerFast"]), output / "docs", workers=1)
    assert os.listdir(output) == [], "a failed run must not leave output or temporary files"


def test_existing_output_needs_overwrite(tokenizers, tmp_path):
    source = TokenizerSource(HF, tokenizers["PreTrainedTokenizerFast"])
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
        "docs.bin",
        "docs.idx",
    ]


def test_command_line_prints_the_summary_and_no_missing_library_warnings(tokenizers, tmp_path):
    (tmp_path / "a.txt").write_text("Each rank holds one stripe of the sequence.")
    (tmp_path / "b.txt").write_text("The ring passes keys and values.")

    def run(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                str(REPO / "tools" / "preprocess_data.py"),
                "--input",
                str(tmp_path / "a.txt"),
                str(tmp_path / "b.txt"),
                "--output-prefix",
                str(tmp_path / "a"),
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )

    done = run(
        "--tokenizer-type",
        HF,
        "--tokenizer-model",
        str(tokenizers["Qwen2Tokenizer"]),
        "--workers",
        "2",
        "--target-length",
        "4",
    )
    assert done.returncode == 0, done.stderr
    assert "documents: 2 (skipped 0 empty)" in done.stdout and "documents with >= 4 tokens" in done.stdout
    noise = [
        line
        for line in done.stderr.splitlines()
        if any(word in line for word in ("Transformer Engine", "transformer-engine", "Apex", "absl", "CUDA", "Warning"))
    ]
    assert noise == [], "library warnings in the output"
    refused = run("--tokenizer", str(tokenizers["Qwen2Tokenizer"]))
    assert refused.returncode != 0 and "preprocess_data: error:" in refused.stderr and "already exist" in refused.stderr
