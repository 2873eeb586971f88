"""Stage-wise training with gradual unfreezing, over any nn.Module, after the multi-stage
distillation paper (Mukherjee and Awadallah, *Multi-Stage Distillation Framework for Massive
Multi-lingual NER*, 2020; docs/METHODS.md has the references).

Within a stage (Algorithm 1 of the multi-stage paper): every parameter of the model is frozen;
then the listed layers are unfrozen one at a time from the TOP (the output side) down, and each
time the model is trained with everything unfrozen so far, a layer staying trainable once
unfrozen. After each layer's training the best model seen so far in the stage, by a
validation score, is restored, so a stage never ends worse than its best point.

    layers = ["embedding", "bilstm", "projection", "regression_head"]   # bottom to top
    history = gradual_unfreezing(student, layers, train_one_epoch, validation_score,
                                 rounds_per_layer=3)

    history = stagewise_training(student, [
        Stage("representation", train_rl, ["embedding", "bilstm", "projection"]),
        Stage("logits", train_ll, ["embedding", "bilstm", "projection", "regression_head"]),
        Stage("labels", train_ce, ["embedding", "bilstm", "projection", "softmax_head"]),
    ], evaluate_fn=validation_score)

The callables:
    train_fn(model, trainable_parameters) -> None    trains the model once (one epoch, or n);
        trainable_parameters is the list of parameters that currently require grad: build the
        optimizer over it (only those change; frozen ones get no gradient).
    evaluate_fn(model) -> float                      a validation score, HIGHER is better
        (return -loss for a validation loss, as the multi-stage paper does; F1 works as it
        is). NaN never counts as best. Set model.eval() / model.train() inside them as needed:
        this helper does not change the module's training mode.
"""
from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .._validation import check_int

__all__ = ["UnfreezingRound", "Stage", "gradual_unfreezing", "stagewise_training"]

TrainFn = Callable[[nn.Module, List[nn.Parameter]], None]
EvaluateFn = Callable[[nn.Module], float]
LayerSpec = Union[str, nn.Module, nn.Parameter, Sequence[Union[str, nn.Module, nn.Parameter]]]


@dataclass(frozen=True)
class UnfreezingRound:
    """One evaluation in gradual unfreezing.

    stage: the stage's name (None outside stagewise_training).
    layer: the layer most recently unfrozen; None for the evaluation of the starting point.
    round: 0-based index of the train_fn call for this layer; -1 for the starting point.
    trainable_layers: every layer trainable during that round, top first.
    score: evaluate_fn after that round.
    best_score: the best score in the stage so far, this round included.
    restored: True on a layer's last round when the model was then reset to an earlier,
        better checkpoint (False when this round's model is the best, and on other rounds).
    """

    stage: Optional[str]
    layer: Optional[str]
    round: int
    trainable_layers: Tuple[str, ...]
    score: float
    best_score: float
    restored: bool = False


@dataclass
class Stage:
    """One stage of stagewise_training: a name, a loss-specific train_fn, and optionally its own
    layers (bottom to top; default: stagewise_training's layers) and evaluate_fn."""

    name: str
    train_fn: TrainFn
    layers: Optional[Sequence[LayerSpec]] = None
    evaluate_fn: Optional[EvaluateFn] = field(default=None)


def _layer_name(model: nn.Module, item, index: int) -> str:
    if not isinstance(item, (str, nn.Module, nn.Parameter)):
        raise TypeError(f"layers[{index}] must be a name, an nn.Module, an nn.Parameter or a list of them, "
                        f"got {type(item).__name__}")
    if isinstance(item, str):
        return item
    for name, module in model.named_modules():
        if module is item:
            return name or type(item).__name__
    for name, parameter in model.named_parameters():
        if parameter is item:
            return name
    kind = "parameter" if isinstance(item, nn.Parameter) else f"module {type(item).__name__}"
    raise ValueError(f"layers: the {kind} given is not part of the model")


def _layer_parameters(model: nn.Module, item, index: int) -> List[nn.Parameter]:
    if isinstance(item, str):
        try:
            return list(model.get_submodule(item).parameters())
        except AttributeError:
            pass
        try:
            return [model.get_parameter(item)]
        except AttributeError:
            raise ValueError(f"layers[{index}] = {item!r} names neither a submodule "
                             "nor a parameter of the model") from None
    if isinstance(item, nn.Parameter):
        return [item]
    return list(item.parameters())  # an nn.Module, checked by _layer_name


