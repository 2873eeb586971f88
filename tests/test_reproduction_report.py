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


# ---------------------------------------------------------------------- the students issue (issue 60)
STUDENT = "BiLSTM 1x(2x300), words 150-d frozen, cased, char CNN 50, casing 8, CRF"


def new_record(variant, seed, test_f1, teacher=None, k=None, pool=None, crossfit=0, sentences_per_s=1500.0):
    """A record as crfkit.tool.job writes it since issue 60 (distilled, student, dataset, pool, ...)."""
    return {**record(variant, seed, test_f1, k=k, dev_f1=test_f1 + 4), "distilled": teacher is not None,
            "teacher_sha256": teacher, "student": STUDENT, "dataset": "conll2003", "pool": pool,
            "pool_sentences": 20000 if pool else 0, "crossfit_folds": crossfit,
            "da_pool": {"news": 0, "augment": 0, "news_articles": 20000} if pool else None,
            "sentences_per_s": sentences_per_s, "date": "2026-12-03T00:00:00", "dev": {"f1": 0.9}}


def teacher_record(digest, test_f1, encoder):
    return {**record("teacher", 0, test_f1, dev_f1=95.0), "teacher_sha256": digest, "sentences_per_s": 100.0,
            "command": f"python -m crfkit.tool --teacher_model_name_or_path {encoder} --output_dir ."}


def test_paired_interval_and_sign_test(report):
    same = report.paired_interval([1.5] * 5)
    assert (same["mean"], same["low"], same["high"], same["n"]) == (1.5, 1.5, 1.5, 5)
    assert same["p"] == 0.0625   # 5 of 5 positive: 2 / 2**5
    assert report.sign_test([-0.3] * 5) == 0.0625
    assert report.sign_test([1, 1, 1, 1, -1]) == 0.375   # 2 * (1 + 5) / 32
    assert report.sign_test([1, 1, -1, 1, -1]) == 1.0
    assert report.sign_test([1, 1, 0]) == 0.5   # a tie is dropped: 2 of 2
    assert report.sign_test([0, 0]) == 1.0 and report.sign_test([]) == 1.0
    mixed = report.paired_interval([1.5, 1.5, -0.5, 1.5, -0.5])
    # resampled means are 1.5 - 0.4 k (k negatives, binomial(5, 0.4)): 2.5% at k = 4, 97.5% at k = 0
    assert (mixed["mean"], mixed["low"], mixed["high"]) == (0.7, -0.1, 1.5)
    assert report.paired_interval([1.5, 1.5, -0.5, 1.5, -0.5]) == mixed   # seeded: the same every time
    one = report.paired_interval([2.0])
    assert one["low"] is None and one["high"] is None and one["mean"] == 2.0
    assert report.interval_verdict(same) == "holds"
    assert report.interval_verdict(report.paired_interval([-1.0, -2.0])) == "does not hold"
    assert report.interval_verdict(mixed) == "not resolved (interval spans 0)"
    assert report.interval_verdict(one) == "not resolved (n < 2)"
    assert report.interval_verdict(report.paired_interval([])) == "not run yet"
    # the ordering is judged over five seeds: two positive pairs always give an interval above 0
    two = report.paired_interval([0.4, 0.1])
    assert report.interval_verdict(two) == "holds" and report.ordering_verdict(two) == "not judged (2 of 5 seeds)"
    assert report.ordering_verdict(same) == "holds" and report.ordering_verdict(mixed) == report.interval_verdict(mixed)
    assert report.ordering_verdict(None) == "not run yet"


