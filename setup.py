"""Build crfkit's compiled kernels ahead of time.

    pip install --no-build-isolation -e .

builds crfkit._C against the torch already installed (no isolated build environment, so pip
never downloads another torch). Environment variables:
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
"""
import glob
import os
import platform

from setuptools import setup


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

    arch = os.environ.get("CRFKIT_ARCH", "dispatch")
    shared_arch_flags, levels, dispatch_flags = cpu_build_plan(arch)
    kernel_sources = sorted(set(glob.glob("csrc/cpu/*.cpp")) - set(CPU_SHARED_SOURCES))
    sources = sorted(glob.glob("csrc/*.cpp")) + list(CPU_SHARED_SOURCES)
    # No fast-math: -inf / NaN stay exact. Wide vectors and FMA come from each copy's -march.
    cxx_flags = ["-O3", "-std=c++20", "-fopenmp"]
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
            extra_link_args=["-fopenmp"],
        )
    else:
        extension = CppExtension(
            "crfkit._C", sources, extra_compile_args={"cxx": cxx_flags + shared_arch_flags + dispatch_flags},
            extra_link_args=["-fopenmp"],
        )
    extension.cpu_kernel_copies = [(level, kernel_sources, flags) for level, flags in levels]
    extension.cpu_shared_only_flags = shared_arch_flags + dispatch_flags
    # Relink when a kernel file or a header changed (setuptools looks at sources and depends
    # only; the kernel files are not the extension's sources, and ninja recompiles what changed).
    extension.depends = kernel_sources + sorted(glob.glob("csrc/**/*.h", recursive=True) + glob.glob("csrc/cuda/*.cuh"))
    ext_modules = [extension]
    cmdclass = {"build_ext": with_cpu_kernel_copies(BuildExtension).with_options(use_ninja=True)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
