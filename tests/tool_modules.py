"""The command-line modules of ``tools/``, for tests that run a tool's ``main`` (or other command-line code) in-process.

``tools/`` is a folder of scripts, not a package, and is not put on ``sys.path`` here: :func:`load_tool` loads
``tools/<name>.py`` from its file, once, and keeps it in ``sys.modules`` under ``name``. Library code is
imported from ``megatron_mtraining`` as usual.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str) -> ModuleType:
    """The module of ``tools/<name>.py`` (the one already loaded under ``name``, if any)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
