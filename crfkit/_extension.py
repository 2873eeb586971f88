"""Loading crfkit._C (the compiled kernels), and the true reason when it cannot be used.

The extension is compiled against torch's stable C ABI (csrc/tensor.h) for a target torch
version: it loads under that torch and every later one. setup.py records the torch it built
against and the target in crfkit/_build_info.py (generated, not in git). load() refuses a build
whose target is newer than the running torch, and warns (RuntimeWarning) when an extension
present fails to load, naming both versions and the rebuild command: otherwise crfkit would
quietly fall back to a slower backend. (A build that recorded no target, made before the stable
ABI, is taken as one for its exact torch.) A checkout where the extension was never built
(CRFKIT_NO_EXTENSION=1) gets no warning, only the reason in crfkit.backend_info().

Where no usable crfkit._C is installed (not built: a pure-Python wheel; built for another torch
or Python; failing to load) and this copy of crfkit carries its C++ sources, the first-use build
takes over (crfkit/_build.py): a build for the running torch and this CPU already in crfkit's
cache is loaded (no warning: it matches), else the ImportError carries `first_use_build = True`
and crfkit.backends compiles it at the first op call (announced on stderr, no warning either);
a binary built for another torch is then not loaded at all. Where the first-use build cannot
run, the reason says why, and a present but unusable binary warns as before.
"""
from __future__ import annotations

import glob
import importlib
import importlib.machinery
import importlib.util
import os
import runpy
import sys
import warnings
from typing import Optional

import torch

REBUILD = ("`pip install --no-build-isolation -e .` (or `make setup`) in the crfkit checkout, or reinstall "
           "crfkit with --no-build-isolation")

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

# Set by load() when the extension loaded but was built against another torch: the note that
# crfkit.backend_info()["reason"] carries.
version_note: Optional[str] = None
# Set by load() when crfkit._C came from a first-use build in crfkit's cache: its folder.
cached_build: Optional[str] = None


def built_with_torch() -> Optional[str]:
    """The torch version crfkit._C was built against (crfkit/_build_info.py), or None when no
    build recorded it. Read from this package's folder: an import could find another checkout's
    file through an editable install's finder (see load)."""
    path = os.path.join(PACKAGE_DIR, "_build_info.py")
    if not os.path.isfile(path):
        return None
    return runpy.run_path(path).get("TORCH_VERSION")


def built_for_torch() -> Optional[str]:
    """The oldest torch crfkit._C loads under (its stable-ABI target, crfkit/_build_info.py), or
    None when the build recorded none."""
    path = os.path.join(PACKAGE_DIR, "_build_info.py")
    if not os.path.isfile(path):
        return None
    return runpy.run_path(path).get("TORCH_TARGET")


def _release(version: str) -> tuple:
    """(major, minor) of a torch version string: '2.13.0+cpu' -> (2, 13)."""
    parts = version.split("+")[0].split(".")
    return tuple(int("".join(ch for ch in part if ch.isdigit()) or 0) for part in parts[:2])


def _fits_running_torch(built: Optional[str]) -> bool:
    """Whether the installed crfkit._C suits the running torch: built against it, or against a
    stable-ABI target it reaches."""
    target = built_for_torch()
    if target is not None:
        return _release(torch.__version__) >= _release(target)
    return built is None or built == torch.__version__


def _versions(built: Optional[str]) -> str:
    running = torch.__version__
    if built is None:
        return f"torch {running} is running (the torch crfkit._C was built against is not recorded)"
    return f"crfkit._C was built against torch {built} and torch {running} is running"


def _unusable(reason: str, stacklevel: int = 3) -> ImportError:
    """Warn that a built extension is not used, and return the ImportError to raise."""
    warnings.warn(f"crfkit: the compiled kernels are not used: {reason}", RuntimeWarning, stacklevel=stacklevel)
    return ImportError(reason)


def _first_use_instead(problem: str, rebuild: str = "rebuild it"):
    """What replaces an installed crfkit._C that cannot be used (`problem`; crfkit/_build.py):
    (module, reason) for a finished first-use build in crfkit's cache; raises the ImportError
    (with first_use_build = True) when the first op call will build one; else (None, reason),
    the reason saying how to `rebuild` it, and why no first-use build where this copy of crfkit
    has its sources."""
    global cached_build
    from . import _build

    found = _build.find_built()
    if found is not None:
        try:
            module = _build.load_library(found[1])
        except (ImportError, OSError) as error:
            problem = f"{problem}; the first-use build in {found[0].folder} failed to load ({error})"
        else:
            cached_build = found[0].folder
            return module, problem
    pending, note = _build.first_use_status()
    if pending:
        error = ImportError(f"{problem}; {note}")
        error.first_use_build = True
        raise error
    reason = f"{problem}; {rebuild} with {REBUILD}"
    return None, (f"{reason}; {note}" if note else reason)


