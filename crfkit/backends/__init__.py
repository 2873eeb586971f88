"""Which implementation runs the ops, and why.

Backends, in order of preference:
- "compiled": the C++ (and, when built for it, CUDA) kernels of crfkit._C, registered as
  torch.ops.crfkit.* with autograd and fake implementations (crfkit/backends/compiled.py).
- "numba": the same CPU kernels written in Python and compiled by numba
  (crfkit/backends/numba_backend.py), when numba is installed: the fallback when the
  extension is not built (compiled on first use, then cached on disk).
- "reference": plain PyTorch (crfkit/reference.py): slower, always available.

The environment variable CRFKIT_BACKEND (compiled | numba | reference) forces one at import;
crfkit.use_backend(name) switches now, or within a `with` block (the tests use it to run one
suite on each).

Where no usable crfkit._C is installed but this copy of crfkit can compile one (crfkit/_build.py,
which says when and why), the first op call (the first current()) compiles it, announced on
stderr, loads it and switches to "compiled", unless a backend was forced or chosen; until then,
and where it cannot or fails, numba or the reference runs and backend_info()["reason"] says why.
build_extension() does it now.

The numba backend is imported on first need (when it is chosen, or asked about by available() /
backend_info()): importing numba takes about 0.23 s and 55 MiB of memory, which users of the
compiled backend would otherwise pay at every `import crfkit`.

Every backend is a module that provides the contract CRFBackend below; crfkit.functional checks
the arguments (crfkit._arguments) and calls those functions of current(). Nothing here, or in
a backend, imports the front end (crfkit.functional, crfkit.nn, crfkit.distribution).
"""
from __future__ import annotations

import importlib
import os
import sys
import threading
import types
import warnings
from typing import Dict, Literal, Optional, Protocol, Tuple, runtime_checkable

import torch
from torch import Tensor

from .. import _extension, reference


