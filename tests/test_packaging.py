"""The package as a user installs it: the sdist builds the extension on its own (every header
and CUDA source inside), and a downstream project that lists "crfkit" as a dependency installs
it from that sdist and calls crfkit.kbest_viterbi with the compiled backend.

The venv sees the installed torch (--system-site-packages) and builds without isolation, as the
README tells users to, so nothing is downloaded. It builds what a user gets, the portable build
(CRFKIT_ARCH=dispatch: the CPU kernels for x86-64, AVX2 and AVX-512), about 3.5 minutes on 2 cores.

Without torch: the sdist is made where importing torch fails, setup.py there gives a pure-Python
wheel carrying the C++ sources, and a plain isolated `pip install` of the sdist (pip's own build
environment, offline: its only package is setuptools) installs that pure package, which compiles
its kernels at the first op call (crfkit/_build.py; slow: a few minutes).
"""
import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile

import pytest
import torch

import crfkit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_tools = pytest.mark.skipif(
    importlib.util.find_spec("build") is None or shutil.which("ninja") is None or shutil.which("c++") is None,
    reason="needs the build package, ninja and a C++ compiler (make setup installs the first two)")


def _run(command, **kwargs):
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def _without_torch(tmp_path):
    """An environment in which `import torch` fails (a stand-in package first on PYTHONPATH) and
    records each attempt in the file it returns."""
    shim = tmp_path / "no-torch" / "torch"
    shim.mkdir(parents=True, exist_ok=True)
    attempts = tmp_path / "torch-imports.txt"
    (shim / "__init__.py").write_text(f"open({str(attempts)!r}, 'a').write('imported\\n')\n"
                                      "raise ImportError('torch is made missing by the test')\n")
    return dict(os.environ, PYTHONPATH=str(shim.parent)), attempts


SDIST_TORCH_IMPORTS = []  # the file in which the sdist fixture's build records any import of torch


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    # Made where torch cannot be imported: making the sdist must not need it.
    env, attempts = _without_torch(tmp_path_factory.mktemp("sdist-env"))
    # setuptools writes crfkit.egg-info into the tree it builds from; left there, it shadows the
    # installed metadata for any `python -m` run in the checkout, so remove it unless it was there.
    egg_info = os.path.join(ROOT, "crfkit.egg-info")
    had_egg_info = os.path.exists(egg_info)
    try:
        _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out), ROOT], timeout=600,
             env=env)
    finally:
        if not had_egg_info:
            shutil.rmtree(egg_info, ignore_errors=True)
    (path,) = out.glob("crfkit-*.tar.gz")
    SDIST_TORCH_IMPORTS.append(attempts)  # read by test_sdist_is_made_without_torch
    return path


@needs_tools
def test_sdist_is_made_without_torch(sdist):
    assert sdist.exists() and SDIST_TORCH_IMPORTS
    assert not SDIST_TORCH_IMPORTS[-1].exists(), "making the sdist imported torch"
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        requires = re.search(r"^\[build-system\][^\[]*?^requires = (\[.*?\])$", f.read(), re.M | re.S).group(1)
    assert json.loads(requires) == ["setuptools>=77"]  # no torch, no ninja: an isolated build fetches neither


@needs_tools
def test_setup_py_without_torch_gives_a_pure_python_wheel_with_the_sources(sdist, tmp_path):
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path / "src", filter="data")
    (source,) = (tmp_path / "src").iterdir()
    env, attempts = _without_torch(tmp_path)
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "wheel"),
          str(source)], timeout=600, env=env)
    assert attempts.exists()  # setup.py did try torch, and went on without it
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    assert wheel.name == f"crfkit-{crfkit.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(f"crfkit-{crfkit.__version__}.dist-info/WHEEL").decode()
    assert "Root-Is-Purelib: true" in metadata
    assert not [n for n in names if n.endswith((".so", ".pyd")) or n == "crfkit/_build_info.py"]
    # The first-use build's sources: every C++ / CUDA file of csrc/.
    for directory, _, files in os.walk(os.path.join(ROOT, "csrc")):
        for name in files:
            if name.endswith((".cpp", ".h", ".cu", ".cuh")):
                relative = os.path.relpath(os.path.join(directory, name), ROOT).replace(os.sep, "/")
                assert f"crfkit/_sources/{relative}" in names, relative
    assert {"crfkit/_build.py", "crfkit/_build_config.py", "crfkit/build.py"} <= names


