"""Why the compiled backend is (not) used: crfkit/_extension.py. Each case runs a fresh Python on
a copy of the package in a temporary folder (its Python files; the real crfkit/_C*.so copied in
where the case needs it, never moved or changed), so the checkout's own build is left alone."""
import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILT = sorted(glob.glob(os.path.join(ROOT, "crfkit", "_C.*.so")))
needs_extension = pytest.mark.skipif(not BUILT, reason="crfkit._C is not built in this checkout")

# Imports crfkit from the copy and prints what it says, as JSON. The editable install's finder
# (setuptools, on sys.meta_path after the normal path search) is taken out first: it maps
# crfkit.* to the installed checkout, whose _C the copy would otherwise find. The same probe
# without that step is test_another_checkouts_extension_is_not_loaded.
PROBE = textwrap.dedent("""\
    import json, sys, warnings
    KEEP_FINDERS = {keep_finders}
    if not KEEP_FINDERS:
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import crfkit
    info = crfkit.backend_info()
    print(json.dumps({{"file": crfkit.__file__, "backend": info["backend"], "reason": info["reason"],
                      "unavailable": info["unavailable"].get("compiled"),
                      "warnings": [f"{{w.category.__name__}}: {{w.message}}" for w in caught
                                   if "crfkit" in str(w.message)]}}))
    """)


def package_copy(tmp_path, extension=True, build_info=None):
    """tmp_path/site/crfkit: the checkout's Python files, the built _C when `extension`, and a
    _build_info.py recording torch `build_info` when given."""
    target = tmp_path / "site" / "crfkit"
    shutil.copytree(os.path.join(ROOT, "crfkit"), target,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "_build_info.py"))
    if extension:
        for path in BUILT:
            shutil.copy2(path, target)
    if build_info is not None:
        (target / "_build_info.py").write_text(f"TORCH_VERSION = {build_info!r}\nBUILD_MODE = 'release'\n")
    return target


def probe(tmp_path, keep_finders=False, **env):
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(keep_finders=keep_finders)], capture_output=True, text=True,
        cwd=tmp_path, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(tmp_path / "site"), CRFKIT_BACKEND="", **env))
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["file"] == str(tmp_path / "site" / "crfkit" / "__init__.py")  # the copy, not the checkout
    return out


def test_missing_extension_is_reported_as_not_built(tmp_path):
    package_copy(tmp_path, extension=False)
    out = probe(tmp_path)
    assert out["backend"] in ("numba", "reference")
    reason = out["unavailable"]
    assert reason.startswith("ImportError: crfkit._C is not built (no _C*.so in ")
    assert str(tmp_path / "site" / "crfkit") in reason
    assert "pip install --no-build-isolation -e ." in reason and "make setup" in reason
    assert "circular import" not in reason
    assert out["reason"].startswith(f"the compiled extension is not available: {reason}")
    assert out["warnings"] == []  # not built on purpose (CRFKIT_NO_EXTENSION=1): no warning


@needs_extension
def test_extension_of_the_running_torch_loads_without_warning(tmp_path):
    package_copy(tmp_path, build_info=torch.__version__)
    out = probe(tmp_path)
    assert out["backend"] == "compiled" and out["reason"] == "the compiled extension loaded"
    assert out["unavailable"] is None and out["warnings"] == []


@needs_extension
def test_extension_built_for_another_torch_warns(tmp_path):
    package_copy(tmp_path, build_info="2.4.0+cu121")
    out = probe(tmp_path)
    assert len(out["warnings"]) == 1
    warning = out["warnings"][0]
    assert warning.startswith("RuntimeWarning: crfkit: crfkit._C was built against torch 2.4.0+cu121 and "
                              f"torch {torch.__version__} is running")
    assert "pip install --no-build-isolation -e ." in warning
    # It loaded (the copied binary is in fact this torch's): used, with the mismatch in the reason.
    assert out["backend"] == "compiled"
    assert "built against torch 2.4.0+cu121" in out["reason"]


@needs_extension
def test_stable_abi_build_for_an_older_torch_loads_without_warning(tmp_path):
    # crfkit._C is built on torch's stable ABI (csrc/tensor.h): a build recording a target the
    # running torch reaches suits it, whichever torch compiled it.
    target = package_copy(tmp_path, build_info="2.14.1")
    with open(target / "_build_info.py", "a") as f:
        f.write("TORCH_TARGET = '2.10'\n")
    out = probe(tmp_path)
    assert out["backend"] == "compiled" and out["reason"] == "the compiled extension loaded"
    assert out["warnings"] == []


@needs_extension
def test_stable_abi_build_for_a_newer_torch_warns(tmp_path):
    target = package_copy(tmp_path, build_info="3.1.0")
    with open(target / "_build_info.py", "a") as f:
        f.write("TORCH_TARGET = '3.1'\n")
    out = probe(tmp_path)
    assert len(out["warnings"]) == 1, out
    assert f"crfkit._C was built against torch 3.1.0 and torch {torch.__version__} is running" in out["warnings"][0]


