"""Tokenise JSONL or plain-text documents into a Megatron indexed dataset (``<prefix>.bin`` and ``<prefix>.idx``).

    python tools/preprocess_data.py --input books.jsonl papers.jsonl --tokenizer Qwen2.5-3B \\
        --output-prefix data/long_docs --workers 16 --target-length 524288

* **Inputs.** ``*.jsonl``/``*.json`` files hold one JSON object per line; its ``--json-key`` (default
  ``text``) is one document. Any other file is one plain-text document. Files must be UTF-8; blank
  lines are skipped, empty documents are skipped and counted.
* **Tokenizer.** A Hugging Face directory with ``tokenizer.json`` (e.g. the Qwen2.5 model directory,
  the same one the launcher's ``--tokenizer-model`` names), a ``tokenizer.json`` file, or a
  SentencePiece ``*.model``. Text is encoded as Megatron's tokenizers do (Hugging Face: with the
  tokenizer's own special-token template; SentencePiece: plain ids).
* **Output.** Each document is one sequence: its ids followed by the end-of-document token
  (``--eod-token``; default the ``eos_token`` of ``tokenizer_config.json``, or SentencePiece's end
  of sentence), written through ``megatron.core.datasets.indexed_dataset`` (uint16 ids when the
  vocabulary fits, else int32, as ``GPTDataset`` expects). Train with ``--data-path <prefix>``. The files
  are written under temporary names and renamed at the end; existing outputs need ``--overwrite``.
* **Summary.** Documents, tokens, and how many documents (and what share of the tokens) reach
  ``--target-length`` tokens, i.e. can fill a whole training sequence on their own.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy
from tqdm import tqdm

JSONL_SUFFIXES = (".jsonl", ".json")
BLOCK_BYTES = 16 * 2 ** 20          # text handed to the workers at a time (two blocks are in flight)
UINT16_VOCAB_LIMIT = 2 ** 16        # GPTDatasetConfig reads uint16 ids up to this vocabulary size


@dataclass(frozen=True)
class TokenizerSource:
    """Where the tokenizer comes from (picklable, so that worker processes load their own copy)."""

    path: Path
    eod_token: str | None = None

    @property
    def is_sentencepiece(self) -> bool:
        return self.path.suffix == ".model"


class DocumentTokenizer:
    """A Hugging Face ``tokenizers`` or SentencePiece tokenizer that turns a document into ids + EOD."""

    def __init__(self, source: TokenizerSource):
        self.source = source
        if source.is_sentencepiece:
            self._load_sentencepiece(source)
        else:
            self._load_huggingface(source)
        if not 0 <= self.eod_id < self.vocab_size:
            raise ValueError(f"end-of-document id {self.eod_id} is outside the vocabulary of {self.vocab_size}")

    def _load_sentencepiece(self, source: TokenizerSource) -> None:
        import sentencepiece

        if not source.path.is_file():
            raise ValueError(f"--tokenizer {source.path} does not exist; give a SentencePiece .model file")
        try:
            self._sentencepiece = sentencepiece.SentencePieceProcessor(model_file=str(source.path))
        except (RuntimeError, OSError) as error:
            raise ValueError(f"--tokenizer {source.path} is not a SentencePiece model ({error})") from None
        self.vocab_size = self._sentencepiece.get_piece_size()
        if source.eod_token is None:
            self.eod_id = self._sentencepiece.eos_id()
            if self.eod_id < 0:
                raise ValueError(f"{source.path} has no end-of-sentence piece; name the end-of-document piece with "
                                 "--eod-token")
        else:
            self.eod_id = self._sentencepiece.piece_to_id(source.eod_token)
            if self.eod_id == self._sentencepiece.unk_id() and source.eod_token != self._sentencepiece.id_to_piece(
                    self.eod_id):
                raise ValueError(f"--eod-token {source.eod_token!r} is not a piece of {source.path}")
        self._hf = None

    def _load_huggingface(self, source: TokenizerSource) -> None:
        from tokenizers import Tokenizer

        tokenizer_file = source.path / "tokenizer.json" if source.path.is_dir() else source.path
        if not tokenizer_file.is_file():
            raise ValueError(f"--tokenizer {source.path}: no tokenizer.json there; give a Hugging Face model or "
                             "tokenizer directory, a tokenizer.json file or a SentencePiece .model file")
        try:
            self._hf = Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # noqa: BLE001 - the Rust library raises a bare Exception for bad files
            raise ValueError(f"{tokenizer_file} is not a Hugging Face tokenizer ({error})") from None
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        eod_token = source.eod_token or _configured_eos_token(tokenizer_file.parent / "tokenizer_config.json")
        if eod_token is None:
            raise ValueError(f"{tokenizer_file.parent} has no tokenizer_config.json with an eos_token; name the "
                             "end-of-document token with --eod-token (Qwen2.5: '<|endoftext|>')")
        self.eod_id = self._hf.token_to_id(eod_token)
        if self.eod_id is None:
            raise ValueError(f"end-of-document token {eod_token!r} is not in {tokenizer_file}")

    def encode(self, text: str) -> numpy.ndarray:
        """int64 ids of ``text`` followed by the end-of-document id."""
        ids = self._hf.encode(text).ids if self._hf is not None else self._sentencepiece.encode(text)
        return numpy.array(ids + [self.eod_id], dtype=numpy.int64)


def _configured_eos_token(config_path: Path) -> str | None:
    if not config_path.is_file():
        return None
    eos = json.loads(config_path.read_text()).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


# ------------------------------------------------------------------------------------------ reading
def _decode(raw: bytes, path: Path, first_line: int, byte_offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = first_line + raw[:error.start].count(b"\n")
        raise ValueError(f"{path}:{line}: not valid UTF-8 (byte {byte_offset + error.start}); re-encode the file as "
                         "UTF-8") from None


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
                raise ValueError(f"{path}:{line_number}: not a JSON object ({error.msg}); each line must be one "
                                 "JSON object") from None
            if not isinstance(record, dict) or json_key not in record:
                raise ValueError(f"{path}:{line_number}: no key {json_key!r} in this record; set --json-key to the "
                                 "key that holds the text")
            if not isinstance(record[json_key], str):
                raise ValueError(f"{path}:{line_number}: {json_key!r} is a {type(record[json_key]).__name__}, not a "
                                 "string")
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
        progress.update(unread)         # trailing blank lines
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
        return (f"documents: {self.documents:,} (skipped {self.skipped_empty:,} empty)\n"
                f"tokens: {self.tokens:,} including one end-of-document token per document; longest document "
                f"{self.longest_document:,} tokens\n"
                f"documents with >= {self.target_length:,} tokens (--target-length): {self.documents_at_target:,}, "
                f"holding {share:.1%} of the tokens")


def token_dtype(vocab_size: int) -> type:
    """The id dtype ``GPTDataset`` reads for ``vocab_size``: uint16 when it fits, else int32."""
    return numpy.uint16 if vocab_size <= UINT16_VOCAB_LIMIT else numpy.int32


def check_inputs(inputs: list[Path], output_prefix: Path, overwrite: bool, workers: int, target_length: int,
                 json_key: str) -> None:
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


def preprocess(inputs: list[Path], tokenizer: TokenizerSource, output_prefix: Path, *, json_key: str = "text",
               workers: int = 1, target_length: int = 524288, overwrite: bool = False) -> Summary:
    """Tokenise ``inputs`` into ``<output_prefix>.bin``/``.idx``; return the :class:`Summary`.

    Documents keep their input order. Nothing is left under the output names if anything fails.
    """
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
        with tqdm(total=sum(path.stat().st_size for path in inputs), unit="B", unit_scale=True,
                  desc="tokenising") as progress:
            for ids in _tokenised_documents(inputs, json_key, tokenizer, local_tokenizer, workers, progress, summary):
                builder.add_document(ids, [len(ids)])
                summary.add(ids)
        if summary.documents == 0:
            raise ValueError(f"the inputs hold no non-empty documents ({summary.skipped_empty} empty); check "
                             "--json-key")
        builder.finalize(str(temporary_paths[1]))
        for staged, final in zip(temporary_paths, _output_paths(output_prefix)):
            os.replace(staged, final)
    finally:
        for path in temporary_paths:
            path.unlink(missing_ok=True)
    return summary


def _tokenised_documents(inputs: list[Path], json_key: str, source: TokenizerSource, tokenizer: DocumentTokenizer,
                         workers: int, progress: tqdm, summary: Summary) -> Iterator[numpy.ndarray]:
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, type=Path,
                        help="JSONL files (*.jsonl, *.json) or plain-text files (one document each)")
    parser.add_argument("--json-key", default="text", help="JSONL key holding the document text")
    parser.add_argument("--tokenizer", required=True, type=Path,
                        help="Hugging Face directory or tokenizer.json, or a SentencePiece .model")
    parser.add_argument("--eod-token", default=None,
                        help="end-of-document token appended to every document (default: the tokenizer's eos)")
    parser.add_argument("--output-prefix", required=True, type=Path,
                        help="writes <prefix>.bin and <prefix>.idx; train with --data-path <prefix>")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="tokenising processes")
    parser.add_argument("--target-length", type=int, default=524288,
                        help="training sequence length for the summary's count of long documents")
    parser.add_argument("--overwrite", action="store_true", help="replace existing <prefix>.bin/.idx")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        summary = preprocess(args.input, TokenizerSource(args.tokenizer, args.eod_token), args.output_prefix,
                             json_key=args.json_key, workers=args.workers, target_length=args.target_length,
                             overwrite=args.overwrite)
    except ValueError as error:
        raise SystemExit(f"preprocess_data: error: {error}") from None
    print(f"wrote {args.output_prefix}.bin and {args.output_prefix}.idx\n{summary.report()}")


if __name__ == "__main__":
    main()
