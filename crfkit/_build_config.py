"""How crfkit._C is compiled: its sources, flags and per-instruction-set defines, written once for
both builds that make it:

- the build ahead of time, setup.py (`pip install --no-build-isolation -e .`, `make setup`): all
  three CPU kernel copies by default (CRFKIT_ARCH=dispatch), with setuptools and ninja;
- the first-use build, crfkit/_build.py: one copy, the one this CPU runs, with
  torch.utils.cpp_extension.load, into crfkit's cache folder.

Standard library only, and no import of crfkit: setup.py loads this file by its path, before it
knows whether torch is installed (an isolated build has none). Source paths are relative to a
`root` holding csrc/: the checkout (or an unpacked sdist), or crfkit/_sources in an installed
wheel (setup.py's build_py copies csrc/ there).
"""
import glob
import os
import platform
import shlex

# Compile and link flags of each CRFKIT_BUILD_MODE. -fno-sanitize-recover: a UBSan report stops
# the process, so a test run cannot pass over one.
BUILD_MODES = {
    "release": (["-O3", "-g0"], []),
    "debug": (["-O0", "-g"], []),
    "sanitize": (["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                  "-fno-sanitize-recover=all"], ["-fsanitize=address,undefined"]),
    "tsan": (["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=thread"], ["-fsanitize=thread"]),
}

# The kernels use torch's stable C ABI only (csrc/tensor.h) and Python's limited API (an abi3
# module, Python 3.10 on): one binary loads under every torch from TORCH_TARGET (a version whose
# stable ABI has everything the kernels call) on, and every Python from 3.10 on.
# CRFKIT_TORCH_TARGET=2.11 builds for torch >= 2.11, whose stable ABI also lets the CPU kernels
# recycle their large buffers (csrc/cpu/recycled_memory.h). The first-use build targets the
# running torch (it is compiled for that torch anyway).
TORCH_TARGET = "2.10"
PYTHON_LIMITED_API = "0x030a0000"


def torch_target_flags(target):
    """The defines that make the torch headers offer the stable ABI of torch `target` ('2.10')
    and no later one; none for target None (the running torch's)."""
    if target is None:
        return []
    try:
        major, minor = (int(part) for part in target.split("."))
    except ValueError:
        raise ValueError(f"CRFKIT_TORCH_TARGET must be a torch version like 2.10, got {target!r}") from None
    if (major, minor) < (2, 10):
        raise ValueError(f"CRFKIT_TORCH_TARGET must be 2.10 or later (the first stable ABI with every call "
                         f"the kernels make), got {target!r}")
    return [f"-DTORCH_TARGET_VERSION=0x{major:02x}{minor:02x}000000000000"]


def torch_target(environ=os.environ) -> str:
    """CRFKIT_TORCH_TARGET (default TORCH_TARGET): the oldest torch an ahead-of-time build loads under."""
    return environ.get("CRFKIT_TORCH_TARGET", "").strip() or TORCH_TARGET


# No fast-math: -inf / NaN stay exact. Wide vectors and FMA come from each copy's -march.
# -fvisibility=hidden: torch's stable types live in a hidden namespace (each library its own
# copy), and the library exports nothing but PyInit__C.
CXX_FLAGS = ["-std=c++20", "-fopenmp", "-fvisibility=hidden"]
LINK_FLAGS = ["-fopenmp"]
# No --use_fast_math: -inf and NaN must keep their meaning in every kernel.
# -lineinfo: source lines in compute-sanitizer / profiler reports, no cost at run time.
NVCC_FLAGS = ["-O3", "-std=c++20", "-lineinfo"]
# A CUDA build without a visible GPU (setup.py with CRFKIT_FORCE_CUDA=1): real code for A100 /
# H100 / H200 and PTX for newer GPUs, unless TORCH_CUDA_ARCH_LIST (the standard variable) says
# otherwise. (The first-use build compiles CUDA only where a GPU is visible: for that GPU.)
FORCED_CUDA_ARCH_LIST = "8.0;9.0+PTX"

# ---- CPU kernel copies (CRFKIT_ARCH) ------------------------------------------------------------
# The CPU kernel files (csrc/cpu/*.cpp but the shared ones below) are compiled once per
# instruction-set level, each copy with -DCRFKIT_CPU_ISA=<level> so that its code lives in
# namespace crfkit::cpu::<level> (csrc/cpu/isa.h); csrc/cpu/dispatch.cpp registers one copy.
CPU_SHARED_SOURCES = ("csrc/cpu/dispatch.cpp", "csrc/cpu/recycled_memory.cpp")  # compiled once

# -mtune=generic: a wheel is built once and run on many CPUs, so no one CPU's tuning.
DISPATCH_LEVELS = (
    ("baseline", ["-march=x86-64", "-mtune=generic"]),
    ("avx2", ["-march=x86-64-v3", "-mtune=generic"]),
    ("avx512", ["-march=x86-64-v4", "-mtune=generic"]),
)


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def build_mode(environ=os.environ) -> str:
    """CRFKIT_BUILD_MODE (default release); ValueError for an unknown one."""
    mode = environ.get("CRFKIT_BUILD_MODE", "release").strip().lower() or "release"
    if mode not in BUILD_MODES:
        raise ValueError(f"CRFKIT_BUILD_MODE must be one of {sorted(BUILD_MODES)}, got {mode!r}")
    return mode


def compile_flags(mode: str, environ=os.environ):
    """(C++ flags, link flags) of build mode `mode`, with CRFKIT_EXTRA_CFLAGS / CRFKIT_EXTRA_LDFLAGS
    (split like a shell would) last; the CPU target's flags come from cpu_build_plan."""
    mode_cflags, mode_ldflags = BUILD_MODES[mode]
    cxx = [*mode_cflags, *CXX_FLAGS, *shlex.split(environ.get("CRFKIT_EXTRA_CFLAGS", ""))]
    link = [*LINK_FLAGS, *mode_ldflags, *shlex.split(environ.get("CRFKIT_EXTRA_LDFLAGS", ""))]
    return cxx, link


def cpu_build_plan(arch):
    """(flags of the sources compiled once, [(level, flags of that copy of the kernels)],
    flags of dispatch.cpp) for CRFKIT_ARCH=arch."""
    if arch == "dispatch" and is_x86_64():
        # Everything outside the kernel copies is built for the baseline: it runs on any x86-64.
        return DISPATCH_LEVELS[0][1], list(DISPATCH_LEVELS), ["-DCRFKIT_CPU_DISPATCH"]
    if arch == "dispatch":
        arch = "none"
    flags = [] if arch == "none" else [f"-march={arch}"]
    return flags, [("single", flags)], [f"-DCRFKIT_CPU_ARCH={arch}"]


def one_level_plan(level):
    """cpu_build_plan of a build of one copy, dispatch level `level` ('baseline', 'avx2' or
    'avx512'), with that level's flags: the first-use build. It reports itself as that level's
    -march (crfkit._C.cpu_isa() == 'march=x86-64-v3' for avx2)."""
    flags = dict(DISPATCH_LEVELS)[level]
    (march,) = [flag.split("=", 1)[1] for flag in flags if flag.startswith("-march=")]
    return flags, [("single", flags)], [f"-DCRFKIT_CPU_ARCH={march}"]


def sources(root=""):
    """{'main': the C++ files compiled once (csrc/*.cpp and CPU_SHARED_SOURCES), 'kernels': the
    CPU kernel files compiled once per copy, 'cuda': csrc/cuda/*.cu, 'depends': the headers},
    each sorted, as paths under `root` ("": relative, as setuptools wants them)."""
    def under(pattern):
        return sorted(glob.glob(os.path.join(root, pattern), recursive=True))

    shared = [os.path.join(root, path) for path in CPU_SHARED_SOURCES]
    return {
        "main": under("csrc/*.cpp") + shared,
        "kernels": sorted(set(under("csrc/cpu/*.cpp")) - set(shared)),
        "cuda": under("csrc/cuda/*.cu"),
        "depends": sorted(under("csrc/**/*.h") + under("csrc/cuda/*.cuh")),
    }


SOURCE_SUFFIXES = (".cpp", ".h", ".cu", ".cuh")  # what MANIFEST.in and a wheel's _sources carry
