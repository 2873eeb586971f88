"""Build crfkit's compiled kernels ahead of time.

    pip install --no-build-isolation -e .

builds crfkit._C against the torch already installed (no isolated build environment, so pip
never downloads another torch). Environment variables:
    CRFKIT_NO_EXTENSION=1   install the pure-Python package only (the reference backend runs)
    CRFKIT_FORCE_CUDA=1     build the CUDA kernels even when no GPU is visible (needs nvcc)
    CRFKIT_ARCH=native      the CPU the C++ kernels are compiled for (-march=...): "native"
                            (default: the building machine, e.g. AVX2/AVX-512 where present),
                            a name such as "x86-64-v3", or "none" for the compiler's portable
                            default (use that to build on one machine and run on another)
"""
import glob
import os

from setuptools import setup

ext_modules = []
cmdclass = {}
if os.environ.get("CRFKIT_NO_EXTENSION", "0") != "1":
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME

    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    cxx_flags = ["-O3", "-std=c++20", "-fopenmp"]
    arch = os.environ.get("CRFKIT_ARCH", "native")
    if arch != "none":
        # Wide vectors (and FMA) for the T x T products; no fast-math, so -inf / NaN stay exact.
        cxx_flags.append(f"-march={arch}")
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
            extra_link_args=["-fopenmp"],
        )
    else:
        extension = CppExtension(
            "crfkit._C", sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=["-fopenmp"]
        )
    ext_modules = [extension]
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
