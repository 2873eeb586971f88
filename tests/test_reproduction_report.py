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
    assert "SEQ (87.50 ± 0.71, n = 2) > TOKEN-POS (86.00, n = 1) > TE (85.00, n = 1): met" in text
    assert len(data["records"]) == 10


def test_records_of_another_teacher_stay_out_of_the_tables(report, tmp_path):
    """Runs name their teacher's weights; the tables keep to the teacher most students name, and
    a teacher record without a digest (written before records named it) is superseded by its
    later rerun with the main teacher's digest."""
    workdir = tmp_path / "runs"
    workdir.mkdir()
    main, other = "a" * 64, "b" * 64

    def named(variant, seed, test_f1, teacher, **kw):
        return {**record(variant, seed, test_f1, **kw), "teacher_sha256": teacher, "date": "2026-11-27T05:00:00"}

    earlier = {"records": [dict(record("teacher", 0, 89.0), pool=None, teacher_sha256=None),
                           dict(record("vanilla", 0, 80.0), pool=None, teacher_sha256=None)],
               "side_by_side": {"command": "python -m crfkit.pipeline --stages report", "git": "abc", "date": "d",
                                "machine": "m", "throughput_sentences": 512, "batch_size": 32,
                                "rows": [{"model": "teacher (minilm + CRF)", "test_f1": 89.0,
                                          "sentences_per_s": 150.0, "speedup": 1.0}]}}
    (tmp_path / "docs" / "reproduction.json").write_text(json.dumps(earlier))
    records = [named("te", 0, 85.0, main), named("te_seq", 0, 86.0, main, k=5),
               named("te_da_stagewise", 0, 85.5, main, da_pool=NEWS),
               named("teacher", 0, 88.2, other), named("te_da_token_em", 0, 84.0, other, da_pool=NEWS)]
    (workdir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text, data = report.build(workdir, "te_da_seq", 5)
    assert "| teacher (MiniLM-L6 + CRF; the paper: BERT-base + CRF) | 89.00 (n = 1) |" in text  # not 88.20
    assert "| + TE + DA + TOKEN-EM | only with another teacher (below) |" in text
    assert "| + TE + DA + TOKEN-POS | not run yet |" in text
    # the other teacher's own verdicts, against Table 1's vanilla student (80.00)
    assert f"With the minilm teacher `{other[:12]}`" in text
    assert "(te_da_token_em, 84.00) within 1.5 F1 of the teacher: gap 4.20, NOT met" in text
    assert "above vanilla (80.00): +4.00, NOT met" in text
    assert "## Runs with another teacher" in text and f"`{main[:12]}`" in text
    assert f"| `{other[:12]}` | minilm | teacher | - | 0 | 88.20 |" in text
    assert f"| `{other[:12]}` | minilm | te_da_token_em | - | 0 | 84.00 |" in text
    assert "| te_da_stagewise | - | 85.50 (n = 1) | 90.00 |" in text   # under "Other students"
    assert "| teacher (minilm + CRF) | 89.00 | 150 | 1.0x |" in text   # side by side kept from the docs
    assert len(data["records"]) == 7
    assert data["side_by_side"] == earlier["side_by_side"]

    # the teacher rerun with the main teacher's digest replaces the record that named none
    with open(workdir / "results.jsonl", "a") as f:
        f.write(json.dumps(named("teacher", 0, 89.1, main)) + "\n")
    text, data = report.build(workdir, "te_da_seq", 5)
    assert "| teacher (MiniLM-L6 + CRF; the paper: BERT-base + CRF) | 89.10 (n = 1) |" in text
    assert [r["teacher_sha256"] for r in data["records"] if r["variant"] == "teacher"] == [main, other]


def test_a_second_workdir_with_another_encoder(report, tmp_path):
    """Runs with another teacher (here an MPNet-base one, in a workdir of its own) are merged and
    listed by teacher and encoder; the tables keep to the main teacher."""
    main, mpnet = "a" * 64, "c" * 64
    first, second = tmp_path / "runs", tmp_path / "mpnet"
    first.mkdir()
    second.mkdir()

    def named(variant, seed, test_f1, teacher, command="python -m crfkit.pipeline --full", **kw):
        return {**record(variant, seed, test_f1, **kw), "teacher_sha256": teacher, "date": "2026-11-28T05:00:00",
                "command": command}

    (first / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        named("teacher", 0, 89.0, main), named("vanilla", 0, 80.0, main), named("te", 0, 85.0, main),
        named("te_seq", 0, 86.0, main, k=5)]))
    (second / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        named("teacher", 0, 91.5, mpnet, command="python -m crfkit.pipeline --full --teacher-encoder mpnet"),
        named("te_seq", 0, 87.5, mpnet, k=5), named("te", 0, 86.0, mpnet), named("te_token_pos", 0, 87.0, mpnet)]))
    text, data = report.build([first, second], "te_da_seq", 5)
    assert "| teacher (MiniLM-L6 + CRF; the paper: BERT-base + CRF) | 89.00 (n = 1) |" in text
    assert "| + TE + SEQ | 86.00 (n = 1) |" in text
    assert f"| `{mpnet[:12]}` | mpnet | teacher | - | 0 | 91.50 |" in text
    assert f"| `{mpnet[:12]}` | mpnet | te_seq | 5 | 0 | 87.50 |" in text
    # work folders outside the repository are named by their own name: no machine paths in the docs
    assert "`runs/results.jsonl`, `mpnet/results.jsonl`, commands as run from inside that work folder" in text
    assert str(tmp_path) not in text and str(tmp_path) not in json.dumps(data)
    assert len(data["records"]) == 8
    targets = text[text.index("## Targets"):]
    assert "SEQ (86.00" not in targets   # the main teacher has no TOKEN-POS run: no verdict
    mpnet_targets = targets[targets.index(f"With the mpnet teacher `{mpnet[:12]}`"):]
    assert "teacher at least 88 F1: 91.50, met" in mpnet_targets
    assert "(te_seq, 87.50) within 1.5 F1 of the teacher: gap 4.00, NOT met" in mpnet_targets
    assert "above vanilla (80.00): +7.50, met" in mpnet_targets   # Table 1's vanilla: it needs no teacher
    assert "SEQ (87.50, n = 1) > TOKEN-POS (87.00, n = 1) > TE (86.00, n = 1): met" in mpnet_targets


@pytest.mark.parametrize("command, encoder", [
    ("python -m crfkit.pipeline --full", "minilm"),
    ("python -m crfkit.pipeline --teacher-encoder mpnet --full", "mpnet"),
    ("python -m crfkit.pipeline --teacher-encoder=/root/gpu_teacher/mpnet/", "mpnet")])
def test_encoder_name(report, command, encoder):
    assert report.encoder_name({"command": command}) == encoder
    assert report.encoder_name(None) == "?"


def test_recorded_commands_lose_the_machine_paths(report):
    """Runs recorded before the tool wrote commands relative to their work folder carry the
    machine's paths; the docs show them as run from inside that folder."""
    assert (report.without_machine_paths("python -m crfkit.pipeline --full --workdir /root/runs/full --stages "
                                         "students --runs te_seq") ==
            "python -m crfkit.pipeline --full --workdir . --stages students --runs te_seq")
    assert (report.without_machine_paths("python -m crfkit.distill --train_file /data/a.conll --output_dir /w/x")
            == "python -m crfkit.distill --train_file ../../data/a.conll --output_dir .")
    assert report.without_machine_paths("python -m crfkit.pipeline --full") == "python -m crfkit.pipeline --full"
    assert report.without_machine_paths(None) is None
