"""Gradual unfreezing, its one implementation: the schedule (crfkit.distill.GradualUnfreezing) and
fit_tagger_gradually, which trains each of its rounds with the Trainer (fit_tagger is replaced
here by a stand-in that records what would train and saves the round, so no training runs; the
real training is tests/test_training.py::test_fit_tagger_gradually_unfreezes_from_the_top).

The documented order (docs/METHODS.md 5.2): freeze everything, then unfreeze the layers one at a
time from the top (the output side) down, each staying trainable once unfrozen."""
import importlib.util
import os
import types

import pytest
import torch
from torch import nn

from crfkit import data, distill
from crfkit.distill import GradualUnfreezing

pytestmark = pytest.mark.usefixtures("one_thread")
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                                        or importlib.util.find_spec("accelerate") is None,
                                        reason="pip install transformers accelerate")

LAYERS = ["0", "2", "4"]  # bottom to top


def tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def layers_of(model, names=LAYERS):
    return [(name, list(model.get_submodule(name).parameters())) for name in names]


def flags(model):
    return {name: [p.requires_grad for p in module.parameters()] for name, module in model.named_children()
            if list(module.parameters())}


def test_rounds_unfreeze_from_the_top_each_layer_staying_trainable():
    model = tiny_model()
    model[2].bias.requires_grad_(False)    # a caller's own setting, which must come back
    schedule = GradualUnfreezing(layers_of(model, ["2", "4"]), model.parameters())   # "0" in no layer
    assert len(schedule) == 2
    seen = []
    with schedule as entered:
        assert entered is schedule
        for round_ in range(1, len(schedule) + 1):
            trainable = schedule.apply(round_)
            seen.append((schedule.trainable_layers(round_), flags(model), [id(p) for p in trainable]))
    assert seen == [
        (("4",), {"0": [False, False], "2": [False, False], "4": [True, True]},
         [id(model[4].weight), id(model[4].bias)]),
        (("4", "2"), {"0": [False, False], "2": [True, True], "4": [True, True]},
         [id(model[2].weight), id(model[2].bias), id(model[4].weight), id(model[4].bias)]),
    ]
    assert flags(model) == {"0": [True, True], "2": [True, False], "4": [True, True]}


def test_a_layer_out_of_the_schedule_is_not_touched_unless_governed():
    model = tiny_model()
    with GradualUnfreezing(layers_of(model, ["2", "4"])) as schedule:   # governs the layers' parameters only
        schedule.apply(1)
        assert flags(model) == {"0": [True, True], "2": [False, False], "4": [True, True]}


def test_flags_come_back_after_an_exception():
    model = tiny_model()
    model[0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="boom"):
        with GradualUnfreezing(layers_of(model)) as schedule:
            schedule.apply(1)
            raise RuntimeError("boom")
    assert flags(model) == {"0": [False, True], "2": [True, True], "4": [True, True]}


@pytest.mark.parametrize("layers,exception,pattern", [
    ([], ValueError, "^layers must not be empty$"),
    ("4", TypeError, "^layers must be a list of \\(name, parameters\\), bottom to top, got str$"),
    ([("0", [])], ValueError, "^layers\\[0\\] \\('0'\\) has no parameters$"),
    (lambda m: [("low", list(m[4].parameters())), ("high", [m[4].weight])], ValueError,
     "^layers 'low' and 'high' share a parameter; each parameter must belong to one layer$"),
])
def test_bad_layers(layers, exception, pattern):
    model = tiny_model()
    with pytest.raises(exception, match=pattern):
        GradualUnfreezing(layers(model) if callable(layers) else layers)


def test_bad_rounds():
    schedule = GradualUnfreezing(layers_of(tiny_model()))
    for bad in (0, 4):
        with pytest.raises(ValueError, match=f"^round must be an int in 1 .. 3, got {bad}$"):
            schedule.apply(bad)
        with pytest.raises(ValueError, match=f"^round must be an int in 1 .. 3, got {bad}$"):
            schedule.trainable_layers(bad)
    with pytest.raises(ValueError, match="^round must be an int, got 1.0"):
        schedule.apply(1.0)


# --------------------------------------------------------------------------- fit_tagger_gradually
LABELS = list(data.CONLL2003_TAGS)


def tagger():
    from crfkit.taggers import BiLSTMCRFTagger

    torch.manual_seed(0)
    student = BiLSTMCRFTagger(LABELS, ["<pad>", "<unk>", "eu", "rejects"], embedding_dim=4, hidden_size=4)
    student.freeze_embeddings()   # frozen by design: it must stay frozen in every round
    return student


class StandIn:
    """fit_tagger's stand-in: records the trainable parameters' names of each call, changes them
    (so that a loaded round can be told from a fresh one) and saves the round as fit_tagger does."""

    def __init__(self, fail_in=None):
        self.calls, self.fail_in = [], fail_in

    def __call__(self, tagger, train_items, dev_items, args, objective, cache, hidden_projection, callbacks):
        from safetensors.torch import save_model

        round_ = os.path.basename(args.output_dir)
        if round_ == self.fail_in:
            raise RuntimeError("killed")
        named = [*tagger.named_parameters()] + ([(f"projection.{n}", p) for n, p in
                                                 hidden_projection.named_parameters()] if hidden_projection else [])
        self.calls.append((round_, sorted(name for name, p in named if p.requires_grad), tuple(callbacks)))
        with torch.no_grad():
            for _, parameter in named:
                if parameter.requires_grad:
                    parameter.add_(1.0)
        tagger.save_pretrained(os.path.join(args.output_dir, "model"))
        if hidden_projection is not None:
            save_model(hidden_projection, os.path.join(args.output_dir, "hidden_projection.safetensors"))
        return f"trainer of {round_}"


