"""The first-use build of crfkit._C: where no matching compiled extension is installed (a
pure-Python wheel from a plain, isolated `pip install crfkit`; one built for another torch; a
checkout never built), crfkit compiles the one copy of the CPU kernels this CPU runs against the
running torch, with torch.utils.cpp_extension.load (ninja), into a cache folder, as DeepSpeed
does for its ops, and every later process loads it from there without a compiler.

When the build happens (and why):
- By default, at the first op call of a process that needs it (crfkit.log_partition, ...), not
  at import: the call waits for it, and a line on stderr says first that crfkit is compiling,
  for which CPU and torch, into which folder and about how long it takes (BUILD_TIME), another
  then how long it took. Why automatic: crfkit is a dependency package; its users call
  crfkit.kbest_viterbi and should get the compiled kernels without a step that only this
  package's docs mention, as DeepSpeed's users do. Why announced and not in the background:
  a background build would take the machine's cores for minutes unasked, and switching
  backends half-way through a run changes its numbers; a compile that is announced, done once
  per (crfkit, torch, CPU) and then cached is the smaller surprise.
- Ahead of time, explicitly: `python -m crfkit.build` (or crfkit.build_extension()), e.g. in a
  Dockerfile or a job's setup step, so that no op call ever waits.
- Never with CRFKIT_BUILD_ON_FIRST_USE=0 or CRFKIT_NO_EXTENSION=1 in the environment, nor when a
  backend is forced (CRFKIT_BACKEND) or chosen (crfkit.use_backend), nor while torch.compile
  traces: then numba or the reference runs, and crfkit.backend_info()["reason"] says why and how
  to build. CRFKIT_BACKEND=compiled builds at import, as the user asked for the compiled kernels.
- Not where it cannot work, which is checked first, in milliseconds: no C++ sources shipped with
  this copy of crfkit, no C++ compiler, no ninja, no Python headers (backend_info says which).
  A build that failed is not retried by later processes (each would wait for the same error):
  backend_info names its log, and `python -m crfkit.build` retries.

What it compiles: the sources, flags and per-ISA defines of setup.py (crfkit/_build_config.py),
but one copy of the CPU kernels, not three: the level this CPU runs (baseline, avx2 = x86-64-v3,
avx512 = x86-64-v4; read from /proc/cpuinfo, else from torch), or the lower one CRFKIT_CPU_ISA
asks for; crfkit._C.cpu_isa() then says e.g. 'march=x86-64-v4'. The CUDA kernels are compiled too
only where torch is a CUDA build, nvcc is found and a GPU is visible (for that GPU's architecture,
unless TORCH_CUDA_ARCH_LIST says otherwise); otherwise the build is CPU only.

Where: $CRFKIT_CACHE/extensions/<key> (default ~/.cache/crfkit), the key naming the crfkit
version, the torch version, the Python, the ISA and CPU-or-CUDA, plus a digest of the sources and
flags (an edited checkout gets a new folder, never a stale binary). A folder is written under a
file lock (filelock: an flock, dropped by the kernel when its process dies), so two processes
never build into one folder: the second waits, then loads what the first built. build.json
marks a finished build, failed.json a failed one (with build.log).
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shlex
import shutil
import sys
import sysconfig
import time
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from . import _build_config as config
from ._version import __version__

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
SWITCH = "CRFKIT_BUILD_ON_FIRST_USE"
COMMAND = "python -m crfkit.build"
DONE, FAILED, LOG = "build.json", "failed.json", "build.log"
# Measured on this project's 2-core machine, shared with a training job: the CPU kernels' one copy
# took 122 s of CPU time, 192 s and 206 s of wall time with MAX_JOBS=1.
BUILD_TIME = "about 2 CPU-minutes: 1 to 3 minutes on 2 cores"

# The x86-64-v3 and -v4 features, as /proc/cpuinfo names them (abm: LZCNT), the ones
# csrc/cpu/dispatch.cpp asks the CPU for.
_V3_FLAGS = ("avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "abm", "movbe")
_V4_FLAGS = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
_LEVELS = tuple(level for level, _ in config.DISPATCH_LEVELS)


class BuildError(RuntimeError):
    """The first-use build cannot run, or failed; the message says why (and the log's path)."""


class Plan(NamedTuple):
    """One build of crfkit._C for this process: what is compiled, how, and where."""
    folder: str
    isa: str
    cuda: bool
    sources: Tuple[str, ...]
    cflags: Tuple[str, ...]
    cuda_cflags: Tuple[str, ...]
    ldflags: Tuple[str, ...]


def announce(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- what and where ---------------------------------------------------------------------------
def source_root() -> Optional[str]:
    """The folder holding csrc/: crfkit/_sources in an installed wheel (setup.py's build_py), the
    checkout or unpacked sdist this package lies in, or None (a copy without its sources)."""
    installed = os.path.join(PACKAGE_DIR, "_sources")
    if os.path.isdir(os.path.join(installed, "csrc")):
        return installed
    checkout = os.path.dirname(PACKAGE_DIR)
    if os.path.isfile(os.path.join(checkout, "setup.py")) and os.path.isdir(os.path.join(checkout, "csrc")):
        return checkout
    return None


def cache_root() -> str:
    """$CRFKIT_CACHE/extensions, default ~/.cache/crfkit/extensions."""
    return os.path.join(os.environ.get("CRFKIT_CACHE") or os.path.expanduser("~/.cache/crfkit"), "extensions")


def _cpuinfo_flags() -> Optional[set]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def best_level() -> str:
    """The best dispatch level this x86-64 CPU (and its operating system) runs."""
    flags = _cpuinfo_flags()
    if flags is None:  # not Linux: torch's own reading of the CPU
        capability = torch.backends.cpu.get_cpu_capability()
        return "avx512" if capability.startswith("AVX512") else "avx2" if capability.startswith("AVX2") else "baseline"
    v3 = all(flag in flags for flag in _V3_FLAGS)
    return "avx512" if v3 and all(flag in flags for flag in _V4_FLAGS) else "avx2" if v3 else "baseline"


def cpu_target():
    """(the ISA the first-use build compiles for, its flags and defines): on x86-64 the best level
    this CPU runs, or the lower one CRFKIT_CPU_ISA asks for (a higher or unknown one is ignored, as
    csrc/cpu/dispatch.cpp does); elsewhere the compiler's default target, named by the machine."""
    if not config.is_x86_64():
        flags, _, defines = config.cpu_build_plan("none")
        return platform_name(), flags, defines
    level = best_level()
    asked = os.environ.get("CRFKIT_CPU_ISA", "").strip().lower()
    if asked in _LEVELS and _LEVELS.index(asked) < _LEVELS.index(level):
        level = asked
    flags, _, defines = config.one_level_plan(level)
    return level, flags, defines


def platform_name() -> str:
    import platform

    return platform.machine().lower() or "unknown"


def _cuda_possible() -> bool:
    """Whether the build compiles the CUDA kernels: a CUDA torch, nvcc and a visible GPU."""
    if torch.version.cuda is None:
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None and torch.cuda.is_available()


def plan(cuda: bool, root: Optional[str] = None) -> Plan:
    """The build for this process: the sources under `root` (default source_root()), the flags,
    and the cache folder its key names. ValueError for a bad CRFKIT_BUILD_MODE."""
    root = root or source_root()
    if root is None:
        raise BuildError("the C++ sources are not installed with this copy of crfkit (no crfkit/_sources)")
    isa, cpu_flags, defines = cpu_target()
    mode = config.build_mode()
    cxx, link = config.compile_flags(mode)
    files = config.sources(root)
    sources = files["main"] + files["kernels"] + (files["cuda"] if cuda else [])
    # The running torch's stable ABI; the limited API, as setup.py's py_limited_api extension has.
    target = [*config.torch_target_flags(None), f"-DPy_LIMITED_API={config.PYTHON_LIMITED_API}"]
    cflags = [*cxx, *cpu_flags, *defines, *target]
    cuda_cflags = [*config.NVCC_FLAGS, *target] if cuda else []
    digest = hashlib.sha256()
    for path in sorted(sources + files["depends"]):
        digest.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "") if cuda else ""
    settings = [cflags, cuda_cflags, link, arch_list, torch.__version__, torch.version.git_version]
    digest.update(json.dumps(settings).encode())
    device = f"cuda{torch.version.cuda}" if cuda else "cpu"
    key = (f"crfkit{__version__}-torch{torch.__version__}-{sys.implementation.cache_tag}-{isa}-{device}-"
           f"{digest.hexdigest()[:12]}")
    return Plan(os.path.join(cache_root(), key), isa, cuda, tuple(sources), tuple(cflags), tuple(cuda_cflags),
                tuple(link))


def library(folder: str) -> Optional[str]:
    """The finished build's library in `folder`, or None."""
    try:
        with open(os.path.join(folder, DONE)) as f:
            path = os.path.join(folder, json.load(f)["library"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return path if os.path.isfile(path) else None


def _variants():
    """The builds this process could load, best first: with the CUDA kernels (a CUDA torch:
    without asking the GPU, which would initialise CUDA at import), then CPU only."""
    return (True, False) if torch.version.cuda is not None else (False,)


def find_built() -> Optional[Tuple[Plan, str]]:
    """(plan, library) of a finished build for this crfkit, torch, Python and CPU, or None."""
    if source_root() is None:
        return None
    for cuda in _variants():
        try:
            candidate = plan(cuda)
        except (BuildError, ValueError, OSError):
            return None
        found = library(candidate.folder)
        if found is not None:
            return candidate, found
    return None


def _failed(folder: str) -> Optional[dict]:
    try:
        with open(os.path.join(folder, FAILED)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _scripts_dirs():
    """Where pip puts the ninja command: this Python's scripts folder, and the ninja package's."""
    dirs = [sysconfig.get_path("scripts")]
    spec = importlib.util.find_spec("ninja")
    if spec is not None and spec.submodule_search_locations:
        dirs.append(os.path.join(list(spec.submodule_search_locations)[0], "data", "bin"))
    return [d for d in dirs if d and os.path.isdir(d)]


def _search_path() -> str:
    return os.pathsep.join([*_scripts_dirs(), os.environ.get("PATH", "")])


def missing_tools() -> str:
    """What the build needs and this machine lacks, "" when nothing."""
    missing = []
    compiler = (shlex.split(os.environ.get("CXX", "")) or ["c++"])[0]
    if shutil.which(compiler) is None:
        missing.append(f"no C++ compiler ({compiler!r} is not on PATH; set CXX)")
    if shutil.which("ninja", path=_search_path()) is None:
        missing.append("no ninja (pip install ninja)")
    # Where torch.utils.cpp_extension looks for Python.h.
    include = sysconfig.get_path("include", scheme="posix_prefix" if os.name == "posix" else "nt")
    if not os.path.isfile(os.path.join(include or "", "Python.h")):
        missing.append(f"no Python headers ({include}/Python.h: install python3-dev or the like)")
    for module in ("setuptools", "filelock"):  # torch.utils.cpp_extension imports setuptools
        if importlib.util.find_spec(module) is None:
            missing.append(f"no {module} (pip install {module})")
    return "; ".join(missing)


def first_use_status() -> Tuple[bool, str]:
    """(whether the first op call will build, the sentence backend_info's reason gets): called
    when no usable crfkit._C is installed. "" when this copy of crfkit has no sources (a copy made
    by hand: only the ahead-of-time build applies)."""
    if source_root() is None:
        return False, ""
    how = f"build it with `{COMMAND}`"
    for name, off in (("CRFKIT_NO_EXTENSION", "1"), (SWITCH, "0")):
        if os.environ.get(name, "").strip() == off:
            return False, f"the first-use build is off ({name}={off}); {how}"
    missing = missing_tools()
    if missing:
        return False, f"it cannot be compiled here at first use: {missing}; then {how}"
    try:
        candidates = [plan(cuda) for cuda in _variants()]
    except (BuildError, ValueError, OSError) as error:
        return False, f"it cannot be compiled at first use: {error}"
    for candidate in candidates:
        failure = _failed(candidate.folder)
        if failure is not None:
            return False, (f"its first-use build failed ({failure.get('error', '?')}; log: "
                           f"{os.path.join(candidate.folder, LOG)}); fix that and {how}, which retries")
    isa = candidates[-1].isa
    return True, (f"it is compiled for this CPU ({isa}) and torch {torch.__version__} at the first op call, "
                  f"once, into {cache_root()} ({BUILD_TIME}; {SWITCH}=0 turns that off), or now with "
                  f"`{COMMAND}`")


# ---- building ---------------------------------------------------------------------------------
def compile_into(build: Plan, name: str = "_C", verbose: bool = False, retry: bool = False,
                 say: Callable[[str], None] = announce) -> Tuple[str, bool]:
    """Compile build.sources into build.folder with torch.utils.cpp_extension.load, under the
    folder's file lock, unless a finished build is there (reused). Returns (the library, whether
    this call compiled it). A failed build leaves failed.json and build.log, and raises
    BuildError; later calls raise it again without compiling unless `retry`."""
    import filelock

    os.makedirs(os.path.dirname(build.folder), exist_ok=True)
    lock = filelock.FileLock(build.folder + ".lock", thread_local=False)
    try:
        lock.acquire(blocking=False)
    except filelock.Timeout:
        say(f"crfkit: waiting for another process that is compiling crfkit._C into {build.folder}")
        lock.acquire()
    try:
        found = library(build.folder)
        if found is not None:
            return found, False
        log = os.path.join(build.folder, LOG)
        failure = _failed(build.folder)
        if failure is not None and not retry:
            raise BuildError(f"the first-use build of crfkit._C failed before ({failure.get('error', '?')}; "
                             f"log: {log}); fix that and run `{COMMAND}`, which retries")
        os.makedirs(build.folder, exist_ok=True)
        for leftover in (FAILED, "lock"):  # "lock": torch's own baton, left by a build that was killed
            if os.path.exists(os.path.join(build.folder, leftover)):
                os.remove(os.path.join(build.folder, leftover))
        what = "the CPU and CUDA kernels" if build.cuda else "the CPU kernels"
        say(f"crfkit: compiling crfkit._C ({what} for {build.isa}) against torch {torch.__version__}, once, "
            f"into {build.folder}: {BUILD_TIME}; later processes load it from there "
            f"(`{COMMAND}` does this ahead of time; {SWITCH}=0 skips it)")
        start = time.monotonic()
        with open(log, "w") as f:
            f.write(f"torch.utils.cpp_extension.load(name={name!r}) for crfkit {__version__}, torch "
                    f"{torch.__version__}\nsources: {' '.join(build.sources)}\ncflags: {' '.join(build.cflags)}\n"
                    f"cuda_cflags: {' '.join(build.cuda_cflags)}\nldflags: {' '.join(build.ldflags)}\n")
        path = os.environ.get("PATH", "")
        try:
            from torch.utils import cpp_extension

            os.environ["PATH"] = _search_path()
            built = cpp_extension.load(name=name, sources=list(build.sources), extra_cflags=list(build.cflags),
                                       extra_cuda_cflags=list(build.cuda_cflags), extra_ldflags=list(build.ldflags),
                                       build_directory=build.folder, with_cuda=build.cuda, is_python_module=False,
                                       verbose=verbose)
        except Exception as error:
            text = f"{type(error).__name__}: {error}"
            with open(log, "a") as f:
                f.write(text + "\n")
            lines = [line.strip() for line in str(error).splitlines() if "error" in line.lower()]
            summary = (lines[1] if len(lines) > 1 else lines[0] if lines else text.splitlines()[0])[:300]
            with open(os.path.join(build.folder, FAILED), "w") as f:
                json.dump({"error": summary, "time": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
            raise BuildError(f"the first-use build of crfkit._C failed ({summary}; log: {log})") from error
        finally:
            os.environ["PATH"] = path
        seconds = time.monotonic() - start
        record = {"library": os.path.basename(built), "seconds": round(seconds, 1), "crfkit": __version__,
                  "torch": torch.__version__, "isa": build.isa, "cuda": build.cuda,
                  "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        temporary = os.path.join(build.folder, DONE + ".tmp")
        with open(temporary, "w") as f:
            json.dump(record, f)
        os.replace(temporary, os.path.join(build.folder, DONE))  # the build is finished only now
        say(f"crfkit: compiled crfkit._C in {seconds:.0f} s")
        return built, True
    finally:
        lock.release()


def build(verbose: bool = False, retry: bool = False, say: Callable[[str], None] = announce) -> Tuple[Plan, str, bool]:
    """The first-use build for this process, or the finished one in the cache: (plan, library,
    whether this call compiled it). BuildError when it cannot run or fails."""
    if source_root() is None:
        raise BuildError("the C++ sources are not installed with this copy of crfkit (no crfkit/_sources), so "
                         "it cannot compile crfkit._C: reinstall crfkit from its sdist or a wheel")
    found = find_built()
    if found is not None:
        return found[0], found[1], False
    missing = missing_tools()
    if missing:
        raise BuildError(f"crfkit._C cannot be compiled here: {missing}")
    try:
        build_plan = plan(_cuda_possible())
    except ValueError as error:
        raise BuildError(str(error)) from None
    built, compiled = compile_into(build_plan, verbose=verbose, retry=retry, say=say)
    return build_plan, built, compiled


def load_library(path: str):
    """Import the library at `path` as crfkit._C (its module init is PyInit__C, whatever the
    file is called) and return it; loading it registers torch.ops.crfkit.*."""
    name = f"{__package__}._C"
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module
    package = sys.modules.get(__package__)
    if package is not None:
        setattr(package, "_C", module)
    return module
