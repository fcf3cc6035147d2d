"""Tokenise JSONL or plain-text documents into a Megatron indexed dataset (``<prefix>.bin`` and ``<prefix>.idx``)
with the training launcher's own tokenizer.

    python tools/preprocess_data.py --input books.jsonl papers.jsonl \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model models/Qwen2.5-3B \\
        --output-prefix data/long_docs --workers 16 --target-length 524288

* **Inputs.** ``*.jsonl``/``*.json`` files hold one JSON object per line; its ``--json-key`` (default
  ``text``) is one document. Any other file is one plain-text document. Files must be UTF-8; blank
  lines are skipped, empty documents are skipped and counted.
* **Tokenizer.** The one the launcher (``python -m megatron_mtraining.pretrain``) uses: pass the
  ``--tokenizer-type`` and ``--tokenizer-model`` values you pass to training, i.e. ``HuggingFaceTokenizer``
  with a local Hugging Face model or tokenizer directory, or ``SentencePieceTokenizer`` (or
  ``GPTSentencePieceTokenizer``, ``Llama2Tokenizer``) with a ``.model`` file. Megatron's other tokenizer
  flags that change the ids (``--tokenizer-special-tokens``, ``--tokenizer-hf-no-include-special-tokens``,
  ``--no-tokenizer-sentencepiece-ignore-extra-whitespaces``, ...; see ``--help``) are accepted too and
  must match training's. ``--tokenizer PATH`` is short for both flags: a ``*.model`` file is a
  ``SentencePieceTokenizer``, anything else a ``HuggingFaceTokenizer`` directory. The tokenizer is
  Megatron's ``build_tokenizer`` of these settings, the tokenizer that ``get_tokenizer()`` returns in the
  launcher, and each document is its ``tokenize(text)``: preprocessing and training share one tokenizer.
* **Output.** Each document is one sequence: its ids followed by the tokenizer's ``eod`` (what
  ``GPTDataset`` takes as end of document; ``--eod-token``, if given, must name that token), written
  through ``megatron.core.datasets.indexed_dataset`` (uint16 ids when the vocabulary fits, else int32, as
  ``GPTDataset`` expects). Train with ``--data-path <prefix>``. The files are written under temporary
  names and renamed at the end; existing outputs need ``--overwrite``.
* **Summary.** Documents, tokens, and how many documents (and what share of the tokens) reach
  ``--target-length`` tokens, i.e. can fill a whole training sequence on their own.

Megatron's warnings that Transformer Engine or Apex are not installed (irrelevant to tokenising) are
not shown; every other warning and error is.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy
from tqdm import tqdm

JSONL_SUFFIXES = (".jsonl", ".json")
BLOCK_BYTES = 16 * 2**20  # text handed to the workers at a time (two blocks are in flight)
UINT16_VOCAB_LIMIT = 2**16  # GPTDatasetConfig reads uint16 ids up to this vocabulary size

HUGGINGFACE_TYPE = "HuggingFaceTokenizer"
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = (HUGGINGFACE_TYPE, *SENTENCEPIECE_TYPES)
HUGGINGFACE_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model")
# Megatron's tokenizer settings (TokenizerConfig fields) besides type and model that change the ids of a
# Hugging Face or SentencePiece tokenizer; the command line takes them under Megatron's own flag names.
MEGATRON_TOKENIZER_OPTIONS = (
    "vocab_file",
    "merge_file",
    "metadata_path",
    "special_tokens",
    "tokenizer_hf_no_use_fast",
    "tokenizer_hf_no_include_special_tokens",
    "trust_remote_code",
    "tokenizer_sentencepiece_legacy",
    "tokenizer_sentencepiece_ignore_extra_whitespaces",
)
# How Megatron's warnings about what tokenising does not use (Transformer Engine, Apex, absl, a rank) begin.
IRRELEVANT_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "Only transformer-engine",
    "absl.logging is not installed",
    "Could not determine rank",
)


@contextlib.contextmanager
def _without_irrelevant_warnings() -> Iterator[None]:
    """Hide what Megatron (and torch, on import) says about Transformer Engine, Apex, absl, CUDA or a rank
    being absent: none of them takes part in tokenising. Other warnings and all errors still show."""
    cuda_logger = logging.getLogger("torch.utils.cpp_extension")  # "No CUDA runtime is found"
    level = cuda_logger.level
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="|".join(IRRELEVANT_WARNINGS), category=UserWarning)
        cuda_logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            cuda_logger.setLevel(level)


@dataclass(frozen=True)
class TokenizerSource:
    """The launcher's tokenizer flags (picklable, so that worker processes build their own tokenizer).

    ``options`` maps :data:`MEGATRON_TOKENIZER_OPTIONS` names to values; absent ones keep Megatron's defaults.
    ``model_flag`` is the flag that gave ``tokenizer_model``, for messages.
    """

    tokenizer_type: str
    tokenizer_model: Path
    options: dict[str, Any] = field(default_factory=dict)
    eod_token: str | None = None
    model_flag: str = "--tokenizer-model"

    @classmethod
    def from_path(cls, path: Path, **settings) -> TokenizerSource:
        """``--tokenizer PATH``: a ``*.model`` file is a SentencePiece model, anything else a Hugging Face directory."""
        path = Path(path)
        return cls(
            SENTENCEPIECE_TYPES[0] if path.suffix == ".model" else HUGGINGFACE_TYPE,
            path,
            model_flag="--tokenizer",
            **settings,
        )

    def check(self) -> None:
        """``ValueError`` naming the flag and the fix when Megatron could not build this tokenizer."""
        if self.tokenizer_type not in TOKENIZER_TYPES:
            raise ValueError(
                f"--tokenizer-type {self.tokenizer_type} is not one preprocess_data builds; pass the "
                f"launcher's --tokenizer-type, one of {', '.join(TOKENIZER_TYPES)}"
            )
        unknown = sorted(set(self.options) - set(MEGATRON_TOKENIZER_OPTIONS))
        if unknown:
            raise ValueError(f"unknown tokenizer options {unknown}; known: {', '.join(MEGATRON_TOKENIZER_OPTIONS)}")
        path, flag = self.tokenizer_model, f"{self.model_flag} {self.tokenizer_model}"
        if not path.exists():
            raise ValueError(
                f"{flag} does not exist; give the local tokenizer path that training's --tokenizer-model "
                "names (download a Hugging Face hub model first, e.g. `huggingface-cli download NAME "
                "--local-dir DIR`, and pass DIR to both)"
            )
        if self.tokenizer_type == HUGGINGFACE_TYPE:
            if not path.is_dir():
                raise ValueError(
                    f"{flag} is a file; a {HUGGINGFACE_TYPE} is a directory: give the one that holds it "
                    "(or a SentencePiece .model with --tokenizer-type SentencePieceTokenizer)"
                )
            if not any((path / name).is_file() for name in HUGGINGFACE_TOKENIZER_FILES):
                raise ValueError(
                    f"{flag} holds no tokenizer files (none of {', '.join(HUGGINGFACE_TOKENIZER_FILES)}); "
                    "give the Hugging Face model or tokenizer directory"
                )
        elif not path.is_file():
            raise ValueError(
                f"{flag} is a directory; a {self.tokenizer_type} needs the SentencePiece .model file "
                f"(or pass --tokenizer-type {HUGGINGFACE_TYPE} for a Hugging Face directory)"
            )

    def launcher_args(self) -> argparse.Namespace:
        """The launcher's tokenizer arguments: Megatron's ``TokenizerConfig`` defaults with these settings."""
        from megatron.training.config import TokenizerConfig

        settings = dataclasses.asdict(TokenizerConfig())
        settings.update(self.options, tokenizer_type=self.tokenizer_type, tokenizer_model=str(self.tokenizer_model))
        settings["pad_vocab_size"] = False  # padding sizes the model's embedding table; the ids do not change
        return argparse.Namespace(**settings)


class DocumentTokenizer:
    """Megatron's tokenizer of a :class:`TokenizerSource`, built as the launcher builds it; a document -> ids + EOD."""

    def __init__(self, source: TokenizerSource):
        source.check()
        with _without_irrelevant_warnings():
            from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

            try:
                self.megatron = build_tokenizer(source.launcher_args())
            except (ValueError, OSError, RuntimeError) as error:
                raise ValueError(
                    f"Megatron's {source.tokenizer_type} cannot load {source.tokenizer_model}: {error}"
                ) from None
        self.vocab_size = self.megatron.vocab_size
        self.eod_id = self.megatron.eod
        if self.eod_id is None or not 0 <= self.eod_id < self.vocab_size:
            raise ValueError(
                f"{source.tokenizer_model} has no end-of-document token (Megatron's eod is "
                f"{self.eod_id}); give it one, for training too: an eos_token in tokenizer_config.json, "
                "or a SentencePiece model trained with an eos piece"
            )
        eod_token = self.megatron.inv_vocab[self.eod_id]
        if source.eod_token is not None and source.eod_token != eod_token:
            raise ValueError(
                f"--eod-token {source.eod_token!r} is not the end-of-document token of "
                f"{source.tokenizer_model} ({eod_token!r}, id {self.eod_id}), which GPTDataset uses; "
                "drop --eod-token"
            )

    def encode(self, text: str) -> numpy.ndarray:
        """int64 ids of ``text`` (the launcher tokenizer's ``tokenize``) followed by the end-of-document id."""
        return numpy.array(self.megatron.tokenize(text) + [self.eod_id], dtype=numpy.int64)


