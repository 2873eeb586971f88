"""The CPU kernels' copies per instruction set (csrc/cpu/isa.h, csrc/cpu/dispatch.cpp): the
kernel files leave registration to dispatch.cpp and keep their code in the copy's namespace,
every level this CPU runs gives the reference's results when forced with CRFKIT_CPU_ISA, and the
built library runs nothing beyond baseline x86-64 outside the avx2 / avx512 copies
(tools/check_isa_symbols.py). The last two need a dispatch build (CRFKIT_ARCH=dispatch, the
default); a one-copy build (CRFKIT_ARCH=native) skips them."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import crfkit
from crfkit.backends import op_table

ROOT = Path(__file__).resolve().parents[1]
CPU = ROOT / "csrc" / "cpu"
LEVELS = ("baseline", "avx2", "avx512")
SHARED_SOURCES = {"dispatch.cpp", "recycled_memory.cpp"}  # compiled once (crfkit/_build_config.py CPU_SHARED_SOURCES)
NOT_COPIED_HEADERS = {"isa.h", "kernels.h", "dispatch.h", "recycled_memory.h"}


def _cpu_isa():
    try:
        from crfkit import _C
    except ImportError:
        return None
    return _C.cpu_isa()


needs_dispatch_build = pytest.mark.skipif(
    _cpu_isa() not in LEVELS, reason=f"not a dispatch build of crfkit._C (cpu_isa: {_cpu_isa()})")


def test_setup_py_compiles_once_what_the_test_expects():
    # setup.py reads its sources and flags from crfkit/_build_config.py (shared with the first-use build).
    assert "config.sources()" in (ROOT / "setup.py").read_text()
    assert re.search(r'CPU_SHARED_SOURCES = \("csrc/cpu/dispatch.cpp", "csrc/cpu/recycled_memory.cpp"\)',
                     (ROOT / "crfkit" / "_build_config.py").read_text())


@pytest.mark.parametrize("path", sorted(p.name for p in CPU.iterdir() if p.suffix in (".cpp", ".h")))
def test_kernel_code_lives_in_its_copy_and_does_not_register(path):
    code = re.sub(r"//.*", "", (CPU / path).read_text())  # without comments
    if path in ("dispatch.cpp", "isa.h"):  # the registration, and the macro that stops any other
        assert "TORCH_LIBRARY_IMPL(crfkit, CPU, m)" in code or path == "isa.h"
        return
    assert "TORCH_LIBRARY_IMPL" not in code, f"{path} registers ops: list its kernels in csrc/cpu/kernels.h"
    if path in SHARED_SOURCES or path in NOT_COPIED_HEADERS:
        assert "CRFKIT_CPU_ISA" not in code, path
        return
    # Every definition of a kernel file or header inside crfkit::cpu::CRFKIT_CPU_ISA.
    assert '#include "isa.h"' in code, path
    assert code.count("inline namespace CRFKIT_CPU_ISA {") == 1, path
    assert "namespace crfkit {\nnamespace cpu {\ninline namespace CRFKIT_CPU_ISA {" in code, path


def test_every_op_has_a_cpu_kernel_in_the_table():
    listed = re.findall(r"^\s*X\((\w+),", (CPU / "kernels.h").read_text(), flags=re.M)
    assert sorted(listed) == sorted(op_table.OPS), "csrc/cpu/kernels.h and crfkit/backends/op_table.py differ"


# The child: runs tests/test_parity.py's all_outputs (every op, values and gradients) at the level
# CRFKIT_CPU_ISA asks for and saves them; prints the level in use.
_CHILD = """
import sys, torch, crfkit
sys.path.insert(0, {tests!r})
from conftest import random_crf
from test_parity import all_outputs
from crfkit import _C
out = {{}}
for dtype in (torch.float64, torch.float32):
    for B, L, T in {shapes!r}:
        out[(str(dtype), B, L, T)] = all_outputs(*random_crf(B, L, T, dtype=dtype, scale=2.0))