@runtime_checkable
class CRFBackend(Protocol):
    """What every backend module provides (crfkit.reference, crfkit.backends.compiled,
    crfkit.backends.numba_backend): the functions below, as module-level names, and
    VALUES_CHECKED_ON_DEVICE. A backend without its own implementation of one assigns its
    fallback in its own module, with a comment saying why (e.g. the numba backend's
    expected_transition_counts = reference.expected_transition_counts).

    The arguments arrive prepared by crfkit._arguments.prepare: emissions (B, L, T) contiguous
    float32 / float64; transitions (T, T), start (T,), end (T,) contiguous in the emissions'
    dtype and on their device (start / end zeros when the caller gave none); lengths (B,)
    contiguous int64, in [0, L] unless the device type is in VALUES_CHECKED_ON_DEVICE. The
    order is the one of crfkit.functional and of the compiled ops' schemas
    (crfkit/backends/op_table.py): emissions, transitions, then k, n or tags, then lengths, start,
    end (the samplers: their generator last); decoders return scores before paths. Every
    result that holds scores is differentiable in emissions, transitions, start and end.
    """

    PER_EXAMPLE_DEVICES: Tuple[str, ...]
    """The device types on which this backend's functions take per-example parameters
    (transitions (B, Lt, T, T), start / end (B, T): crfkit._arguments.per_example_form); on the
    others crfkit.functional runs the reference for such calls (for_transitions below). ("*",):
    every device."""

    VALUES_CHECKED_ON_DEVICE: Tuple[str, ...]
    """The device types ("cuda", ...) on which this backend's kernels check the values of
    lengths and tags themselves (raising, with the argument named, once they have run); the
    front end then does not read them back to the host. () where the front end checks them."""

    def log_partition(self, emissions: Tensor, transitions: Tensor, lengths: Tensor, start: Tensor,
                      end: Tensor) -> Tensor:
        """log_partition(emissions, transitions, lengths, start, end) -> log Z (B,)."""
        ...

    def marginals(self, emissions: Tensor, transitions: Tensor, lengths: Tensor, start: Tensor,
                  end: Tensor) -> Tensor:
        """marginals(emissions, transitions, lengths, start, end) -> P(y_i = t | x) (B, L, T),
        0 at padded positions."""
        ...

    def expected_transition_counts(self, emissions: Tensor, transitions: Tensor, lengths: Tensor, start: Tensor,
                                   end: Tensor) -> Tensor:
        """expected_transition_counts(emissions, transitions, lengths, start, end) -> (B, T, T),
        the pairwise marginals summed over positions."""
        ...

    def marginals_and_transition_counts(self, emissions: Tensor, transitions: Tensor, lengths: Tensor,
                                        start: Tensor, end: Tensor) -> Tuple[Tensor, Tensor]:
        """marginals_and_transition_counts(emissions, transitions, lengths, start, end) ->
        (marginals (B, L, T), expected transition counts (B, T, T)): what the two functions
        above return, from one forward-backward where the backend can."""
        ...

    def viterbi(self, emissions: Tensor, transitions: Tensor, lengths: Tensor, start: Tensor,
                end: Tensor) -> Tuple[Tensor, Tensor]:
        """viterbi(emissions, transitions, lengths, start, end) -> (scores (B,), paths (B, L)
        int64, -1 at padded positions)."""
        ...

    def kbest_viterbi(self, emissions: Tensor, transitions: Tensor, k: int, lengths: Tensor, start: Tensor,
                      end: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """kbest_viterbi(emissions, transitions, k, lengths, start, end) -> (scores (B, k),
        paths (B, k, L) int64, log_probs (B, k)); missing rows have path -1 and -inf scores."""
        ...

    def sequence_score(self, emissions: Tensor, transitions: Tensor, tags: Tensor, lengths: Tensor,
                       start: Tensor, end: Tensor) -> Tensor:
        """sequence_score(emissions, transitions, tags, lengths, start, end) -> (B, N) for
        tags (B, N, L) int64 contiguous (always 3-dimensional here; values at real positions
        in [0, T) unless the device type is in VALUES_CHECKED_ON_DEVICE)."""
        ...

    def sample_with_replacement(self, emissions: Tensor, transitions: Tensor, n: int, lengths: Tensor,
                                start: Tensor, end: Tensor, generator: Optional[torch.Generator]) -> Tensor:
        """sample_with_replacement(emissions, transitions, n, lengths, start, end, generator) ->
        paths (B, n, L) int64: n exact, independent samples per sentence (forward filtering,
        backward sampling), -1 at padded positions and in every row of a sentence with no allowed
        sequence; every random number from generator (torch's default when None), drawn in the
        order of crfkit/sampling.py, so that one seeded generator gives the same paths on every
        backend (crfkit/sampling.py says to what precision). Not differentiable (the front end
        scores the paths)."""
        ...

    def sample_without_replacement(self, emissions: Tensor, transitions: Tensor, n: int, lengths: Tensor,
                                   start: Tensor, end: Tensor, generator: Optional[torch.Generator]) -> Tensor:
        """sample_without_replacement(emissions, transitions, n, lengths, start, end, generator) ->
        paths (B, n, L) int64: n distinct sequences per sentence, an exact sample without
        replacement, the rows in the order of sequential drawing (stochastic beam search), -1 at
        padded positions and in the rows after the last allowed sequence (a length-0 sentence:
        its empty sequence in row 0, then nothing); random numbers from generator in the order of
        crfkit/sampling.py, as sample_with_replacement's. Not differentiable."""
        ...


_available: Dict[str, types.ModuleType] = {"reference": reference}
_unavailable: Dict[str, str] = {}
# True while the first op call is to compile crfkit._C (crfkit/_build.py): current() checks it.
_first_use_pending = False
_first_use_lock = threading.RLock()

try:
    # First crfkit._C itself (crfkit/_extension.py): its error says why it cannot be used (not
    # built, built for another torch or Python) and it warns when a built one is not used. The
    # plain `from .. import _C` in compiled.py would report a missing extension as a circular
    # import.
    _extension.load()
    from . import compiled

    _available["compiled"] = compiled
except Exception as error:  # ImportError, or an ABI mismatch (OSError / undefined symbol)
    _unavailable["compiled"] = f"{type(error).__name__}: {error}"
    _first_use_pending = getattr(error, "first_use_build", False) is True
    if "crfkit._C" in sys.modules and sys.modules["crfkit._C"] is not None:
        # The extension loaded, but the compiled backend did not (an extension older than
        # compiled.py: its op schemas differ): as loud as an extension that fails to load.
        warnings.warn(f"crfkit: the compiled kernels are not used: {_unavailable['compiled']}", RuntimeWarning,
                      stacklevel=2)

_IMPORTED_ON_FIRST_NEED = {"numba": ".numba_backend"}
_PREFERENCE = ("compiled", "numba", "reference")


def _load(name: str) -> bool:
    """Whether backend `name` can be used, importing it first if it is loaded on first need."""
    if name in _available:
        return True
    if name in _unavailable or name not in _IMPORTED_ON_FIRST_NEED:
        return False
    try:
        _available[name] = importlib.import_module(_IMPORTED_ON_FIRST_NEED[name], __name__)
    except Exception as error:  # ImportError: numba is not installed (pip install crfkit[numba])
        _unavailable[name] = f"{type(error).__name__}: {error}"
        return False
    return True

_DESCRIPTION = {"compiled": "the compiled extension", "numba": "numba", "reference": "the reference"}


def _initial_choice():
    global _first_use_pending
    forced = os.environ.get("CRFKIT_BACKEND", "").strip().lower()
    if forced:
        if forced not in _PREFERENCE:
            raise ValueError(f"CRFKIT_BACKEND must be one of {_PREFERENCE}, got {forced!r}")
        if forced == "compiled" and _first_use_pending:  # asked for: compiled now, at import
            _build_and_load(explicit=False)
        _first_use_pending = False  # a forced backend is kept: no build at the first op call
        if not _load(forced):
            raise ImportError(f"CRFKIT_BACKEND={forced} but it cannot be loaded: {_unavailable[forced]}")
        return forced, f"forced by CRFKIT_BACKEND={forced}"
    return _automatic_choice()


def _automatic_choice():
    """The best backend that loads, and why the better ones did not."""
    for name in _PREFERENCE:
        if _load(name):
            # Why each better backend was passed over, e.g. "the compiled extension is not
            # available: ImportError: ...; numba is not available: ImportError: ...".
            skipped = [f"{_DESCRIPTION[other]} is not available: {_unavailable.get(other, '?')}"
                       for other in _PREFERENCE[: _PREFERENCE.index(name)]]
            why = "; ".join(skipped) if skipped else f"{_DESCRIPTION[name]} loaded"
            if name == "compiled" and _extension.version_note:
                why += f" ({_extension.version_note})"
            if name == "compiled" and _extension.cached_build:
                why += f" (built at first use: {_extension.cached_build})"
            return name, why
    raise AssertionError("the reference backend is always available")


def _build_and_load(explicit: bool, verbose: bool = False) -> str:
    """Compile crfkit._C for this process, or take the finished build in crfkit's cache
    (crfkit/_build.py), load it and make the compiled backend available; the library's path.
    A failure is recorded as the compiled backend's reason; raised (RuntimeError) if `explicit`."""
    from .. import _build

    try:
        _, library, _ = _build.build(verbose=verbose, retry=explicit)
        _build.load_library(library)
        from . import compiled
    except Exception as error:
        why = str(error) if isinstance(error, _build.BuildError) else f"{type(error).__name__}: {error}"
        _unavailable["compiled"] = why
        if not explicit:
            _build.announce(f"crfkit: {why}; running {_DESCRIPTION[_automatic_choice()[0]]} instead")
            return ""
        raise RuntimeError(why) from error
    _extension.cached_build = os.path.dirname(library)
    _available["compiled"] = compiled
    _unavailable.pop("compiled", None)
    return library


def _first_use_build() -> None:
    """The first op call's build (current()): only for the backend chosen automatically, and
    not while torch.compile traces."""
    global _first_use_pending, _current, _reason, _automatic_reason
    if _reason is not _automatic_reason:  # forced or chosen by the user: no build
        return
    import torch

    if torch.compiler.is_compiling():
        return
    with _first_use_lock:
        if not _first_use_pending or _reason is not _automatic_reason:
            return
        _first_use_pending = False
        _build_and_load(explicit=False)
        _current, _reason = _automatic_choice()
        _automatic_reason = _reason


_current, _reason = _initial_choice()
# The reason of the automatic choice (the same object): a first-use build replaces that choice only.
_automatic_reason = _reason if not os.environ.get("CRFKIT_BACKEND", "").strip() else None


def current():
    """The backend module in use."""
    if _first_use_pending:
        _first_use_build()
    return _available[_current]


def for_transitions(transitions: Tensor):
    """The backend for prepared transitions: current(), or the reference where they are per
    example ((B, Lt, T, T)) and the current backend has no kernels for them on their device."""
    backend = current()
    devices = backend.PER_EXAMPLE_DEVICES
    if transitions.dim() == 4 and "*" not in devices and transitions.device.type not in devices:
        return reference
    return backend


def build_extension(verbose: bool = False) -> str:
    """Compile crfkit._C for the running torch and this CPU now, or reuse the build in crfkit's
    cache (crfkit/_build.py: the first-use build, done ahead of the first op call; also what
    `python -m crfkit.build` runs), load it, and use the compiled backend from now on unless a
    backend was forced or chosen. Returns the path of the crfkit._C library in use (of the one
    just built, for the next process, when this one already runs a crfkit._C built for another
    torch: one process cannot load two). A build that failed before is retried. RuntimeError
    says why it cannot be built, with the log's path when compiling failed. verbose: the
    compiler's output on stdout."""
    global _first_use_pending, _current, _reason, _automatic_reason
    with _first_use_lock:
        if "compiled" in _available and not _extension.version_note:
            from .. import _C

            return _C.__file__
        if sys.modules.get("crfkit._C", 0) is None:
            raise RuntimeError("crfkit._C is blocked in this process (sys.modules['crfkit._C'] is None)")
        if "crfkit._C" in sys.modules:
            # A crfkit._C built for another torch, or refused (out of date), is loaded: build for
            # the next process, which loads this one (crfkit/_extension.py looks in the cache).
            from .. import _build

            try:
                _, library, _ = _build.build(verbose=verbose, retry=True)
            except _build.BuildError as error:
                raise RuntimeError(str(error)) from error
            _build.announce(f"crfkit: built {library}; this process keeps the crfkit._C it has loaded "
                            f"({sys.modules['crfkit._C'].__file__})")
            return library
        _first_use_pending = False
        library = _build_and_load(explicit=True, verbose=verbose)
        if _reason is _automatic_reason:
            _current, _reason = _automatic_choice()
            _automatic_reason = _reason
        return library


def available() -> tuple:
    """The backends that can be used, best first (imports those loaded on first need)."""
    return tuple(name for name in _PREFERENCE if _load(name))


def backend_info() -> dict:
    """Which implementation runs crfkit's ops and why, e.g.

    {'backend': 'compiled', 'reason': 'the compiled extension loaded',
     'available': ('compiled', 'numba', 'reference'), 'unavailable': {}, 'cuda_kernels': False,
     'cpu_isa': 'avx512', 'extension': '/.../crfkit/_C.cpython-311-x86_64-linux-gnu.so'}

    cpu_isa: the copy of the C++ CPU kernels in use (crfkit._C.cpu_isa(); None without the
    extension): 'baseline', 'avx2' or 'avx512' in the default build, 'march=native' in a
    CRFKIT_ARCH=native build (setup.py), the level's -march ('march=x86-64-v4' for avx512) in a
    first-use build (crfkit/_build.py).
    extension: the file of the crfkit._C in use (the installed one, or a first-use build in
    crfkit's cache), or None.
    """
    usable = available()  # first: it records why a backend loaded on first need is unusable
    cuda, cpu_isa, extension = False, None, None
    if "compiled" in _available:
        import torch

        from .. import _C

        cuda = torch._C._dispatch_has_kernel_for_dispatch_key("crfkit::log_partition", "CUDA")
        cpu_isa = _C.cpu_isa() if hasattr(_C, "cpu_isa") else None  # None: built before it existed
        extension = getattr(_C, "__file__", None)
    return {
        "backend": _current,
        "reason": _reason,
        "available": usable,
        "unavailable": dict(_unavailable),
        "cuda_kernels": cuda,
        "cpu_isa": cpu_isa,
        "extension": extension,
    }


def release_cached_memory() -> int:
    """Free the CPU buffers the compiled backend keeps between calls and return their size in
    bytes. It keeps the last few freed buffers of a differentiable log_partition (its marginals,
    expected transition counts and emissions gradient; at most 256 MiB in 8 buffers;
    csrc/cpu/recycled_memory.h), because a fresh block of that size page-faults on every call
    of a training loop. 0 when nothing is kept or the extension is not built. (Each thread that
    ran marginals or a differentiable log Z also keeps one workspace of up to 16 MiB, freed
    with the thread.)"""
    if "compiled" not in _available:
        return 0
    from .. import _C

    return int(_C.release_cached_memory())


def cached_memory() -> int:
    """Bytes of buffers the compiled backend keeps now (see release_cached_memory)."""
    if "compiled" not in _available:
        return 0
    from .. import _C

    return int(_C.cached_memory())


def set_backend(name: str) -> None:
    """Use `name` ('compiled', 'numba' or 'reference') from now on."""
    global _current, _reason
    if name not in _PREFERENCE:
        raise ValueError(f"backend must be one of {_PREFERENCE}, got {name!r}")
    if not _load(name):
        raise RuntimeError(f"backend {name!r} is not available: {_unavailable.get(name)}")
    _current, _reason = name, "chosen with crfkit.set_backend / use_backend"


class use_backend:
    """Switch to backend `name` ('compiled', 'numba' or 'reference'), as a call or for a block.

    Like torch.set_grad_enabled, it works both ways:

        crfkit.use_backend("reference")        # switches now and stays switched (= set_backend)
        with crfkit.use_backend("reference"):  # switches for the block only
            ...                                # the previous backend and its reason are back
                                               # after the block, also when it raises

    The switch happens when it is called, so an unknown or unavailable name raises there,
    with set_backend's errors; the state to restore is the one seen at that call.
    """

    def __init__(self, name: str) -> None:
        self._previous = (_current, _reason)  # read before set_backend, which may raise
        set_backend(name)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info) -> Literal[False]:
        global _current, _reason
        _current, _reason = self._previous
        return False  # never swallow the block's exception