@needs_tools
def test_sdist_has_every_source_the_build_needs(sdist):
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for folder in ("csrc", os.path.join("csrc", "cpu"), os.path.join("csrc", "cuda")):
        for name in os.listdir(os.path.join(ROOT, folder)):
            if name.endswith((".cpp", ".h", ".cu", ".cuh")):
                assert f"{folder}/{name}" in names, f"{folder}/{name} is missing from the sdist"
    assert {"LICENSE", "setup.py", "pyproject.toml", "crfkit/py.typed", "crfkit/_version.py"} <= names
    assert not [n for n in names if n.endswith(".so") or n.startswith("runs/")]
    # Generated by each build for its torch (a checkout's copy would describe the checkout's build).
    assert "crfkit/_build_info.py" not in names


@needs_tools
def test_downstream_project_installs_crfkit_from_the_sdist(sdist, tmp_path):
    venv = tmp_path / "venv"
    # no pip (nor the old setuptools that venv would bundle) inside: this pip and the installed
    # setuptools, torch and ninja serve the venv, so nothing needs downloading
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], timeout=300)
    python = str(venv / "bin" / "python")
    # --no-cache-dir: pip caches the wheel it builds from an sdist under the sdist's path, and
    # pytest reuses its temporary paths: a cached wheel of an older checkout would be installed.
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index", "--no-build-isolation",
           "--no-cache-dir"]
    env = dict(os.environ, MAX_JOBS="2", CRFKIT_ARCH="dispatch", PIP_NO_INPUT="1")
    env.pop("CRFKIT_CPU_ISA", None)
    env.pop("PYTHONPATH", None)
    # crfkit from the sdist into the venv (the checkout's editable install stays outside it)
    _run([*pip, "--no-deps", "--ignore-installed", "--find-links", str(sdist.parent), "crfkit"], env=env, timeout=1800,
         cwd=tmp_path)
    project = tmp_path / "tagging-app"
    (project / "tagging_app").mkdir(parents=True)
    (project / "pyproject.toml").write_text(textwrap.dedent("""\
        [build-system]
        requires = ["setuptools>=77"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "tagging-app"
        version = "0.0.1"
        dependencies = ["crfkit"]
        """))
    (project / "tagging_app" / "__init__.py").write_text(textwrap.dedent("""\
        import crfkit
        import torch


        def best_two(emissions, transitions):
            return crfkit.kbest_viterbi(emissions, transitions, k=2)
        """))
    _run([*pip, "--find-links", str(sdist.parent), str(project)], env=env, timeout=600, cwd=tmp_path)
    probe = textwrap.dedent("""\
        import json, torch, crfkit, tagging_app
        generator = torch.Generator().manual_seed(0)
        emissions = torch.randn(2, 5, 4, generator=generator, dtype=torch.float64)
        transitions = torch.randn(4, 4, generator=generator, dtype=torch.float64)
        best = tagging_app.best_two(emissions, transitions)
        from crfkit import _extension
        print(json.dumps({"file": crfkit.__file__, "backend": crfkit.backend_info()["backend"],
                          "built_with_torch": _extension.built_with_torch(),
                          "cpu_isa": crfkit.backend_info()["cpu_isa"],
                          "paths": best.paths.tolist(), "log_probs": best.log_probs.tolist()}))
        """)
    result = __import__("json").loads(_run([python, "-c", probe], env=env, timeout=300, cwd=tmp_path).splitlines()[-1])
    assert result["file"].startswith(str(venv)), "the venv imported the checkout, not the installed sdist"
    assert result["backend"] == "compiled"
    assert result["built_with_torch"] == torch.__version__  # recorded in the wheel by its own build
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert result["cpu_isa"] in ("baseline", "avx2", "avx512"), result["cpu_isa"]
    _assert_kbest_is_the_references(result, (2, 5, 4), k=2)


