"""Build crfkit's compiled kernels ahead of time.

    pip install --no-build-isolation -e .

builds crfkit._C against the torch already installed (no isolated build environment, so pip
never downloads another torch). The torch version it was built against is written next to it,
to crfkit/_build_info.py (generated, not in git): at import, crfkit warns when the running torch
differs (crfkit/_extension.py). Environment variables:
    CRFKIT_NO_EXTENSION=1   install the pure-Python package only (the reference backend runs)
    CRFKIT_FORCE_CUDA=1     build the CUDA kernels even when no GPU is visible (needs nvcc)
    CRFKIT_ARCH=dispatch    the CPUs the C++ kernels are compiled for:
        dispatch  (default) portable: the kernels compiled three times, for x86-64 (baseline),
                  x86-64-v3 (AVX2) and x86-64-v4 (AVX-512); crfkit uses the best copy the CPU
                  runs, chosen at import (environment variable CRFKIT_CPU_ISA=baseline|avx2|
                  avx512 picks a lower one). What `pip install` and `python -m build` make; a
                  wheel built this way runs on any x86-64 machine. (On other CPUs: as "none".)
        native    one copy for the building machine's CPU (-march=native): a local developer
                  build, faster to compile; it may not run on another machine
        none      one copy for the compiler's default target
        <name>    one copy for -march=<name>, e.g. x86-64-v3
    crfkit._C.cpu_isa() (and crfkit.backend_info()["cpu_isa"]) names the copy in use.
    CRFKIT_BUILD_MODE=release   how the C++ kernels are compiled:
                            release   -O3 -g0 (default): -g0 cancels the -g of Python's own
                                      CFLAGS, as debug info in a release build costs build
                                      time and size (CRFKIT_EXTRA_CFLAGS=-g puts it back)
                            debug     -O0 -g: no optimiser to hide undefined behaviour, and
                                      line-accurate backtraces in gdb
                            sanitize  -O1 -g with AddressSanitizer and UndefinedBehaviorSanitizer
                                      (the Python process must preload libasan / libubsan)
                            tsan      -O1 -g with ThreadSanitizer (preload libtsan)
                            The CUDA sources keep -O3 in every mode. tools/sanitize.sh builds the
                            debug, sanitize and tsan modes into build/<mode>/ and runs the tests
                            there (with CRFKIT_ARCH=native: one copy of the kernels);
                            `make sanitize` and `make debug-test` call it.
    CRFKIT_EXTRA_CFLAGS     more C++ compiler flags, after the mode's (split like a shell would)
    CRFKIT_EXTRA_LDFLAGS    more linker flags, appended last
"""
import glob
import os
import platform
import shlex
import sys

from setuptools import setup

