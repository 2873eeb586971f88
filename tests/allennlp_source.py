"""AllenNLP's own CRF modules for the compat tests to compare with, where they can be loaded.

An installed allennlp is used as is. Otherwise the wheel unpacked without its dependencies by
`make setup` (build/allennlp-2.10.1, or CRFKIT_ALLENNLP_SITE), which `import allennlp` cannot use
(it needs spacy, ...), is loaded file by file: the CRF modules need only allennlp.common.checks and
allennlp.nn.util, and nn.util only three helpers of allennlp.common.util at import time (stubbed:
the CRFs never call them). The stubs are removed from sys.modules afterwards.
"""
import importlib.util
import os
import pathlib
import sys
import types

PACKAGE = "allennlp.modules.conditional_random_field"


def load_crf_modules(stems=("conditional_random_field",)):
    """{stem: module} of allennlp/modules/conditional_random_field/<stem>.py, with
    "checks": allennlp.common.checks; None where AllenNLP's source cannot be loaded. The first
    stem is loaded first (the weighted variants import conditional_random_field)."""
    if importlib.util.find_spec("allennlp") is not None:
        try:
            found = {stem: importlib.import_module(f"{PACKAGE}.{stem}") for stem in stems}
            found["checks"] = importlib.import_module("allennlp.common.checks")
            return found
        except Exception:
            return None
    site = os.environ.get("CRFKIT_ALLENNLP_SITE", os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "build", "allennlp-2.10.1"))
    root = pathlib.Path(site) / "allennlp"
    files = {stem: root / "modules" / "conditional_random_field" / f"{stem}.py" for stem in stems}
    if not all(f.exists() for f in files.values()):
        return None
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "allennlp"}

    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    try:
        for name in ("allennlp", "allennlp.common", "allennlp.nn", "allennlp.modules", PACKAGE):
            sys.modules[name] = types.ModuleType(name)
            sys.modules[name].__path__ = []
        found = {"checks": load("allennlp.common.checks", root / "common" / "checks.py")}
        common_util = sys.modules["allennlp.common.util"] = types.ModuleType("allennlp.common.util")
        common_util.int_to_device = common_util.is_distributed = common_util.is_global_primary = None
        load("allennlp.nn.util", root / "nn" / "util.py")
        for stem, path in files.items():
            found[stem] = load(f"{PACKAGE}.{stem}", path)
        return found
    except Exception:
        return None
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "allennlp"]:
            del sys.modules[name]
        sys.modules.update(saved)