def _resolve_layers(model: nn.Module, layers) -> List[Tuple[str, List[nn.Parameter]]]:
    """[(name, parameters)] bottom to top; a list item groups several modules into one layer."""
    if isinstance(layers, (str, nn.Module)) or not isinstance(layers, (list, tuple)):
        raise TypeError(f"layers must be a list or tuple (bottom to top), got {type(layers).__name__}")
    if len(layers) == 0:
        raise ValueError("layers must not be empty")
    model_parameters = {id(p) for p in model.parameters()}
    owner: Dict[int, str] = {}
    resolved = []
    for index, item in enumerate(layers):
        parts = list(item) if isinstance(item, (list, tuple)) else [item]
        if not parts:
            raise ValueError(f"layers[{index}] is an empty group")
        name = "+".join(_layer_name(model, part, index) for part in parts)
        parameters = []
        for part in parts:
            for parameter in _layer_parameters(model, part, index):
                if id(parameter) not in model_parameters:
                    raise ValueError(f"layers[{index}] ({name}) holds a parameter that is not part of the model")
                if id(parameter) in owner:
                    if owner[id(parameter)] == name:
                        continue  # a group may name a module and one of its parameters
                    raise ValueError(f"layers {owner[id(parameter)]!r} and {name!r} share a parameter; "
                                     f"each parameter must belong to one layer (group tied modules together)")
                owner[id(parameter)] = name
                parameters.append(parameter)
        if not parameters:
            raise ValueError(f"layers[{index}] ({name}) has no parameters")
        resolved.append((name, parameters))
    return resolved


class _BestCheckpoint:
    """The best model state seen so far: a copy in memory, or a file written atomically (so a
    crash while saving never destroys the previous best)."""

    def __init__(self, path: Optional[Union[str, os.PathLike]]):
        self.path = os.fspath(path) if path is not None else None
        self.state = None

    def save(self, model: nn.Module) -> None:
        if self.path is None:
            # state_dict() returns references to the live tensors: copy them.
            self.state = {key: value.detach().clone() for key, value in model.state_dict().items()}
            return
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        temporary = f"{self.path}.tmp-{os.getpid()}"  # one per process: ranks may save at once
        torch.save(model.state_dict(), temporary)
        os.replace(temporary, self.path)

    def restore(self, model: nn.Module) -> None:
        # load_state_dict copies in place: requires_grad flags and optimizer references stay valid.
        if self.path is None:
            model.load_state_dict(self.state)
        else:
            model.load_state_dict(torch.load(self.path, map_location="cpu", weights_only=True))


def _score(evaluate_fn: EvaluateFn, model: nn.Module) -> float:
    value = evaluate_fn(model)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"evaluate_fn must return a number (higher is better), got {type(value).__name__}") from None


