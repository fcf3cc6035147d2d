"""Where a benchmark row comes from: the checkout's commit, marked when the tree differs from it."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """Short commit hash of the checkout, ``+dirty`` when tracked files differ from it (a device's copy of the
    tree can carry an older ``.git``), ``unknown`` without git."""

    def git(*arguments: str) -> str:
        return subprocess.run(["git", *arguments], cwd=REPO, capture_output=True, text=True, check=True).stdout

    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")