# Compile and link flags of each CRFKIT_BUILD_MODE. -fno-sanitize-recover: a UBSan report stops
# the process, so a test run cannot pass over one.
BUILD_MODES = {
    "release": (["-O3", "-g0"], []),
    "debug": (["-O0", "-g"], []),
    "sanitize": (["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                  "-fno-sanitize-recover=all"], ["-fsanitize=address,undefined"]),
    "tsan": (["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=thread"], ["-fsanitize=thread"]),
}

ROOT = os.path.dirname(os.path.abspath(__file__))

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


def cpu_build_plan(arch):
    """(flags of the sources compiled once, [(level, flags of that copy of the kernels)],
    flags of dispatch.cpp) for CRFKIT_ARCH=arch."""
    if arch == "dispatch" and platform.machine().lower() in ("x86_64", "amd64"):
        # Everything outside the kernel copies is built for the baseline: it runs on any x86-64.
        return DISPATCH_LEVELS[0][1], list(DISPATCH_LEVELS), ["-DCRFKIT_CPU_DISPATCH"]
    if arch == "dispatch":
        arch = "none"
    flags = [] if arch == "none" else [f"-march={arch}"]
    return flags, [("single", flags)], [f"-DCRFKIT_CPU_ARCH={arch}"]


def with_cpu_kernel_copies(build_extension_class):
    """build_ext that compiles each extension's `cpu_kernel_copies` [(level, sources, flags)]
    and links them after the extension's own objects. A copy gets the extension's C++ flags
    (torch's, and any build mode's) but its `cpu_shared_only_flags`, then its own.

    Why here and not as sources of the Extension: BuildExtension compiles an extension's sources
    with one set of flags (one ninja rule), and the copies need their own -march. Each copy is
    compiled by the same compiler call (ninja included) into build_temp/isa/<level>/.

    Why this link order (shared objects, then baseline, avx2, avx512 copies): inline functions of
    torch and the standard library that a copy does not inline are emitted in every object that
    uses them, and the linker keeps the first it meets; the baseline's must win, or a CPU without
    AVX-512 would run AVX-512 code outside the dispatch (PyTorch orders its own CPU_CAPABILITY
    objects so, for the same reason). tools/check_isa_symbols.py checks the built library."""

    class BuildWithCpuKernelCopies(build_extension_class):
        def build_extension(self, ext):
            copies = getattr(ext, "cpu_kernel_copies", ())
            if copies:
                own_objects = getattr(ext, "own_extra_objects", None)
                if own_objects is None:
                    own_objects = ext.own_extra_objects = list(ext.extra_objects or [])
                compile_args = ext.extra_compile_args
                shared_only = set(getattr(ext, "cpu_shared_only_flags", ()))
                cxx_flags = [flag for flag in (compile_args["cxx"] if isinstance(compile_args, dict) else compile_args)
                             if flag not in shared_only]
                objects = []
                for level, sources, flags in copies:
                    objects += self.compiler.compile(
                        sources, output_dir=os.path.join(self.build_temp, "isa", level),
                        macros=ext.define_macros, include_dirs=ext.include_dirs, debug=self.debug,
                        extra_postargs=[*cxx_flags, *flags, f"-DCRFKIT_CPU_ISA={level}"],
                        depends=ext.depends)
                ext.extra_objects = [*objects, *own_objects]
            super().build_extension(ext)

    return BuildWithCpuKernelCopies


ext_modules = []
cmdclass = {}
if os.environ.get("CRFKIT_NO_EXTENSION", "0") != "1":
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME

    mode = os.environ.get("CRFKIT_BUILD_MODE", "release").strip().lower() or "release"
    if mode not in BUILD_MODES:
        raise SystemExit(f"CRFKIT_BUILD_MODE must be one of {sorted(BUILD_MODES)}, got {mode!r}")
    mode_cflags, mode_ldflags = BUILD_MODES[mode]
    arch = os.environ.get("CRFKIT_ARCH", "dispatch")
    shared_arch_flags, levels, dispatch_flags = cpu_build_plan(arch)
    kernel_sources = sorted(set(glob.glob("csrc/cpu/*.cpp")) - set(CPU_SHARED_SOURCES))
    sources = sorted(glob.glob("csrc/*.cpp")) + list(CPU_SHARED_SOURCES)
    # No fast-math: -inf / NaN stay exact. Wide vectors and FMA come from each copy's -march.
    cxx_flags = [*mode_cflags, "-std=c++20", "-fopenmp", *shlex.split(os.environ.get("CRFKIT_EXTRA_CFLAGS", ""))]
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
            extra_compile_args={"cxx": cxx_flags + shared_arch_flags + dispatch_flags,
                                "nvcc": ["-O3", "-std=c++20", "-lineinfo"]},
            extra_link_args=link_flags,
        )
    else:
        extension = CppExtension(
            "crfkit._C", sources, extra_compile_args={"cxx": cxx_flags + shared_arch_flags + dispatch_flags},
            extra_link_args=link_flags,
        )
    extension.cpu_kernel_copies = [(level, kernel_sources, flags) for level, flags in levels]
    extension.cpu_shared_only_flags = shared_arch_flags + dispatch_flags
    # Relink when a kernel file or a header changed (setuptools looks at sources and depends
    # only; the kernel files are not the extension's sources, and ninja recompiles what changed).
    extension.depends = kernel_sources + sorted(glob.glob("csrc/**/*.h", recursive=True) + glob.glob("csrc/cuda/*.cuh"))
    ext_modules = [extension]

    class BuildWithInfo(with_cpu_kernel_copies(BuildExtension).with_options(use_ninja=True)):
        """build_ext that also writes crfkit/_build_info.py next to the built crfkit._C (in the
        source tree for --inplace and editable installs, in the build folder otherwise): the
        torch it was compiled against, which crfkit/_extension.py compares with the running one."""

        def finalize_options(self):
            super().finalize_options()
            if self.inplace:
                # An editable install (pip install -e, make setup) compiles in a fresh temporary
                # folder each time, so every reinstall recompiled every source; in a kept folder
                # ninja recompiles only what changed. One folder per mode, CPU target, Python and
                # torch: the objects of one do not fit another.
                python = f"py{sys.version_info.major}{sys.version_info.minor}"
                self.build_temp = os.path.join(ROOT, "build", f"temp-{mode}-{arch}-{python}-torch{torch.__version__}")

        def run(self):
            super().run()
            target = os.path.join(os.path.dirname(self.get_ext_fullpath("crfkit._C")), "_build_info.py")
            with open(target, "w") as f:
                f.write("# Written by setup.py (build_ext) with crfkit._C; not in git.\n"
                        f"TORCH_VERSION = {torch.__version__!r}\n"
                        f"BUILD_MODE = {mode!r}\n")

    cmdclass = {"build_ext": BuildWithInfo}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
