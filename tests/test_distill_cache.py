"""The teacher-label cache (crfkit.distill.cache): round trip against direct crfkit ops, resume
and refusal, a real SIGKILL part-way and resume, two torchrun ranks, lazy loading."""
import builtins
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open

import crfkit
from crfkit.distill import cache as cache_mod
from crfkit.distill.cache import (
    CacheMismatchError,
    TeacherLabelCache,
    TeacherOutput,
    label_corpus,
    load_cache,
)

from cache_worker import TEACHER_INFO, ToyTeacher, toy_corpus

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "cache_worker.py")


def subprocess_env():
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def direct(teacher, corpus, k, with_marginals=True):
    """The teacher on the whole corpus in one batch, then crfkit's ops: what the cache must hold."""
    out = teacher(corpus)
    kb = crfkit.kbest_viterbi(out.emissions, out.transitions, k, out.lengths, out.start, out.end)
    log_z = crfkit.log_partition(out.emissions, out.transitions, out.lengths, out.start, out.end)
    margs = (crfkit.marginals(out.emissions, out.transitions, out.lengths, out.start, out.end) if with_marginals
             else None)
    return kb, log_z, margs, out.lengths


def label(directory, corpus, k=5, num_tags=3, **kwargs):
    kwargs.setdefault("batch_size", 5)
    kwargs.setdefault("shard_size", 8)
    kwargs.setdefault("teacher_info", TEACHER_INFO)
    kwargs.setdefault("progress", False)
    teacher = kwargs.pop("teacher", None) or ToyTeacher(num_tags)
    return label_corpus(teacher, corpus, str(directory), k, **kwargs), teacher


def assert_same_records(a, b):
    assert len(a) == len(b)
    for i in range(len(a)):
        ra, rb = a[i], b[i]
        assert ra.id == rb.id == i
        assert torch.equal(ra.paths, rb.paths)
        torch.testing.assert_close(ra.log_probs, rb.log_probs, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ra.scores, rb.scores, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ra.log_z, rb.log_z, rtol=1e-6, atol=1e-6)
        if ra.marginals is None or rb.marginals is None:
            assert ra.marginals is None and rb.marginals is None
        else:
            torch.testing.assert_close(ra.marginals, rb.marginals, rtol=1e-6, atol=1e-6)


def shard_ids(directory):
    ids = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("shard-"):
            with safe_open(os.path.join(directory, name), framework="pt") as f:
                ids += f.get_tensor("ids").tolist()
    return ids


