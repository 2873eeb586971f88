"""examples/reproduction_report.py: tables from run records (made-up records, real code)."""
import importlib.util
import json
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture()
def report(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("reproduction_report",
                                                  os.path.join(HERE, "..", "examples", "reproduction_report.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "DOCS", tmp_path / "docs")
    monkeypatch.setattr(module, "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    return module


NEWS = {"news": 2687, "augment": 0}


def record(variant, seed, test_f1, k=None, dev_f1=90.0, da_pool=None):
    return {"da_pool": da_pool, "run": f"{variant}-k{k or 5}-seed{seed}", "variant": variant, "K": k, "seed": seed,
            "dev_f1": dev_f1, "test_f1": test_f1, "params": 1_000_000, "trainable_params": 500_000,
            "sentences_per_s": 1000.0, "wall_s": 60.0, "machine": "test machine",
            "command": "python -m crfkit.pipeline", "git": "abc"}


def test_tables_means_spreads_and_targets(report, tmp_path):
    workdir = tmp_path / "runs"
    workdir.mkdir()
    records = [record("teacher", 0, 89.0), record("vanilla", 0, 80.0), record("vanilla", 1, 82.0),
               record("te", 0, 85.0), record("te_token_pos", 0, 86.0), record("te_seq", 0, 88.0, k=5),
               record("te_seq", 1, 87.0, k=5), record("te_da_seq", 0, 86.0, k=1, da_pool=NEWS),
               record("te_da_seq", 0, 87.5, k=10, da_pool=NEWS),
               record("te_da", 0, 84.0, dev_f1=88.0),   # written before records named their pool: Tang augmentation
               record("vanilla", 1, 81.0)]   # a rerun: the later record of (vanilla, seed 1) counts
    (workdir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text, data = report.build(workdir, "te_da_seq", 5)
    assert "| vanilla BiLSTM+CRF | 80.50 ± 0.71 (n = 2) | 80.08 |" in text
    assert "| + TE + SEQ | 87.50 ± 0.71 (n = 2) | 89.54 |" in text
    assert "| + TE + DA | not run yet | 90.69 |" in text   # its one run pooled other text
    assert "| te_da | augment 1 | 84.00 (n = 1) | 88.00 | not run yet |" in text
    assert "| 1 | 86.00 (n = 1) | 90.00 |" in text and "| 5 | not run yet |  |" in text
    assert (tmp_path / "docs" / "kbest_ablation.png").exists()
    assert "teacher at least 88 F1: 89.00, met" in text
    # best distilled: te_seq 87.50, gap 1.50 to the teacher (met), +7.00 over vanilla (met)
    assert "gap 1.50, met" in text and "+7.00, met" in text
    assert "SEQ (87.50) > TOKEN-POS (86.00) > TE (85.00): met" in text
    assert len(data["records"]) == 10