# ------------------------------------------------------------------------------------------ reading
def _decode(raw: bytes, path: Path, first_line: int, byte_offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = first_line + raw[: error.start].count(b"\n")
        raise ValueError(
            f"{path}:{line}: not valid UTF-8 (byte {byte_offset + error.start}); re-encode the file as UTF-8"
        ) from None


def read_documents(path: Path, json_key: str) -> Iterator[tuple[str, int]]:
    """``(document text, bytes consumed)`` of one input file; ``ValueError`` names the file and line of bad input.

    Blank JSONL lines are skipped (their bytes count toward the next document).
    """
    if path.suffix not in JSONL_SUFFIXES:
        raw = path.read_bytes()
        yield _decode(raw, path, 1, 0), len(raw)
        return
    offset = consumed = 0
    with path.open("rb") as stream:
        for line_number, raw in enumerate(stream, start=1):
            text = _decode(raw, path, line_number, offset)
            offset += len(raw)
            consumed += len(raw)
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}:{line_number}: not a JSON object ({error.msg}); each line must be one JSON object"
                ) from None
            if not isinstance(record, dict) or json_key not in record:
                raise ValueError(
                    f"{path}:{line_number}: no key {json_key!r} in this record; set --json-key to the "
                    "key that holds the text"
                )
            if not isinstance(record[json_key], str):
                raise ValueError(
                    f"{path}:{line_number}: {json_key!r} is a {type(record[json_key]).__name__}, not a string"
                )
            yield record[json_key], consumed
            consumed = 0