def shard_files(directory):
    return sorted(name for name in os.listdir(directory) if cache_mod._SHARD_RE.match(name))


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("marginals_dtype", [torch.float32, torch.float16])
def test_round_trip_equals_direct_ops(tmp_path, marginals_dtype):
    corpus = toy_corpus(45)
    k = 5
    cache, teacher = label(tmp_path, corpus, k=k, with_marginals=True, marginals_dtype=marginals_dtype,
                           label_names=["O", "B", "I"], corpus_info="toy corpus")
    kb, log_z, margs, lengths = direct(teacher, corpus, k)
    assert len(cache) == 45 and cache.k == k and cache.num_tags == 3 and cache.complete
    assert cache.label_names == ["O", "B", "I"] and cache.teacher_info == TEACHER_INFO
    assert cache.corpus_info == "toy corpus"
    tol = dict(rtol=0, atol=1e-3) if marginals_dtype == torch.float16 else dict(rtol=1e-6, atol=1e-6)
    missing_rows = 0
    for i in range(len(corpus)):
        r = cache[i]
        n = len(corpus[i])
        assert r.id == i and r.paths.shape == (k, n) and r.paths.dtype == torch.int64
        assert torch.equal(r.paths, kb.paths[i, :, :n])
        assert torch.equal(kb.paths[i, :, n:], torch.full_like(kb.paths[i, :, n:], -1))  # nothing lost by trimming
        torch.testing.assert_close(r.log_probs, kb.log_probs[i], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r.scores, kb.scores[i], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r.log_z, log_z[i], rtol=1e-6, atol=1e-6)
        assert r.marginals.dtype == marginals_dtype and r.marginals.shape == (n, 3)
        torch.testing.assert_close(r.marginals.float(), margs[i, :n], **tol)
        if n:
            missing_rows += int(torch.isinf(r.log_probs).sum())
    # the edge cases are really in the corpus: empty, length 1 (fewer than K sequences), all forbidden
    assert cache[0].paths.shape == (k, 0) and cache[0].log_probs[0] == 0 and torch.isinf(cache[0].log_probs[1:]).all()
    assert (cache[1].paths.shape == (k, 1) and (cache[1].paths[2:] == -1).all()
            and torch.isinf(cache[1].log_probs[2:]).all())
    assert cache[3].log_z == float("-inf") and (cache[3].paths == -1).all()
    assert missing_rows > 0
    assert cache[-1].id == 44
    with pytest.raises(IndexError):
        cache[45]
    assert [r.id for r in cache] == list(range(45))

    # a padded batch is exactly what kbest_viterbi returned
    L = kb.paths.shape[-1]
    batch = cache.batch(torch.arange(45), pad_to=L)
    assert torch.equal(batch.kbest.paths, kb.paths) and torch.equal(batch.lengths, lengths)
    assert torch.equal(batch.ids, torch.arange(45))
    torch.testing.assert_close(batch.kbest.log_probs, kb.log_probs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(batch.kbest.scores, kb.scores, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(batch.log_z, log_z, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(batch.marginals.float(), margs, **tol)
    assert isinstance(batch.kbest, crfkit.KBest)
    short = cache.batch([1, 2], dtype=torch.float64)
    assert short.kbest.paths.shape == (2, k, 2) and short.kbest.log_probs.dtype == torch.float64
    with pytest.raises(ValueError, match="pad_to"):
        cache.batch([5, 6], pad_to=0)

    # and it feeds the k-best distillation loss like the direct KBest does
    structured = pytest.importorskip("crfkit.distill.structured")
    student = torch.randn(45, L, 3, dtype=torch.float64)
    student_transitions = torch.randn(3, 3, dtype=torch.float64)
    ok = torch.isfinite(log_z)  # sentence 3 has no allowed teacher sequence
    kb_ok = crfkit.KBest(*(x[ok] for x in kb))
    batch_ok = cache.batch(torch.arange(45)[ok], pad_to=L, dtype=torch.float64)
    from_cache = structured.kbest_cross_entropy(student[ok], student_transitions, batch_ok.kbest, batch_ok.lengths)
    kb_ok64 = crfkit.KBest(kb_ok.scores.double(), kb_ok.paths, kb_ok.log_probs.double())
    expected = structured.kbest_cross_entropy(student[ok], student_transitions, kb_ok64, lengths[ok])
    torch.testing.assert_close(from_cache, expected)


def test_compact_path_dtypes_and_wide_tag_sets(tmp_path):
    corpus = toy_corpus(10, max_len=6)
    cache, teacher = label(tmp_path / "narrow", corpus, k=3, num_tags=4)
    with safe_open(os.path.join(cache.directory, "shard-00000.safetensors"), framework="pt") as f:
        assert f.get_tensor("paths").dtype == torch.int8
        assert "marginals" not in f.keys()
    assert cache[5].marginals is None and cache.batch([4, 5]).marginals is None
    assert cache.manifest["paths_dtype"] == "int8"

    cache, teacher = label(tmp_path / "wide", corpus, k=3, num_tags=200, shard_size=4)
    assert cache.manifest["paths_dtype"] == "int16"
    kb, _, _, _ = direct(teacher, corpus, 3, with_marginals=False)
    for i in range(len(corpus)):
        assert torch.equal(cache[i].paths, kb.paths[i, :, :len(corpus[i])])
    assert int(kb.paths.max()) > 127  # the int16 storage was needed


def test_empty_corpus(tmp_path):
    cache, teacher = label(tmp_path, [], k=2)
    assert len(cache) == 0 and cache.complete and teacher.calls == 0 and cache.num_tags is None
    assert list(cache) == []


# --------------------------------------------------------------------------- resume and refusal


def test_resume_refuses_other_runs_and_completed_run_is_a_noop(tmp_path):
    corpus = toy_corpus(30)
    first, _ = label(tmp_path, corpus, k=3)
    before = {name: os.stat(tmp_path / name).st_mtime_ns for name in os.listdir(tmp_path)}

    again, teacher = label(tmp_path, corpus, k=3)
    assert teacher.calls == 0
    assert {name: os.stat(tmp_path / name).st_mtime_ns for name in os.listdir(tmp_path)} == before
    assert_same_records(first, again)
    # shard_size=None takes the cache's
    again, teacher = label(tmp_path, corpus, k=3, shard_size=None)
    assert teacher.calls == 0

    with pytest.raises(CacheMismatchError, match=r"k: the cache has 3, this run asks for 4"):
        label(tmp_path, corpus, k=4)
    with pytest.raises(CacheMismatchError, match="teacher: the cache has"):
        label(tmp_path, corpus, k=3, teacher_info={"model": "another teacher"})
    changed = [list(s) for s in corpus]
    changed[17] = changed[17][:-1] + ["w999"]
    with pytest.raises(CacheMismatchError, match="corpus_fingerprint"):
        label(tmp_path, changed, k=3)
    with pytest.raises(CacheMismatchError, match="num_sentences"):
        label(tmp_path, corpus[:29], k=3)
    with pytest.raises(CacheMismatchError, match="shard_size"):
        label(tmp_path, corpus, k=3, shard_size=16)
    with pytest.raises(CacheMismatchError, match="with_marginals"):
        label(tmp_path, corpus, k=3, with_marginals=True)
    with pytest.raises(CacheMismatchError, match="label_names"):
        label(tmp_path, corpus, k=3, label_names=["a", "b", "c"])
    # nothing was touched by the refusals
    assert {name: os.stat(tmp_path / name).st_mtime_ns for name in os.listdir(tmp_path)} == before


def test_resume_relabels_only_missing_shards(tmp_path):
    corpus = toy_corpus(30)
    reference, _ = label(tmp_path / "reference", corpus)
    directory = tmp_path / "resumed"
    label(directory, corpus)
    os.unlink(directory / "shard-00002.safetensors")
    kept = {name: os.stat(directory / name).st_ino for name in shard_files(directory)}
    with pytest.raises(CacheMismatchError, match="gives 5 tags but the cache .* holds 3"), \
            pytest.warns(UserWarning, match="1 shard"):
        label(directory, corpus, teacher=ToyTeacher(5))
    with pytest.warns(UserWarning, match="1 shard"):
        resumed, teacher = label(directory, corpus)
    assert teacher.calls == 2  # shard 2: sentences 16..23 in batches of 5
    assert {name: os.stat(directory / name).st_ino for name in kept} == kept
    assert_same_records(reference, resumed)
    assert sorted(shard_ids(directory)) == list(range(30))


@pytest.mark.filterwarnings("ignore:.*the manifest says complete")
def test_foreign_and_corrupt_files(tmp_path):
    corpus = toy_corpus(20)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "shard-00000.safetensors").write_bytes(b"not ours")
    with pytest.raises(CacheMismatchError, match="no manifest.json"):
        label(tmp_path / "foreign", corpus)

    reference, _ = label(tmp_path / "reference", corpus)
    directory = tmp_path / "corrupt"
    label(directory, corpus)
    (directory / "shard-00001.safetensors").write_bytes(b"\x00" * 10)
    with pytest.warns(UserWarning, match="unreadable"):
        resumed, teacher = label(directory, corpus)
    assert teacher.calls == 2
    assert_same_records(reference, resumed)

    with pytest.raises(FileNotFoundError, match="manifest.json"):
        TeacherLabelCache(tmp_path / "foreign-nothing")


def test_the_reader_refuses_a_shard_of_another_cache(tmp_path):
    """A shard copied in from another labelling run (another K, teacher, or another shard's
    place) used to be read as this cache's: foreign paths for some sentences, a shape error for
    others. Each is a CacheMismatchError naming the file."""
    import shutil

    corpus = toy_corpus(20)
    mine, _ = label(tmp_path / "mine", corpus, k=5)
    label(tmp_path / "other-k", corpus, k=3)
    label(tmp_path / "other-teacher", corpus, k=5, teacher_info={"model": "another"})
    target = tmp_path / "mine" / "shard-00001.safetensors"
    original = target.read_bytes()
    for source, found in [(tmp_path / "other-k" / "shard-00001.safetensors", "config_hash .*k '3' \\(expected '5'\\)"),
                          (tmp_path / "other-teacher" / "shard-00001.safetensors", "config_hash"),
                          (tmp_path / "mine" / "shard-00000.safetensors", "shard_index '0' \\(expected '1'\\)")]:
        shutil.copyfile(source, target)
        cache = load_cache(tmp_path / "mine")
        assert torch.equal(cache[0].paths, mine[0].paths)   # shard 0 is still read
        with pytest.raises(CacheMismatchError, match=f"^{re.escape(str(target))} is not shard 1 of the cache in "
                                                     f".*: {found}.*copied from another labelling run"):
            cache[8]
    target.write_bytes(original)
    assert torch.equal(load_cache(tmp_path / "mine")[8].paths, mine[8].paths)


def test_the_reader_names_a_truncated_shard(tmp_path):
    corpus = toy_corpus(20)
    label(tmp_path, corpus)
    target = tmp_path / "shard-00001.safetensors"
    data = target.read_bytes()
    for damaged in (data[:len(data) // 2], data[:6]):
        target.write_bytes(damaged)
        with pytest.raises(ValueError, match=f"^{re.escape(str(target))} is not a readable shard .*delete the file "
                                             "and run label_corpus again"):
            load_cache(tmp_path)[9]


def test_a_second_writer_of_a_cache_is_refused_while_the_first_runs(tmp_path):
    """label_corpus deleted the temporary files of a live writer (which then died on its rename);
    now the directory is locked for the whole labelling job and a second job is refused with a
    CacheBusyError naming the first."""
    from crfkit.distill import CacheBusyError

    corpus = toy_corpus(30)
    refusals = []

    class Intruder(ToyTeacher):
        def __call__(self, items):
            if self.calls == 2:  # the first job is part way: one shard written, more to come
                with pytest.raises(CacheBusyError, match=f"is being labelled by another job \\(pid {os.getpid()} "
                                                         "on .*, started .*\\); one labelling job per directory"):
                    label(tmp_path, corpus)
                refusals.append(sorted(os.listdir(tmp_path)))
            return super().__call__(items)

    cache, teacher = label(tmp_path, corpus, teacher=Intruder(3))
    assert refusals and len(cache) == 30 and cache.complete
    reference, _ = label(tmp_path / "reference", corpus)
    assert_same_records(reference, cache)
    # the lock is released with the job: a later call opens the finished cache at once
    again, teacher = label(tmp_path, corpus)
    assert teacher.calls == 0 and len(again) == 30
    assert not (tmp_path / cache_mod.WRITER_INFO).exists()


def test_a_finished_cache_opens_while_another_job_holds_the_lock(tmp_path):
    """Two student seeds started together on one finished cache: the second was refused with a
    CacheBusyError while the first merely checked the cache. A complete, matching cache is now
    read without the writer lock; an unfinished one still needs (and is refused) the lock."""
    import filelock

    from crfkit.distill import CacheBusyError

    corpus = toy_corpus(30)
    first, _ = label(tmp_path, corpus)
    holder = filelock.FileLock(str(tmp_path / cache_mod.WRITER_LOCK), thread_local=False)
    with holder:
        again, teacher = label(tmp_path, corpus)
        assert teacher.calls == 0 and len(again) == 30 and again.complete
        assert_same_records(first, again)
        with pytest.raises(cache_mod.CacheMismatchError, match="k: the cache has 5, this run asks for 2"):
            label(tmp_path, corpus, k=2)  # a mismatch is still named without the lock
        (tmp_path / "shard-00001.safetensors").unlink()  # no longer complete: needs the writer
        with pytest.raises(CacheBusyError, match="is being labelled by another job"):
            label(tmp_path, corpus)
    repaired, teacher = label(tmp_path, corpus)
    assert teacher.calls > 0 and repaired.complete
    assert_same_records(first, repaired)


def test_bad_arguments(tmp_path):
    corpus = toy_corpus(10)
    with pytest.raises(ValueError, match="k must be"):
        label(tmp_path, corpus, k=0)
    with pytest.raises(ValueError, match="batch_size"):
        label(tmp_path, corpus, batch_size=0)
    with pytest.raises(ValueError, match="marginals_dtype"):
        label(tmp_path, corpus, with_marginals=True, marginals_dtype=torch.int8)
    with pytest.raises(TypeError, match="Sequence"):
        label(tmp_path, iter(corpus))
    with pytest.raises(TypeError, match="JSON"):
        label(tmp_path, corpus, teacher_info=object())
    with pytest.raises(ValueError, match="label_names has 2 names but the teacher has 3 tags"):
        label(tmp_path / "names", corpus, label_names=["a", "b"])

    def wrong_batch(batch):
        out = ToyTeacher(3)(batch)
        return out._replace(emissions=out.emissions[:1])
    with pytest.raises(ValueError, match="emissions for 1 sentences for a batch of 5"):
        label(tmp_path / "wrong", corpus, teacher=wrong_batch)
    with pytest.raises(TypeError, match="TeacherOutput"):
        label(tmp_path / "none", corpus, teacher=lambda batch: None)
    # an interrupted run leaves an incomplete cache, which the reader refuses unless asked
    with pytest.raises(ValueError, match="incomplete"):
        TeacherLabelCache(tmp_path / "wrong")


def test_teacher_may_return_tuples_and_mappings(tmp_path):
    corpus = toy_corpus(12)
    toy = ToyTeacher(3)
    reference, _ = label(tmp_path / "reference", corpus)
    as_tuple, _ = label(tmp_path / "tuple", corpus, teacher=lambda batch: tuple(toy(batch)))
    as_dict, _ = label(tmp_path / "dict", corpus, teacher=lambda batch: toy(batch)._asdict())
    assert_same_records(reference, as_tuple)
    assert_same_records(reference, as_dict)


# --------------------------------------------------------------------------- lazy loading


def test_opening_reads_only_the_manifest_and_shards_load_on_demand(tmp_path, monkeypatch):
    corpus = toy_corpus(40)
    label(tmp_path, corpus, with_marginals=True)
    opened, files = [], []
    real_safe_open, real_open = cache_mod.safe_open, builtins.open

    def counting_safe_open(path, *args, **kwargs):
        opened.append(os.path.basename(path))
        return real_safe_open(path, *args, **kwargs)

    def recording_open(path, *args, **kwargs):
        files.append(os.path.basename(os.fspath(path)))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(cache_mod, "safe_open", counting_safe_open)
    monkeypatch.setattr(builtins, "open", recording_open)
    cache = load_cache(tmp_path, max_open_shards=2)
    monkeypatch.setattr(builtins, "open", real_open)
    assert files == ["manifest.json"] and opened == []
    assert len(cache) == 40 and opened == []

    cache[3]
    assert opened == ["shard-00000.safetensors"]
    cache[7], cache[0]
    assert opened == ["shard-00000.safetensors"]  # same shard: kept open
    cache[8], cache[39]
    assert opened == ["shard-00000.safetensors", "shard-00001.safetensors", "shard-00004.safetensors"]
    cache[1]  # shard 0 was the least recently used of three with room for two: reopened
    assert opened[-1] == "shard-00000.safetensors" and len(opened) == 4
    cache.close()
    cache[1]
    assert len(opened) == 5


def test_incomplete_cache_can_be_read_when_asked(tmp_path):
    corpus = toy_corpus(30)
    label(tmp_path, corpus)
    os.unlink(tmp_path / "shard-00001.safetensors")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest.update(complete=False, shards=[])
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="incomplete"):
        TeacherLabelCache(tmp_path)
    cache = TeacherLabelCache(tmp_path, allow_incomplete=True)
    assert cache[3].id == 3 and cache[20].id == 20
    with pytest.raises(KeyError, match="shard 1"):
        cache[9]


def test_killed_after_the_last_shard_only_the_manifest_is_written(tmp_path):
    corpus = toy_corpus(30)
    reference, _ = label(tmp_path / "reference", corpus)
    directory = tmp_path / "cache"
    label(directory, corpus)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest.update(complete=False, shards=[])
    (directory / "manifest.json").write_text(json.dumps(manifest))
    resumed, teacher = label(directory, corpus)
    assert teacher.calls == 0 and resumed.complete
    assert resumed.manifest == reference.manifest


def test_a_run_stopped_before_its_first_shard_may_restart_with_other_settings(tmp_path):
    corpus = toy_corpus(20)
    with pytest.raises(ValueError, match="label_names has 2 names"):
        label(tmp_path, corpus, label_names=["a", "b"])
    cache, _ = label(tmp_path, corpus, label_names=["a", "b", "c"])
    assert cache.label_names == ["a", "b", "c"] and cache.complete


def test_cache_is_a_dataset_for_dataloader_workers(tmp_path):
    import pickle
    corpus = toy_corpus(20)
    cache, _ = label(tmp_path, corpus, with_marginals=True)
    cache[3]
    copy = pickle.loads(pickle.dumps(cache))
    assert_same_records(cache, copy)
    loader = torch.utils.data.DataLoader(cache, batch_size=6, collate_fn=TeacherLabelCache.collate)
    batches = list(loader)
    assert [b.ids.tolist() for b in batches][0] == list(range(6)) and sum(len(b.ids) for b in batches) == 20


# --------------------------------------------------------------------------- kill and resume


def test_sigkill_part_way_then_resume_equals_uninterrupted_run(tmp_path):
    num_sentences, shard_size, batch_size = 240, 8, 4
    num_shards = num_sentences // shard_size
    directory = tmp_path / "killed"
    command = [sys.executable, WORKER, str(directory), "--num-sentences", str(num_sentences), "--num-tags", "4",
               "--shard-size", str(shard_size), "--batch-size", str(batch_size), "--sleep", "0.04", "--marginals"]
    process = subprocess.Popen(command, env=subprocess_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"the labelling process ended (rc {process.returncode}) before it could be killed: "
                            f"{process.stderr.read().decode()[-2000:]}")
            if directory.exists() and len(shard_files(directory)) >= 3:
                break
            time.sleep(0.01)
        else:
            pytest.fail("no shard appeared within 90 s")
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        process.stderr.close()
    assert process.returncode == -signal.SIGKILL

    at_kill = shard_files(directory)
    assert 3 <= len(at_kill) < num_shards
    assert not json.loads((directory / "manifest.json").read_text())["complete"]
    with pytest.raises(ValueError, match="incomplete"):
        TeacherLabelCache(directory)
    # what a kill in the middle of a write leaves behind
    leftover = directory / f".shard-{num_shards - 1:05d}.safetensors.tmp-{os.getpid():x}-0badc0de"
    leftover.write_bytes(b"half a shard")
    kept = {name: os.stat(directory / name).st_ino for name in at_kill}

    teacher = ToyTeacher(4)
    resumed = label_corpus(teacher, toy_corpus(num_sentences), str(directory), 5, batch_size=batch_size,
                           shard_size=shard_size, teacher_info=TEACHER_INFO, with_marginals=True,
                           marginals_dtype=torch.float32, progress=False)
    missing = num_shards - len(at_kill)
    assert teacher.calls == missing * (shard_size // batch_size)  # only the missing shards were labelled
    assert {name: os.stat(directory / name).st_ino for name in at_kill} == kept
    assert not leftover.exists()
    assert not [name for name in os.listdir(directory) if ".tmp-" in name]

    uninterrupted = label_corpus(ToyTeacher(4), toy_corpus(num_sentences), str(tmp_path / "uninterrupted"), 5,
                                 batch_size=batch_size, shard_size=shard_size, teacher_info=TEACHER_INFO,
                                 with_marginals=True, marginals_dtype=torch.float32, progress=False)
    assert_same_records(uninterrupted, resumed)
    ids = shard_ids(directory)
    assert len(ids) == num_sentences and sorted(ids) == list(range(num_sentences))  # each id exactly once
    assert resumed.manifest == uninterrupted.manifest


# --------------------------------------------------------------------------- torchrun


def test_two_torchrun_ranks_give_the_same_union(tmp_path):
    directory = tmp_path / "ranks"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
               WORKER, str(directory), "--num-sentences", "60", "--num-tags", "4", "--shard-size", "8",
               "--batch-size", "5", "--marginals"]
    try:
        result = subprocess.run(command, env=subprocess_env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"torchrun did not finish in 240 s: {error.stderr}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "rank 0: 60 sentences" in result.stdout and "rank 1: 60 sentences" in result.stdout

    single = label_corpus(ToyTeacher(4), toy_corpus(60), str(tmp_path / "single"), 5, batch_size=5, shard_size=8,
                          teacher_info=TEACHER_INFO, with_marginals=True, marginals_dtype=torch.float32,
                          progress=False, distributed=False)
    ranks = TeacherLabelCache(directory)
    assert_same_records(single, ranks)
    assert ranks.manifest == single.manifest
    ids = shard_ids(directory)
    assert len(ids) == 60 and sorted(ids) == list(range(60))
    writers = {}
    for name in shard_files(directory):
        with safe_open(str(directory / name), framework="pt") as f:
            writers[name] = int(f.metadata()["rank"])
    assert set(writers.values()) == {0, 1}
    assert all(writers[f"shard-{i:05d}.safetensors"] == i % 2 for i in range(len(writers)))


def test_teacher_output_is_a_named_tuple():
    out = TeacherOutput(torch.zeros(1, 2, 3), torch.zeros(3, 3), torch.tensor([2]))
    assert out.start is None and out.end is None


def test_corpus_fingerprint_sees_every_value():
    from crfkit.distill.cache import corpus_fingerprint
    corpus = toy_corpus(9000)  # more than one fingerprint chunk
    base = corpus_fingerprint(corpus)
    assert base.startswith("sha256:") and corpus_fingerprint([list(s) for s in corpus]) == base
    changed = [list(s) for s in corpus]
    changed[8999] = changed[8999] + ["w0"]
    assert corpus_fingerprint(changed) != base
    assert corpus_fingerprint(corpus[:-1]) != base
    tensors = [torch.arange(5), torch.arange(6)]  # not JSON: hashed item by item, by value
    assert corpus_fingerprint(tensors) == corpus_fingerprint([torch.arange(5), torch.arange(6)])
    assert corpus_fingerprint(tensors) != corpus_fingerprint([torch.arange(5), torch.arange(1, 7)])
    assert corpus_fingerprint([b"ab", "ab"]) != corpus_fingerprint(["ab", b"ab"])
