"""How the extension is compiled (setup.py): a release build carries no debug info, and the sources
and the built library use torch's stable C ABI only, so that one binary keeps loading under later
torch versions."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


SOURCES = sorted([*ROOT.glob("csrc/**/*.h"), *ROOT.glob("csrc/**/*.cuh"), *ROOT.glob("csrc/**/*.cpp"),
                  *ROOT.glob("csrc/**/*.cu")])
# The torch headers a source may include: torch's stable C ABI (and the C shim under it), so that
# the library runs under every torch from its target on (csrc/tensor.h).
STABLE_HEADERS = ("torch/csrc/stable/", "torch/headeronly/", "torch/csrc/inductor/aoti_torch/c/shim.h")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT / "csrc")))
def test_sources_include_only_torchs_stable_abi(path):
    for header in re.findall(r"#include\s*<([^>]+)>", path.read_text()):
        if header.startswith(("ATen/", "c10/", "torch/", "caffe2/")):
            assert header.startswith(STABLE_HEADERS), f"{path.name} includes <{header}>, outside torch's stable ABI"


def test_built_library_calls_torch_through_its_c_shim_only():
    # No C++ symbol of torch, ATen or c10 among what the library needs: those change from one
    # torch to the next ("undefined symbol" after an upgrade); the shim's C functions do not.
    compiled = pytest.importorskip("crfkit._C", reason="the compiled extension is not built")
    if shutil.which("nm") is None:
        pytest.skip("needs nm (binutils)")
    undefined = subprocess.run(["nm", "-D", "--undefined-only", compiled.__file__], capture_output=True, text=True,
                               check=True).stdout.split()
    torch_cpp = [name for name in undefined if re.match(r"_Z.*(N3c10|N2at|N5torch|3c10|2at|5torch)", name)]
    assert torch_cpp == []
    assert any(name.startswith("aoti_torch_") for name in undefined)  # the shim it does call


def test_release_build_has_no_debug_info():
    compiled = pytest.importorskip("crfkit._C", reason="the compiled extension is not built")
    build_info = pytest.importorskip("crfkit._build_info", reason="no build record (crfkit/_build_info.py)")
    if build_info.BUILD_MODE != "release":
        pytest.skip(f"a {build_info.BUILD_MODE} build")
    if shutil.which("objdump") is None:
        pytest.skip("needs objdump (binutils)")
    sections = subprocess.run(["objdump", "-h", compiled.__file__], capture_output=True, text=True,
                              check=True, timeout=60).stdout
    # -g in Python's own CFLAGS would put them back (setup.py's release mode adds -g0).
    assert ".debug_info" not in sections, f"{compiled.__file__} was built with debug info"