torch.save(out, {path!r})
print(_C.cpu_isa())
"""
# Small and large batches (the batch-lane kernels), tags below and above a vector's width.
SHAPES = [(6, 7, 5), (64, 24, 9), (4, 64, 37), (3, 20, 100)]


def _run_child(level, path):
    env = dict(os.environ)
    env.pop("CRFKIT_CPU_ISA", None)
    env.pop("CRFKIT_BACKEND", None)
    if level is not None:
        env["CRFKIT_CPU_ISA"] = level
    code = _CHILD.format(tests=str(ROOT / "tests"), shapes=SHAPES, path=str(path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split()[-1], result.stderr


@needs_dispatch_build
def test_each_level_this_cpu_runs_matches_the_reference(tmp_path):
    from test_parity import TOL, all_outputs
    from conftest import random_crf

    best, _ = _run_child(None, tmp_path / "best.pt")
    assert best in LEVELS
    want = {}
    with crfkit.use_backend("reference"):
        for dtype in (torch.float64, torch.float32):
            for B, L, T in SHAPES:
                want[(str(dtype), B, L, T)] = all_outputs(*random_crf(B, L, T, dtype=dtype, scale=2.0))
    used = []
    for level in LEVELS[: LEVELS.index(best) + 1]:
        reported, _ = _run_child(level, tmp_path / f"{level}.pt")
        assert reported == level, f"CRFKIT_CPU_ISA={level} ran {reported}"
        used.append(reported)
        got = torch.load(tmp_path / f"{level}.pt")
        for key, outputs in want.items():
            dtype = torch.float64 if "float64" in key[0] else torch.float32
            for name, expected in outputs.items():
                if "paths" in name:
                    assert torch.equal(got[key][name], expected), (level, key, name)
                else:
                    torch.testing.assert_close(got[key][name], expected, **TOL[dtype], msg=f"{level} {key} {name}")
    assert len(set(used)) == len(used)  # each run used another copy


@needs_dispatch_build
@pytest.mark.parametrize("asked", ["avx1024", "sse"])
def test_an_unknown_level_warns_and_uses_the_best(tmp_path, asked):
    best, _ = _run_child(None, tmp_path / "best.pt")
    reported, stderr = _run_child(asked, tmp_path / "asked.pt")
    assert reported == best
    assert "CRFKIT_CPU_ISA must be baseline, avx2 or avx512" in stderr


def test_backend_info_names_the_cpu_kernels():
    info = crfkit.backend_info()
    if "compiled" in info["available"]:
        assert info["cpu_isa"] == _cpu_isa()
    else:
        assert info["cpu_isa"] is None


@needs_dispatch_build
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_no_code_outside_the_avx_copies_needs_more_than_baseline_x86_64():
    from crfkit import _C

    result = subprocess.run([sys.executable, str(ROOT / "tools" / "check_isa_symbols.py"), _C.__file__],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    counts = json.loads(re.search(r"copy of the CPU kernels: (\{.*\})", result.stdout)[1].replace("'", '"'))
    assert min(counts[level] for level in LEVELS) > 0


# Older CPUs, emulated: user-mode QEMU runs the interpreter on a CPU model without AVX-512
# (Haswell) or without AVX2 (Sandy Bridge; older models stop in numpy's own baseline check).
# Opt-in (pytest -m slow), minutes under emulation; needs qemu-x86_64 (Debian: qemu-user).
_SMOKE = """
import torch, crfkit
g = torch.Generator().manual_seed(0)
em, tr = torch.randn(4, 12, 7, generator=g), torch.randn(7, 7, generator=g)
best = crfkit.kbest_viterbi(em, tr, k=3)
with crfkit.use_backend("reference"):
    ref = crfkit.kbest_viterbi(em, tr, k=3)
assert torch.equal(best.paths, ref.paths)
torch.testing.assert_close(best.log_probs, ref.log_probs)
print(crfkit.backend_info()["cpu_isa"])
"""


@pytest.mark.slow
@needs_dispatch_build
@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="needs qemu-x86_64 (qemu-user)")
@pytest.mark.parametrize("cpu,level", [("Haswell-noTSX", "avx2"), ("SandyBridge", "baseline")])
def test_an_older_cpu_runs_its_level(cpu, level):
    env = {k: v for k, v in os.environ.items() if k != "CRFKIT_CPU_ISA"}
    result = subprocess.run(["qemu-x86_64", "-cpu", cpu, sys.executable, "-c", _SMOKE], capture_output=True,
                            text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]  # 132: SIGILL, an instruction the CPU lacks
    assert result.stdout.split()[-1] == level