def _assert_kbest_is_the_references(result, shape, k):
    """result's "paths" and "log_probs", from an installed crfkit's kbest_viterbi on the CRF of
    torch.randn with seed 0 of `shape` (B, L, T) in float64, are the reference's here."""
    batch, length, tags = shape
    generator = torch.Generator().manual_seed(0)
    emissions = torch.randn(batch, length, tags, generator=generator, dtype=torch.float64)
    transitions = torch.randn(tags, tags, generator=generator, dtype=torch.float64)
    with crfkit.use_backend("reference"):
        expected = crfkit.kbest_viterbi(emissions, transitions, k=k)
    assert result["paths"] == expected.paths.tolist()
    torch.testing.assert_close(torch.tensor(result["log_probs"], dtype=torch.float64), expected.log_probs)


def _wheel_of_installed(name, directory):
    """A wheel of the installed pure-Python distribution `name`, made from its installed files:
    what pip's isolated build environment gets from --find-links here, with no index."""
    distribution = importlib.metadata.distribution(name)
    info = f"{distribution.metadata['Name'].replace('-', '_')}-{distribution.version}.dist-info"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{distribution.metadata['Name'].replace('-', '_')}-{distribution.version}-py3-none-any.whl"
    records = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for file in distribution.files:
            name_in_wheel = str(file).replace(os.sep, "/")
            if name_in_wheel.startswith("..") or "__pycache__" in name_in_wheel or name_in_wheel == f"{info}/RECORD":
                continue
            data = file.locate().read_bytes()
            wheel.writestr(name_in_wheel, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append(f"{name_in_wheel},sha256={digest},{len(data)}")
        wheel.writestr(f"{info}/RECORD", "\n".join([*records, f"{info}/RECORD,,"]) + "\n")
    return path


# The first op call in the venv, and what backend_info says before and after it.
FIRST_CALL = textwrap.dedent("""\
    import json, torch, crfkit
    before = crfkit.backend_info()
    generator = torch.Generator().manual_seed(0)
    emissions = torch.randn(3, 6, 5, generator=generator, dtype=torch.float64)
    transitions = torch.randn(5, 5, generator=generator, dtype=torch.float64)
    best = crfkit.kbest_viterbi(emissions, transitions, k=3)
    print(json.dumps({"file": crfkit.__file__, "before": before, "after": crfkit.backend_info(),
                      "paths": best.paths.tolist(), "log_probs": best.log_probs.tolist()}))
    """)


@pytest.mark.slow
@needs_tools
def test_plain_isolated_install_gives_the_pure_package_and_the_first_call_compiles(sdist, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], timeout=300)
    python = str(venv / "bin" / "python")
    links = tmp_path / "links"
    _wheel_of_installed("setuptools", links)
    # pip as a user runs it, but offline: no index, no configured links (this machine's local
    # torch among them), only the setuptools wheel. [build-system] asking for torch (or anything
    # but setuptools) would fail here instead of downloading it.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "CRFKIT_")) and k != "PYTHONPATH"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INPUT="1", CRFKIT_CACHE=str(tmp_path / "cache"),
               MAX_JOBS=os.environ.get("MAX_JOBS", "1"))
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "--no-index", "--find-links", str(links),
           "--no-cache-dir"]
    # The plain install: no --no-build-isolation. --ignore-installed --no-deps: into the venv, past
    # the checkout's own editable crfkit in the system site-packages the venv sees.
    _run([*pip, "--ignore-installed", "--no-deps", str(sdist)], env=env, timeout=1800, cwd=tmp_path)
    # Its dependencies (torch 2.13 among them) are those the venv has: nothing to fetch.
    _run([*pip, "--dry-run", "--find-links", str(sdist.parent), "crfkit"], env=env, timeout=600, cwd=tmp_path)
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], env=env).strip()
    (record,) = [p for p in os.listdir(site) if p.startswith("crfkit-") and p.endswith(".dist-info")]
    assert "Root-Is-Purelib: true" in open(os.path.join(site, record, "WHEEL")).read()
    assert not [p for p in os.listdir(os.path.join(site, "crfkit")) if p.startswith("_C")]
    assert os.path.isfile(os.path.join(site, "crfkit", "_sources", "csrc", "cpu", "dispatch.cpp"))

    result = subprocess.run([python, "-c", FIRST_CALL], capture_output=True, text=True, env=env, timeout=3600,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["file"] == os.path.join(site, "crfkit", "__init__.py")
    assert out["before"]["backend"] in ("numba", "reference")
    assert "at the first op call, once, into " + str(tmp_path / "cache" / "extensions") in out["before"]["reason"]
    after = out["after"]
    assert after["backend"] == "compiled", after
    assert after["extension"].startswith(str(tmp_path / "cache" / "extensions" / f"crfkit{crfkit.__version__}-torch"
                                             f"{torch.__version__}-"))
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert after["cpu_isa"] in ("march=x86-64", "march=x86-64-v3", "march=x86-64-v4"), after["cpu_isa"]
    lines = [line for line in result.stderr.splitlines() if line.startswith("crfkit: ")]
    assert lines[0].startswith("crfkit: compiling crfkit._C (the CPU kernels for ") and "once, into" in lines[0]
    assert lines[1].startswith("crfkit: compiled crfkit._C in "), lines
    print(lines[1])  # the build's time, for the record (pytest -s)
    _assert_kbest_is_the_references(out, (3, 6, 5), k=3)

    # The next process loads the cached build at import: no compiler call, nothing on stderr.
    again = subprocess.run([python, "-c", FIRST_CALL], capture_output=True, text=True, env=env, timeout=600,
                           cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    second = json.loads(again.stdout.splitlines()[-1])
    assert second["before"]["backend"] == "compiled" and second["before"]["extension"] == after["extension"]
    assert not [line for line in again.stderr.splitlines() if line.startswith("crfkit: ")]
    assert second["paths"] == out["paths"]


# ---- the abi3 wheel: one binary on torch's stable ABI ------------------------------------------
@pytest.mark.slow
@needs_tools
def test_abi3_wheel_installs_into_a_fresh_venv_and_passes_the_parity_suite(sdist, tmp_path):
    """The wheel a release ships: built from the sdist against the installed torch (no isolation,
    the portable dispatch build), tagged cp310-abi3 (Python's limited API; torch's stable ABI,
    target 2.10), installed into a fresh venv, where tests/test_parity.py passes with the
    compiled backend and crfkit._C reports the stable-ABI target. About 5 minutes on 2 cores."""
    wheels = tmp_path / "wheels"
    env = dict(os.environ, MAX_JOBS="2", CRFKIT_ARCH="dispatch", PIP_NO_INPUT="1")
    for name in ("CRFKIT_CPU_ISA", "PYTHONPATH", "CRFKIT_NO_EXTENSION", "CRFKIT_TORCH_TARGET"):
        env.pop(name, None)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-index", "--no-build-isolation", "--no-deps",
          "--no-cache-dir", "-w", str(wheels), str(sdist)], env=env, timeout=1800, cwd=tmp_path)
    (wheel,) = wheels.glob("crfkit-*.whl")
    assert re.search(r"-cp310-abi3-linux_x86_64\.whl$", wheel.name) or platform.machine().lower() not in (
        "x86_64", "amd64"), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (library,) = [n for n in names if re.fullmatch(r"crfkit/_C\.abi3\.so", n)]
        build_info = archive.read("crfkit/_build_info.py").decode()
    assert "TORCH_TARGET = '2.10'" in build_info
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], timeout=300)
    python = str(venv / "bin" / "python")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index", "--no-deps",
          "--ignore-installed", str(wheel)], env=env, timeout=600, cwd=tmp_path)
    # The parity suite from a copy of tests/ (so that nothing of the checkout is on the path).
    tests = tmp_path / "tests"
    shutil.copytree(os.path.join(ROOT, "tests"), tests, ignore=shutil.ignore_patterns("__pycache__"))
    probe = ("import crfkit, json; info = crfkit.backend_info(); "
             "print(json.dumps({'file': crfkit.__file__, 'backend': info['backend'], 'extension': info['extension']}))")
    result = json.loads(_run([python, "-c", probe], env=env, timeout=300, cwd=tmp_path).splitlines()[-1])
    assert result["file"].startswith(str(venv)) and result["extension"].startswith(str(venv)), result
    assert result["backend"] == "compiled", result
    out = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                str(tests / "test_parity.py")], env=dict(env, OMP_NUM_THREADS="1"), timeout=1800, cwd=tmp_path)
    assert re.search(r"\d+ passed", out) and " failed" not in out, out[-2000:]
