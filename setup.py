"""Build crfkit: the Python package, and its compiled kernels (crfkit._C) ahead of time.

    pip install --no-build-isolation -e .

builds crfkit._C against the torch already installed (no isolated build environment, so pip
never downloads another torch). The torch version it was built against is written next to it,
to crfkit/_build_info.py (generated, not in git): at import, crfkit warns when the running torch
differs (crfkit/_extension.py).

Where torch is not importable (a plain `pip install crfkit` or `pip install crfkit-*.tar.gz`:
pip builds in an isolated environment, and pyproject.toml's [build-system] does not ask for
torch) or with CRFKIT_NO_EXTENSION=1, this builds the pure-Python package: a py3-none-any wheel
that carries the C++ / CUDA sources (crfkit/_sources/csrc/), which crfkit compiles against the
running torch at first use (crfkit/_build.py; `python -m crfkit.build`). Making the sdist or the
metadata never imports torch. The sources, flags and per-ISA defines are in
crfkit/_build_config.py, shared by both builds. Environment variables:
    CRFKIT_NO_EXTENSION=1   build the pure-Python package only (at run time, it also turns the
                            first-use build off: then numba or the reference backend runs)
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
import importlib.util
import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def _load_build_config():
    """crfkit/_build_config.py, loaded by its path: the sources, flags and per-ISA defines, shared
    with the first-use build (crfkit/_build.py). Importing `crfkit` would import torch."""
    spec = importlib.util.spec_from_file_location("_crfkit_build_config",
                                                  os.path.join(ROOT, "crfkit", "_build_config.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


config = _load_build_config()


class BuildPyWithSources(build_py):
    """build_py that also puts the C++ / CUDA sources (csrc/) into the wheel, as
    crfkit/_sources/csrc/: the first-use build (crfkit/_build.py) compiles them where the wheel has
    no crfkit._C for the running torch (a pure-Python wheel, or after a torch upgrade). Not in an
    editable install: that one finds csrc/ in the checkout."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for directory, _, names in os.walk(os.path.join(ROOT, "csrc")):
            for name in sorted(names):
                if name.endswith(config.SOURCE_SUFFIXES):
                    source = os.path.join(directory, name)
                    target = os.path.join(self.build_lib, "crfkit", "_sources", os.path.relpath(source, ROOT))
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    shutil.copy2(source, target)


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


# Commands that compile; any other (sdist, egg_info, dist_info: making the sdist and the metadata)
# needs no torch, so setup.py does not import it for them.
BUILD_COMMANDS = {"build", "build_ext", "bdist_wheel", "bdist", "bdist_egg", "install", "develop", "editable_wheel"}


def _extension_wanted():
    """Whether to build crfkit._C, and why not (printed) when not."""
    if os.environ.get("CRFKIT_NO_EXTENSION", "0") == "1":
        return False, "CRFKIT_NO_EXTENSION=1"
    if not BUILD_COMMANDS & set(sys.argv[1:]):
        return False, None  # the sdist or the metadata: nothing is compiled anyway
    try:
        import torch  # noqa: F401
    except ImportError as error:
        return False, (f"torch cannot be imported here ({error}; an isolated build: pip install without "
                       "--no-build-isolation)")
    return True, None


ext_modules = []
cmdclass = {"build_py": BuildPyWithSources}
wanted, why_not = _extension_wanted()
if why_not:
    print(f"crfkit: building the pure-Python package, without crfkit._C: {why_not}; crfkit compiles its "
          "kernels against the running torch at first use (`python -m crfkit.build`; crfkit/_build.py)",
          file=sys.stderr)
if wanted:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME

    try:
        mode = config.build_mode()
    except ValueError as error:
        raise SystemExit(str(error))
    cxx_flags, link_flags = config.compile_flags(mode)
    try:
        target_flags = config.torch_target_flags(config.torch_target())
    except ValueError as error:
        raise SystemExit(str(error))
    cxx_flags = cxx_flags + target_flags
    arch = os.environ.get("CRFKIT_ARCH", "dispatch")
    shared_arch_flags, levels, dispatch_flags = config.cpu_build_plan(arch)
    files = config.sources()
    kernel_sources = files["kernels"]
    use_cuda = CUDA_HOME is not None and (
        torch.cuda.is_available() or os.environ.get("CRFKIT_FORCE_CUDA", "0") == "1"
    )
    if use_cuda and files["cuda"]:
        if not torch.cuda.is_available():
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", config.FORCED_CUDA_ARCH_LIST)
        extension = CUDAExtension(
            "crfkit._C",
            files["main"] + files["cuda"],
            extra_compile_args={"cxx": cxx_flags + shared_arch_flags + dispatch_flags,
                                "nvcc": [*config.NVCC_FLAGS, *target_flags]},
            extra_link_args=link_flags, py_limited_api=True,
        )
    else:
        extension = CppExtension(
            "crfkit._C", files["main"], extra_compile_args={"cxx": cxx_flags + shared_arch_flags + dispatch_flags},
            extra_link_args=link_flags, py_limited_api=True,
        )
    extension.cpu_kernel_copies = [(level, kernel_sources, flags) for level, flags in levels]
    extension.cpu_shared_only_flags = shared_arch_flags + dispatch_flags
    # Relink when a kernel file or a header changed (setuptools looks at sources and depends
    # only; the kernel files are not the extension's sources, and ninja recompiles what changed).
    extension.depends = kernel_sources + files["depends"]
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
                        f"TORCH_TARGET = {config.torch_target()!r}  # the stable ABI: this torch and later\n"
                        f"BUILD_MODE = {mode!r}\n")

    cmdclass["build_ext"] = BuildWithInfo

# A wheel with crfkit._C is tagged abi3 (cp310-abi3): the module uses Python's limited API only.
options = {"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {}
setup(ext_modules=ext_modules, cmdclass=cmdclass, options=options)