def make_args(directory):
    return types.SimpleNamespace(output_dir=directory)


def names(student, *prefixes):
    return sorted(name for name, _ in student.named_parameters() if name.startswith(prefixes))


@needs_transformers
def test_fit_tagger_gradually_unfreezes_from_the_top_and_resumes_in_its_round(tmp_path, monkeypatch):
    from crfkit.training import fit_tagger_gradually, trainer as trainer_module

    stand_in = StandIn()
    monkeypatch.setattr(trainer_module, "fit_tagger", stand_in)
    student = tagger()
    before = {name: p.requires_grad for name, p in student.named_parameters()}
    assert [name for name, _ in student.layer_groups()] == ["input", "lstm", "output"]
    marker = object()
    result = fit_tagger_gradually(student, [], [], make_args, str(tmp_path), callbacks=[marker])
    output, lstm, casing = names(student, "head.", "crf."), names(student, "lstm."), names(student, "casing.")
    assert stand_in.calls == [("unfreeze1", output, (marker,)),
                              ("unfreeze2", sorted(lstm + output), (marker,)),
                              ("unfreeze3", sorted(casing + lstm + output), (marker,))]
    assert result == "trainer of unfreeze3" and sorted(os.listdir(tmp_path)) == ["unfreeze1", "unfreeze2", "unfreeze3"]
    assert {name: p.requires_grad for name, p in student.named_parameters()} == before
    assert not student.word_embedding.weight.requires_grad
    # a run killed in round 3 resumes there: rounds 1 and 2 are loaded, not trained again
    trained = {name: p.detach().clone() for name, p in student.named_parameters()}
    (tmp_path / "unfreeze3" / "model" / "config.json").unlink()
    stand_in.calls.clear()
    fresh = tagger()
    assert fit_tagger_gradually(fresh, [], [], make_args, str(tmp_path)) == "trainer of unfreeze3"
    assert stand_in.calls == [("unfreeze3", sorted(casing + lstm + output), ())]
    for name, parameter in fresh.named_parameters():
        assert torch.equal(parameter, trained[name]), name
    # every round done: the last one's weights are loaded and nothing trains
    stand_in.calls.clear()
    again = tagger()
    assert fit_tagger_gradually(again, [], [], make_args, str(tmp_path)) is None and stand_in.calls == []
    for name, parameter in again.named_parameters():
        assert torch.equal(parameter, trained[name]), name


@needs_transformers
def test_the_hidden_loss_stage_puts_its_projection_on_top_and_leaves_the_output_layer_out(tmp_path, monkeypatch):
    from crfkit.training import ObjectiveConfig, fit_tagger_gradually, trainer as trainer_module

    stand_in = StandIn()
    monkeypatch.setattr(trainer_module, "fit_tagger", stand_in)
    student, projection = tagger(), distill.GeluProjectionLoss(8, 3)
    fit_tagger_gradually(student, [], [], make_args, str(tmp_path), objective=ObjectiveConfig(("hidden",)),
                         hidden_projection=projection)
    projected = ["projection.projection.bias", "projection.projection.weight"]
    lstm, casing = names(student, "lstm."), names(student, "casing.")
    assert [trainable for _, trainable, _ in stand_in.calls] == [projected, sorted(lstm + projected),
                                                                 sorted(casing + lstm + projected)]
    assert all(p.requires_grad for p in [*student.head.parameters(), *projection.parameters()])
    fresh_projection = distill.GeluProjectionLoss(8, 3)
    assert fit_tagger_gradually(tagger(), [], [], make_args, str(tmp_path), objective=ObjectiveConfig(("hidden",)),
                                hidden_projection=fresh_projection) is None
    assert torch.equal(fresh_projection.projection.weight, projection.projection.weight)
    with pytest.raises(ValueError, match="^the hidden loss needs hidden_projection$"):
        fit_tagger_gradually(tagger(), [], [], make_args, str(tmp_path / "x"), objective=ObjectiveConfig(("hidden",)))


@needs_transformers
def test_fit_tagger_gradually_restores_the_flags_when_a_round_fails(tmp_path, monkeypatch):
    from crfkit.training import fit_tagger_gradually, trainer as trainer_module

    monkeypatch.setattr(trainer_module, "fit_tagger", StandIn(fail_in="unfreeze2"))
    student = tagger()
    before = {name: p.requires_grad for name, p in student.named_parameters()}
    with pytest.raises(RuntimeError, match="killed"):
        fit_tagger_gradually(student, [], [], make_args, str(tmp_path))
    assert {name: p.requires_grad for name, p in student.named_parameters()} == before
    assert sorted(os.listdir(tmp_path)) == ["unfreeze1"]
