"""The uniform interface of the peer adapters, and helpers they share.

crfkit's conventions, which every adapter converts from and back to:
    emissions    (B, L, T) float, batch first
    transitions  (T, T)    transitions[from, to]
    start, end   (T,)      scores of the first / last tag
    lengths      (B,)      int64; sentence b is positions 0 .. lengths[b]-1 (left-aligned)
Results in crfkit's layout:
    log_partition            (B,)
    log_partition_fwd_bwd    (log Z (B,), d logZ.sum() / d emissions (B, L, T), d ... / d transitions (T, T) [from, to])
    marginals                (B, L, T), zero at padding
    viterbi                  paths (B, L) int64 with -1 padding, scores (B,)
    kbest                    paths (B, K, L) with -1 padding, scores (B, K), best first

An adapter separates what is timed from what is not: `bind(op, x, k)` builds the peer's module
(parameters overwritten with crfkit's transitions / start / end), its masks and layouts once,
and returns (fn, convert): `fn()` is the timed call (the peer's own computation, on inputs in
the layout the peer takes), `convert(fn())` turns its output into crfkit's layout (not timed;
where a peer returns paths without scores, convert rescores the paths with crfkit's reference
`sequence_score`, so that the check can compare scores). The methods log_partition / viterbi /
kbest / marginals with crfkit's argument order are built on bind.
"""
from __future__ import annotations

import importlib.metadata
import inspect
import sys
import textwrap
from typing import Any, Callable, Dict, FrozenSet, Optional, Sequence, Tuple

import torch

OPS = ("log_partition", "log_partition_fwd_bwd", "marginals", "viterbi", "kbest")
NATIVE = "native"
VIA_AUTOGRAD = "autograd of its log Z"


class PeerUnavailable(Exception):
    """The peer's package cannot be imported (the message says why)."""


class Inputs:
    """The arguments in crfkit's conventions (duck-type of benchmarks/cases.Inputs)."""

    def __init__(self, emissions, transitions, lengths, start, end, k=None):
        self.emissions, self.transitions, self.lengths = emissions, transitions, lengths
        self.start, self.end, self.k = start, end, k


def distribution_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def import_peer(module: str, dist: str):
    """Import a peer's module, or raise PeerUnavailable with the reason."""
    try:
        return __import__(module, fromlist=["_"])
    except Exception as error:  # ImportError, or a peer that breaks on import with this torch
        raise PeerUnavailable(f"{dist}: import {module} failed: {type(error).__name__}: {error}") from error


def package_folder(peer: str, package: str) -> str:
    """The folder of installed package `package`, found without importing it (its __init__ may
    need what is not installed); PeerUnavailable naming `peer` when it is not there."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except Exception as error:
        raise PeerUnavailable(f"{peer}: {type(error).__name__}: {error}") from error
    if spec is None or not spec.submodule_search_locations:
        raise PeerUnavailable(f"{peer}: package {package} not found")
    return list(spec.submodule_search_locations)[0]


def mask_from_lengths(lengths: torch.Tensor, L: int) -> torch.Tensor:
    """(B, L) bool, True at positions < lengths[b] (left-aligned)."""
    return torch.arange(L, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def pad_paths(paths: Sequence[Sequence[int]], L: int) -> torch.Tensor:
    """A list of tag lists (one per sentence, each as long as the sentence) as (B, L) int64
    with -1 padding."""
    out = torch.full((len(paths), L), -1, dtype=torch.long)
    for b, path in enumerate(paths):
        if len(path):
            out[b, : len(path)] = torch.as_tensor([int(t) for t in path], dtype=torch.long)
    return out


def mask_paths(paths: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Set positions at or past each sentence's length to -1 (paths (B, L) or (B, K, L))."""
    L = paths.shape[-1]
    valid = mask_from_lengths(lengths, L)
    if paths.dim() == 3:
        valid = valid.unsqueeze(1)
    return paths.masked_fill(~valid, -1)


def rescore(x, paths: torch.Tensor) -> torch.Tensor:
    """Scores of paths ((B, L) or (B, K, L), -1 padded) under crfkit's reference scoring."""
    import crfkit

    return crfkit.reference.sequence_score(x.emissions, x.transitions, paths.clamp(min=0), x.lengths,
                                           x.start, x.end)