def _blocks(paths: list[Path], json_key: str, progress: tqdm) -> Iterator[list[str]]:
    """Documents (empty ones included, as ``""``) in blocks of about :data:`BLOCK_BYTES` of text."""
    block, size = [], 0
    for path in paths:
        unread = path.stat().st_size
        for text, consumed in read_documents(path, json_key):
            progress.update(consumed)
            unread -= consumed
            block.append(text)
            size += len(text)
            if size >= BLOCK_BYTES:
                yield block
                block, size = [], 0
        progress.update(unread)  # trailing blank lines
    if block:
        yield block


# ------------------------------------------------------------------------------------------ tokenising
_worker_tokenizer: DocumentTokenizer | None = None


def _init_worker(source: TokenizerSource) -> None:
    global _worker_tokenizer
    _worker_tokenizer = DocumentTokenizer(source)


def _encode_in_worker(text: str) -> numpy.ndarray:
    return _worker_tokenizer.encode(text)


@dataclass
class Summary:
    """What was written: document and token counts (tokens include one EOD per document)."""

    documents: int = 0
    skipped_empty: int = 0
    tokens: int = 0
    longest_document: int = 0
    target_length: int = 0
    documents_at_target: int = 0
    tokens_in_documents_at_target: int = 0

    def add(self, ids: numpy.ndarray) -> None:
        self.documents += 1
        self.tokens += len(ids)
        self.longest_document = max(self.longest_document, len(ids) - 1)
        if len(ids) - 1 >= self.target_length:
            self.documents_at_target += 1
            self.tokens_in_documents_at_target += len(ids)

    def report(self) -> str:
        share = self.tokens_in_documents_at_target / self.tokens if self.tokens else 0.0
        return (
            f"documents: {self.documents:,} (skipped {self.skipped_empty:,} empty)\n"
            f"tokens: {self.tokens:,} including one end-of-document token per document; longest document "
            f"{self.longest_document:,} tokens\n"
            f"documents with >= {self.target_length:,} tokens (--target-length): {self.documents_at_target:,}, "
            f"holding {share:.1%} of the tokens"
        )


