"""What every crfkit tagger shares: a CRF over word-level emissions, saving and loading as a folder,
decoding, and predict() on token lists.

A tagger is an nn.Module with
    featurize(token_lists) -> dict of tensors   the model's inputs for B sentences, always with
                                                "lengths" (B,) int64 (the words of each sentence)
    word_features(batch) -> (B, L, D)           the last word-level features before the linear
                                                layer (what hidden-state distillation reads)
    emissions(batch) -> (B, L, T)               word-level scores, L = max(lengths)
    layer_groups() -> [(name, parameters)]      trainable layers, bottom to top (gradual unfreezing)
    forward(tags=None, **batch) -> dict         {"emissions", and "loss" (mean CRF NLL) if tags}
and the CRF ops on top (decode, kbest, marginals). The Trainer feeds forward() the collated
batches of crfkit.training; predict() is the user's entry point.

A saved tagger is a folder: config.json (the class, every constructor argument, the labels, the
temperature), model.safetensors (the weights) and the class's own extra files (vocabulary,
tokenizer). Loading reads JSON and safetensors only: nothing is unpickled.

Confidence: predict(..., confidence=True) gives each entity its exact probability under the CRF
(crfkit.entities) with every score divided by the tagger's temperature (1.0 unless set, or fitted
on validation data by calibrate(); saved in config.json, and a folder saved without one loads
with 1.0). The temperature never changes the tags predict returns.
"""
from __future__ import annotations

import inspect
import json
import os
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

from .._files import read_json
from .._validation import check_bool, check_int, check_number
from ..constraints import SCHEMES, allowed_transitions
from ..functional import KBest
from ..nn import CRF

__all__ = ["CRFTagger", "load_tagger", "TAGGER_FORMAT"]

TAGGER_FORMAT = "crfkit-tagger"
TAGGER_FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_REGISTRY: dict[str, type] = {}


def _check_token_lists(token_lists) -> list[list[str]]:
    if isinstance(token_lists, (str, bytes)) or not isinstance(token_lists, Sequence):
        raise TypeError("token_lists must be a list of sentences, each a list of word strings "
                        f"(got {type(token_lists).__name__})")
    checked = []
    for i, tokens in enumerate(token_lists):
        if isinstance(tokens, str) or not isinstance(tokens, Sequence):
            raise TypeError(f"token_lists[{i}] must be a list of word strings, got {type(tokens).__name__}; "
                            "split sentences into words first (e.g. text.split())")
        for word in tokens:
            if not isinstance(word, str) or word == "":
                raise ValueError(f"token_lists[{i}] holds {word!r}; every word must be a non-empty str")
        checked.append(list(tokens))
    return checked


def sentence_preview(tokens: Sequence[str], words: int = 8) -> str:
    """The first words of a sentence, quoted, for error messages."""
    text = " ".join(tokens[:words]) + (" ..." if len(tokens) > words else "")
    return repr(text if len(text) <= 100 else text[:100] + "...")