def _raise_or_load(problem: str, warn: bool, rebuild: str = "rebuild it", cause: Optional[BaseException] = None):
    """The cached first-use build in place of an unusable crfkit._C, or raise the ImportError
    (warning when `warn`: a binary is present but not used)."""
    module, text = _first_use_instead(problem, rebuild)
    if module is not None:
        return module
    raise (_unusable(text, stacklevel=4) if warn else ImportError(text)) from cause


def load():
    """Import and return crfkit._C. Raises ImportError whose message is the true reason when it
    cannot be used; warns (RuntimeWarning) when an extension is present but not used, or loads
    but was built against another torch."""
    global version_note
    name = f"{__package__}._C"
    built = built_with_torch()
    if sys.modules.get(name, 0) is not None:  # None: the import is blocked on purpose (tests)
        spec = importlib.util.find_spec(name)
        if spec is None:
            present = sorted(os.path.basename(p) for p in glob.glob(os.path.join(PACKAGE_DIR, "_C.*"))
                             if p.endswith((".so", ".pyd")))
            if not present:
                return _raise_or_load(f"crfkit._C is not built (no _C*.so in {PACKAGE_DIR})", warn=False,
                                      rebuild="build it")
            suffixes = ", ".join("_C" + suffix for suffix in importlib.machinery.EXTENSION_SUFFIXES)
            return _raise_or_load(f"crfkit._C is built for another Python: found {', '.join(present)}, but Python "
                                  f"{sys.version_info.major}.{sys.version_info.minor} loads only {suffixes}",
                                  warn=True)
        # An editable install of another checkout maps crfkit.* to that checkout's folder
        # (setuptools' finder comes after the normal path search), so a checkout without its own
        # build would load another checkout's binary, built from other sources.
        origin = os.path.abspath(spec.origin or "")
        if os.path.dirname(origin) != PACKAGE_DIR:
            return _raise_or_load(f"crfkit._C is not built in {PACKAGE_DIR}; the one found, {origin}, belongs to "
                                  "another copy of crfkit (an editable install) and is not loaded", warn=True,
                                  rebuild="build this one")
        if not _fits_running_torch(built):
            # Not loaded where a build for the running torch replaces it: once loaded, its ops
            # stay registered in this process, and it may misbehave with this torch.
            module, version_note = _first_use_instead(_versions(built))
            if module is not None:
                version_note = None
                return module
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError:
        raise  # blocked, or something the extension imports is missing
    except (ImportError, OSError) as error:  # e.g. "undefined symbol": a binary for another torch
        version_note = None
        return _raise_or_load(f"crfkit._C failed to load ({type(error).__name__}: {error}); {_versions(built)}",
                              warn=True, cause=error)
    if not _fits_running_torch(built):
        version_note = version_note or f"{_versions(built)}; rebuild it with {REBUILD}"
        warnings.warn(f"crfkit: {version_note} (it may fail or misbehave with this torch)", RuntimeWarning,
                      stacklevel=2)
    warn_about_cpu_isa(module)
    return module


_DISPATCH_LEVELS = ("baseline", "avx2", "avx512")


def warn_about_cpu_isa(module) -> None:
    """Warn (RuntimeWarning) when CRFKIT_CPU_ISA asks for a copy of the CPU kernels that `module`
    (crfkit._C) does not run: an unknown level, one above what this CPU runs (the best is used),
    or any level for a build with one copy (it is ignored). The C++ side picks the copy
    (csrc/cpu/dispatch.cpp); the stable ABI gives it no way to warn, so the warning is here."""
    asked = os.environ.get("CRFKIT_CPU_ISA", "")
    in_use = module.cpu_isa() if hasattr(module, "cpu_isa") else None
    if not asked or in_use is None:
        return
    if in_use not in _DISPATCH_LEVELS:  # a one-copy build: 'march=...'
        message = (f"crfkit: CRFKIT_CPU_ISA={asked} is ignored: this build has one copy of the CPU kernels "
                   f"({in_use})")
    elif asked.lower() not in _DISPATCH_LEVELS:
        message = f"crfkit: CRFKIT_CPU_ISA must be baseline, avx2 or avx512, got {asked!r}; using {in_use}"
    elif asked.lower() != in_use:
        message = f"crfkit: CRFKIT_CPU_ISA={asked} but this CPU runs at most {in_use}; using {in_use}"
    else:
        return
    warnings.warn(message, RuntimeWarning, stacklevel=3)
