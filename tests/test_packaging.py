"""The package as a user installs it: the sdist builds the extension on its own (every header
and CUDA source inside), and a downstream project that lists "crfkit" as a dependency installs
it from that sdist and calls crfkit.kbest_viterbi with the compiled backend.

The venv sees the installed torch (--system-site-packages) and builds without isolation, as the
README tells users to, so nothing is downloaded. It builds what a user gets, the portable build
(CRFKIT_ARCH=dispatch: the CPU kernels for x86-64, AVX2 and AVX-512), about 12 minutes on 2 cores.
"""
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import textwrap

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


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out), ROOT], timeout=600)
    (path,) = out.glob("crfkit-*.tar.gz")
    return path


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


@needs_tools
def test_downstream_project_installs_crfkit_from_the_sdist(sdist, tmp_path):
    venv = tmp_path / "venv"
    # no pip (nor the old setuptools that venv would bundle) inside: this pip and the installed
    # setuptools, torch and ninja serve the venv, so nothing needs downloading
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], timeout=300)
    python = str(venv / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index", "--no-build-isolation"]
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
        print(json.dumps({"file": crfkit.__file__, "backend": crfkit.backend_info()["backend"],
                          "cpu_isa": crfkit.backend_info()["cpu_isa"],
                          "paths": best.paths.tolist(), "log_probs": best.log_probs.tolist()}))
        """)
    result = __import__("json").loads(_run([python, "-c", probe], env=env, timeout=300, cwd=tmp_path).splitlines()[-1])
    assert result["file"].startswith(str(venv)), "the venv imported the checkout, not the installed sdist"
    assert result["backend"] == "compiled"
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert result["cpu_isa"] in ("baseline", "avx2", "avx512"), result["cpu_isa"]
    generator = torch.Generator().manual_seed(0)
    emissions = torch.randn(2, 5, 4, generator=generator, dtype=torch.float64)
    transitions = torch.randn(4, 4, generator=generator, dtype=torch.float64)
    with crfkit.use_backend("reference"):
        expected = crfkit.kbest_viterbi(emissions, transitions, k=2)
    assert result["paths"] == expected.paths.tolist()
    torch.testing.assert_close(torch.tensor(result["log_probs"], dtype=torch.float64), expected.log_probs)