def gradual_unfreezing(model: nn.Module, layers: Sequence[LayerSpec], train_fn: TrainFn, evaluate_fn: EvaluateFn,
                       rounds_per_layer: int = 1, checkpoint_path: Optional[Union[str, os.PathLike]] = None,
                       stage: Optional[str] = None) -> List[UnfreezingRound]:
    """The multi-stage paper's gradual unfreezing (section 5.3), one stage.

    Args:
        model: any nn.Module.
        layers: its layers from BOTTOM (input side, e.g. word embeddings) to TOP (the output
            head); each a submodule name ("encoder.lstm"), a parameter name ("crf.transitions"),
            an nn.Module or nn.Parameter of the model, or a list of those forming one layer.
            No parameter may belong to two layers.
        train_fn: train_fn(model, trainable_parameters), see the module docstring.
        evaluate_fn: evaluate_fn(model) -> score, higher is better.
        rounds_per_layer: train_fn calls per unfrozen layer, each followed by an evaluation
            (the multi-stage paper tunes each layer for n epochs and keeps the best of any of
            them).
        checkpoint_path: keep the best state in this file instead of in memory.
        stage: a name recorded in the history.

    Steps: freeze every parameter of the model (parameters of no listed layer stay frozen
    for the whole stage); evaluate the starting point, which is the first best; then for each
    layer from the top: unfreeze it, run rounds_per_layer rounds of train_fn + evaluate_fn
    (a strictly higher score becomes the best, saved), and restore the best state if the last
    round's is not it. The state restored is the whole state_dict (buffers included); the
    optimizer's state is train_fn's business.

    Gradients left in .grad from earlier training are cleared at the start. On return (or
    exception) every parameter's requires_grad is what it was before the call. On return the
    model holds the best state of the stage. Returns the history, one UnfreezingRound per
    evaluation, the starting point first.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    resolved = _resolve_layers(model, layers)
    if not callable(train_fn):
        raise TypeError(f"train_fn must be callable, got {type(train_fn).__name__}")
    if not callable(evaluate_fn):
        raise TypeError(f"evaluate_fn must be callable, got {type(evaluate_fn).__name__}")
    rounds_per_layer = check_int("rounds_per_layer", rounds_per_layer, minimum=1)

    all_parameters = list(model.parameters())
    original_flags = [p.requires_grad for p in all_parameters]
    checkpoint = _BestCheckpoint(checkpoint_path)
    history: List[UnfreezingRound] = []
    try:
        for parameter in all_parameters:
            parameter.requires_grad_(False)
            # A stale gradient on a frozen parameter would still be applied by an optimizer
            # that holds every parameter of the model.
            parameter.grad = None
        initial_score = _score(evaluate_fn, model)
        checkpoint.save(model)
        best_score = -math.inf if math.isnan(initial_score) else initial_score  # a NaN start is beaten by anything
        history.append(UnfreezingRound(stage, None, -1, (), initial_score, best_score))

        trainable_layers: List[str] = []
        for name, parameters in reversed(resolved):
            for parameter in parameters:
                parameter.requires_grad_(True)
            trainable_layers.append(name)  # top first, as they are unfrozen
            trainable_parameters = [p for p in all_parameters if p.requires_grad]
            current_is_best = False
            for round_index in range(rounds_per_layer):
                train_fn(model, trainable_parameters)
                score = _score(evaluate_fn, model)
                current_is_best = score > best_score
                if current_is_best:
                    best_score = score
                    checkpoint.save(model)
                restored = round_index == rounds_per_layer - 1 and not current_is_best
                history.append(UnfreezingRound(stage, name, round_index, tuple(trainable_layers),
                                               score, best_score, restored))
            if not current_is_best:
                checkpoint.restore(model)
    finally:
        for parameter, flag in zip(all_parameters, original_flags):
            parameter.requires_grad_(flag)
    return history


def stagewise_training(model: nn.Module, stages: Sequence[Union[Stage, tuple]],
                       layers: Optional[Sequence[LayerSpec]] = None, evaluate_fn: Optional[EvaluateFn] = None,
                       rounds_per_layer: int = 1,
                       checkpoint_dir: Optional[Union[str, os.PathLike]] = None) -> List[UnfreezingRound]:
    """The multi-stage paper's stage-wise distillation (section 5.2, Algorithm 1): stages run in
    order, each with gradual_unfreezing, each starting from the model the previous one left (its
    best).

    The multi-stage paper's three stages are L_RL (representation loss on unlabelled data), L_LL
    (logit loss on unlabelled data) and L_CE (cross entropy on labelled data); here a stage is any
    Stage(name, train_fn, layers=None, evaluate_fn=None), or a tuple of those fields in that
    order ((name, train_fn) is enough when `layers` and `evaluate_fn` are given here).

    Args:
        model: any nn.Module.
        stages: the stages, in order; names must be distinct.
        layers: default layers (bottom to top) for stages that give none.
        evaluate_fn: default score for stages that give none (higher is better).
        rounds_per_layer: as in gradual_unfreezing.
        checkpoint_dir: keep each stage's best state in <checkpoint_dir>/<stage name>.pt
            instead of in memory.

    Returns the concatenated history; each UnfreezingRound names its stage. The best score
    is tracked per stage (each stage has its own objective and may have its own score).
    """
    if isinstance(stages, (str, Stage)) or not isinstance(stages, (list, tuple)):
        raise TypeError(f"stages must be a list or tuple of Stage (or tuples), got {type(stages).__name__}")
    if len(stages) == 0:
        raise ValueError("stages must not be empty")
    resolved_stages: List[Stage] = []
    for index, item in enumerate(stages):
        if isinstance(item, tuple):
            if not 2 <= len(item) <= 4:
                raise ValueError(f"stages[{index}] must be (name, train_fn[, layers[, evaluate_fn]]), "
                                 f"got a tuple of {len(item)}")
            item = Stage(*item)
        if not isinstance(item, Stage):
            raise TypeError(f"stages[{index}] must be a Stage or a tuple, got {type(item).__name__}")
        if not isinstance(item.name, str) or not item.name:
            raise ValueError(f"stages[{index}] needs a non-empty name, got {item.name!r}")
        stage = copy.copy(item)
        stage.layers = item.layers if item.layers is not None else layers
        stage.evaluate_fn = item.evaluate_fn if item.evaluate_fn is not None else evaluate_fn
        if stage.layers is None:
            raise ValueError(f"stage {stage.name!r} has no layers: give them in the stage or as `layers`")
        if stage.evaluate_fn is None:
            raise ValueError(f"stage {stage.name!r} has no evaluate_fn: give it in the stage or as `evaluate_fn`")
        resolved_stages.append(stage)
    names = [stage.name for stage in resolved_stages]
    if len(set(names)) != len(names):
        raise ValueError(f"stage names must be distinct, got {names}")
    # Check every stage's layers before any training starts, not when its turn comes.
    for stage in resolved_stages:
        _resolve_layers(model, stage.layers)

    if checkpoint_dir is not None:
        for name in names:
            if os.sep in name or (os.altsep and os.altsep in name) or name in (".", ".."):
                raise ValueError(f"stage name {name!r} cannot name a file in checkpoint_dir")

    history: List[UnfreezingRound] = []
    for stage in resolved_stages:
        path = os.path.join(os.fspath(checkpoint_dir), f"{stage.name}.pt") if checkpoint_dir is not None else None
        history.extend(gradual_unfreezing(model, stage.layers, stage.train_fn, stage.evaluate_fn,
                                          rounds_per_layer=rounds_per_layer, checkpoint_path=path,
                                          stage=stage.name))
    return history