@pytest.mark.parametrize("in_use,asked,expected", [
    ("march=x86-64-v3", "avx2", "CRFKIT_CPU_ISA=avx2 is ignored: this build has one copy of the CPU kernels"),
    ("avx2", "avx1024", "CRFKIT_CPU_ISA must be baseline, avx2 or avx512, got 'avx1024'; using avx2"),
    ("avx2", "AVX512", "CRFKIT_CPU_ISA=AVX512 but this CPU runs at most avx2; using avx2"),
    ("avx2", "avx2", None),
    ("baseline", "Baseline", None),
])
def test_a_cpu_isa_the_build_cannot_honour_warns(monkeypatch, in_use, asked, expected):
    # The C++ side picks the copy (csrc/cpu/dispatch.cpp); the stable ABI cannot warn, Python does.
    import types
    import warnings

    from crfkit import _extension

    monkeypatch.setenv("CRFKIT_CPU_ISA", asked)
    module = types.SimpleNamespace(cpu_isa=lambda: in_use)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _extension.warn_about_cpu_isa(module)
    messages = [str(w.message) for w in caught]
    if expected is None:
        assert messages == []
    else:
        assert len(messages) == 1 and messages[0].startswith(f"crfkit: {expected}")
        assert caught[0].category is RuntimeWarning


def test_extension_that_fails_to_load_warns_with_both_versions(tmp_path):
    # A stand-in for a binary built against another torch: a library with the module's entry
    # point that needs a symbol nothing provides, so loading it fails as such a binary does
    # ("undefined symbol").
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("needs a C++ compiler")
    target = package_copy(tmp_path, extension=False, build_info="2.4.0")
    source = tmp_path / "stale.cpp"
    source.write_text('void symbol_of_another_torch();\nextern "C" void* PyInit__C() '
                      '{ symbol_of_another_torch(); return nullptr; }\n')
    import sysconfig

    library = target / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(library)], check=True, timeout=120)
    out = probe(tmp_path)
    assert out["backend"] != "compiled"
    reason = out["unavailable"]
    assert reason.startswith("ImportError: crfkit._C failed to load (ImportError: ")
    assert "undefined symbol" in reason and "symbol_of_another_torch" in reason
    assert f"crfkit._C was built against torch 2.4.0 and torch {torch.__version__} is running" in reason
    assert len(out["warnings"]) == 1
    assert out["warnings"][0] == f"RuntimeWarning: crfkit: the compiled kernels are not used: {reason[13:]}"


def test_extension_for_another_python_warns(tmp_path):
    target = package_copy(tmp_path, extension=False)
    (target / "_C.cpython-38-x86_64-linux-gnu.so").write_bytes(b"")
    out = probe(tmp_path)
    assert out["unavailable"].startswith("ImportError: crfkit._C is built for another Python: found "
                                         "_C.cpython-38-x86_64-linux-gnu.so, but Python ")
    assert len(out["warnings"]) == 1 and "is built for another Python" in out["warnings"][0]


def test_another_checkouts_extension_is_not_loaded(tmp_path):
    # With the editable install's finder in place (as in any checkout but the installed one),
    # a copy without its own _C must not load the installed checkout's binary.
    import importlib.metadata

    # The installed distribution is the one with direct_url.json; a crfkit.egg-info lying in the
    # checkout (on sys.path under `python -m pytest`) would otherwise be found first.
    direct_urls = (d.read_text("direct_url.json") for d in importlib.metadata.distributions(name="crfkit"))
    origin = json.loads(next(filter(None, direct_urls), "{}"))
    if not origin.get("dir_info", {}).get("editable"):
        pytest.skip("crfkit is not installed in editable mode here")
    installed = glob.glob(os.path.join(origin["url"].removeprefix("file://"), "crfkit", "_C.*.so"))
    if not installed:
        pytest.skip("the installed checkout has no built extension")
    package_copy(tmp_path, extension=False)
    out = probe(tmp_path, keep_finders=True)
    assert out["backend"] != "compiled"
    assert out["unavailable"].startswith(f"ImportError: crfkit._C is not built in {tmp_path / 'site' / 'crfkit'}; "
                                         f"the one found, {installed[0]}, belongs to another copy of crfkit")
    assert len(out["warnings"]) == 1


@needs_extension
def test_extension_older_than_the_python_side_warns(tmp_path):
    # An extension whose op schemas differ from those its sources define (csrc/crfkit.cpp, read by
    # op_table.source_schemas; an extension built from older sources): it loads, the compiled
    # backend refuses it, and that is as loud as a failed load. The copy carries its sources as a
    # wheel does (crfkit/_sources/csrc), with viterbi's schema changed.
    target = package_copy(tmp_path, build_info=torch.__version__)
    (target / "_sources" / "csrc").mkdir(parents=True)
    cpp = open(os.path.join(ROOT, "csrc", "crfkit.cpp")).read()
    defined = ('m.def("viterbi(Tensor emissions, Tensor transitions, Tensor lengths, Tensor start, "\n'
               '        "Tensor end) -> (Tensor scores, Tensor paths)");')
    assert cpp.count(defined) == 1
    (target / "_sources" / "csrc" / "crfkit.cpp").write_text(
        cpp.replace(defined, 'm.def("viterbi(Tensor emissions, Tensor transitions, Tensor start, Tensor end, '
                             'Tensor lengths) -> (Tensor scores, Tensor paths)");'))
    out = probe(tmp_path)
    assert out["backend"] != "compiled"
    assert out["unavailable"].startswith("ImportError: crfkit._C is out of date: op viterbi has schema ")
    assert out["warnings"] == [f"RuntimeWarning: crfkit: the compiled kernels are not used: {out['unavailable']}"]
