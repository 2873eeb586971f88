"""Adapters of the peer CRF libraries behind crfkit's conventions (see base.py for the interface,
and each module's docstring for that peer's conventions as read from its source).

    from peers import load_peers
    for name, peer, reason in load_peers():   # peer is None when it cannot be imported
        ...
    peer = load("allencrf"); paths, scores = peer.viterbi(emissions, transitions, lengths, start, end)

The peers are installed by benchmarks/peers/install.sh (never touching torch).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .base import NATIVE, OPS, VIA_AUTOGRAD, Inputs, Peer, PeerUnavailable

# name (PyPI) -> (adapter module, class name): the order is the order of the report's columns.
REGISTRY: Dict[str, Tuple[str, str]] = {
    "torch-struct": ("torch_struct_peer", "TorchStruct"),
    "pytorch-crf": ("pytorch_crf_peer", "PytorchCrf"),
    "allencrf": ("allencrf_peer", "AllenCrf"),
    "TorchCRF": ("torchcrf_peer", "TorchCrf"),
    "pytorchcrf": ("pytorchcrf_peer", "PytorchCrfNbest"),
    "pyt-crf": ("pyt_crf_peer", "PytCrf"),
    "transformers-crf": ("transformers_crf_peer", "TransformersCrf"),
    "pytorch-crf-compiled": ("pytorch_crf_compiled_peer", "PytorchCrfCompiled"),
    "hmmlearn": ("hmmlearn_peer", "Hmmlearn"),
    "torbi": ("torbi_peer", "Torbi"),
}
NAMES = tuple(REGISTRY)

_LOADED: Dict[str, Tuple[Optional[Peer], Optional[str]]] = {}


def load(name: str) -> Peer:
    """The adapter of one peer; raises PeerUnavailable (with the reason) when its package is
    not installed or does not import."""
    if name not in REGISTRY:
        raise KeyError(f"unknown peer {name!r}; known: {', '.join(REGISTRY)}")
    if name not in _LOADED:
        module_name, class_name = REGISTRY[name]
        try:
            module = __import__(f"{__name__}.{module_name}", fromlist=[class_name])
            _LOADED[name] = (getattr(module, class_name)(), None)
        except PeerUnavailable as error:
            _LOADED[name] = (None, str(error))
    peer, reason = _LOADED[name]
    if peer is None:
        raise PeerUnavailable(reason)
    return peer


def load_peers(names: Optional[List[str]] = None) -> List[Tuple[str, Optional[Peer], Optional[str]]]:
    """[(name, adapter or None, reason it is unavailable or None)] for every (or the named) peer."""
    out = []
    for name in names or NAMES:
        try:
            out.append((name, load(name), None))
        except PeerUnavailable as error:
            out.append((name, None, f"not installed: {error}"))
    return out


__all__ = ["OPS", "NATIVE", "VIA_AUTOGRAD", "Inputs", "Peer", "PeerUnavailable", "REGISTRY", "NAMES",
           "load", "load_peers"]
