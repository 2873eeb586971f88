"""The package's layers, as its imports show them (read with the ast module, nothing imported):

    crfkit._arguments, crfkit.reference, crfkit.constraints      arguments, the oracle, schemes
    crfkit.backends (+ compiled, numba_backend, numba_kernels)   the backends: CRFBackend
    crfkit.functional, crfkit.nn, crfkit.distribution            the CRF ops users call
    crfkit.compat, crfkit.distill, crfkit.taggers, ...           built on the ops

A backend never imports the front end; the ops layer imports nothing from the layers above it;
the private helpers of crfkit.functional and crfkit._arguments stay private to their module;
and every backend provides the whole contract crfkit.backends.CRFBackend.
"""
import ast
import inspect
import os

import pytest
import torch

import crfkit
from crfkit import backends

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "crfkit")

OPS_LAYER = ["functional.py", "nn.py", "distribution.py", "reference.py", "constraints.py", "_arguments.py",
             "backends/"]
FRONT_END = ("crfkit.functional", "crfkit.nn", "crfkit.distribution", "crfkit.distill")
UPPER_LAYERS = ("crfkit.distill", "crfkit.taggers", "crfkit.training", "crfkit.pipeline", "crfkit.data",
                "crfkit.compat", "crfkit.tag")


def _source_files():
    """{module name: path} of every .py file under crfkit/."""
    files = {}
    for directory, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                parts = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
                files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


FILES = _source_files()


def _tree(module: str) -> ast.Module:
    with open(FILES[module]) as f:
        return ast.parse(f.read(), FILES[module])


