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


def moved_to(target: str, names: tuple[str, ...], module: str):
    """A module __getattr__ that finds `names` in module `target` (imported on first use): for
    names that moved there, kept for the code written against their old module. Lazy, because the
    target may import the old module itself."""
    def __getattr__(name: str):
        if name in names:
            return getattr(importlib.import_module(target), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