def token_dtype(vocab_size: int) -> type:
    """The id dtype ``GPTDataset`` reads for ``vocab_size``: uint16 when it fits, else int32."""
    return numpy.uint16 if vocab_size <= UINT16_VOCAB_LIMIT else numpy.int32


def check_inputs(
    inputs: list[Path], output_prefix: Path, overwrite: bool, workers: int, target_length: int, json_key: str
) -> None:
    """Everything that can be checked before reading the data; ``ValueError`` names the problem."""
    if not inputs:
        raise ValueError("no --input files given")
    for path in inputs:
        if not path.is_file():
            raise ValueError(f"--input {path} is not a file; give existing JSONL or text files")
        if path.stat().st_size == 0:
            raise ValueError(f"--input {path} is empty; drop it from --input or give a file that holds documents")
    if workers < 1:
        raise ValueError(f"--workers {workers} must be >= 1")
    if target_length < 1:
        raise ValueError(f"--target-length {target_length} must be >= 1")
    if not json_key:
        raise ValueError("--json-key must not be empty")
    existing = [str(path) for path in _output_paths(output_prefix) if path.exists()]
    if existing and not overwrite:
        raise ValueError(f"{', '.join(existing)} already exist; choose another --output-prefix or pass --overwrite")


def _output_paths(prefix: Path) -> tuple[Path, Path]:
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx")


def preprocess(
    inputs: list[Path],
    tokenizer: TokenizerSource,
    output_prefix: Path,
    *,
    json_key: str = "text",
    workers: int = 1,
    target_length: int = 524288,
    overwrite: bool = False,
) -> Summary:
    """Tokenise ``inputs`` into ``<output_prefix>.bin``/``.idx``; return the :class:`Summary`.

    Documents keep their input order. Nothing is left under the output names if anything fails.
    """
    with _without_irrelevant_warnings():
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    inputs, output_prefix = [Path(path) for path in inputs], Path(output_prefix)
    check_inputs(inputs, output_prefix, overwrite, workers, target_length, json_key)
    local_tokenizer = DocumentTokenizer(tokenizer)
    output_prefix.parent.mkdir(parents=True, exist_ok=True)
    temporary = output_prefix.parent / f".{output_prefix.name}.tmp-{uuid.uuid4().hex[:8]}"
    temporary_paths = _output_paths(temporary)
    summary = Summary(target_length=target_length)
    try:
        builder = IndexedDatasetBuilder(str(temporary_paths[0]), dtype=token_dtype(local_tokenizer.vocab_size))
        with tqdm(
            total=sum(path.stat().st_size for path in inputs), unit="B", unit_scale=True, desc="tokenising"
        ) as progress:
            for ids in _tokenised_documents(inputs, json_key, tokenizer, local_tokenizer, workers, progress, summary):
                builder.add_document(ids, [len(ids)])
                summary.add(ids)
        if summary.documents == 0:
            raise ValueError(
                f"the inputs hold no non-empty documents ({summary.skipped_empty} empty); check --json-key"
            )
        builder.finalize(str(temporary_paths[1]))
        for staged, final in zip(temporary_paths, _output_paths(output_prefix)):
            os.replace(staged, final)
    finally:
        for path in temporary_paths:
            path.unlink(missing_ok=True)
    return summary


