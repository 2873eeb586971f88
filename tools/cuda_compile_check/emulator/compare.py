"""Are two versions of the CUDA kernels bit-identical? Runs every op of the emulated kernels
(build.py) of this tree and of another source tree on the same inputs and compares the outputs
with torch.equal (the few sums made with atomicAdd, whose last bits vary from run to run, to
rounding: ATOMIC_SUMS).

    git worktree add /tmp/old REV        # or: mkdir /tmp/old && git archive REV | tar -x -C /tmp/old
    python tools/cuda_compile_check/emulator/compare.py /tmp/old

For kernel changes meant to keep every result (a different instruction schedule, fewer branches):
on a machine without a GPU this is the strongest check there is, stronger than
tests/test_cuda.py's comparison with the CPU kernels to rounding. It says nothing about speed,
and the emulator is compiled by the host compiler, not nvcc (whose contraction of a * b + c into
fused multiply-adds may differ). Exit status 1 when any output differs.

The inputs cover the register kernel's edges (T = 1, 8, 9, 16, 17, 32, 33), the generic kernel
(T = 37), float32 and float64, lengths 0 .. L, forbidden transitions and tags, an all-forbidden
sentence, and scores wide enough to take the exact fallbacks. Each build runs in its own
process (both register the namespace crfkit_emu).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RELATIVE = HERE.relative_to(HERE.parents[2])  # tools/cuda_compile_check/emulator


def inputs():
    """(name, emissions, transitions, start, end, lengths) for every case, the same each run."""
    import torch

    g = torch.Generator().manual_seed(0)
    B, L = 7, 13
    lengths = torch.tensor([13, 0, 1, 13, 5, 12, 2])
    for T in (1, 2, 3, 8, 9, 16, 17, 32, 33, 37):
        for dtype in (torch.float32, torch.float64):
            for kind in ("normal", "forbidden", "wide"):
                scale = 8.0 if kind == "wide" else 1.0
                emissions = torch.randn(B, L, T, generator=g, dtype=dtype) * scale
                transitions = torch.randn(T, T, generator=g, dtype=dtype) * (30.0 if kind == "wide" else 1.0)
                start, end = torch.randn(T, generator=g, dtype=dtype), torch.randn(T, generator=g, dtype=dtype)
                if kind == "forbidden":
                    transitions[torch.rand(T, T, generator=g) < 0.4] = -float("inf")
                    emissions[torch.rand(B, L, T, generator=g) < 0.2] = -float("inf")
                    emissions[3] = -float("inf")  # every sequence of sentence 3 forbidden
                yield f"T={T} {dtype} {kind}", emissions, transitions, start, end, lengths


def dump(library: str, out: str) -> None:
    """Run every op of crfkit.backends.op_table the library has on inputs(); save
    {case / op: outputs} to out. (k-best runs with k = 1, 5 and 40.)"""
    import torch

    from crfkit.backends import op_table

    torch.ops.load_library(library)
    emu = torch.ops.crfkit_emu
    g = torch.Generator().manual_seed(1)
    results = {}
    for name, em, tr, st, en, ln in inputs():
        B, L, T = em.shape
        grad = torch.randn(B, generator=g, dtype=em.dtype)
        tags = torch.randint(0, T, (B, 3, L), generator=g)
        grad_scores = torch.randn(B, 3, generator=g, dtype=em.dtype)
        grad_marginals = torch.randn(em.shape, generator=g, dtype=em.dtype)  # every draw before any op runs
        for k in (1, 5, 40):
            calls = op_table.example_arguments(emu, em, tr, ln, st, en, tags=tags, k=k, grad_log_z=grad,
                                               grad_scores=grad_scores, grad_marginals=grad_marginals)
            for op, arguments in calls.items():
                with_k = op.startswith("kbest")
                # an older tree may lack an op; one without a CUDA kernel has no emulated kernel
                if (k == 5 or with_k) and hasattr(emu, op) and op_table.has_kernel("crfkit_emu", op, "CPU"):
                    results[f"{name} / {op}" + (f" k={k}" if with_k else "")] = getattr(emu, op)(*arguments)
    torch.save(results, out)


# Outputs summed with atomicAdd, whose last bits depend on the order the lanes run in (also from
# run to run of one build, csrc/cuda/sequence_score.cu): compared to rounding instead, by index
# into the op's outputs.
ATOMIC_SUMS = {"sequence_score_backward": (1, 2, 3)}  # grad transitions, start, end


def _same(key: str, this, other) -> bool:
    import torch

    atomic = ATOMIC_SUMS.get(key.rsplit(" / ", 1)[-1].split(" ")[0], ())
    for index, (a, b) in enumerate(zip(_flat(this), _flat(other), strict=True)):
        if index in atomic:
            tolerance = 1e-5 if a.dtype == torch.float32 else 1e-12
            if not torch.allclose(a, b, rtol=tolerance, atol=tolerance, equal_nan=True):
                return False
        elif not torch.equal(a, b):
            return False
    return True


def _flat(x):
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _flat(item)]
    return [x]


def build_and_dump(tree: Path, build_dir: Path, out: Path) -> None:
    env = dict(os.environ, CRFKIT_EMU_BUILD=str(build_dir))
    built = subprocess.run([sys.executable, str(tree / RELATIVE / "build.py")], env=env, capture_output=True,
                           text=True)
    if built.returncode != 0:
        sys.exit(f"emulator build of {tree} failed:\n{built.stdout[-3000:]}{built.stderr[-3000:]}")
    library = built.stdout.strip().splitlines()[-1]
    # Each version dumps with its own compare.py and crfkit package, so that each calls its ops
    # the way its own schemas say.
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, str(tree / RELATIVE / "compare.py"), "--dump", library, str(out)], env=env,
                   check=True, cwd=tree)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other_tree", nargs="?", help="source tree of the other version")
    parser.add_argument("--dump", nargs=2, metavar=("LIBRARY", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help="folder for the builds (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.dump:
        dump(*args.dump)
        return 0
    if not args.other_tree:
        parser.error("the other version's source tree is required")
    import torch

    work = Path(args.work or tempfile.mkdtemp(prefix="crfkit_emu_compare_"))
    this_tree, other_tree = HERE.parents[2], Path(args.other_tree).resolve()
    build_and_dump(other_tree, work / "other", work / "other.pt")
    build_and_dump(this_tree, work / "this", work / "this.pt")
    other, this = torch.load(work / "other.pt"), torch.load(work / "this.pt")
    differ = [key for key in this if key in other and not _same(key, this[key], other[key])]
    only = sorted(set(this) ^ set(other))
    print(f"{len(set(this) & set(other))} outputs compared, {len(differ)} differ"
          + (f"; {len(only)} only in one version (ops added or removed)" if only else ""))
    for key in differ[:20]:
        print("  differs:", key)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
