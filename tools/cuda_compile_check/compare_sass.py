"""Compare the GPU machine code (SASS) of one .cu file in two trees, kernel by kernel.

    python tools/cuda_compile_check/compare_sass.py OTHER [--base BASE] [--arch 90,80]
        [--file csrc/cuda/log_partition.cu] [--keep DIR] [--cuobjdump PATH] [--show-diff N]

For refactorings of device code meant to change nothing on the GPU (moving code into headers,
extracting device functions): identical SASS for every kernel proves the machine code, hence its
speed and results, unchanged, with no GPU. OTHER and BASE (default: this tree) are each a
repository root, whose FILE is compiled, or an object a previous run kept (--keep): the object of
BASE, unchanged between attempts, need not be compiled again.

Each tree's FILE is compiled by one nvcc process with the flags of check.py (this tree's), `-c`
into an object holding the cubins of every --arch; `cuobjdump -sass` disassembles them (it needs
nvdisasm on PATH or in NVDISASM_PATH; both come with a full toolkit, or from the
nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm wheels). Compared per arch and function: every
instruction with its encoding (control bits included), addresses dropped and runs of blanks
made one (cuobjdump pads to the widest address of the file). The other normalisation: the name
nvcc gives an anonymous namespace (_GLOBAL__N__<hash>_..._<file>_<hash>) depends on the
source's path, so it is replaced by _GLOBAL__N_ in every name. Registers and stack size come from
`cuobjdump -res-usage`; STL / LDL counts the local-memory (spill) stores and loads in the code.

Prints one line per function and a summary per arch; exit status 0 when every function of both
is identical, 1 otherwise. Run it under `nice` on a shared machine: each compile takes a core.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import check  # noqa: E402  (this folder's compile check: the nvcc flags)

ANON = re.compile(r"(\d+)_GLOBAL__N__")
ADDRESS = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*")

Sass = Dict[str, Dict[str, List[str]]]  # arch -> function -> normalised lines


def normalise_names(text: str) -> str:
    """Replace each <length>_GLOBAL__N__... identifier (an anonymous namespace) by _GLOBAL__N_."""
    out, pos = [], 0
    for match in ANON.finditer(text):
        if match.start() < pos:
            continue
        out.append(text[pos:match.start()])
        out.append("11_GLOBAL__N_")
        pos = match.start() + len(match.group(1)) + int(match.group(1))
    out.append(text[pos:])
    return "".join(out)


def find_tool(name: str, given: Optional[str]) -> str:
    if given:
        return given
    found = shutil.which(name)
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / name).exists():
            return str(Path(home) / "bin" / name)
    raise FileNotFoundError(f"{name} not found (PATH, CUDA_HOME, /usr/local/cuda); see --cuobjdump")


def compile_object(tree: Path, file: str, archs: Sequence[str], out: Path) -> None:
    nvcc = check.find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)")
    source = tree / file
    if not source.exists():
        raise FileNotFoundError(source)
    begin = time.perf_counter()
    cmd = [nvcc, *check.nvcc_flags(archs), str(source), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tree)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed for {source}:\n{proc.stdout}{proc.stderr}")
    print(f"compiled {source} (sm_{', sm_'.join(archs)}) in {time.perf_counter() - begin:.0f} s", flush=True)


def split_functions(text: str) -> Sass:
    """cuobjdump -sass output -> arch -> function -> lines (addresses dropped, names normalised)."""
    result: Sass = {}
    arch, function = None, None
    for raw in normalise_names(text).splitlines():
        line = raw.strip()
        if line.startswith(".target"):
            arch = line.split()[1]
            result.setdefault(arch, {})
            function = None
        elif line.startswith("Function :"):
            function = line.split(":", 1)[1].strip()
            result.setdefault(arch or "?", {})[function] = []
        elif function is not None and line:
            result[arch or "?"][function].append(" ".join(ADDRESS.sub("", raw).split()))
    return result


def resource_usage(text: str) -> Dict[str, Dict[str, Dict[str, str]]]:
    """cuobjdump -res-usage output -> arch -> function -> {REG: .., STACK: .., ...}."""
    result: Dict[str, Dict[str, Dict[str, str]]] = {}
    arch, function = "?", None
    for line in normalise_names(text).splitlines():
        line = line.strip()
        target = re.search(r"arch = (sm_\d+)", line)
        if target:
            arch = target.group(1)
        elif line.startswith("Function "):
            function = line[len("Function "):].rstrip(":")
        elif function is not None and line.startswith("REG:"):
            result.setdefault(arch, {})[function] = dict(item.split(":", 1) for item in line.split())
            function = None
    return result


def disassemble(cuobjdump: str, obj: Path) -> Tuple[Sass, Dict[str, Dict[str, Dict[str, str]]]]:
    def run(flag: str) -> str:
        proc = subprocess.run([cuobjdump, flag, str(obj)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"cuobjdump {flag} {obj} failed:\n{proc.stdout}{proc.stderr}")
        return proc.stdout

    return split_functions(run("-sass")), resource_usage(run("-res-usage"))


def demangle(names: Sequence[str]) -> Dict[str, str]:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    proc = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True)
    pretty = proc.stdout.splitlines()
    if proc.returncode != 0 or len(pretty) != len(names):
        return {n: n for n in names}
    return {n: p.replace("crfkit::cuda::(anonymous namespace)::", "") for n, p in zip(names, pretty)}


def describe(usage: Dict[str, str], lines: List[str]) -> str:
    stl = sum(1 for line in lines if re.search(r"\bSTL(\.\S+)?\s", line))
    ldl = sum(1 for line in lines if re.search(r"\bLDL(\.\S+)?\s", line))
    instructions = sum(1 for line in lines if not line.lstrip().startswith("/*"))
    return (f"REG {usage.get('REG', '?')} STACK {usage.get('STACK', '?')} STL {stl} LDL {ldl} "
            f"{instructions} instr")


def obtain(tree_or_object: Path, file: str, archs: Sequence[str], tmp: Path, label: str,
           keep: Optional[Path]) -> Path:
    if tree_or_object.is_file():
        return tree_or_object
    obj = tmp / f"{label}.o"
    compile_object(tree_or_object, file, archs, obj)
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(obj, keep / f"{label}.o")
        print(f"kept {keep / f'{label}.o'}")
    return obj


def compare(base: Path, other: Path, file: str, archs: Sequence[str], cuobjdump: str,
            keep: Optional[Path], show_diff: int) -> bool:
    import difflib

    with tempfile.TemporaryDirectory(prefix="crfkit_sass_") as tmp_name:
        tmp = Path(tmp_name)
        base_obj = obtain(base, file, archs, tmp, "base", keep)
        other_obj = obtain(other, file, archs, tmp, "other", keep)
        base_sass, base_usage = disassemble(cuobjdump, base_obj)
        other_sass, other_usage = disassemble(cuobjdump, other_obj)
    all_same = True
    for arch in sorted(set(base_sass) | set(other_sass)):
        a, b = base_sass.get(arch, {}), other_sass.get(arch, {})
        names = sorted(set(a) | set(b))
        pretty = demangle(names)
        same = 0
        print(f"\n{arch}: base {base}, other {other}")
        for name in sorted(names, key=lambda n: pretty[n]):
            if name not in a or name not in b:
                print(f"  only in {'base' if name in a else 'other'}: {pretty[name]}")
                all_same = False
                continue
            if a[name] == b[name]:
                same += 1
                print(f"  identical  {pretty[name]}")
                continue
            all_same = False
            ua = base_usage.get(arch, {}).get(name, {})
            ub = other_usage.get(arch, {}).get(name, {})
            print(f"  DIFFERS    {pretty[name]}\n"
                  f"             base:  {describe(ua, a[name])}\n"
                  f"             other: {describe(ub, b[name])}")
            if show_diff:
                diff = list(difflib.unified_diff(a[name], b[name], "base", "other", n=1, lineterm=""))
                for line in diff[:show_diff]:
                    print(f"             | {line}")
        print(f"{arch}: {same} of {len(names)} functions identical")
    return all_same


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("other", type=Path, help="a repository root, or an object kept by --keep")
    parser.add_argument("--base", type=Path, default=ROOT, help="likewise; default: this tree")
    parser.add_argument("--file", default="csrc/cuda/log_partition.cu", help="relative to each tree's root")
    parser.add_argument("--arch", default="90", help="compute capabilities, e.g. 90 or 80,90")
    parser.add_argument("--keep", type=Path, default=None, help="copy the compiled objects (base.o, other.o) here")
    parser.add_argument("--cuobjdump", default=None, help="default: on PATH, else under CUDA_HOME")
    parser.add_argument("--show-diff", type=int, default=0, metavar="N",
                        help="print the first N lines of each differing function's diff")
    args = parser.parse_args(argv)
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    same = compare(args.base.resolve(), args.other.resolve(), args.file, archs,
                   find_tool("cuobjdump", args.cuobjdump), args.keep, args.show_diff)
    print("\nall identical" if same else "\nSOME DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
