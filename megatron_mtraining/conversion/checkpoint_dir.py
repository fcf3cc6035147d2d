"""The directories a conversion reads and writes: a Hugging Face model's ``config.json``, a Megatron
checkpoint root (tracker file, ``release/`` or ``iter_XXXXXXX/``) and an output directory that is written
under a temporary name and renamed at the end (DESIGN.md §4).
"""

from __future__ import annotations

import json
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE_DIR = "release"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_hf_config(directory: Path, option: str) -> dict:
    """The ``config.json`` of the Hugging Face model ``directory`` (given as ``option``), as a dict."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(
            f"{option} {directory} is not a directory; give a Hugging Face model directory (config.json, *.safetensors)"
        )
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"{option} {directory} has no config.json; give a Hugging Face model directory")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); re-download it") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object; re-download it")
    return config


def resolve_checkpoint_dir(path: Path) -> Path:
    """The ``torch_dist`` directory of ``path``: a checkpoint root (tracker file) or ``release``/``iter_*`` itself."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"--checkpoint {path} is not a directory; give the checkpoint root (with {TRACKER_FILE}) "
            "or its release/iter_XXXXXXX directory"
        )
    tracker = path / TRACKER_FILE
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == RELEASE_DIR:
            path = path / RELEASE_DIR
        elif text.isdigit():
            path = path / f"iter_{int(text):07d}"
        else:
            raise ValueError(f"{tracker} holds {text!r}; expected 'release' or an iteration number")
    if not (path / "metadata.json").is_file():
        raise ValueError(
            f"{path} is not a Megatron torch_dist checkpoint (no metadata.json, and no {TRACKER_FILE} "
            "pointing to one); give the checkpoint root or its release/iter_XXXXXXX directory"
        )
    return path


def check_output_dir(output: Path, overwrite: bool, inputs: dict[str, Path]) -> None:
    """Refuse an ``output`` that is a file, a non-empty directory unless ``overwrite``, or one holding an input.

    ``inputs`` maps option names (e.g. ``--hf-dir``) to the directories the conversion reads, which replacing
    ``output`` must not delete.
    """
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output-dir {output} is a file; give a directory path")
    for option, path in inputs.items():
        if Path(path).resolve().is_relative_to(output.resolve()):
            raise ValueError(
                f"--output-dir {output} holds {option} {path}, which the conversion reads; choose another --output-dir"
            )
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise ValueError(
            f"--output-dir {output} is not empty (it may hold a checkpoint); choose another directory "
            "or pass --overwrite to replace it"
        )


@contextmanager
def staged_output_dir(output: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory next to ``output``; on success it replaces ``output``, on error it is removed.

    Nothing partial is ever visible under ``output``: the swap is a rename on the same file system.
    """
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if output.exists():
        previous = output.parent / f".{output.name}.old-{uuid.uuid4().hex[:8]}"
        output.rename(previous)
        staging.rename(output)
        shutil.rmtree(previous)
    else:
        staging.rename(output)
