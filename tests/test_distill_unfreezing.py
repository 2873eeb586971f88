"""Seed 002's gradual unfreezing and stage-wise training (crfkit.distill.unfreezing) on a tiny
nn.Sequential: freeze states at every step, best-checkpoint restoration, stages."""
import math

import pytest
import torch
from torch import nn

from crfkit.distill.unfreezing import Stage, UnfreezingRound, gradual_unfreezing, stagewise_training


pytestmark = pytest.mark.usefixtures("one_thread")


LAYERS = ["0", "2", "4"]  # bottom to top


def tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def data(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 3, generator=g)
    return x, torch.stack([x.sum(-1), x[:, 0] * x[:, 1]], -1)


TRAIN, VALID = data(1), data(2)


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_state_equal(model, state):
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


def sgd_step(parameters, loss, lr=0.1):
    """Plain gradient descent (torch.optim's first step imports torch._dynamo: seconds)."""
    gradients = torch.autograd.grad(loss, parameters)
    with torch.no_grad():
        for parameter, gradient in zip(parameters, gradients):
            parameter -= lr * gradient


def sgd_epoch(model, trainable_parameters, steps=5):
    """A real training step on the synthetic data; frozen parameters must get no gradient."""
    x, y = TRAIN
    for _ in range(steps):
        for p in model.parameters():
            assert p.grad is None
        loss = nn.functional.mse_loss(model(x), y)
        assert set(map(id, trainable_parameters)) == {id(p) for p in model.parameters() if p.requires_grad}
        sgd_step(trainable_parameters, loss)


def validation_score(model):
    with torch.no_grad():
        x, y = VALID
        return -nn.functional.mse_loss(model(x), y).item()


def layer_flags(model):
    return {name: all(p.requires_grad for p in model.get_submodule(name).parameters()) for name in LAYERS}


def test_freeze_states_top_layer_first_and_flags_restored():
    model = tiny_model()
    model[2].bias.requires_grad_(False)  # a caller's own setting, which must come back
    seen = []

    def train_fn(m, trainable_parameters):
        seen.append((layer_flags(m), [id(p) for p in trainable_parameters]))
        assert all(p.requires_grad for p in trainable_parameters)
        assert len(trainable_parameters) == sum(p.requires_grad for p in m.parameters())
        sgd_epoch(m, trainable_parameters, steps=1)

    history = gradual_unfreezing(model, LAYERS, train_fn, validation_score)
    assert [flags for flags, _ in seen] == [
        {"0": False, "2": False, "4": True},
        {"0": False, "2": True, "4": True},
        {"0": True, "2": True, "4": True},
    ]
    expected_ids = [[id(model[4].weight), id(model[4].bias)],
                    [id(model[2].weight), id(model[2].bias), id(model[4].weight), id(model[4].bias)],
                    [id(p) for p in model.parameters()]]
    assert [ids for _, ids in seen] == expected_ids
    assert [(r.layer, r.round, r.trainable_layers) for r in history] == [
        (None, -1, ()), ("4", 0, ("4",)), ("2", 0, ("4", "2")), ("0", 0, ("4", "2", "0"))]
    assert all(isinstance(r, UnfreezingRound) and r.stage is None for r in history)
    assert [p.requires_grad for p in model.parameters()] == [True, True, True, False, True, True]


def test_best_checkpoint_is_restored_after_each_layer():
    model = tiny_model()
    scores = iter([0.1, 0.5, 0.3, 0.2])  # start, after layer 4 (best), after 2, after 0
    states = []
    calls = []

    def evaluate_fn(m):
        states.append(snapshot(m))
        return next(scores)

    def train_fn(m, trainable_parameters):
        calls.append(len(calls))
        if len(calls) >= 2:
            # Training after the worse layer-2 round starts from the restored best state.
            assert_state_equal(m, states[1])
        sgd_epoch(m, trainable_parameters)

    history = gradual_unfreezing(model, LAYERS, train_fn, evaluate_fn)
    assert [r.score for r in history] == [0.1, 0.5, 0.3, 0.2]
    assert [r.best_score for r in history] == [0.1, 0.5, 0.5, 0.5]
    assert [r.restored for r in history] == [False, False, True, True]
    # The weights really changed in the worse rounds, and the best ones came back.
    assert not torch.equal(states[2]["2.weight"], states[1]["2.weight"])
    assert_state_equal(model, states[1])