class CRFTagger(nn.Module):
    """Base class: labels (T names), the tagging scheme's constraints and a crfkit.CRF.

    labels: the T tag names, e.g. crfkit.data.CONLL2003_TAGS.
    scheme: "BIO" (IOB2), "IOB1", "BIOES" or "BMES": forbidden transitions are -inf in training and
        decoding alike; None for an unconstrained CRF.
    """

    _temperature = 1.0  # (a class default too, for subclasses built without CRFTagger.__init__)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _REGISTRY[cls.__name__] = cls

    def __init__(self, labels: Sequence[str], scheme: Optional[str] = "BIO"):
        super().__init__()
        if isinstance(labels, str) or not isinstance(labels, Sequence) or len(labels) < 1:
            raise ValueError(f"labels must be a non-empty list of tag names, got {labels!r}")
        if len(set(labels)) != len(labels):
            raise ValueError(f"labels must be distinct, got {list(labels)}")
        self.labels = [str(label) for label in labels]
        self.scheme = scheme
        constraints = allowed_transitions(self.labels, scheme) if scheme is not None else None
        self.crf = CRF(len(self.labels), constraints=constraints)
        self._temperature = 1.0

    # ------------------------------------------------------------------ to implement
    def featurize(self, token_lists: Sequence[Sequence[str]]) -> dict[str, Tensor]:
        raise NotImplementedError

    def word_features(self, batch: Mapping[str, Tensor]) -> Tensor:
        """(B, L, D): the word-level features the linear layer reads."""
        raise NotImplementedError

    def emissions_from_features(self, features: Tensor) -> Tensor:
        """(B, L, D) word_features -> (B, L, T) emissions (dropout, then the linear layer)."""
        raise NotImplementedError

    def layer_groups(self) -> list[tuple[str, list[nn.Parameter]]]:
        """The trainable parameters in layers, bottom (input side) to top (the linear layer and
        CRF), for gradual unfreezing; parameters frozen by design (a TE table) are left out."""
        raise NotImplementedError

    def emissions_and_hidden(self, batch: Mapping[str, Tensor], layer: int) -> tuple[Tensor, Tensor]:
        """(emissions (B, L, T), hidden layer `layer` per word (B, L, H)) in one forward pass."""
        raise NotImplementedError(f"{type(self).__name__} has no hidden layers to distil from")

    def emissions(self, batch: Mapping[str, Tensor]) -> Tensor:
        """(B, L, T) word-level emissions."""
        return self.emissions_from_features(self.word_features(batch))

    def config(self) -> dict[str, Any]:
        """The constructor arguments (JSON values) that rebuild this tagger, labels excluded."""
        raise NotImplementedError

    def save_extra(self, directory: str) -> None:
        """Write the files besides config.json and model.safetensors that loading needs."""

    @classmethod
    def build_from_saved(cls, directory: str, labels: list[str], config: dict[str, Any]) -> "CRFTagger":
        """A tagger with the saved architecture and untrained weights (no pretrained download)."""
        return cls(labels, **config)

    # ------------------------------------------------------------------ the CRF on top
    @property
    def num_tags(self) -> int:
        return len(self.labels)

    def forward(self, tags: Optional[Tensor] = None, **batch: Tensor) -> dict[str, Tensor]:
        """batch: featurize()'s tensors (extra keys are ignored); tags: (B, L) gold tag indices,
        anything (e.g. -100) past each length. Returns {"emissions": (B, L, T)} and, with tags,
        "loss": the CRF negative log-likelihood averaged over sentences."""
        emissions = self.emissions(batch)
        out = {"emissions": emissions}
        if tags is not None:
            out["loss"] = self.crf.nll(emissions, tags[:, :emissions.shape[1]], lengths=batch["lengths"])
        return out

    def distribution_parameters(self):
        """(transitions (T, T), start (T,), end (T,)) with the constraints applied."""
        return self.crf.constrained_parameters()

    def decode(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Viterbi paths (B, L) int64, -1 past each length."""
        return self.crf.decode(self.emissions(batch), lengths=batch["lengths"]).paths

    def kbest(self, batch: Mapping[str, Tensor], k: int) -> KBest:
        """The k best paths with scores and log-probabilities (crfkit.kbest_viterbi)."""
        return self.crf.kbest(self.emissions(batch), k, lengths=batch["lengths"])

    def marginals(self, batch: Mapping[str, Tensor]) -> Tensor:
        """P(y_i = t | x): (B, L, T), zero past each length."""
        return self.crf.marginals(self.emissions(batch), lengths=batch["lengths"])

    @torch.no_grad()
    def teacher_output(self, token_lists: Sequence[Sequence[str]], hidden_layer: Optional[int] = None):
        """The tagger as a teacher for crfkit.distill.label_corpus: B sentences ->
        TeacherOutput(emissions (B, L, T), transitions, lengths, start, end, hidden), without
        gradient, on the tagger's device, in the tagger's current mode (call .eval() first).
        hidden_layer: also give that hidden layer per word (B, L, H) (for label_corpus(...,
        with_hidden=True); functools.partial(tagger.teacher_output, hidden_layer=3))."""
        from ..distill.cache import TeacherOutput

        device = next(self.parameters()).device
        batch = {name: t.to(device) for name, t in self.featurize(_check_token_lists(token_lists)).items()}
        transitions, start, end = self.distribution_parameters()
        if hidden_layer is None:
            return TeacherOutput(self.emissions(batch), transitions, batch["lengths"], start, end)
        emissions, hidden = self.emissions_and_hidden(batch, hidden_layer)
        return TeacherOutput(emissions, transitions, batch["lengths"], start, end, hidden)

    # ------------------------------------------------------------------ predicting, with confidence
    @property
    def temperature(self) -> float:
        """The temperature T > 0 of the entity probabilities: every CRF score is divided by T before
        they are computed (T > 1 flattens, T < 1 sharpens; the predicted tags never change). 1.0
        unless set or fitted by calibrate(); saved in config.json."""
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self._temperature = check_number("temperature", value, minimum=0, open_minimum=True)

    @property
    def entity_scheme(self) -> str:
        """The scheme whose labels crfkit.entities reads: the tagger's scheme, or for an
        unconstrained tagger (scheme None) the first of BIO, BIOES, BMES, IOB1 that accepts its
        labels (the reading of tags as entities is the same in all of them)."""
        if self.scheme is not None:
            return allowed_transitions(self.labels, self.scheme).scheme
        for scheme in ("BIO", "BIOES", "BMES", "IOB1"):
            try:
                allowed_transitions(self.labels, scheme)
            except ValueError:
                continue
            return scheme
        raise ValueError(f"the labels {self.labels} fit none of the schemes {', '.join(SCHEMES)}: "
                         "their entities cannot be read")

    def _batches(self, sentences: list[list[str]], batch_size: int):
        """(positions, sentences, featurize() batch on the tagger's device) per batch of at most
        batch_size, positions being the batch's indices into sentences. The sentences go longest
        first, so that a batch's sentences have about one length: every model here computes the
        padded positions and throws them away, and on CoNLL-2003 test in order a batch of 32 is
        about half padding (benchmarks/results/predict_order.md measures what it saves)."""
        device = next(self.parameters()).device
        order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))   # stable: ties in order
        for begin in range(0, len(order), batch_size):
            positions = order[begin:begin + batch_size]
            chunk = [sentences[i] for i in positions]
            yield positions, chunk, {name: t.to(device) for name, t in self.featurize(chunk).items()}

    def _scaled_parameters(self):
        """(transitions, start, end) divided by the temperature (None stays None)."""
        transitions, start, end = self.distribution_parameters()
        scale = 1.0 / self.temperature
        return transitions * scale, None if start is None else start * scale, None if end is None else end * scale

    @torch.no_grad()
    def predict(self, token_lists: Sequence[Sequence[str]], batch_size: int = 32,
                confidence: bool = False) -> list:
        """Tag sentences: a list of word lists -> a list of tag-name lists (same lengths), the
        Viterbi paths, in the order given. Runs in eval mode on the tagger's device, batch_size
        sentences at a time, longest first (_batches). A sentence that no tag sequence is allowed
        for (every path scores -inf) is a ValueError naming it.

        confidence=True: per sentence instead a dict
            {"tags": [tag names, as without confidence],
             "entities": [{"text": "the words joined by spaces", "type": "PER", "start": first word,
                           "end": word after the last, "probability": float}, ...]}
        with the entities of those tags, in order (read as crfkit.tag.entities and crfkit.entities
        read tags), each with its exact probability under the CRF at the tagger's temperature:
        P(the CRF's tag sequence holds an entity of that type with exactly those words)."""
        sentences = _check_token_lists(token_lists)
        check_int("batch_size", batch_size, minimum=1, type_error=ValueError)
        check_bool("confidence", confidence)
        was_training = self.training
        self.eval()
        tagged: list = [None] * len(sentences)
        try:
            for positions, chunk, batch in self._batches(sentences, batch_size):
                if confidence:
                    emissions = self.emissions(batch)
                    paths = self.crf.decode(emissions, lengths=batch["lengths"]).paths
                else:
                    paths = self.decode(batch)
                for i, tokens, path in zip(positions, chunk, paths.tolist()):
                    if tokens and path[0] < 0:  # Viterbi's -1: no sequence has a finite score
                        raise ValueError(
                            f"predict: sentence {i} ({sentence_preview(tokens)}) has no tag sequence that "
                            "the CRF allows: every sequence scores -inf (-inf emissions rule out each sequence that "
                            "the transition constraints leave)")
                    tagged[i] = [self.labels[t] for t in path[:len(tokens)]]
                if confidence:
                    for i, found in zip(positions, self._entities(emissions, batch["lengths"], paths, chunk)):
                        tagged[i] = {"tags": tagged[i], "entities": found}
        finally:
            self.train(was_training)
        return tagged

    def _entities(self, emissions: Tensor, lengths: Tensor, paths: Tensor, chunk: list[list[str]]) -> list[list[dict]]:
        """The entities of paths (B, L) with their probabilities at the tagger's temperature, per sentence."""
        from ..entities import entity_marginals, entity_spans, entity_types

        scheme = self.entity_scheme
        spans = entity_spans(paths, self.labels, lengths, scheme=scheme)
        transitions, start, end = self._scaled_parameters()
        found = entity_marginals(emissions / self.temperature, transitions, self.labels, spans, lengths, start, end,
                                 scheme=scheme)
        types = entity_types(self.labels, scheme)
        out: list[list[dict]] = [[] for _ in chunk]
        for (b, first, stop, kind), p in zip(found.spans.tolist(), found.probabilities.tolist()):
            out[b].append({"text": " ".join(chunk[b][first:stop]), "type": types[kind], "start": first, "end": stop,
                           "probability": p})
        return out

    @torch.no_grad()
    def calibrate(self, token_lists: Sequence[Sequence[str]], tag_lists: Sequence[Sequence[str]],
                  batch_size: int = 32, **search) -> float:
        """Fit the temperature on held-out sentences with gold tags (the validation split), set it
        and return it: crfkit.calibration.fit_temperature, the T minimising the gold sequences'
        negative log-likelihood with every CRF score divided by T (search: its bounds / tolerance).
        A gold sequence that the CRF forbids (say IOB1 tags for a BIO tagger) is a ValueError."""
        from ..calibration import fit_temperature

        sentences = _check_token_lists(token_lists)
        check_int("batch_size", batch_size, minimum=1, type_error=ValueError)
        if isinstance(tag_lists, (str, bytes)) or not isinstance(tag_lists, Sequence) or len(tag_lists) != len(
                sentences):
            raise ValueError(f"tag_lists must hold one list of tag names per sentence ({len(sentences)})")
        index = {label: i for i, label in enumerate(self.labels)}
        gold = []
        for i, (tokens, tags) in enumerate(zip(sentences, tag_lists)):
            if isinstance(tags, str) or not isinstance(tags, Sequence) or len(tags) != len(tokens):
                raise ValueError(f"tag_lists[{i}] must be a list of {len(tokens)} tag names, one per word")
            unknown = [t for t in tags if t not in index]
            if unknown:
                raise ValueError(f"tag_lists[{i}] holds {unknown[0]!r}, not one of the tagger's labels {self.labels}")
            gold.append([index[t] for t in tags])
        was_training = self.training
        self.eval()
        emissions, tags, lengths = [], [], []
        try:
            for positions, _, batch in self._batches(sentences, batch_size):
                em = self.emissions(batch)
                tg = torch.zeros(em.shape[:2], dtype=torch.long, device=em.device)
                for b, i in enumerate(positions):
                    tg[b, :len(gold[i])] = torch.tensor(gold[i], dtype=torch.long)
                emissions.append(em)
                tags.append(tg)
                lengths.append(batch["lengths"])
        finally:
            self.train(was_training)
        transitions, start, end = self.distribution_parameters()
        self.temperature = fit_temperature(emissions, transitions, tags, lengths, start, end, **search)
        return self.temperature

    def describe(self) -> str:
        """A short architecture string for run records, e.g. "BiLSTM 2x300, ..., CRF"."""
        return f"{type(self).__name__}, CRF"

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def parameter_groups(self, learning_rate: float, **_: Any) -> list[dict[str, Any]]:
        """Optimizer parameter groups; the base gives every trainable parameter one rate."""
        return [{"params": [p for p in self.parameters() if p.requires_grad], "lr": learning_rate}]

    # ------------------------------------------------------------------ saving and loading
    def save_pretrained(self, directory: str) -> None:
        """Write config.json, model.safetensors and the class's extra files into directory."""
        from safetensors.torch import save_model

        from .. import __version__

        os.makedirs(directory, exist_ok=True)
        record = {"format": TAGGER_FORMAT, "format_version": TAGGER_FORMAT_VERSION, "tagger": type(self).__name__,
                  "labels": self.labels, "scheme": self.scheme, "config": self.config(),
                  "temperature": self.temperature, "crfkit_version": __version__}
        self.save_extra(directory)
        save_model(self, os.path.join(directory, WEIGHTS_NAME))
        with open(os.path.join(directory, CONFIG_NAME), "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")

    @classmethod
    def from_pretrained(cls, directory: str, device: Optional[torch.device] = None) -> "CRFTagger":
        """Load a tagger saved by save_pretrained (of this class, or any tagger class when called
        on CRFTagger / through crfkit.taggers.load_tagger). Returns it in eval mode.

        A folder that is not a whole, consistent saved tagger (a damaged or hand-edited
        config.json, another tagger's weights, a missing encoder/ or vocab.json) raises
        FileNotFoundError or ValueError naming the file and what is wrong with it."""
        directory = os.fspath(directory)
        path = os.path.join(directory, CONFIG_NAME)
        record = _read_tagger_config(path, directory)
        target = _REGISTRY.get(record["tagger"])
        if target is None:
            raise ValueError(f"{path} names an unknown tagger class {record['tagger']!r}; known: {sorted(_REGISTRY)}")
        if cls is not CRFTagger and not issubclass(target, cls):
            raise ValueError(f"{directory!r} holds a {record['tagger']}, not a {cls.__name__}")
        config = dict(record["config"])
        config["scheme"] = record["scheme"]
        accepted = {name for name, parameter in inspect.signature(target).parameters.items()
                    if parameter.kind is not inspect.Parameter.VAR_KEYWORD and not name.startswith("_")}
        unknown = sorted(set(config) - accepted)
        if unknown:
            raise ValueError(f"{path}: 'config' holds arguments that {record['tagger']} does not take: {unknown} "
                             "(written by another crfkit version, or edited by hand)")
        weights = os.path.join(directory, WEIGHTS_NAME)
        if not os.path.isfile(weights):
            raise FileNotFoundError(f"{weights} does not exist: the tagger in {directory!r} has no weights")
        try:
            tagger = target.build_from_saved(directory, record["labels"], config)
        except (TypeError, ValueError, KeyError) as error:
            message = error.args[0] if isinstance(error, KeyError) and error.args else error
            raise ValueError(f"{path} describes a {record['tagger']} that cannot be built: {message}") from None
        _load_weights(tagger, weights, path, device)
        tagger.temperature = record.get("temperature", 1.0)  # (folders saved before it existed: 1.0)
        return tagger.eval()


def _read_tagger_config(path: str, directory: str) -> dict[str, Any]:
    """config.json, checked for the fields loading needs (ValueError naming the file if not)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: {directory!r} is not a saved crfkit tagger")
    record = read_json(path, "a crfkit tagger config")
    if not isinstance(record, dict) or record.get("format") != TAGGER_FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{path} is not a crfkit tagger config (format {found!r})")
    labels = record.get("labels")
    if (not isinstance(labels, list) or not labels or not all(isinstance(label, str) and label for label in labels)):
        raise ValueError(f"{path}: 'labels' must be the non-empty list of tag names, got {reprlib.repr(labels)}")
    expected = (("tagger", str, "the tagger class's name"), ("config", dict, "the constructor arguments"))
    for key, kind, what in expected:
        if not isinstance(record.get(key), kind):
            raise ValueError(f"{path}: {key!r} must be {what} (a JSON {'string' if kind is str else 'object'}), "
                             f"got {reprlib.repr(record.get(key))}")
    temperature = record.get("temperature", 1.0)
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0
            or temperature == float("inf")):
        raise ValueError(f"{path}: 'temperature' must be a positive number (the entity probabilities' temperature), "
                         f"got {reprlib.repr(temperature)}")
    if "scheme" not in record or not isinstance(record["scheme"], (str, type(None))):
        raise ValueError(f"{path}: 'scheme' must be a tagging scheme name or null, got "
                         f"{reprlib.repr(record.get('scheme', '(missing)'))}")
    return record


def _load_weights(tagger: nn.Module, weights: str, config_path: str, device: Optional[torch.device]) -> None:
    """model.safetensors into tagger, strictly; a file that does not fit the tagger config.json
    describes (another tagger's, or a config with another label list) is a ValueError naming both."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_model

    try:
        with safe_open(weights, framework="pt") as f:
            saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError) as error:  # a truncated or overwritten file
        raise ValueError(f"{weights} is not a readable safetensors file: {error}") from None
    expected = {name: tuple(t.shape) for name, t in tagger.state_dict().items()}
    differences = [f"{name} is {saved[name]} in the file, {shape} in the tagger"
                   for name, shape in expected.items() if name in saved and saved[name] != shape]
    differences += [f"{name} is not in the file" for name in expected if name not in saved]
    differences += [f"{name} is in the file but not in the tagger" for name in saved if name not in expected]
    # save_model drops the aliases of shared tensors, so an absent name may still load: let
    # load_model decide, and explain its refusal with the differences found above.
    try:
        load_model(tagger, weights, strict=True, device=str(device or "cpu"))
    except (RuntimeError, SafetensorError) as error:
        shown = differences[:3] + ([f"{len(differences) - 3} more"] if len(differences) > 3 else [])
        detail = "; ".join(shown) if shown else str(error).splitlines()[0]
        raise ValueError(f"{weights} does not hold the weights of the tagger {config_path} describes "
                         f"({len(tagger.labels)} labels): {detail}") from None


def load_tagger(directory: str, device: Optional[torch.device] = None) -> CRFTagger:
    """Load any saved crfkit tagger (the class is read from its config.json)."""
    return CRFTagger.from_pretrained(directory, device=device)
