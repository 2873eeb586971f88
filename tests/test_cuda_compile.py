"""The CUDA kernels (csrc/cuda/*.cu) compile with nvcc against the installed torch's headers.

Compile only, for a real architecture, so that device code is instantiated and checked on
machines without a GPU: the kernels cannot rot unseen. The suite compiles for sm_90 alone (the
sources have no per-architecture code, and a second architecture costs minutes of CI);
`python tools/cuda_compile_check/check.py` checks sm_80 and sm_90. The flags and the stand-in
header a CPU-only torch needs are in tools/cuda_compile_check/check.py. Each .cu file is one
nvcc process; the files compile in parallel (one job per CPU). Skipped when nvcc is missing.
"""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("crfkit_cuda_compile_check",
                                               ROOT / "tools" / "cuda_compile_check" / "check.py")
cuda_compile_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cuda_compile_check)

NVCC = cuda_compile_check.find_nvcc()
SUITE_ARCHS = ("90",)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH (nor under CUDA_HOME or /usr/local/cuda): "
                                         "the CUDA compile check needs the CUDA toolkit")
def test_every_cuda_source_compiles(capsys, record_property):
    ok, wall, results = cuda_compile_check.check(archs=SUITE_ARCHS, verbose=False)
    lines = [f"{source.name}: {'ok' if code == 0 else f'FAILED (exit {code})'} in {seconds:.1f} s"
             for source, code, seconds, _ in results]
    summary = f"nvcc compile check of {len(results)} CUDA file(s): {wall:.1f} s wall ({'; '.join(lines)})"
    record_property("cuda_compile_seconds", round(wall, 1))
    with capsys.disabled():  # the time is part of the report, not only with -s
        print(f"\n{summary}")
    failures = "\n\n".join(f"{source}:\n{output}" for source, code, _, output in results if code != 0)
    assert ok, f"{summary}\n\n{failures}"
    # Warnings in crfkit's own CUDA sources (not torch's headers) fail the check too.
    ours = [line for _, _, _, output in results for line in output.splitlines()
            if "csrc/cuda/" in line and "warning" in line]
    assert not ours, "nvcc warnings in csrc/cuda:\n" + "\n".join(ours)


def test_cuda_emulator_python_side_matches_the_backend():
    """The CPU emulator of the kernels (CRFKIT_CUDA_TESTS_EMULATED=1, tests/test_cuda.py) is not
    run in CI (it builds for minutes), so its Python side is checked here: every name it takes
    from crfkit.backends.compiled must exist there. (Moving the autograd formulas to C++ once
    broke it without any test failing.)"""
    import ast

    compiled = pytest.importorskip("crfkit.backends.compiled", reason="the compiled extension is not built")
    tree = ast.parse((ROOT / "tools" / "cuda_compile_check" / "emulator" / "emulated.py").read_text())
    # Attributes of the names it binds to the module: `c` and `compiled`.
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id in ("c", "compiled")}
    assert used, "no reference to compiled.py found: the emulator binds it under another name now"
    missing = sorted(name for name in used if not hasattr(compiled, name))
    assert not missing, f"tools/cuda_compile_check/emulator/emulated.py uses compiled.{missing}, which do not exist"
