"""Backend selection: the compiled extension when it loads, the reference otherwise, a clear
reason either way, and an environment variable to force one."""
import math
import os
import subprocess
import sys

import pytest
import torch

import crfkit


# A subprocess line printing log Z of one all-zero sentence (2 tags, 2 positions: 4 sequences).
PRINT_LOG_Z_OF_ZEROS = "print(float(crfkit.log_partition(torch.zeros(1, 2, 2), torch.zeros(2, 2))))"
LOG_Z_OF_ZEROS = math.log(4)


def run_python(code, **env):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=120)
    return out


def test_backend_info_says_what_runs_and_why():
    info = crfkit.backend_info()
    assert info["backend"] in info["available"] and "reference" in info["available"]
    assert isinstance(info["reason"], str) and info["reason"]


def test_missing_extension_falls_back_to_the_reference():
    # Block both compiled backends (the extension and numba): the reference remains.
    code = ("import sys; sys.modules['crfkit._C'] = None; sys.modules['numba'] = None\n"
            "import torch, crfkit\n"
            "info = crfkit.backend_info(); print(info['backend']); print(info['reason'])\n"
            + PRINT_LOG_Z_OF_ZEROS)
    out = run_python(code, CRFKIT_BACKEND="")
    assert out.returncode == 0, out.stderr
    backend, reason, value = out.stdout.split("\n")[:3]
    assert backend == "reference" and "not available" in reason
    assert float(value) == pytest.approx(LOG_Z_OF_ZEROS)


@pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")
def test_numba_is_imported_only_when_needed():
    # With the extension built, `import crfkit` must not pay for numba (0.23 s, 55 MiB); asking
    # which backends exist loads it, and choosing it works.
    code = ("import sys, torch, crfkit\n"
            "print('numba' in sys.modules)\n"
            "print(crfkit.backend_info()['available'])\n"
            "crfkit.set_backend('numba')\n" + PRINT_LOG_Z_OF_ZEROS)
    out = run_python(code, CRFKIT_BACKEND="")
    assert out.returncode == 0, out.stderr
    loaded_at_import, available, value = out.stdout.split("\n")[:3]
    assert loaded_at_import == "False"
    assert "numba" in available
    assert float(value) == pytest.approx(LOG_Z_OF_ZEROS)


def test_missing_numba_is_reported_when_asked_for():
    code = ("import sys; sys.modules['numba'] = None\n"
            "import crfkit\n"
            "info = crfkit.backend_info(); print('numba' in info['available']); print(info['unavailable']['numba'])\n"
            "crfkit.set_backend('numba')")
    out = run_python(code, CRFKIT_BACKEND="")
    assert out.returncode != 0
    listed, reason = out.stdout.split("\n")[:2]
    assert listed == "False" and "import of numba halted" in reason
    assert "backend 'numba' is not available: ModuleNotFoundError" in out.stderr
    out = run_python("import sys; sys.modules['numba'] = None\nimport crfkit", CRFKIT_BACKEND="numba")
    assert out.returncode != 0 and "CRFKIT_BACKEND=numba but it cannot be loaded" in out.stderr


def test_environment_variable_forces_a_backend():
    out = run_python("import crfkit; print(crfkit.backend_info()['backend'])", CRFKIT_BACKEND="reference")
    assert out.returncode == 0 and out.stdout.strip() == "reference"
    out = run_python("import crfkit", CRFKIT_BACKEND="cuda-magic")
    assert out.returncode != 0 and "CRFKIT_BACKEND must be one of" in out.stderr


def test_use_backend_restores_the_previous_one():
    before = crfkit.backend_info()["backend"]
    with crfkit.use_backend("reference"):
        assert crfkit.backend_info()["backend"] == "reference"
    assert crfkit.backend_info()["backend"] == before
    with pytest.raises(ValueError, match="backend must be one of"):
        crfkit.set_backend("fortran")


@pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")
def test_an_out_of_date_extension_is_refused(monkeypatch):
    # The loaded extension's schemas are checked against those csrc/crfkit.cpp defines: here the
    # sources define the old argument order of viterbi (lengths last), which the build does not have.
    from crfkit.backends import op_table

    op_table.check_schemas()  # the real build matches
    old = ("(Tensor emissions, Tensor transitions, Tensor start, Tensor end, Tensor lengths) "
           "-> (Tensor scores, Tensor paths)")
    changed = {**op_table.source_schemas(), "viterbi": old}
    monkeypatch.setattr(op_table, "source_schemas", lambda: changed)
    with pytest.raises(ImportError, match="out of date: op viterbi has schema .*rebuild"):
        op_table.check_schemas()


