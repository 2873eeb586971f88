"""Kept for code written against this module: require lives in crfkit._optional, the packaged
encoders (encoder_path("minilm") and friends) in crfkit.packaged.
"""
from __future__ import annotations

from .._optional import moved_to, require

__all__ = ["require"]

# Kept for the code written against this module: these names live in crfkit.packaged now.
__getattr__ = moved_to("crfkit.packaged", ("ENCODERS", "encoder_path"), __name__)