def reshape_instead_of_view(cls: type, method: str) -> type:
    """A subclass of cls whose `method` is the peer's own source with every `.view(` replaced by
    `.reshape(` (recent torch refuses .view on the non-contiguous tensors some peers build in their
    n-best decoders). The peer's installed files are not touched; the method is recompiled from
    its source at run time, in the peer module's globals."""
    source = textwrap.dedent(inspect.getsource(getattr(cls, method)))
    patched = source.replace(".view(", ".reshape(")
    namespace: Dict[str, Any] = {}
    module_globals = vars(sys.modules[cls.__module__])
    exec(compile(patched, f"<{cls.__module__}.{cls.__name__}.{method}: .view -> .reshape>", "exec"),
         module_globals, namespace)
    return type(cls.__name__ + "ReshapePatched", (cls,), {method: namespace[method],
                                                         "__doc__": cls.__doc__})


class Peer:
    """One peer library behind crfkit's conventions. Subclasses set the class attributes and
    implement _setup and the primitive ops they have.

    name: the PyPI name; module: what is imported; version: the installed version;
    native: ops the peer computes itself; supports: every op the adapter can run (native, or
    derived: marginals as the gradient of the peer's log Z, labelled by how(op));
    has_start_end: False for a peer without start / end scores (it is then compared on inputs
    whose start / end are zero).
    """

    name = ""
    module = ""
    dist = ""
    native: FrozenSet[str] = frozenset()
    has_start_end = True
    returns_scores: FrozenSet[str] = frozenset()  # of viterbi / kbest: the peer returns the scores itself

    def __init__(self) -> None:
        self.lib = self._load()
        self.version = distribution_version(self.dist or self.name)

    def _load(self):
        """The peer's module (overridden where importing the package itself is not possible)."""
        return import_peer(self.module, self.name)

    # ---- what the adapter offers ----------------------------------------------------------
    @property
    def supports(self) -> FrozenSet[str]:
        derived = {"marginals", "log_partition_fwd_bwd"} if "log_partition" in self.native else set()
        return frozenset(self.native | derived)

    def how(self, op: str) -> Optional[str]:
        """How the op is computed: "native", "autograd of its log Z" (marginals of a peer that has
        none), "backward of its log Z" (fwd+bwd: every peer's training path), or None."""
        if op == "log_partition_fwd_bwd" and op in self.supports:
            return "backward of its log Z"
        if op in self.native:
            return NATIVE
        if op in self.supports:
            return VIA_AUTOGRAD
        return None

    def skip_reason(self, op: str, x, k: Optional[int] = None) -> Optional[str]:
        """Why the adapter declines this cell (reported as "skipped: <why>", not run nor
        timed), or None (default: it runs every cell of the ops it supports)."""
        return None

    def memory_estimate(self, op: str, x, k: Optional[int] = None) -> int:
        """Bytes the peer's largest intermediate is expected to take (0: small)."""
        return 0

    # ---- to implement ---------------------------------------------------------------------
    def _setup(self, x) -> Any:
        """Untimed: the peer's module with crfkit's parameters, masks, layouts."""
        raise NotImplementedError

    def _log_z(self, state, emissions: torch.Tensor) -> torch.Tensor:
        """(B,) log Z of batch-first emissions (which may require grad); differentiable."""
        raise NotImplementedError

    def _transitions_leaf(self, state) -> torch.Tensor:
        """The tensor holding the transitions inside the peer (its gradient is reported as
        d log Z / d transitions, in crfkit's [from, to] orientation after _transitions_grad)."""
        raise NotImplementedError

    def _transitions_grad(self, state, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def _viterbi(self, state) -> Any:
        raise NotImplementedError

    def _viterbi_convert(self, state, out) -> Tuple[torch.Tensor, torch.Tensor]:
        """Default: the peer returned a list of tag lists and no scores: pad with -1, rescore."""
        x = state["x"]
        paths = pad_paths(out, x.emissions.shape[1])
        return paths, rescore(x, paths)

    def _kbest(self, state, k: int) -> Any:
        raise NotImplementedError

    def _kbest_convert(self, state, out, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _marginals(self, state) -> Any:
        raise NotImplementedError

    def _marginals_convert(self, state, out) -> torch.Tensor:
        raise NotImplementedError

    # ---- the uniform interface --------------------------------------------------------------
    def bind(self, op: str, x, k: Optional[int] = None) -> Tuple[Callable[[], Any], Callable[[Any], tuple]]:
        """(fn, convert) for one op on inputs x (crfkit's conventions); see the module docstring."""
        if op not in self.supports:
            raise NotImplementedError(f"{self.name} has no {op}")
        state = self._setup(x)
        L = x.emissions.shape[1]
        if op == "log_partition":
            def fn():
                with torch.no_grad():
                    return self._log_z(state, x.emissions)
            return fn, lambda out: (out.detach(),)
        if op == "log_partition_fwd_bwd":
            transitions = self._transitions_leaf(state)

            def fn():
                emissions = x.emissions.detach().requires_grad_()
                log_z = self._log_z(state, emissions)
                grad_e, grad_t = torch.autograd.grad(log_z.sum(), (emissions, transitions))
                return log_z.detach(), grad_e, grad_t
            return fn, lambda out: (out[0], out[1], self._transitions_grad(state, out[2]))
        if op == "marginals":
            valid = mask_from_lengths(x.lengths, L).unsqueeze(-1)
            if "marginals" in self.native:
                def fn():
                    with torch.no_grad():
                        return self._marginals(state)
                return fn, lambda out: (self._marginals_convert(state, out).masked_fill(~valid, 0),)

            def fn():  # d log Z / d emissions = the marginals
                emissions = x.emissions.detach().requires_grad_()
                return torch.autograd.grad(self._log_z(state, emissions).sum(), emissions)[0]
            return fn, lambda out: (out.masked_fill(~valid, 0),)
        if op == "viterbi":
            def fn():
                with torch.no_grad():
                    return self._viterbi(state)
            return fn, lambda out: self._viterbi_convert(state, out)
        if op == "kbest":
            if k is None:
                raise ValueError("kbest needs k")

            def fn():
                with torch.no_grad():
                    return self._kbest(state, k)
            return fn, lambda out: self._kbest_convert(state, out, k)
        raise ValueError(f"unknown op {op!r}")

    def run(self, op: str, x, k: Optional[int] = None) -> tuple:
        fn, convert = self.bind(op, x, k)
        return convert(fn())

    def log_partition(self, emissions, transitions, lengths, start, end) -> torch.Tensor:
        return self.run("log_partition", Inputs(emissions, transitions, lengths, start, end))[0]

    def viterbi(self, emissions, transitions, lengths, start, end):
        return self.run("viterbi", Inputs(emissions, transitions, lengths, start, end))

    def kbest(self, emissions, transitions, lengths, start, end, k: int):
        return self.run("kbest", Inputs(emissions, transitions, lengths, start, end, k), k)

    def marginals(self, emissions, transitions, lengths, start, end) -> torch.Tensor:
        return self.run("marginals", Inputs(emissions, transitions, lengths, start, end))[0]

    def __repr__(self) -> str:
        return f"<peer {self.name} {self.version}>"


class ModulePeer(Peer):
    """The pytorch-crf family: an nn.Module with parameters transitions [from, to], start and
    end, whose parameters are overwritten with crfkit's. Subclasses name the parameters and
    set `batch_first` (the layout of the private log Z method they call)."""

    transitions_attr = "transitions"
    start_attr = "start_transitions"
    end_attr = "end_transitions"
    batch_first = True

    def _make(self, num_tags: int) -> torch.nn.Module:
        raise NotImplementedError

    def _setup(self, x):
        T = x.emissions.shape[2]
        crf = self._make(T)
        with torch.no_grad():
            getattr(crf, self.transitions_attr).copy_(x.transitions)
            getattr(crf, self.start_attr).copy_(x.start)
            getattr(crf, self.end_attr).copy_(x.end)
        mask = mask_from_lengths(x.lengths, x.emissions.shape[1])
        return {"crf": crf, "x": x, "mask": mask, "mask_tf": mask.t().contiguous()}

    def _transitions_leaf(self, state):
        return getattr(state["crf"], self.transitions_attr)
