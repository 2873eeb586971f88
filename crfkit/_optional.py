"""Optional dependencies: import one, or say which command installs it.

    transformers = require("transformers", "pip install transformers")
"""
from __future__ import annotations

import importlib

__all__ = ["require"]


def require(module: str, install: str):
    """Import module, or raise ImportError saying which command installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"crfkit needs the package that provides {module!r}: {install}") from error
