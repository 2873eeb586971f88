"""The README's Python examples run as written."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run():
    code = "\n".join(re.findall(r"```python\n(.*?)```", README.read_text(), re.S))
    assert "kbest_viterbi" in code
    exec(compile(code, str(README), "exec"), {})