def students_workdirs(tmp_path):
    """An MPNet teacher's work folder (its students, fold teachers and a report.json), a MiniLM
    teacher's with one student, and the baseline g100 in a folder of its own (no teacher)."""
    mpnet, minilm, old = "m" * 64, "n" * 64, "a" * 64
    folders = {name: tmp_path / name for name in ("old", "mpnet", "minilm", "g100")}
    for folder in folders.values():
        folder.mkdir()
    base = [89.0, 89.2, 89.4, 89.6, 89.8]
    runs = {
        "old": [dict(record("teacher", 0, 89.0), teacher_sha256=old), dict(record("te", 0, 85.0), teacher_sha256=old),
                dict(record("te_seq", 0, 86.0, k=5), teacher_sha256=old)],
        "g100": [new_record("g100", s, f1) for s, f1 in enumerate(base)],
        "mpnet": ([teacher_record(mpnet, 92.0, "mpnet")]
                  + [{**record("teacher_fold", 0, 91.0 + fold / 10), "fold": fold, "folds": 2, "distilled": False,
                      "teacher_sha256": str(fold) * 64, "dataset": "conll2003"} for fold in range(2)]
                  + [new_record("g100_token_pos", s, f1 + 0.5, mpnet, crossfit=2) for s, f1 in enumerate(base)]
                  + [new_record("g100_seq", s, f1 + 0.5 + d, mpnet, k=5, crossfit=2)
                     for s, (f1, d) in enumerate(zip(base, [1, 1, -1, 1, -1]))]
                  + [new_record("g100_da_seq", s, f1 + 2.5, mpnet, k=5, pool="articles20000")
                     for s, f1 in enumerate(base[:3])]
                  + [new_record("g100_da_token_pos", s, f1 + 2.0, mpnet, pool="articles20000")
                     for s, f1 in enumerate(base[:3])]
                  + [new_record("g100_da", 0, 90.0, mpnet, pool="articles20000")]),
        "minilm": [teacher_record(minilm, 89.0, "minilm")]
                  + [new_record("g100_seq", s, f1 + 1.0, minilm, k=5) for s, f1 in enumerate(base[:2])]}
    for name, records in runs.items():
        (folders[name] / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = [{"model": "teacher (mpnet + CRF)", "test_f1": 92.0, "sentences_per_s": 120.0, "speedup": 1.0}]
    rows += [{"model": f"BiLSTM+CRF g100_da_seq, K = 5, seed {s}", "test_f1": 91.5, "sentences_per_s": 3000.0,
              "speedup": 25.0} for s in range(3)]
    (folders["mpnet"] / "report.json").write_text(json.dumps({
        "rows": rows, "machine": "test machine", "date": "d", "git": "abc", "command": "python -m crfkit.tool.report .",
        "batch_size": 32, "throughput_sentences": 512}))
    return [folders[name] for name in ("old", "mpnet", "minilm", "g100")], mpnet, minilm, old


def test_students_section_paired_against_the_baseline(report, tmp_path):
    workdirs, mpnet, minilm, old = students_workdirs(tmp_path)
    text, data = report.build(workdirs, "te_da_seq", 5)
    tables, section = text[:text.index("## Students issue (issue 60)")], text[text.index("## Students issue"):]
    # the paper's tables keep to their teacher: issue 60's students and the fold teachers are in none of them
    assert "| teacher (MiniLM-L6 + CRF; the paper: BERT-base + CRF) | 89.00 (n = 1) |" in tables
    assert "g100" not in tables.replace("g100/results.jsonl", "") and "teacher_fold" not in tables
    assert "Cross-fitting fold teachers (teacher_fold; not students, in no table): 2 record(s)" in section
    assert "Tagging speed, measured side by side" not in tables   # the MPNet report.json times g100 students only

    mpnet_table = section[section.index(f"### teacher `{mpnet[:12]}` (mpnet, test F1 92.00); student `{STUDENT}`; "
                                        "conll2003"):section.index(f"### teacher `{minilm[:12]}`")]
    rows = [line for line in mpnet_table.splitlines() if line.startswith("| g100")]
    # report.json timed g100_da_seq only; every variant has its network, so every row reads that timing
    assert rows == [
        "| g100 | - | - | - | 89.40 ± 0.32 (n = 5) | 93.40 | the baseline |  |  | 2.60 | 25.0x |",
        "| g100_token_pos | - | - | 2 | 89.90 ± 0.32 (n = 5) | 93.90 | +0.50 (5) | [+0.50, +0.50] | 0.0625 | 2.10 "
        "| 25.0x |",
        "| g100_seq | 5 | - | 2 | 90.10 ± 0.95 (n = 5) | 94.10 | +0.70 (5) | [-0.10, +1.50] | 1 | 1.90 "
        "| 25.0x |",
        "| g100_da | - | articles20000 (20,000) | - | 90.00 (n = 1) | 94.00 | +1.00 (1) | n < 2 | 1 | 2.00 "
        "| 25.0x |",
        "| g100_da_token_pos | - | articles20000 (20,000) | - | 91.20 ± 0.20 (n = 3) | 95.20 | +2.00 (3) "
        "| [+2.00, +2.00] | 0.25 | 0.80 | 25.0x |",
        "| g100_da_seq | 5 | articles20000 (20,000) | - | 91.70 ± 0.20 (n = 3) | 95.70 | +2.50 (3) | [+2.50, +2.50] "
        "| 0.25 | 0.30 | 25.0x |"]
    assert ("- SEQ > TOKEN-POS (without DA, cross-fit 2; g100_seq against g100_token_pos): +0.20 over 5 seeds, "
            "95% bootstrap [-0.60, +1.00], sign test p = 1: not resolved (interval spans 0)") in mpnet_table
    assert ("- TOKEN-POS > alone (without DA, cross-fit 2; g100_token_pos against g100): +0.50 over 5 seeds, "
            "95% bootstrap [+0.50, +0.50], sign test p = 0.0625: holds") in mpnet_table
    assert "- SEQ > TOKEN-POS > alone (without DA, cross-fit 2): not resolved" in mpnet_table
    assert ("- SEQ > TOKEN-POS (with DA, pool articles20000; g100_da_seq against g100_da_token_pos): +0.50 over 3 "
            "seeds, 95% bootstrap [+0.50, +0.50], sign test p = 0.25: not judged (3 of 5 seeds)") in mpnet_table
    assert ("- TOKEN-POS > alone (with DA, pool articles20000; g100_da_token_pos against g100_da): +1.00 over 1 seed, "
            "95% bootstrap n < 2, sign test p = 1: not judged (1 of 5 seeds)") in mpnet_table
    assert "- SEQ > TOKEN-POS > alone (with DA, pool articles20000): not judged (fewer than 5 seeds)" in mpnet_table

    # the baseline, which no teacher shaped, serves the MiniLM teacher's table too
    minilm_table = section[section.index(f"### teacher `{minilm[:12]}`"):section.index("### Targets (issue 60)")]
    assert "| g100 | - | - | - | 89.40 ± 0.32 (n = 5) | 93.40 | the baseline |  |  | -0.40 |" in minilm_table
    assert "| g100_seq | 5 | - | - | 90.10 ± 0.14 (n = 2) | 94.10 | +1.00 (2) | [+1.00, +1.00] | 0.5 |" in minilm_table
    assert "g100_token_pos" not in minilm_table and "- SEQ > TOKEN-POS (without DA; g100_seq against (not run))" \
        ": not run yet" in minilm_table

    targets = section[section.index("### Targets (issue 60)"):]
    assert ("- best distilled student (g100_da_seq, K = 5, pool articles20000: 91.70 ± 0.20 (n = 3)) at least 91.0 "
            "F1 and within 1.0 of its teacher (92.00): gap 0.30, met") in targets
    assert ("- at least 1.0 F1 above the baseline g100 (89.40 ± 0.32 (n = 5); paired): +2.50 over 3 seeds, 95% "
            "bootstrap [+2.50, +2.50], sign test p = 0.25, met; the interval is above 1.0") in targets
    assert ("- at least 20x the teacher's sentences per second: 25.0x (measured side by side in one run of d, this "
            "student's architecture, n = 3), met" in targets)
    assert ("- the ordering SEQ > TOKEN-POS > alone (with DA, pool articles20000): not judged (fewer than 5 seeds) "
            "(see above)") in targets
    minilm_targets = targets[targets.index(f"With the minilm teacher `{minilm[:12]}`"):]
    assert "(g100_seq, K = 5: 90.10 ± 0.14 (n = 2)) at least 91.0 F1 and within 1.0 of its teacher (89.00): " \
           "gap -1.10, NOT met" in minilm_targets
    # the MiniLM teacher (89.00) scores below the baseline (89.40); the MPNet one (92.00) does not
    assert ("+1.00 over 2 seeds, 95% bootstrap [+1.00, +1.00], sign test p = 0.5, met; the interval is above 1.0; "
            "the teacher itself (89.00) is 0.40 F1 below this baseline") in minilm_targets
    assert "F1 below this baseline" not in targets[:targets.index(f"With the minilm teacher `{minilm[:12]}`")]
    assert ("15.0x (from the records' sentences_per_s, each measured when its run finished, NOT side by side, n = 2), "
            "NOT met") in minilm_targets

    issue = data["students_issue"]
    assert issue["bootstrap"] == {"resamples": 10_000, "seed": report.BOOTSTRAP_SEED, "confidence": 0.95}
    first = issue["tables"][0]
    assert first["teacher_sha256"] == mpnet and first["teacher_test_f1"] == 92.0
    seq = next(r for r in first["rows"] if r["variant"] == "g100_seq")
    assert seq["vs_baseline"]["seeds"] == [0, 1, 2, 3, 4] and seq["vs_baseline"]["low"] == -0.1
    assert seq["test_f1_by_seed"] == {"0": 90.5, "1": 90.7, "2": 88.9, "3": 91.1, "4": 89.3}
    # the records keep issue 60's fields (nothing lost), the old ones gain none
    kept = next(r for r in data["records"] if r["variant"] == "g100_da_seq")
    assert (kept["distilled"], kept["student"], kept["dataset"], kept["pool"], kept["pool_sentences"],
            kept["crossfit_folds"]) == (True, STUDENT, "conll2003", "articles20000", 20000, 0)
    baseline = next(r for r in data["records"] if r["variant"] == "g100")
    assert baseline["distilled"] is False and baseline["teacher_sha256"] is None
    assert "distilled" not in next(r for r in data["records"] if r["variant"] == "te")
    assert len(data["records"]) == 3 + 5 + 1 + 2 + 5 + 5 + 3 + 3 + 1 + 1 + 2
    assert [e["seed"] for e in data["students_side_by_side"]] == [0, 1, 2]

    # rebuilt from docs/reproduction.json alone (the work folders gone), the section comes out the same
    (tmp_path / "docs" / "reproduction.json").write_text(json.dumps(data))
    again, _ = report.build([], "te_da_seq", 5)
    assert again[again.index("## Students issue"):] == section


def test_the_baseline_belongs_to_no_teacher(report, tmp_path):
    """A baseline (distilled false) names no teacher because it uses none: it is kept (not taken
    for a record of the main teacher's written before records named it) and compared with the
    students of the teacher that has them; the main teacher of the paper's tables is counted over
    those tables' own students only, so issue 60's runs never take them over."""
    main, other = "a" * 64, "b" * 64
    workdir = tmp_path / "runs"
    workdir.mkdir()
    records = ([dict(record("teacher", 0, 89.0), teacher_sha256=main), dict(record("te", 0, 85.0), teacher_sha256=main),
                teacher_record(other, 92.0, "mpnet")]
               + [new_record("g100_seq", s, 90.0, other, k=5) for s in range(3)]
               + [new_record("g100", s, 89.0) for s in range(3)])
    (workdir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert report.main_teacher(records) == other   # by raw counts the g100 students would take the tables
    text, data = report.build(workdir, "te_da_seq", 5)
    assert "| teacher (MiniLM-L6 + CRF; the paper: BERT-base + CRF) | 89.00 (n = 1) |" in text
    assert len([r for r in data["records"] if r["variant"] == "g100"]) == 3
    assert "| g100_seq | 5 | - | - | 90.00 ± 0.00 (n = 3) | 94.00 | +1.00 (3) | [+1.00, +1.00] | 0.25 |" in text


def test_no_students_section_without_issue_60_records(report, tmp_path):
    workdir = tmp_path / "runs"
    workdir.mkdir()
    (workdir / "results.jsonl").write_text(json.dumps(record("teacher", 0, 89.0)) + "\n")
    text, data = report.build(workdir, "te_da_seq", 5)
    assert "Students issue" not in text and "students_issue" not in data


def test_encoder_name_from_the_tools_command(report):
    assert report.encoder_name({"command": "python -m crfkit.tool --teacher_model_name_or_path mpnet"}) == "mpnet"
    assert report.encoder_name({"command": "python -m crfkit.tool --teacher_model_name_or_path "
                                           "../mpnet_xf/teacher/model"}) == "mpnet_xf"


def test_tagging_speed_section_gives_each_student_over_each_teacher(report, tmp_path):
    """The benchmark's rows become a table, and each student's speed over each teacher's is the
    median of the per-round ratios (here 20, 25 and 30 against the trained teacher: 25)."""
    def row(model, source, describe, rounds):
        return {"model": model, "source": source, "describe": describe, "params": 2_000_000,
                "sentences_per_s": sorted(rounds)[1], "rounds": rounds, "vs_first": 1.0}

    bench = {"command": "python benchmarks/tagging_speed.py", "git": "abc", "date": "2026-12-04", "machine": "m",
             "threads": 1, "sentences": 512, "batch_size": 32,
             "rows": [row("MiniLM teacher", "runs/t/model", "minilm (6 layers), casing 16, CRF", [100, 80, 60]),
                      row("MPNet-base", "fresh:mpnet", "mpnet (12 layers), casing 16, CRF", [20, 10, 12]),
                      row("student", "runs/s/model", "BiLSTM 1x(2x300), CRF", [2000, 2000, 1800])]}
    lines = report.tagging_speed_section(bench)
    assert "| MPNet-base (untrained) | mpnet (12 layers), casing 16, CRF | 2.0M | 12 | 1.00x |" in lines
    assert "- student over MiniLM teacher: 25.0x (rounds 20.0x to 30.0x)" in lines
    assert "- student over MPNet-base: 150.0x (rounds 100.0x to 200.0x)" in lines
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "tagging_speed.json").write_text(json.dumps(bench))
    workdir = tmp_path / "runs"
    workdir.mkdir()
    (workdir / "results.jsonl").write_text(json.dumps(record("teacher", 0, 89.0)) + "\n")
    text, _ = report.build(workdir, "te_da_seq", 5)
    assert "## Tagging speed against other teacher architectures" in text


def test_the_speed_target_reads_the_newest_side_by_side_report(report):
    """Two report stages timed the same student architecture: the newer one (faster code) gives
    every row's ratio, whichever variant it timed; another teacher's row falls back to records."""
    def entry(variant, date, speedup):
        return {"teacher_sha256": "t", "student": "s", "dataset": "conll2003", "variant": variant, "K": None,
                "pool": None, "crossfit_folds": 0, "date": date, "speedup": speedup}

    speeds = [entry("g100_da_seq", "2026-12-02", 15.0), entry("g100_da_token_pos", "2026-12-04", 18.0),
              entry("g100_da_token_pos", "2026-12-04", 20.0)]
    row = {"variant": "g100_da_seq", "K": None, "pool": None, "crossfit_folds": 0, "sentences_per_s": 1500.0,
           "n": 3}
    assert report._speed(row, "t", None, speeds, "s", "conll2003") == {
        "ratio": 19.0, "n": 2, "source": "side by side", "date": "2026-12-04"}
    assert report._speed(row, "other teacher", None, speeds, "s", "conll2003") is None
    assert report._speed(row, "other teacher", {"sentences_per_s": 100.0}, speeds, "s", "conll2003") == {
        "ratio": 15.0, "n": 3, "source": "records"}
