"""Checked or deferred error reporting of the CUDA kernels (crfkit.deferred_errors, crfkit.check_errors).

The CUDA kernels find data-dependent errors on the device (a length outside [0, L], NaN or +inf
scores, a tag outside [0, T)). By default each op then copies a few status words to the host and
raises at once: one wait for the GPU per call. In deferred mode nothing is copied: the kernels
record errors in persistent words on the device and `check_errors()` raises them, so a training
step never waits for the host because of crfkit, and every op can be captured in a CUDA graph.
While a CUDA graph is being captured the ops are deferred whatever the mode (a capture cannot
read anything back), so `torch.compile(mode="reduce-overhead")` and `torch.cuda.graph` need no
setting; after replaying a graph, call `check_errors()` where an error should surface.

A deferred call on bad input returns meaningless values until the check (the kernels never read
or write out of bounds on bad data). CPU ops always raise at once: they need no copy.

The switch and the words live in the CUDA code (csrc/cuda/common.cu) behind two C functions,
reached here with ctypes in every library that has them: crfkit._C built with CUDA, and the
CUDA emulator's library (tools/cuda_compile_check/emulator) once loaded.
"""
from __future__ import annotations

import ctypes
from typing import List, Literal

_WORDS = 7  # csrc/cuda/common.cuh: kNumStatusWords
_CLEAR = 2**63 - 1  # kStatusClear

_libraries: List[ctypes.CDLL] = []
_deferred = False


def add_library(path: str) -> None:
    """Use the switch and the words of the shared library at `path` if it has them (crfkit._C
    without CUDA has not). Its mode is set to the current one."""
    library = ctypes.CDLL(path)
    if not hasattr(library, "crfkit_cuda_take_deferred_errors"):
        return
    library.crfkit_cuda_set_deferred_errors.argtypes = [ctypes.c_int]
    library.crfkit_cuda_set_deferred_errors.restype = ctypes.c_int
    library.crfkit_cuda_take_deferred_errors.argtypes = [ctypes.POINTER(ctypes.c_longlong),
                                                         ctypes.POINTER(ctypes.c_int)]
    library.crfkit_cuda_take_deferred_errors.restype = ctypes.c_int
    library.crfkit_cuda_set_deferred_errors(int(_deferred))
    _libraries.append(library)


def _set(enabled: bool) -> None:
    global _deferred
    _deferred = bool(enabled)
    for library in _libraries:
        library.crfkit_cuda_set_deferred_errors(int(_deferred))


def is_deferred() -> bool:
    """True while the CUDA ops record errors for check_errors() instead of raising."""
    return _deferred


class deferred_errors:
    """Let the CUDA ops record bad input on the device instead of raising after each call (one
    wait for the GPU less per call); `check_errors()` raises what they recorded. As a call or
    for a block, like torch.set_grad_enabled:

        crfkit.deferred_errors()            # deferred from now on (deferred_errors(False): back)
        with crfkit.deferred_errors():      # deferred within the block only
            loss = step(batch)
        crfkit.check_errors()               # raises ValueError if an op saw bad input

    Leaving the block restores the previous mode; it does not check (call check_errors()).
    """

    def __init__(self, enabled: bool = True) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        self._previous = _deferred
        _set(enabled)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info) -> Literal[False]:
        _set(self._previous)
        return False


def _message(words: List[int], device: int) -> str:
    """The first error of the words, in the order the checked ops raise them."""
    where = "the CPU emulator" if device < 0 else f"cuda:{device}"
    found = []
    if words[0] != _CLEAR:
        found.append(f"lengths[{words[0]}] was outside [0, seq_len]")
    if words[1] != _CLEAR:
        found.append("transitions contained NaN or +inf (use -inf to forbid a transition)")
    if words[2] != _CLEAR:
        found.append("start contained NaN or +inf (use -inf to forbid a first tag)")
    if words[3] != _CLEAR:
        found.append("end contained NaN or +inf (use -inf to forbid a last tag)")
    if words[4] != _CLEAR:
        found.append(f"a tag was not a tag index in [0, num_tags) (flat index {words[4]} of tags)")
    if words[5] != _CLEAR:
        found.append(f"emissions[{words[5]}] contained NaN or +inf within its length (use -inf to forbid a tag)")
    if words[6] != _CLEAR:
        found.append(f"noise[:, {words[6]}] contained NaN or +-inf within the sentence's length (the samplers' "
                     "standard Gumbels)")
    return (f"crfkit: a CUDA op on {where} since the last check_errors() was given bad input: {found[0]}; "
            "its results are meaningless")


def check_errors() -> None:
    """Raise ValueError if a CUDA op called in deferred mode (or captured in a CUDA graph and
    replayed) since the last check found bad input, and clear the record. Waits for the GPU
    (one small copy per device); nothing to do without CUDA kernels. Not allowed while a CUDA
    graph is being captured."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("crfkit.check_errors() reads from the GPU and cannot run while a CUDA graph is captured; "
                           "call it after replaying the graph")
    first = None
    for library in _libraries:
        words = (ctypes.c_longlong * _WORDS)()
        device = ctypes.c_int(0)
        found = library.crfkit_cuda_take_deferred_errors(words, ctypes.byref(device))
        if found < 0:
            raise RuntimeError("crfkit.check_errors(): reading the recorded errors from the GPU failed "
                               "(a CUDA error; run with CUDA_LAUNCH_BLOCKING=1 to find the failing call)")
        if found and first is None:
            first = _message(list(words), device.value)
    if first is not None:
        raise ValueError(first)