def _tokenised_documents(
    inputs: list[Path],
    json_key: str,
    source: TokenizerSource,
    tokenizer: DocumentTokenizer,
    workers: int,
    progress: tqdm,
    summary: Summary,
) -> Iterator[numpy.ndarray]:
    """Ids of every non-empty document in input order (empty ones are counted in ``summary``)."""

    def non_empty(block: list[str]) -> list[str]:
        kept = [text for text in block if text]
        summary.skipped_empty += len(block) - len(kept)
        return kept

    blocks = _blocks(inputs, json_key, progress)
    if workers == 1:
        for block in blocks:
            yield from map(tokenizer.encode, non_empty(block))
        return
    with multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(source,)) as pool:
        pending = None
        for block in blocks:
            texts = non_empty(block)
            submitted = pool.map_async(_encode_in_worker, texts, chunksize=max(1, len(texts) // (4 * workers)))
            if pending is not None:
                yield from pending.get()
            pending = submitted
        if pending is not None:
            yield from pending.get()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    with _without_irrelevant_warnings():
        from megatron.training.argument_utils import ArgumentGroupFactory
        from megatron.training.config import TokenizerConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        type=Path,
        help="JSONL files (*.jsonl, *.json) or plain-text files (one document each)",
    )
    parser.add_argument("--json-key", default="text", help="JSONL key holding the document text")
    parser.add_argument(
        "--output-prefix",
        required=True,
        type=Path,
        help="writes <prefix>.bin and <prefix>.idx; train with --data-path <prefix>",
    )
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="tokenising processes")
    parser.add_argument(
        "--target-length",
        type=int,
        default=524288,
        help="training sequence length for the summary's count of long documents",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace existing <prefix>.bin/.idx")
    tokenizer = parser.add_argument_group("tokenizer", "the launcher's tokenizer: give the values training gets")
    tokenizer.add_argument("--tokenizer-type", default=None, help=f"one of {', '.join(TOKENIZER_TYPES)}")
    tokenizer.add_argument(
        "--tokenizer-model",
        type=Path,
        default=None,
        help="Hugging Face model or tokenizer directory, or SentencePiece .model file",
    )
    tokenizer.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help=f"instead of the two above: a *.model file ({SENTENCEPIECE_TYPES[0]}) or a directory ({HUGGINGFACE_TYPE})",
    )
    tokenizer.add_argument(
        "--eod-token",
        default=None,
        help="the end-of-document token, checked against the tokenizer's (never substituted)",
    )
    other_settings = [
        item.name for item in dataclasses.fields(TokenizerConfig) if item.name not in MEGATRON_TOKENIZER_OPTIONS
    ]
    ArgumentGroupFactory(TokenizerConfig, exclude=other_settings).build_group(
        parser, "Megatron tokenizer options (as in training; they change the ids)"
    )
    return parser.parse_args(argv)


def tokenizer_source(args: argparse.Namespace) -> TokenizerSource:
    """The :class:`TokenizerSource` of the command line; ``ValueError`` when its tokenizer flags do not fit together."""
    options = {name: getattr(args, name) for name in MEGATRON_TOKENIZER_OPTIONS}
    if args.tokenizer is not None:
        if args.tokenizer_type is not None or args.tokenizer_model is not None:
            raise ValueError("--tokenizer is short for --tokenizer-type and --tokenizer-model; give either it or them")
        return TokenizerSource.from_path(args.tokenizer, options=options, eod_token=args.eod_token)
    if args.tokenizer_type is None or args.tokenizer_model is None:
        raise ValueError(
            "give the launcher's --tokenizer-type and --tokenizer-model (the values training gets), or --tokenizer PATH"
        )
    return TokenizerSource(args.tokenizer_type, args.tokenizer_model, options=options, eod_token=args.eod_token)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        summary = preprocess(
            args.input,
            tokenizer_source(args),
            args.output_prefix,
            json_key=args.json_key,
            workers=args.workers,
            target_length=args.target_length,
            overwrite=args.overwrite,
        )
    except ValueError as error:
        raise SystemExit(f"preprocess_data: error: {error}") from None
    print(f"wrote {args.output_prefix}.bin and {args.output_prefix}.idx\n{summary.report()}")


if __name__ == "__main__":
    main()
