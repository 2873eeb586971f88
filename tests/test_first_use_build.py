"""The first-use build of crfkit._C (crfkit/_build.py): its cache key, its lock (two processes: one
builds, the other waits and reuses), a failed build, and how crfkit/_extension.py and
crfkit.backends use it. None of these compiles the real kernels: the lock and failure cases
compile a tiny source with torch.utils.cpp_extension.load, the loading cases put the checkout's
own built crfkit._C where a finished first-use build would be. (The real build, from a plain
isolated install: tests/test_packaging.py, marked slow.)"""
import ctypes
import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import crfkit
from crfkit import _build, _build_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILT = sorted(glob.glob(os.path.join(ROOT, "crfkit", "_C.*.so")))
needs_extension = pytest.mark.skipif(not BUILT, reason="crfkit._C is not built in this checkout")
needs_tools = pytest.mark.skipif(bool(_build.missing_tools()), reason=f"cannot compile: {_build.missing_tools()}")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CRFKIT_CACHE", str(tmp_path / "cache"))
    for name in ("CRFKIT_CPU_ISA", "CRFKIT_BUILD_MODE", "CRFKIT_EXTRA_CFLAGS", "CRFKIT_EXTRA_LDFLAGS",
                 "CRFKIT_BUILD_ON_FIRST_USE", "CRFKIT_NO_EXTENSION", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache" / "extensions"


# ---- the key ----------------------------------------------------------------------------------
def test_cache_key_names_crfkit_torch_python_and_isa(cache):
    build = _build.plan(cuda=False)
    assert os.path.dirname(build.folder) == str(cache)
    name = os.path.basename(build.folder)
    assert name.startswith(f"crfkit{crfkit.__version__}-torch{torch.__version__}-{sys.implementation.cache_tag}-"
                           f"{build.isa}-cpu-")
    assert build.isa == _build.cpu_target()[0]
    assert _build.plan(cuda=False) == build  # the same process, the same key


def test_cache_key_changes_with_isa_flags_and_sources(cache, monkeypatch, tmp_path):
    if not _build_config.is_x86_64():
        pytest.skip("the ISA levels are x86-64's")
    build = _build.plan(cuda=False)
    monkeypatch.setenv("CRFKIT_CPU_ISA", "baseline")
    baseline = _build.plan(cuda=False)
    assert baseline.isa == "baseline" and "-baseline-cpu-" in os.path.basename(baseline.folder)
    assert "-march=x86-64" in baseline.cflags and "-DCRFKIT_CPU_ARCH=x86-64" in baseline.cflags
    assert (baseline.folder == build.folder) == (build.isa == "baseline")
    monkeypatch.delenv("CRFKIT_CPU_ISA")
    monkeypatch.setenv("CRFKIT_EXTRA_CFLAGS", "-DCRFKIT_SOMETHING_ELSE")
    assert _build.plan(cuda=False).folder != build.folder
    monkeypatch.delenv("CRFKIT_EXTRA_CFLAGS")
    # An edited source (a checkout between two builds): another folder, never the stale binary.
    shutil.copytree(os.path.join(ROOT, "csrc"), tmp_path / "src" / "csrc")
    assert _build.plan(cuda=False, root=str(tmp_path / "src")).folder == build.folder
    with open(tmp_path / "src" / "csrc" / "cpu" / "viterbi.cpp", "a") as f:
        f.write("\n// edited\n")
    assert _build.plan(cuda=False, root=str(tmp_path / "src")).folder != build.folder


def test_the_first_use_build_compiles_what_setup_py_compiles_in_one_copy(cache):
    # The same files and flags as setup.py (crfkit/_build_config.py), the kernels once, for one level.
    build = _build.plan(cuda=False)
    files = _build_config.sources(_build.source_root())
    assert list(build.sources) == files["main"] + files["kernels"]
    cxx, link = _build_config.compile_flags("release")
    assert list(build.cflags[: len(cxx)]) == cxx and list(build.ldflags) == link
    assert "-DCRFKIT_CPU_DISPATCH" not in build.cflags  # one copy: dispatch.cpp registers it alone


@pytest.mark.parametrize("flags, level", [
    (set(), "baseline"),
    (set(_build._V3_FLAGS) - {"movbe"}, "baseline"),
    (set(_build._V3_FLAGS), "avx2"),
    (set(_build._V3_FLAGS) | set(_build._V4_FLAGS) - {"avx512vl"}, "avx2"),
    (set(_build._V3_FLAGS) | set(_build._V4_FLAGS), "avx512"),
])
def test_the_level_is_what_the_cpu_runs(monkeypatch, flags, level):
    monkeypatch.setattr(_build, "_cpuinfo_flags", lambda: flags)
    assert _build.best_level() == level


def test_crfkit_cpu_isa_asks_for_a_lower_level_only(monkeypatch):
    if not _build_config.is_x86_64():
        pytest.skip("the ISA levels are x86-64's")
    monkeypatch.setattr(_build, "_cpuinfo_flags", lambda: set(_build._V3_FLAGS))  # an AVX2 CPU
    for asked, level in (("baseline", "baseline"), ("avx2", "avx2"), ("avx512", "avx2"), ("sse9", "avx2")):
        monkeypatch.setenv("CRFKIT_CPU_ISA", asked)
        assert _build.cpu_target()[0] == level, asked


# ---- the lock, and a failed build, on a tiny source ---------------------------------------------
TINY = 'extern "C" int crfkit_tiny_answer() { return 42; }\n'

# A process asking for the tiny build: prints one JSON line, {"library", "compiled"}.
ASK = textwrap.dedent("""\
    import json, sys
    from crfkit import _build
    build = _build.Plan(sys.argv[1], "tiny", False, (sys.argv[2],), ("-O1",), (), ())
    library, compiled = _build.compile_into(build, name="tiny")
    print(json.dumps({"library": library, "compiled": compiled}))
    """)


def _tiny_plan(tmp_path, source=TINY):
    path = tmp_path / "tiny.cpp"
    path.write_text(source)
    return _build.Plan(str(tmp_path / "cache" / "extensions" / "tiny"), "tiny", False, (str(path),), ("-O1",), (), ())


@needs_tools
def test_two_processes_asking_at_once_one_builds_the_other_waits_and_reuses(cache, tmp_path):
    import filelock

    build = _tiny_plan(tmp_path)
    os.makedirs(cache, exist_ok=True)
    held = filelock.FileLock(build.folder + ".lock")  # the build lock, held here while both start
    held.acquire()
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", ASK, build.folder, build.sources[0]], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for proc in procs:  # both wait for the lock, saying so
            line = proc.stderr.readline()
            assert line.startswith(f"crfkit: waiting for another process that is compiling crfkit._C into "
                                   f"{build.folder}"), line
        assert not os.path.exists(build.folder)
    finally:
        held.release()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        results.append(json.loads(out.splitlines()[-1]))
    assert sorted(r["compiled"] for r in results) == [False, True]  # one compiled, the other reused it
    assert results[0]["library"] == results[1]["library"] == _build.library(build.folder)
    assert ctypes.CDLL(results[0]["library"]).crfkit_tiny_answer() == 42
    record = json.loads((tmp_path / "cache" / "extensions" / "tiny" / "build.json").read_text())
    assert record["torch"] == torch.__version__ and record["isa"] == "tiny"
    # A later process reuses it without compiling.
    again = subprocess.run([sys.executable, "-c", ASK, build.folder, build.sources[0]], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert json.loads(again.stdout.splitlines()[-1])["compiled"] is False


@needs_tools
def test_a_failed_build_is_recorded_and_not_retried_unless_asked(cache, tmp_path):
    build = _tiny_plan(tmp_path, source="this is not C++\n")
    said = []
    with pytest.raises(_build.BuildError, match=r"the first-use build of crfkit._C failed \(.*log: ") as failed:
        _build.compile_into(build, name="tiny_failing", say=said.append)
    log = os.path.join(build.folder, _build.LOG)
    assert log in str(failed.value) and "this is not C++" in open(log).read()
    assert os.path.exists(os.path.join(build.folder, _build.FAILED)) and _build.library(build.folder) is None
    start = time.monotonic()
    with pytest.raises(_build.BuildError, match="failed before .*which retries"):
        _build.compile_into(build, name="tiny_failing", say=said.append)
    assert time.monotonic() - start < 5  # not compiled again
    (tmp_path / "tiny.cpp").write_text(TINY)  # fixed: an explicit retry builds
    library, compiled = _build.compile_into(build, name="tiny_fixed", retry=True, say=said.append)
    assert compiled and ctypes.CDLL(library).crfkit_tiny_answer() == 42
    assert not os.path.exists(os.path.join(build.folder, _build.FAILED))
    assert said[0].startswith("crfkit: compiling crfkit._C (the CPU kernels for tiny) against torch ")
    assert said[-1].startswith("crfkit: compiled crfkit._C in ")


def test_status_says_when_the_first_use_build_cannot_run(cache, monkeypatch):
    pending, note = _build.first_use_status()
    if _build.missing_tools():
        assert not pending and "cannot be compiled here at first use" in note
    else:
        assert pending and note.startswith(f"it is compiled for this CPU ({_build.cpu_target()[0]}) and torch "
                                           f"{torch.__version__} at the first op call, once, into {cache}")
        assert "CRFKIT_BUILD_ON_FIRST_USE=0" in note and "python -m crfkit.build" in note
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    pending, note = _build.first_use_status()
    assert not pending and "no C++ compiler ('/nonexistent/c++' is not on PATH; set CXX)" in note
    monkeypatch.delenv("CXX")
    for name, value in (("CRFKIT_BUILD_ON_FIRST_USE", "0"), ("CRFKIT_NO_EXTENSION", "1")):
        monkeypatch.setenv(name, value)
        assert _build.first_use_status() == (False, f"the first-use build is off ({name}={value}); build it with "
                                                    "`python -m crfkit.build`")
        monkeypatch.delenv(name)


# ---- crfkit/_extension.py and crfkit.backends with it, in a fresh Python on a copy -------------
PROBE = textwrap.dedent("""\
    import json, sys, warnings
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch, crfkit
        from crfkit import _build, backends
        {before}
        info = crfkit.backend_info()
        out = {{"file": crfkit.__file__, "at_import": info, "loaded": "crfkit._C" in sys.modules,
               "pending": backends._first_use_pending}}
        generator = torch.Generator().manual_seed(0)
        emissions, transitions = torch.randn(2, 5, 4, generator=generator), torch.randn(4, 4, generator=generator)
        log_z = crfkit.log_partition(emissions, transitions)
        with crfkit.use_backend("reference"):
            expected = crfkit.log_partition(emissions, transitions)
        out.update(after_call=crfkit.backend_info(), close=bool(torch.allclose(log_z, expected, atol=1e-5)),
                   warnings=[f"{{w.category.__name__}}: {{w.message}}" for w in caught if "crfkit" in str(w.message)])
    print(json.dumps(out))
    """)

# Stands in for the compiler: puts the checkout's built crfkit._C where the build would.
FAKE_COMPILE = textwrap.dedent("""\
    import json, os, shutil
    def fake_compile(build, **kwargs):
        kwargs["say"]("crfkit: compiling (fake)")
        os.makedirs(build.folder, exist_ok=True)
        shutil.copy2({built!r}, os.path.join(build.folder, "_C.so"))
        with open(os.path.join(build.folder, "build.json"), "w") as f:
            json.dump({{"library": "_C.so"}}, f)
        return os.path.join(build.folder, "_C.so"), True
    _build.compile_into = fake_compile
    """)


def checkout_copy(tmp_path, extension=False, build_info=None):
    """tmp_path/co: a checkout of crfkit without its build (setup.py, csrc/, crfkit/'s Python
    files), the built _C copied in when `extension`."""
    target = tmp_path / "co"
    shutil.copytree(os.path.join(ROOT, "crfkit"), target / "crfkit",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "_build_info.py", "_sources"))
    shutil.copytree(os.path.join(ROOT, "csrc"), target / "csrc")
    shutil.copy2(os.path.join(ROOT, "setup.py"), target / "setup.py")
    if extension:
        for path in BUILT:
            shutil.copy2(path, target / "crfkit")
    if build_info is not None:
        (target / "crfkit" / "_build_info.py").write_text(f"TORCH_VERSION = {build_info!r}\nBUILD_MODE = 'release'\n")
    return target


def probe(tmp_path, before="", **env):
    environment = dict(os.environ, PYTHONPATH=str(tmp_path / "co"), CRFKIT_BACKEND="",
                       CRFKIT_CACHE=str(tmp_path / "cache"))
    for name in ("CRFKIT_BUILD_ON_FIRST_USE", "CRFKIT_NO_EXTENSION", "CRFKIT_CPU_ISA"):
        environment.pop(name, None)
    result = subprocess.run([sys.executable, "-c", PROBE.format(before=textwrap.indent(before, "    ").strip())],
                            capture_output=True, text=True, cwd=tmp_path, timeout=600, env={**environment, **env})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["file"] == str(tmp_path / "co" / "crfkit" / "__init__.py")
    out["stderr"] = result.stderr
    return out


@needs_extension
@pytest.mark.skipif(bool(_build.missing_tools()), reason="the first-use build cannot run here")
def test_first_op_call_builds_switches_to_compiled_and_later_processes_reuse(tmp_path):
    checkout_copy(tmp_path)
    out = probe(tmp_path, before=FAKE_COMPILE.format(built=BUILT[0]))
    at_import = out["at_import"]
    assert at_import["backend"] in ("numba", "reference") and out["pending"] and not out["loaded"]
    assert at_import["unavailable"]["compiled"].startswith(
        f"ImportError: crfkit._C is not built (no _C*.so in {tmp_path / 'co' / 'crfkit'}); it is compiled for "
        "this CPU (")
    assert "at the first op call, once, into" in at_import["reason"]
    after = out["after_call"]
    assert after["backend"] == "compiled" and after["unavailable"] == {}
    folder = os.path.dirname(after["extension"])
    assert os.path.dirname(folder) == str(tmp_path / "cache" / "extensions")
    assert after["reason"] == f"the compiled extension loaded (built at first use: {folder})"
    assert out["close"] and out["warnings"] == []
    assert "crfkit: compiling (fake)" in out["stderr"]
    # The next process loads it at import, with no compiler needed.
    again = probe(tmp_path, before="_build.compile_into = None", CXX="/nonexistent/c++")
    assert again["at_import"]["backend"] == "compiled" and again["loaded"] and not again["pending"]
    assert again["at_import"]["reason"] == after["reason"] and again["warnings"] == []
    assert again["stderr"] == ""


@needs_extension
@pytest.mark.skipif(bool(_build.missing_tools()), reason="the first-use build cannot run here")
def test_a_binary_for_another_torch_is_replaced_not_loaded(tmp_path):
    checkout_copy(tmp_path, extension=True, build_info="2.4.0+cu121")
    out = probe(tmp_path, before=FAKE_COMPILE.format(built=BUILT[0]))
    assert not out["loaded"] and out["pending"] and out["warnings"] == []
    assert out["at_import"]["unavailable"]["compiled"].startswith(
        f"ImportError: crfkit._C was built against torch 2.4.0+cu121 and torch {torch.__version__} is running; it "
        "is compiled for this CPU")
    assert out["after_call"]["backend"] == "compiled" and "built at first use" in out["after_call"]["reason"]
    assert out["after_call"]["extension"].startswith(str(tmp_path / "cache"))


@pytest.mark.skipif(bool(_build.missing_tools()), reason="the first-use build cannot run here")
def test_a_failed_first_use_build_falls_back_and_says_why(tmp_path):
    checkout_copy(tmp_path)
    fail = ("def fail(build, **kwargs):\n"
            "    raise _build.BuildError('the first-use build of crfkit._C failed (error: boom; log: L)')\n"
            "_build.compile_into = fail")
    out = probe(tmp_path, before=fail)
    after = out["after_call"]
    assert after["backend"] in ("numba", "reference") and out["close"]
    assert after["unavailable"]["compiled"] == "the first-use build of crfkit._C failed (error: boom; log: L)"
    assert after["reason"].startswith("the compiled extension is not available: the first-use build of crfkit._C "
                                      "failed (error: boom; log: L)")
    assert (f"crfkit: the first-use build of crfkit._C failed (error: boom; log: L); running "
            f"{'numba' if after['backend'] == 'numba' else 'the reference'} instead") in out["stderr"]


def test_no_first_use_build_when_switched_off_or_a_backend_is_chosen(tmp_path):
    checkout_copy(tmp_path)
    never = "def never(build, **kwargs):\n    raise AssertionError('compiled')\n_build.compile_into = never"
    out = probe(tmp_path, before=never, CRFKIT_BUILD_ON_FIRST_USE="0")
    assert not out["pending"] and out["after_call"]["backend"] in ("numba", "reference")
    assert ("the first-use build is off (CRFKIT_BUILD_ON_FIRST_USE=0); build it with `python -m crfkit.build`"
            in out["after_call"]["reason"])
    out = probe(tmp_path, before=never + "\ncrfkit.use_backend('reference')")
    assert out["pending"] and out["after_call"]["backend"] == "reference"  # still pending, not built
    assert out["stderr"] == ""


@needs_extension
def test_python_m_crfkit_build_builds_nothing_where_the_extension_is_installed(tmp_path):
    result = subprocess.run([sys.executable, "-m", "crfkit.build"], capture_output=True, text=True, cwd=ROOT,
                            timeout=300, env=dict(os.environ, CRFKIT_CACHE=str(tmp_path / "cache"), CRFKIT_BACKEND=""))
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout.splitlines()[-1])
    assert info["backend"] == "compiled" and os.path.dirname(info["extension"]) == os.path.join(ROOT, "crfkit")
    assert not (tmp_path / "cache").exists()


@needs_extension
@pytest.mark.skipif(bool(_build.missing_tools()), reason="the first-use build cannot run here")
def test_python_m_crfkit_build_builds_ahead_of_the_first_call(tmp_path):
    checkout_copy(tmp_path)
    code = ("import sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]\n"
            "from crfkit import _build\n" + FAKE_COMPILE.format(built=BUILT[0]) +
            "from crfkit.build import main\nsys.exit(main([]))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(tmp_path / "co"), CRFKIT_BACKEND="",
                                     CRFKIT_CACHE=str(tmp_path / "cache")))
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout.splitlines()[-1])
    assert info["backend"] == "compiled" and info["extension"].startswith(str(tmp_path / "cache" / "extensions"))
    assert "crfkit: compiling (fake)" in result.stderr and f"crfkit._C: {info['extension']}" in result.stderr
