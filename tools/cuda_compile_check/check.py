"""Compile every csrc/cuda/*.cu with nvcc against the installed torch's headers (compile only).

    python tools/cuda_compile_check/check.py [--arch 80,90] [--jobs N] [--resource-usage] [files...]

For machines without a GPU (CI): the CUDA kernels cannot run there, but they must keep
compiling, for real architectures, so that device code is instantiated and checked too. The
flags are those torch.utils.cpp_extension uses for a CUDAExtension (its common nvcc flags,
TORCH_EXTENSION_NAME, TORCH_API_INCLUDE_EXTENSION_H, the C++ ABI, -fPIC) plus setup.py's:
crfkit/_build_config.py's NVCC_FLAGS, the stable-ABI target (TORCH_TARGET_VERSION, from
torch_target_flags(torch_target()): CRFKIT_TORCH_TARGET or 2.10, so an API newer than the
target fails here as in a real build) and Py_LIMITED_API (the abi3 module's). The kernels use
torch's stable C ABI only (csrc/tensor.h), whose headers are device-neutral; their one CUDA call
into torch (aoti_torch_get_current_cuda_stream) is declared in csrc/cuda/common.cuh. The
stand-in c10/cuda/impl/cuda_cmake_macros.h in this folder (a generated header CPU wheels lack)
stays on the include path for any c10 CUDA header a torch header may still pull in.
Objects go to a temporary folder that is removed afterwards. Each file is one nvcc process
(all architectures in it); files are compiled in parallel (--jobs, default: the CPU count).
Exit status 0 when every file compiles; prints one line per file with its time.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def build_config():
    """crfkit/_build_config.py, loaded by path (importing the crfkit package would load crfkit._C)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("crfkit_build_config", ROOT / "crfkit" / "_build_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
DEFAULT_ARCHS = ("80", "90")  # A100 and H100 / H200: real SASS, so device code is compiled


def find_nvcc() -> Optional[str]:
    """nvcc on PATH, else under CUDA_HOME / the usual /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return None


def nvcc_flags(archs: Sequence[str] = DEFAULT_ARCHS) -> List[str]:
    """Every flag but the source and output: include paths, defines, architectures."""
    import torch
    from torch.utils import cpp_extension

    config = build_config()
    flags = [*config.NVCC_FLAGS, "-c", "-I", str(HERE)]
    for path in cpp_extension.include_paths():
        flags += ["-isystem", path]
    flags += ["-isystem", sysconfig.get_paths()["include"]]
    flags += list(cpp_extension.COMMON_NVCC_FLAGS)
    flags += ["-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H",
              f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
              "--compiler-options", "-fPIC"]
    flags += config.torch_target_flags(config.torch_target())  # as setup.py's nvcc flags
    flags += [f"-DPy_LIMITED_API={config.PYTHON_LIMITED_API}"]  # setup.py: py_limited_api=True
    for arch in archs:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    return flags


def sources(names: Sequence[str] = ()) -> List[Path]:
    if names:
        return [Path(n).resolve() for n in names]
    return sorted((ROOT / "csrc" / "cuda").glob("*.cu"))


def compile_one(nvcc: str, source: Path, flags: List[str], out_dir: Path,
                extra: Sequence[str] = ()) -> Tuple[Path, int, float, str]:
    """(source, return code, seconds, compiler output)."""
    begin = time.perf_counter()
    cmd = [nvcc, *flags, *extra, str(source), "-o", str(out_dir / (source.stem + ".o"))]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    return source, proc.returncode, time.perf_counter() - begin, (proc.stdout + proc.stderr).strip()


def check(names: Sequence[str] = (), archs: Sequence[str] = DEFAULT_ARCHS, jobs: Optional[int] = None,
          resource_usage: bool = False, verbose: bool = True) -> Tuple[bool, float, List[Tuple[Path, int, float, str]]]:
    """Compile the files; returns (all compiled, wall seconds, per-file results)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)")
    files = sources(names)
    if not files:
        raise FileNotFoundError("no csrc/cuda/*.cu files")
    flags = nvcc_flags(archs)
    extra = ["-Xptxas", "-warn-spills", "--resource-usage"] if resource_usage else []
    jobs = jobs or os.cpu_count() or 1
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="crfkit_nvcc_") as tmp:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(lambda f: compile_one(nvcc, f, flags, Path(tmp), extra), files))
    wall = time.perf_counter() - begin
    if verbose:
        for source, code, seconds, output in results:
            status = "ok" if code == 0 else f"FAILED (exit {code})"
            print(f"{source.relative_to(ROOT) if source.is_relative_to(ROOT) else source}: {status} in {seconds:.1f} s")
            if output:  # errors, warnings, --resource-usage
                print(output)
        print(f"{len(files)} file(s), sm_{', sm_'.join(archs)}, {jobs} job(s): {wall:.1f} s wall")
    return all(code == 0 for _, code, _, _ in results), wall, results


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", help="default: every csrc/cuda/*.cu")
    parser.add_argument("--arch", default=",".join(DEFAULT_ARCHS), help="compute capabilities, e.g. 80,90")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--resource-usage", action="store_true", help="print registers / spills per kernel")
    args = parser.parse_args(argv)
    ok, _, _ = check(args.files, [a.strip() for a in args.arch.split(",") if a.strip()], args.jobs,
                     args.resource_usage)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