def _package_of(module: str) -> str:
    """The package a relative import in `module` starts from (level 1)."""
    return module if FILES[module].endswith("__init__.py") else module.rpartition(".")[0]


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute name of the module `from <...> import` names in `module`."""
    if node.level == 0:
        return node.module
    base = _package_of(module)
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def imported_modules(module: str) -> set:
    """Every module `module` imports, anywhere in the file (functions included): `import a.b`,
    `from a import b` (a and a.b, b may be a submodule), relative forms resolved. (crfkit.backends
    imports numba_backend with importlib, by a name from a table: that one is not seen here.)"""
    found = set()
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names)
    return found


def _is_within(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _modules_of(entries):
    selected = []
    for entry in entries:
        prefix = "crfkit." + entry.rstrip("/").removesuffix(".py").replace("/", ".")
        selected += [m for m in FILES if m == prefix or (entry.endswith("/") and m.startswith(prefix + "."))]
    return sorted(selected)


def test_the_import_reader_sees_the_imports():
    # Not vacuous: the reader resolves the relative forms the package uses.
    assert {"crfkit.reference", "crfkit._C"} <= imported_modules("crfkit.backends.compiled")
    assert "crfkit._arguments" in imported_modules("crfkit.backends.compiled")  # imported inside a function
    assert "crfkit.backends.compiled" in imported_modules("crfkit.backends")  # from . import compiled
    assert "crfkit.backends.numba_kernels" in imported_modules("crfkit.backends.numba_backend")
    assert {"crfkit.backends", "crfkit._arguments"} <= imported_modules("crfkit.functional")
    assert "crfkit.functional" in imported_modules("crfkit.distill.structured")
    assert len(_modules_of(OPS_LAYER)) >= 10


@pytest.mark.parametrize("module", [m for m in FILES if m.startswith("crfkit.backends")])
def test_backends_do_not_import_the_front_end(module):
    assert not [name for name in imported_modules(module) if _is_within(name, FRONT_END)]


@pytest.mark.parametrize("module", _modules_of(OPS_LAYER))
def test_the_crf_ops_import_nothing_from_the_layers_above(module):
    assert not [name for name in imported_modules(module) if _is_within(name, UPPER_LAYERS)]


def _private_names_used(module: str, target: str, tree=None) -> list:
    """Names starting with '_' that `module` (its source, or `tree`) takes from module `target`
    (crfkit.functional, ...): `from <target> import _x`, and `alias._x` where alias is bound to
    target by an import."""
    parent, _, leaf = target.rpartition(".")
    aliases, used = set(), []
    tree = _tree(module) if tree is None else tree
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == target:
                    aliases.add(alias.asname or alias.name)  # `import crfkit.functional` binds "crfkit.functional"
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            for alias in node.names:
                if source == target and alias.name.startswith("_"):
                    used.append(alias.name)
                if source == parent and alias.name == leaf:
                    aliases.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and ast.unparse(node.value) in aliases:
            used.append(f"{ast.unparse(node.value)}.{node.attr}")
    return used


def test_the_private_name_reader_sees_private_names():
    # Not vacuous: on a module that does take them, the reader finds both forms.
    source = ("from . import functional as ops\nfrom .functional import _hidden, visible\n"
              "import crfkit.functional\nops._a()\ncrfkit.functional._b\nops.public()\n")
    used = _private_names_used("crfkit.nn", "crfkit.functional", tree=ast.parse(source))  # as if in crfkit/nn.py
    assert sorted(used) == ["_hidden", "crfkit.functional._b", "ops._a"]


@pytest.mark.parametrize("target", ["crfkit.functional", "crfkit._arguments"])
def test_private_names_of_the_ops_stay_in_their_module(target):
    used = {module: names for module in FILES if module != target
            for names in [_private_names_used(module, target)] if names}
    assert not used


def test_functional_calls_the_backend_contract_without_probing():
    # Every backend provides the whole contract, so the front end never asks whether it has a name.
    calls = [node for node in ast.walk(_tree("crfkit.functional"))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr",
                                                                                                      "hasattr")]
    assert not calls


# ---- the backend contract ----------------------------------------------------------------------
CONTRACT_FUNCTIONS = {"log_partition", "marginals", "expected_transition_counts", "marginals_and_transition_counts",
                      "viterbi", "kbest_viterbi", "sequence_score", "sample_with_replacement",
                      "sample_without_replacement"}
CONTRACT_ATTRIBUTES = {"PER_EXAMPLE_DEVICES", "VALUES_CHECKED_ON_DEVICE"}


def _protocol_functions():
    return {name: value for name, value in vars(backends.CRFBackend).items()
            if not name.startswith("_") and inspect.isfunction(value)}


def test_the_contract_lists_these_members():
    assert set(_protocol_functions()) == CONTRACT_FUNCTIONS
    assert set(backends.CRFBackend.__annotations__) == CONTRACT_ATTRIBUTES
    for name, function in _protocol_functions().items():
        assert function.__doc__ and function.__doc__.startswith(f"{name}("), name  # argument order stated


def _backend(name):
    with crfkit.use_backend(name):
        return backends.current()


@pytest.mark.parametrize("name", crfkit.backend_info()["available"])
def test_every_available_backend_provides_the_contract(name):
    module = _backend(name)
    assert isinstance(module, backends.CRFBackend)  # runtime_checkable: every member present
    for member, protocol_function in _protocol_functions().items():
        function = getattr(module, member, None)
        assert callable(function), f"{name} has no {member}"
        expected = list(inspect.signature(protocol_function).parameters)[1:]  # without self
        assert list(inspect.signature(function).parameters) == expected, f"{name}.{member}"
    checked = module.VALUES_CHECKED_ON_DEVICE
    assert isinstance(checked, tuple) and all(isinstance(device, str) for device in checked)
    if name != "compiled":
        assert checked == ()  # only the compiled backend's CUDA kernels check lengths and tags


@pytest.mark.parametrize("name", crfkit.backend_info()["available"])
def test_marginals_and_transition_counts_are_the_two_ops(name):
    module = _backend(name)
    g = torch.Generator().manual_seed(0)
    emissions, transitions = torch.randn(3, 4, 3, generator=g), torch.randn(3, 3, generator=g)
    start, end, lengths = torch.randn(3, generator=g), torch.randn(3, generator=g), torch.tensor([4, 0, 2])
    mu, counts = module.marginals_and_transition_counts(emissions, transitions, lengths, start, end)
    torch.testing.assert_close(mu, module.marginals(emissions, transitions, lengths, start, end))
    torch.testing.assert_close(counts, module.expected_transition_counts(emissions, transitions, lengths, start, end))
