"""Build crfkit's compiled kernels ahead of time.

    pip install --no-build-isolation -e .

builds crfkit._C against the torch already installed (no isolated build environment, so pip
never downloads another torch). The torch version it was built against is written next to it,
to crfkit/_build_info.py (generated, not in git): at import, crfkit warns when the running torch
differs (crfkit/_extension.py). Environment variables:
    CRFKIT_NO_EXTENSION=1   install the pure-Python package only (the reference backend runs)
    CRFKIT_FORCE_CUDA=1     build the CUDA kernels even when no GPU is visible (needs nvcc)
    CRFKIT_ARCH=native      the CPU the C++ kernels are compiled for (-march=...): "native"
                            (default: the building machine, e.g. AVX2/AVX-512 where present),
                            a name such as "x86-64-v3", or "none" for the compiler's portable
                            default (use that to build on one machine and run on another)
    CRFKIT_BUILD_MODE=release   how the C++ kernels are compiled:
                            release   -O3 (default)
                            debug     -O0 -g: no optimiser to hide undefined behaviour, and
                                      line-accurate backtraces in gdb
                            sanitize  -O1 -g with AddressSanitizer and UndefinedBehaviorSanitizer
                                      (the Python process must preload libasan / libubsan)
                            tsan      -O1 -g with ThreadSanitizer (preload libtsan)
                            The CUDA sources keep -O3 in every mode. tools/sanitize.sh builds the
                            debug, sanitize and tsan modes into build/<mode>/ and runs the tests
                            there; `make sanitize` and `make debug-test` call it.
    CRFKIT_EXTRA_CFLAGS     more C++ compiler flags, appended last (split like a shell would)
    CRFKIT_EXTRA_LDFLAGS    more linker flags, appended last
"""
import glob
import os
import shlex
import sys

from setuptools import setup

# Compile and link flags of each CRFKIT_BUILD_MODE. -fno-sanitize-recover: a UBSan report stops
# the process, so a test run cannot pass over one.
BUILD_MODES = {
    "release": (["-O3"], []),
    "debug": (["-O0", "-g"], []),
    "sanitize": (["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                  "-fno-sanitize-recover=all"], ["-fsanitize=address,undefined"]),
    "tsan": (["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=thread"], ["-fsanitize=thread"]),
}

ROOT = os.path.dirname(os.path.abspath(__file__))
ext_modules = []
cmdclass = {}
if os.environ.get("CRFKIT_NO_EXTENSION", "0") != "1":
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME

    mode = os.environ.get("CRFKIT_BUILD_MODE", "release").strip().lower() or "release"
    if mode not in BUILD_MODES:
        raise SystemExit(f"CRFKIT_BUILD_MODE must be one of {sorted(BUILD_MODES)}, got {mode!r}")
    mode_cflags, mode_ldflags = BUILD_MODES[mode]
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    cxx_flags = [*mode_cflags, "-std=c++20", "-fopenmp"]
    arch = os.environ.get("CRFKIT_ARCH", "native")
    if arch != "none":
        # Wide vectors (and FMA) for the T x T products; no fast-math, so -inf / NaN stay exact.
        cxx_flags.append(f"-march={arch}")
    cxx_flags += shlex.split(os.environ.get("CRFKIT_EXTRA_CFLAGS", ""))
    link_flags = ["-fopenmp", *mode_ldflags, *shlex.split(os.environ.get("CRFKIT_EXTRA_LDFLAGS", ""))]
    use_cuda = CUDA_HOME is not None and (
        torch.cuda.is_available() or os.environ.get("CRFKIT_FORCE_CUDA", "0") == "1"
    )
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    if use_cuda and cuda_sources:
        if not torch.cuda.is_available():
            # Forced build without a visible GPU: real code for A100 / H100 / H200 and PTX for
            # newer GPUs, unless TORCH_CUDA_ARCH_LIST (the standard variable) says otherwise.
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
        extension = CUDAExtension(
            "crfkit._C",
            sources + cuda_sources,
            # No --use_fast_math: -inf and NaN must keep their meaning in every kernel.
            # -lineinfo: source lines in compute-sanitizer / profiler reports, no cost at run time.
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++20", "-lineinfo"]},
            extra_link_args=link_flags,
        )
    else:
        extension = CppExtension("crfkit._C", sources, extra_compile_args={"cxx": cxx_flags},
                                 extra_link_args=link_flags)
    ext_modules = [extension]

    class BuildWithInfo(BuildExtension.with_options(use_ninja=True)):
        """build_ext that also writes crfkit/_build_info.py next to the built crfkit._C (in the
        source tree for --inplace and editable installs, in the build folder otherwise): the
        torch it was compiled against, which crfkit/_extension.py compares with the running one."""

        def finalize_options(self):
            super().finalize_options()
            if self.inplace:
                # An editable install (pip install -e, make setup) compiles in a fresh temporary
                # folder each time, so every reinstall recompiled every source; in a kept folder
                # ninja recompiles only what changed. One folder per mode, Python and torch: the
                # objects of one do not fit another.
                python = f"py{sys.version_info.major}{sys.version_info.minor}"
                self.build_temp = os.path.join(ROOT, "build", f"temp-{mode}-{python}-torch{torch.__version__}")

        def run(self):
            super().run()
            target = os.path.join(os.path.dirname(self.get_ext_fullpath("crfkit._C")), "_build_info.py")
            with open(target, "w") as f:
                f.write("# Written by setup.py (build_ext) with crfkit._C; not in git.\n"
                        f"TORCH_VERSION = {torch.__version__!r}\n"
                        f"BUILD_MODE = {mode!r}\n")

    cmdclass = {"build_ext": BuildWithInfo}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
