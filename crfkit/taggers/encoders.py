"""Kept for code written against this module: require lives in crfkit._optional, the packaged
encoders (encoder_path("minilm") and friends) in crfkit.packaged.
"""
from __future__ import annotations

from .._optional import require

__all__ = ["require"]

# Kept here for the code written against them; they live in crfkit.packaged.
_PACKAGED = ("ENCODERS", "encoder_path")


def __getattr__(name: str):
    if name in _PACKAGED:
        from .. import packaged

        return getattr(packaged, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
