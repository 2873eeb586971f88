"""Loading crfkit._C (the compiled kernels), and the true reason when it cannot be used.

The extension is compiled against one torch and links to that torch's C++ library: with another
torch it fails to load (an undefined symbol) or loads with a stale binary interface. setup.py
records the torch it built against in crfkit/_build_info.py (generated, not in git). load()
compares it with the running torch and warns (RuntimeWarning) when they differ, or when a built
extension fails to load, naming both versions and the rebuild command: otherwise crfkit would
quietly fall back to a slower backend. A checkout where the extension was never built
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
        if built is not None and built != torch.__version__:
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
    if built is not None and built != torch.__version__:
        version_note = version_note or f"{_versions(built)}; rebuild it with {REBUILD}"
        warnings.warn(f"crfkit: {version_note} (it may fail or misbehave with this torch)", RuntimeWarning,
                      stacklevel=2)
    return module
