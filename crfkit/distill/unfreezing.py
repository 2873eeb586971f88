"""The gradual-unfreezing schedule of the multi-stage distillation paper (Mukherjee and Awadallah,
*Multi-Stage Distillation Framework for Massive Multi-lingual NER*, 2020, Algorithm 1;
docs/METHODS.md section 5.2): freeze everything, then unfreeze the layers one at a time from the
TOP (the output side) down, a layer staying trainable once unfrozen. Round r trains the top r
layers.

This module holds only the schedule (which parameters train in which round); training each round
to its best validation score, and resuming, is crfkit.training.fit_tagger_gradually's, over
transformers' Trainer:

    schedule = GradualUnfreezing(tagger.layer_groups(), tagger.parameters())
    with schedule:                                # every requires_grad flag comes back on exit
        for round_ in range(1, len(schedule) + 1):
            trainable = schedule.apply(round_)    # the top round_ layers; all else frozen
            ...                                   # train them, keep the round's best
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

from .._validation import check_int

__all__ = ["GradualUnfreezing"]


class GradualUnfreezing:
    """Which parameters train in each round of gradual unfreezing.

    layers: [(name, parameters)] from the BOTTOM (input side) to the TOP (output side), the shape
        of a crfkit tagger's layer_groups(); every layer holds at least one parameter, and no
        parameter belongs to two layers.
    parameters: every parameter the schedule governs (the layers' own are always included).
        Those in no layer are frozen in every round: parameters frozen by design (a TE table), or
        a head the stage's loss does not train.

    apply(r) for r in 1 .. len(self): the top r layers train, every other governed parameter is
    frozen; returns the trainable parameters. Used as a context manager, it restores every
    governed parameter's requires_grad flag on exit, after an exception too.
    """

    def __init__(self, layers: Sequence[tuple[str, Sequence[nn.Parameter]]],
                 parameters: Iterable[nn.Parameter] = ()):
        if not isinstance(layers, (list, tuple)):
            raise TypeError(f"layers must be a list of (name, parameters), bottom to top, got {type(layers).__name__}")
        if not layers:
            raise ValueError("layers must not be empty")
        owner: dict[int, str] = {}
        self.layers: list[tuple[str, list[nn.Parameter]]] = []
        for index, (name, layer_parameters) in enumerate(layers):
            layer_parameters = list(layer_parameters)
            if not layer_parameters:
                raise ValueError(f"layers[{index}] ({name!r}) has no parameters")
            for parameter in layer_parameters:
                if id(parameter) in owner:
                    raise ValueError(f"layers {owner[id(parameter)]!r} and {name!r} share a parameter; each "
                                     "parameter must belong to one layer")
                owner[id(parameter)] = name
            self.layers.append((name, layer_parameters))
        governed = [p for _, layer_parameters in self.layers for p in layer_parameters] + list(parameters)
        self.parameters: list[nn.Parameter] = list({id(p): p for p in governed}.values())
        self._saved_flags: list[bool] = []

    def __len__(self) -> int:
        """The number of rounds: one per layer."""
        return len(self.layers)

    def trainable_layers(self, round_: int) -> tuple[str, ...]:
        """The names of the layers that train in round round_ (1-based), top first."""
        round_ = check_int("round", round_, minimum=1, maximum=len(self.layers), type_error=ValueError)
        return tuple(name for name, _ in reversed(self.layers[-round_:]))

    def apply(self, round_: int) -> list[nn.Parameter]:
        """Set requires_grad for round round_ (1-based): True on the top round_ layers' parameters,
        False on every other governed one. Returns the trainable parameters (for an optimizer)."""
        round_ = check_int("round", round_, minimum=1, maximum=len(self.layers), type_error=ValueError)
        trainable = {id(p) for _, layer_parameters in self.layers[-round_:] for p in layer_parameters}
        for parameter in self.parameters:
            parameter.requires_grad_(id(parameter) in trainable)
        return [p for p in self.parameters if id(p) in trainable]

    def __enter__(self) -> "GradualUnfreezing":
        self._saved_flags = [p.requires_grad for p in self.parameters]
        return self

    def __exit__(self, *exception) -> None:
        for parameter, flag in zip(self.parameters, self._saved_flags):
            parameter.requires_grad_(flag)
