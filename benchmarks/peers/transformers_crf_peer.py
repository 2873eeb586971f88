"""transformers-crf (PyPI `transformers-crf`): the CRF of its `transformers_crf/crf.py`
(based on ModelScope AdaSeq's CRF).

The package's `__init__` imports transformers, datasets, onnx, optimum, wandb, ... (it pins
transformers==4.56.1); only `crf.py`, which needs torch alone, is used: the adapter loads that
file of the installed package directly (importlib, without running the package __init__), so
the package is installed with `pip install --no-deps transformers-crf` (see install.sh).

Conventions (read from transformers_crf/crf.py, 0.3.2):
- `CRF(num_tags, batch_first=True)`: BATCH-FIRST by default; the private methods take
  TIME-FIRST tensors.
- parameters `transitions[from, to]`, `start_transitions`, `end_transitions`: overwritten with
  crfkit's.
- mask: bool or uint8 (decode converts to uint8), left-aligned, first position on.
- log Z: the private `_compute_normalizer(emissions_tf, mask_tf)`.
- marginals: `compute_posterior(emissions, mask)` returns LOG posteriors (B, L, T) from a
  forward and a backward pass (the backward flips each sentence in a Python loop over the
  batch); exponentiated, padding zeroed, for the check.
- Viterbi: `decode(emissions, mask)` -> (1, B, L) tags, no scores, pad tag 0; its time loops
  are TorchScript (`torch.jit.script`) functions. n-best: `decode(..., nbest=K)` -> (K, B, L),
  the same n-best decoder as pytorchcrf, with the same `.view` failure on recent torch (patched
  the same way: recompiled from its source with `.view(` -> `.reshape(`) and the same K <= T
  limit. Scores are rescored by crfkit for the check.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import warnings

from .base import PeerUnavailable, package_folder
from .pytorchcrf_peer import PytorchCrfNbest

warnings.filterwarnings("ignore", message="where received a uint8 condition tensor")

_MODULE = "crfkit_bench_transformers_crf_crf"


def _load_crf_module():
    folder = package_folder("transformers-crf", "transformers_crf")
    path = os.path.join(folder, "crf.py")
    if not os.path.exists(path):
        raise PeerUnavailable(f"transformers-crf: {path} missing")
    if _MODULE in sys.modules:
        return sys.modules[_MODULE]
    file_spec = importlib.util.spec_from_file_location(_MODULE, path)
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[_MODULE] = module  # inspect.getsource of its methods needs the module registered
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript deprecation notices
            file_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[_MODULE]
        raise PeerUnavailable(f"transformers-crf: loading crf.py failed: {type(error).__name__}: {error}") from error
    return module


class TransformersCrf(PytorchCrfNbest):
    """pytorchcrf's API (same decoder, same private log Z) plus native marginals."""

    name = "transformers-crf"
    module = "transformers_crf (crf.py only)"
    dist = "transformers-crf"
    native = frozenset({"log_partition", "marginals", "viterbi", "kbest"})

    def _load(self):
        return _load_crf_module()

    def _marginals(self, state):
        return state["crf"].compute_posterior(state["x"].emissions, state["mask"])

    def _marginals_convert(self, state, out):
        return out.exp()
