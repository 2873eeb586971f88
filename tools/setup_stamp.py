"""Whether `make setup` has anything to do: its install steps run only when this says so.

    python tools/setup_stamp.py check [DIST==VERSION ...]   exit 0 if up to date, else 1 and why
    python tools/setup_stamp.py write                       record the state after an install

The stamp (build/.setup-stamp, JSON, one entry per Python environment) records what the last
successful install was made from: the contents of setup.py, pyproject.toml, MANIFEST.in, the
Makefile, crfkit/_version.py, crfkit/_build_config.py (the build's sources and flags) and every
file under csrc/; the torch installed; the build variables (CRFKIT_ARCH, CRFKIT_BUILD_MODE, ...);
and the built crfkit/_C*.so (size and mtime).
`check` also wants this checkout installed in editable mode in this environment and every
DIST==VERSION given (the data packages) installed: anything else reinstalls. It reads files and
package metadata only (no torch import), so an up-to-date check takes well under a second.
"""
import hashlib
import importlib.machinery
import importlib.metadata
import json
import os
import sys
from urllib.parse import unquote, urlparse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAMP = os.path.join(ROOT, "build", ".setup-stamp")
SOURCES = ["setup.py", "pyproject.toml", "MANIFEST.in", "Makefile", os.path.join("crfkit", "_version.py"),
           os.path.join("crfkit", "_build_config.py")]
BUILD_VARIABLES = ["CRFKIT_NO_EXTENSION", "CRFKIT_ARCH", "CRFKIT_BUILD_MODE", "CRFKIT_FORCE_CUDA",
                   "CRFKIT_EXTRA_CFLAGS", "CRFKIT_EXTRA_LDFLAGS", "TORCH_CUDA_ARCH_LIST", "CXX", "CC"]


def _sources_digest() -> str:
    paths = [os.path.join(ROOT, p) for p in SOURCES]
    for directory, _, names in os.walk(os.path.join(ROOT, "csrc")):
        paths += [os.path.join(directory, name) for name in names]
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(os.path.relpath(path, ROOT).encode() + b"\0")
        if os.path.isfile(path):
            with open(path, "rb") as f:
                digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def _extension_file():
    """The crfkit/_C*.so this Python loads, or None."""
    path = os.path.join(ROOT, "crfkit", "_C" + importlib.machinery.EXTENSION_SUFFIXES[0])
    return path if os.path.isfile(path) else None


def _state() -> dict:
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    extension = _extension_file()
    built = None
    if extension is not None:
        info = os.stat(extension)
        built = [os.path.basename(extension), info.st_size, info.st_mtime_ns]
    return {
        "python": sys.version,
        "torch": torch_version,
        "sources": _sources_digest(),
        "variables": {name: os.environ.get(name) for name in BUILD_VARIABLES},
        "extension": built,
    }


def _editable_checkout():
    """The folder this environment's crfkit is an editable install of, or why it is not one."""
    try:
        distribution = importlib.metadata.distribution("crfkit")
    except importlib.metadata.PackageNotFoundError:
        return None, "crfkit is not installed in this environment"
    direct_url = distribution.read_text("direct_url.json")
    if not direct_url:
        return None, "crfkit is installed, but not from a checkout (no direct_url.json)"
    origin = json.loads(direct_url)
    if not origin.get("dir_info", {}).get("editable"):
        return None, f"crfkit is installed from {origin.get('url')}, not in editable mode"
    return os.path.realpath(unquote(urlparse(origin["url"]).path)), None


def _read_stamp() -> dict:
    try:
        with open(STAMP) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def check(requirements) -> str:
    """Why setup must run, or "" when it need not."""
    recorded = _read_stamp().get(sys.prefix)
    if recorded is None:
        return f"no setup recorded for {sys.prefix} in {os.path.relpath(STAMP, ROOT)}"
    now = _state()
    if os.environ.get("CRFKIT_NO_EXTENSION", "0") != "1" and now["extension"] is None:
        return "crfkit/_C*.so is missing"
    changed = [key for key in now if now[key] != recorded.get(key)]
    if changed:
        return "changed since the last setup: " + ", ".join(changed)
    checkout, why_not = _editable_checkout()
    if checkout is None:
        return why_not
    if checkout != os.path.realpath(ROOT):
        return f"crfkit is installed in editable mode from {checkout}, not from {ROOT}"
    for requirement in requirements:
        name, _, version = requirement.partition("==")
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return f"{name} is not installed"
        if version and installed != version:
            return f"{name} {installed} is installed, {version} wanted"
    return ""


def write() -> None:
    stamps = _read_stamp()
    stamps[sys.prefix] = _state()
    os.makedirs(os.path.dirname(STAMP), exist_ok=True)
    with open(STAMP, "w") as f:
        json.dump(stamps, f, indent=1, sort_keys=True)


def main(argv) -> int:
    if argv[:1] == ["write"]:
        write()
        return 0
    if argv[:1] == ["check"]:
        reason = check(argv[1:])
        if reason:
            print(f"make setup: installing ({reason})")
            return 1
        print("make setup: up to date (nothing changed since the last setup; tools/setup_stamp.py)")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
