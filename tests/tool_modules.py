"""The modules of ``tools/``, for tests that run a tool's code in-process.

``tools/`` is a folder of scripts, not a package. A script run as ``python tools/<name>.py`` has ``tools/``
first on ``sys.path``, so tools import their siblings by bare name (``from structured_qk import ...``).
This module gives tests the same ``sys.path``, and is the one place in the tests that changes it for
``tools/``: :func:`load_tool` imports ``tools/<name>.py`` as the module ``name``. Library code is imported
from ``megatron_mtraining`` as usual.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))


def load_tool(name: str) -> ModuleType:
    """The module of ``tools/<name>.py``; raises if ``name`` resolves to another module of that name."""
    module = importlib.import_module(name)
    if Path(module.__file__).resolve() != TOOLS / f"{name}.py":
        raise ImportError(f"module {name!r} is {module.__file__}, not tools/{name}.py")
    return module
