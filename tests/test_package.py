"""The package as users see it: what `import crfkit` loads, the version, the files it ships."""
import json
import os
import subprocess
import sys

import crfkit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules_after(code: str) -> list[str]:
    """sys.modules of a fresh interpreter after running `code`."""
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_import_crfkit_loads_the_ops_only():
    modules = _modules_after("import crfkit")
    upper_layers = ("crfkit.distill", "crfkit.taggers", "crfkit.training", "crfkit.data", "crfkit.pipeline")
    assert not [m for m in modules if m.startswith(upper_layers)]
    assert not [m for m in modules if m.split(".")[0] in ("transformers", "accelerate", "seqeval", "numba")]


def test_import_crfkit_needs_torch_alone():
    """With every other package made missing (numpy, safetensors, tqdm, filelock, numba,
    transformers, ...), `import crfkit` and an op work; the rest loads where it is used."""
    code = (
        "import importlib.abc, sys\n"
        "class Missing(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('numpy', 'safetensors', 'tqdm', 'filelock', 'numba', 'transformers',\n"
        "                                  'accelerate', 'seqeval', 'scipy', 'pyarrow'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Missing())\n"
        "import warnings; warnings.simplefilter('ignore')\n"   # torch's own "Failed to initialize NumPy"
        "import torch, crfkit\n"
        "print(float(crfkit.log_partition(torch.zeros(1, 3, 2), torch.zeros(2, 2))[0]))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stderr[-2000:]
    assert abs(float(result.stdout.split()[-1]) - 3 * 0.6931471805599453) < 1e-5   # log 2 ** 3


def test_upper_layers_load_on_first_use():
    modules = _modules_after("import crfkit\nassert crfkit.distill.label_corpus")
    assert "crfkit.distill" in modules and "crfkit.training" not in modules
    assert "crfkit.distill.cache" in _modules_after("from crfkit import distill\nassert distill.TeacherLabelCache")


def test_the_crf_ops_import_nothing_of_distillation():
    modules = _modules_after("import crfkit.functional, crfkit.nn, crfkit.distribution, crfkit.backends")
    assert not [m for m in modules if m.startswith("crfkit.distill")]


def test_unknown_attribute_is_an_attribute_error():
    try:
        crfkit.no_such_thing
    except AttributeError as error:
        assert "no_such_thing" in str(error)
    else:
        raise AssertionError("crfkit.no_such_thing did not raise")


def test_one_version_source():
    from importlib.metadata import version

    from crfkit._version import __version__

    assert crfkit.__version__ == __version__
    assert version("crfkit") == __version__   # the installed metadata, read by setuptools from _version.py
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    assert 'dynamic = ["version"]' in text and f'"{__version__}"' not in text


def test_shipped_files():
    assert os.path.isfile(os.path.join(ROOT, "crfkit", "py.typed"))
    with open(os.path.join(ROOT, "LICENSE")) as f:
        assert "Apache License" in f.readline() + f.readline()
    assert os.path.isfile(os.path.join(ROOT, "CHANGELOG.md"))
