"""How the extension is compiled, where it costs users build time and disk (setup.py): a release
build carries no debug info, and every kernel file includes only the ATen operators it calls
(README, Layout), so that nobody brings back the whole of ATen/ATen.h unnoticed."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL_FILES = sorted([*(ROOT / "csrc" / "cpu").glob("*.cpp"), *(ROOT / "csrc" / "cuda").glob("*.cu")])


@pytest.mark.parametrize("path", KERNEL_FILES,
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_kernel_file_asks_for_per_operator_headers_before_any_include(path):
    code = path.read_text()
    first_include = code.index("#include")
    guard = code.find("#define TORCH_ASSERT_ONLY_METHOD_OPERATORS")
    assert 0 <= guard < first_include, (
        f"{path.name}: define TORCH_ASSERT_ONLY_METHOD_OPERATORS before the first #include "
        "(then including ATen/ATen.h fails to compile; include ATen/ops/<op>.h instead)")


@pytest.mark.parametrize("path", sorted([*ROOT.glob("csrc/**/*.h"), *ROOT.glob("csrc/**/*.cuh"), *KERNEL_FILES]),
                         ids=lambda p: str(p.relative_to(ROOT / "csrc")))
def test_no_kernel_source_includes_all_of_aten(path):
    assert not re.search(r"#include\s*<ATen/(ATen|Functions)\.h>", path.read_text()), path


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