@pytest.mark.parametrize("in_memory", [True, False])
def test_several_rounds_per_layer_keep_the_best_round(in_memory, tmp_path):
    model = tiny_model()
    # start; layer 4: rounds 0, 1; layer 2: rounds 0, 1; layer 0: rounds 0, 1
    scores = iter([0.0, 0.2, 0.4, 0.7, 0.6, 0.65, 0.69])
    states = []

    def evaluate_fn(m):
        states.append(snapshot(m))
        return next(scores)

    path = None if in_memory else tmp_path / "ckpt" / "best.pt"
    history = gradual_unfreezing(model, LAYERS, sgd_epoch, evaluate_fn, rounds_per_layer=2, checkpoint_path=path)
    assert [(r.layer, r.round) for r in history][1:] == [("4", 0), ("4", 1), ("2", 0), ("2", 1), ("0", 0), ("0", 1)]
    assert [r.restored for r in history] == [False, False, False, False, True, False, True]
    assert history[-1].best_score == 0.7
    assert_state_equal(model, states[3])  # layer 2, round 0
    if not in_memory:
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["best.pt"]  # no temporary left


def test_never_worse_than_the_start_and_nan_never_best():
    model = tiny_model()
    start = snapshot(model)
    scores = iter([1.0, float("nan"), 0.5, -3.0])
    history = gradual_unfreezing(model, LAYERS, sgd_epoch, lambda m: next(scores))
    assert [r.best_score for r in history] == [1.0, 1.0, 1.0, 1.0]
    assert_state_equal(model, start)

    model = tiny_model()
    scores = iter([float("nan"), 0.5, float("nan"), 0.1])
    history = gradual_unfreezing(model, LAYERS, sgd_epoch, lambda m: next(scores))
    assert math.isnan(history[0].score) and history[1].best_score == 0.5


def test_real_training_improves_validation():
    model = tiny_model()
    history = gradual_unfreezing(model, LAYERS, sgd_epoch, validation_score, rounds_per_layer=2)
    assert history[-1].best_score > history[0].score
    assert validation_score(model) == pytest.approx(max(r.score for r in history))


def test_layers_given_as_modules_parameters_and_groups():
    model = tiny_model()
    seen = []
    layers = [[model[0], "2"], "4.weight", model[4].bias]
    history = gradual_unfreezing(model, layers, lambda m, ps: seen.append(len(ps)), lambda m: 0.0)
    assert seen == [1, 2, 6]
    assert [r.layer for r in history[1:]] == ["4.bias", "4.weight", "0+2"]


def test_flags_restored_when_training_fails():
    model = tiny_model()

    def failing(m, ps):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        gradual_unfreezing(model, LAYERS, failing, lambda m: 0.0)
    assert all(p.requires_grad for p in model.parameters())