def test_schemas_are_read_from_the_cpp_source():
    # csrc/crfkit.cpp is the one place the schemas are written; the parser joins a schema's adjacent
    # string literals and keeps the names of the outputs.
    from crfkit.backends import op_table

    source = """// m.def("commented(Tensor x) -> Tensor") is not in the block
    STABLE_TORCH_LIBRARY(crfkit, m) {
      m.def("first(Tensor emissions, "
            "int k) -> (Tensor scores, Tensor paths)");
      // a comment between definitions
      m.def("second(Tensor a) -> Tensor");
    }"""
    assert op_table.schemas_in(source) == {"first": "(Tensor emissions, int k) -> (Tensor scores, Tensor paths)",
                                           "second": "(Tensor a) -> Tensor"}
    assert set(op_table.source_schemas()) == set(op_table.OPS)


@pytest.fixture
def restore_backend():
    """Put back the backend and its reason after the test, whatever it switched to."""
    saved = (crfkit.backends._current, crfkit.backends._reason)
    yield saved
    crfkit.backends._current, crfkit.backends._reason = saved


def another_backend(than):
    """An available backend other than `than` (the reference is always there)."""
    return next(name for name in crfkit.backends.available() if name != than)


def test_use_backend_called_plainly_switches_and_stays_switched(restore_backend):
    # The README says to call crfkit.use_backend("reference"); it used to do nothing unless in a with.
    before = crfkit.backend_info()["backend"]
    other = another_backend(before)
    crfkit.use_backend(other)
    info = crfkit.backend_info()
    assert info["backend"] == other and info["reason"] == "chosen with crfkit.set_backend / use_backend"
    assert crfkit.backends.current() is crfkit.backends._available[other]
    value = float(crfkit.log_partition(torch.zeros(1, 2, 2), torch.zeros(2, 2)))  # runs on it
    assert math.isclose(value, LOG_Z_OF_ZEROS, rel_tol=1e-6)  # float32
    assert crfkit.backend_info()["backend"] == other


def test_use_backend_in_a_with_block_restores_backend_and_reason(restore_backend):
    before = crfkit.backend_info()
    other = another_backend(before["backend"])
    with crfkit.use_backend(other) as entered:
        assert entered is None
        assert crfkit.backend_info()["backend"] == other
    after = crfkit.backend_info()
    assert (after["backend"], after["reason"]) == (before["backend"], before["reason"])


def test_nested_use_backend_restores_each_level(restore_backend):
    before = crfkit.backend_info()
    outer = another_backend(before["backend"])
    inner = another_backend(outer)
    with crfkit.use_backend(outer):
        with crfkit.use_backend(inner):
            assert crfkit.backend_info()["backend"] == inner
        assert crfkit.backend_info()["backend"] == outer
        crfkit.use_backend(inner)  # a plain call inside a block lasts until the block ends
        assert crfkit.backend_info()["backend"] == inner
    after = crfkit.backend_info()
    assert (after["backend"], after["reason"]) == (before["backend"], before["reason"])


def test_use_backend_restores_when_the_block_raises(restore_backend):
    before = crfkit.backend_info()
    other = another_backend(before["backend"])
    with pytest.raises(KeyError, match="raised in the block"):
        with crfkit.use_backend(other):
            assert crfkit.backend_info()["backend"] == other
            raise KeyError("raised in the block")
    after = crfkit.backend_info()
    assert (after["backend"], after["reason"]) == (before["backend"], before["reason"])


def test_use_backend_refuses_what_set_backend_refuses(restore_backend, monkeypatch):
    before = crfkit.backend_info()
    errors = []
    for switch in (crfkit.set_backend, crfkit.use_backend):
        with pytest.raises(ValueError, match="backend must be one of") as raised:
            switch("fortran")
        errors.append(str(raised.value))
    assert errors[0] == errors[1]
    # A known backend that cannot be loaded: RuntimeError with why, from both.
    monkeypatch.setattr(crfkit.backends, "_load", lambda name: False)
    monkeypatch.setitem(crfkit.backends._unavailable, "numba", "ImportError: numba is not installed")
    errors = []
    for switch in (crfkit.set_backend, crfkit.use_backend):
        with pytest.raises(RuntimeError, match="backend 'numba' is not available: ImportError") as raised:
            switch("numba")
        errors.append(str(raised.value))
    assert errors[0] == errors[1]
    after = crfkit.backend_info()
    assert (after["backend"], after["reason"]) == (before["backend"], before["reason"])
