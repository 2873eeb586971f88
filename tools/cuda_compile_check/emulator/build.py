"""Build crfkit's CUDA kernels for the CPU emulator (cuda_emulator.h) and load them as
torch.ops.crfkit_emu.* (CPU tensors in, the kernels' own code running with std::threads as lanes).

    python tools/cuda_compile_check/emulator/build.py [--sanitize thread|address]
    python tools/cuda_compile_check/emulator/build.py --race-check   # ThreadSanitizer, standalone
    python tools/cuda_compile_check/emulator/build.py --race-check --kbest-per-tag  # that kernel only
    python tools/cuda_compile_check/emulator/build.py --race-check --marginals-backward  # likewise
    python tools/cuda_compile_check/emulator/build.py --race-check --samplers  # likewise
    python tools/cuda_compile_check/emulator/build.py --race-check --per-example  # likewise

For machines without a GPU: it executes the real kernel source (index arithmetic, shared memory
layout, synchronisation structure, host-side planning and checks), which compiling alone does
not. It says nothing about the GPU's own behaviour (timing, memory model subtleties beyond the
barriers, the compiler's device code generation).

The sources are copied to the build folder with two textual rewrites that C++ needs (the launch
syntax and the dynamic shared memory declaration); a file whose launches cannot be rewritten
makes the build fail loudly rather than test something else.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
DEFAULT_BUILD = Path(os.environ.get("CRFKIT_EMU_BUILD", "/tmp/crfkit_cuda_emulator"))

LAUNCH = re.compile(r"^(?P<indent>\s*)(?P<kernel>\S.*?)<<<(?P<config>.*?)>>>\(", re.M)
SHARED = re.compile(r"extern\s+__shared__\s+__align__\(\d+\)\s+unsigned\s+char\s+(?P<name>\w+)\[\];")


def rewrite(source: str, name: str) -> str:
    """The two rewrites; raises if a launch would be left behind."""
    out = LAUNCH.sub(lambda m: f"{m['indent']}::emu::launch({m['kernel']}, {m['config']})(", source)
    out = SHARED.sub(lambda m: f"unsigned char* {m['name']} = ::emu::dynamic_shared();", out)
    if "<<<" in out or "__shared__" in out:
        raise RuntimeError(f"{name}: a kernel launch or shared declaration the emulator cannot rewrite")
    return out


def schemas() -> str:
    """csrc/crfkit.cpp's STABLE_TORCH_LIBRARY block for the namespace crfkit_emu."""
    text = (ROOT / "csrc" / "crfkit.cpp").read_text()
    start = text.index("STABLE_TORCH_LIBRARY(crfkit, m)")
    depth, end = 0, None
    for i in range(text.index("{", start), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            end = i + 1
            break
    block = text[start:end].replace("STABLE_TORCH_LIBRARY(crfkit, m)", "STABLE_TORCH_LIBRARY(crfkit_emu, m)", 1)
    return "#include <torch/csrc/stable/library.h>\n\n" + block + "\n"


def _write_if_changed(path: Path, text: str) -> None:
    """Keep the file (and its time stamp, for incremental builds) when nothing changed."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def prepare(build_dir: Path) -> list:
    """Write the rewritten sources; returns the .cpp files to compile."""
    src = build_dir / "src"
    (src / "csrc" / "cuda").mkdir(parents=True, exist_ok=True)
    # The csrc/ headers the CUDA sources include.
    for shared in ("checks.h", "backpointers.h", "kbest_merge.h", "numerics.h", "tensor.h"):
        _write_if_changed(src / "csrc" / shared, (ROOT / "csrc" / shared).read_text())
    sources, written = [], set()
    for path in sorted((ROOT / "csrc" / "cuda").iterdir()):
        if path.suffix not in (".cu", ".cuh"):
            continue
        target = src / "csrc" / "cuda" / (path.stem + ".cpp" if path.suffix == ".cu" else path.name)
        _write_if_changed(target, rewrite(path.read_text(), path.name))
        written.add(target.name)
        if path.suffix == ".cu":
            sources.append(str(target))
    for stale in (src / "csrc" / "cuda").iterdir():  # sources removed from csrc/cuda
        if stale.name not in written:
            stale.unlink()
    _write_if_changed(src / "schemas.cpp", schemas())
    return [str(src / "schemas.cpp")] + sources


def build(build_dir: Path = DEFAULT_BUILD, sanitize: Optional[str] = None, verbose: bool = False) -> str:
    """Compile (incrementally, with ninja) and load the library; returns its path."""
    from torch.utils import cpp_extension

    build_dir = Path(build_dir) / (sanitize or "plain")
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = prepare(build_dir)
    flags = ["-std=c++20", "-O1", "-g", "-include", str(HERE / "cuda_emulator.h"), "-pthread"]
    ldflags = ["-pthread"]
    if sanitize:
        flags += [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer"]
        ldflags += [f"-fsanitize={sanitize}"]
    name = "crfkit_cuda_emulator" + (f"_{sanitize}" if sanitize else "")
    library = cpp_extension.load(name=name, sources=sources, extra_cflags=flags, extra_ldflags=ldflags,
                                 extra_include_paths=[str(HERE / "include")], build_directory=str(build_dir),
                                 is_python_module=False, verbose=verbose)
    return library if isinstance(library, str) else str(build_dir / f"{name}.so")


def build_race_check(build_dir: Path = DEFAULT_BUILD, jobs: Optional[int] = None) -> Path:
    """race_check.cpp and the emulated ops as one program built with ThreadSanitizer (whose
    runtime cannot be preloaded into Python on every machine); returns the program's path."""
    import concurrent.futures
    import subprocess
    import sysconfig

    import torch
    from torch.utils import cpp_extension

    build_dir = Path(build_dir) / "race_check"
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = prepare(build_dir) + [str(HERE / "race_check.cpp")]
    flags = ["-std=c++20", "-O1", "-g", "-fsanitize=thread", "-fno-omit-frame-pointer", "-pthread", "-fPIC",
             "-include", str(HERE / "cuda_emulator.h"), "-I", str(HERE / "include"),
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    for path in cpp_extension.include_paths():
        flags += ["-isystem", path]
    flags += ["-isystem", sysconfig.get_paths()["include"]]

    headers = [*(build_dir / "src" / "csrc").rglob("*.h"), *(build_dir / "src" / "csrc").rglob("*.cuh"),
               *HERE.rglob("*.h")]

    def compile_one(source: str) -> str:
        obj = build_dir / (Path(source).stem + ".o")
        newest_input = max(p.stat().st_mtime for p in [Path(source), *headers])
        if not obj.exists() or obj.stat().st_mtime < newest_input:  # incremental
            subprocess.run(["c++", *flags, "-c", source, "-o", str(obj)], check=True)
        return str(obj)

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        objects = list(pool.map(compile_one, sources))
    program = build_dir / "race_check"
    lib = cpp_extension.TORCH_LIB_PATH
    subprocess.run(["c++", *objects, "-o", str(program), "-fsanitize=thread", "-pthread", f"-L{lib}",
                    f"-Wl,-rpath,{lib}", "-ltorch_cpu", "-lc10"], check=True)
    return program


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sanitize", choices=("thread", "address"), default=None)
    parser.add_argument("--race-check", action="store_true",
                        help="build and run race_check.cpp under ThreadSanitizer (a standalone program)")
    parser.add_argument("--kbest-per-tag", action="store_true",
                        help="with --race-check: only k-best's per-tag kernel (minutes instead of 40)")
    parser.add_argument("--marginals-backward", action="store_true",
                        help="with --race-check: only marginals_backward's kernel (minutes instead of 40)")
    parser.add_argument("--samplers", action="store_true",
                        help="with --race-check: only the two samplers' kernel (minutes instead of 40)")
    parser.add_argument("--per-example", action="store_true",
                        help="with --race-check: only the ops on per-example transitions (minutes instead of 40)")
    parser.add_argument("--build-dir", default=str(DEFAULT_BUILD))
    args = parser.parse_args(argv)
    if args.race_check:
        program = build_race_check(Path(args.build_dir))
        env = dict(os.environ, TSAN_OPTIONS=os.environ.get("TSAN_OPTIONS", "halt_on_error=1 exitcode=66"))
        only = [flag for flag, chosen in (("--kbest-per-tag", args.kbest_per_tag),
                                          ("--marginals-backward", args.marginals_backward),
                                          ("--samplers", args.samplers),
                                          ("--per-example", args.per_example)) if chosen]
        return subprocess_run([str(program)] + only[:1], env)
    print(build(Path(args.build_dir), args.sanitize, verbose=True))
    return 0


def subprocess_run(cmd, env) -> int:
    import subprocess

    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