def test_stagewise_training_runs_stages_in_order_with_their_layers():
    model = nn.Sequential()
    model.add_module("embed", nn.Linear(3, 4))
    model.add_module("encoder", nn.Linear(4, 4))
    model.add_module("regression_head", nn.Linear(4, 2))
    model.add_module("softmax_head", nn.Linear(4, 2))
    order = []

    def forward(m, x):
        h = torch.tanh(m.encoder(torch.tanh(m.embed(x))))
        return m.regression_head(h), m.softmax_head(h)

    def trainer(stage_name, head_index):
        def train_fn(m, trainable_parameters):
            order.append((stage_name, sorted(n for n, p in m.named_parameters() if p.requires_grad)))
            x, y = TRAIN
            for _ in range(3):
                sgd_step(trainable_parameters, nn.functional.mse_loss(forward(m, x)[head_index], y))
        return train_fn

    def scorer(head_index):
        def evaluate_fn(m):
            with torch.no_grad():
                x, y = VALID
                return -nn.functional.mse_loss(forward(m, x)[head_index], y).item()
        return evaluate_fn

    history = stagewise_training(model, [
        ("logits", trainer("logits", 0), ["embed", "encoder", "regression_head"]),
        Stage("labels", trainer("labels", 1), ["embed", "encoder", "softmax_head"], scorer(1)),
    ], evaluate_fn=scorer(0), rounds_per_layer=1)
    assert [stage for stage, _ in order] == ["logits"] * 3 + ["labels"] * 3
    assert order[0][1] == ["regression_head.bias", "regression_head.weight"]
    assert order[3][1] == ["softmax_head.bias", "softmax_head.weight"]
    assert "softmax_head.weight" not in order[2][1]  # unlisted in stage 1: frozen throughout
    assert [r.stage for r in history] == ["logits"] * 4 + ["labels"] * 4
    # The best is tracked per stage: stage 2 starts from its own evaluation of the model.
    assert history[4].layer is None and history[4].best_score == history[4].score
    assert scorer(1)(model) == pytest.approx(max(r.score for r in history[4:]))
    assert all(p.requires_grad for p in model.parameters())


def test_stagewise_checkpoint_dir(tmp_path):
    model = tiny_model()
    stagewise_training(model, [("one", sgd_epoch), ("two", sgd_epoch)], layers=LAYERS,
                       evaluate_fn=validation_score, checkpoint_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.pt", "two.pt"]


@pytest.mark.parametrize("layers,exception,pattern", [
    ([], ValueError, "layers must not be empty"),
    ("4", TypeError, "layers must be a list or tuple"),
    (["0", "nope"], ValueError, "layers\\[1\\] = 'nope' names neither a submodule nor a parameter"),
    (["1"], ValueError, "has no parameters"),
    (["0", "4", "4.weight"], ValueError, "share a parameter"),
    ([nn.Linear(2, 2)], ValueError, "not part of the model"),
    ([3], TypeError, "layers\\[0\\] must be a name"),
])
def test_bad_layers(layers, exception, pattern):
    with pytest.raises(exception, match=pattern):
        gradual_unfreezing(tiny_model(), layers, sgd_epoch, validation_score)


def test_bad_arguments():
    model = tiny_model()
    with pytest.raises(ValueError, match="rounds_per_layer must be a positive int, got 0"):
        gradual_unfreezing(model, LAYERS, sgd_epoch, validation_score, rounds_per_layer=0)
    with pytest.raises(TypeError, match="train_fn must be callable"):
        gradual_unfreezing(model, LAYERS, None, validation_score)
    with pytest.raises(TypeError, match="evaluate_fn must return a number"):
        gradual_unfreezing(model, LAYERS, sgd_epoch, lambda m: "good")
    with pytest.raises(ValueError, match="stage names must be distinct"):
        stagewise_training(model, [("a", sgd_epoch), ("a", sgd_epoch)], LAYERS, validation_score)
    with pytest.raises(ValueError, match="stage 'a' has no layers"):
        stagewise_training(model, [("a", sgd_epoch)], evaluate_fn=validation_score)
    with pytest.raises(ValueError, match="stage 'a' has no evaluate_fn"):
        stagewise_training(model, [("a", sgd_epoch)], LAYERS)
    with pytest.raises(ValueError, match="stages must not be empty"):
        stagewise_training(model, [], LAYERS, validation_score)
    with pytest.raises(ValueError, match="names neither"):  # checked before any stage trains
        stagewise_training(model, [("a", sgd_epoch), ("b", sgd_epoch, ["x"])], LAYERS, validation_score)
    with pytest.raises(ValueError, match="cannot name a file"):
        stagewise_training(model, [("a/b", sgd_epoch)], LAYERS, validation_score, checkpoint_dir="/tmp")
