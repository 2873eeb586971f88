"""TransformerCRFTagger: a pretrained encoder (transformers), word-level emissions, a crfkit CRF.

    tagger = TransformerCRFTagger(crfkit.data.CONLL2003_TAGS)          # MiniLM-L6, BIO constraints
    tagger.predict([["EU", "rejects", "German", "call"]])              # [['B-ORG', 'O', 'B-MISC', 'O']]
    small = TransformerCRFTagger(labels, num_layers=2)                 # the encoder's first 2 layers

Word features are the encoder's hidden state at each word's first piece (crfkit.distill.
align_to_words), concatenated with a casing embedding (the encoders here are uncased), then
dropout and a linear layer give the emissions. Words cut off by max_pieces keep their casing
feature and a zero encoder feature. parameter_groups() gives the layer-wise learning-rate decay
of the multi-grained distillation paper's teacher recipe.
"""
from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

from .._validation import check_choice, check_int, check_number
from ..distill.alignment import REDUCTIONS, align_to_words, word_index_from_word_ids
from .base import CRFTagger, _check_token_lists
from .casing import NUM_CASING_CLASSES, PAD_CASING, casing_tensor
from .._optional import require
from ..packaged import encoder_path

__all__ = ["TransformerCRFTagger"]

ENCODER_DIR = "encoder"
_LAYER = re.compile(r"(?:^|\.)layer\.(\d+)\.")
_SURROGATES = re.compile("[\ud800-\udfff]")


class TransformerCRFTagger(CRFTagger):
    """Encoder + casing embedding + dropout + linear + CRF.

    labels: T tag names. encoder: "minilm" (default), "mpnet" or a local transformers folder.
    scheme: the CRF's constraints ("BIO", "IOB1", "BIOES", "BMES" or None).
    dropout: on the word features before the linear layer. casing_dim: width of the casing
    embedding (0: none). num_layers: keep only the encoder's first num_layers layers (a small
    transformer student initialised from the teacher's encoder); None keeps all.
    max_pieces: word pieces per sentence (longer sentences are truncated for the encoder only, with a
    warning: their words past the limit are tagged from casing and the CRF alone).
    word_pooling: "first", "mean" or "max" piece of each word.
    """

    def __init__(self, labels: Sequence[str], encoder: str = "minilm", scheme: Optional[str] = "BIO",
                 dropout: float = 0.1, casing_dim: int = 16, num_layers: Optional[int] = None,
                 max_pieces: int = 256, word_pooling: str = "first", *, _saved_encoder: Optional[str] = None):
        super().__init__(labels, scheme)
        transformers = require("transformers", "pip install transformers")
        check_choice("word_pooling", word_pooling, REDUCTIONS)
        check_number("dropout", dropout, minimum=0, maximum=1, open_maximum=True)
        check_int("casing_dim", casing_dim, minimum=0, type_error=ValueError)
        check_int("max_pieces", max_pieces, minimum=3, type_error=ValueError)
        path = _saved_encoder or encoder_path(encoder)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        if not self.tokenizer.is_fast:
            raise ValueError(f"encoder {encoder!r} has no fast tokenizer; word alignment needs one")
        config = transformers.AutoConfig.from_pretrained(path)
        if num_layers is not None:
            check_int("num_layers", num_layers, minimum=1, maximum=config.num_hidden_layers, type_error=ValueError)
            config.num_hidden_layers = num_layers
        if _saved_encoder is None:
            self.encoder = _load_encoder(transformers, path, config)
        else:
            self.encoder = _encoder_from_config(transformers, config)
        self.encoder_name = encoder
        self.dropout_rate = float(dropout)
        self.num_layers = config.num_hidden_layers
        self.max_pieces = max_pieces
        self.word_pooling = word_pooling
        self.casing = nn.Embedding(NUM_CASING_CLASSES, casing_dim, padding_idx=PAD_CASING) if casing_dim else None
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(config.hidden_size + casing_dim, self.num_tags)

    # ------------------------------------------------------------------ inputs
    def featurize(self, token_lists: Sequence[Sequence[str]]) -> dict[str, Tensor]:
        """B sentences -> input_ids / attention_mask (B, P), word_index (B, P) (the word of each
        piece, -1 for none), casing (B, L), lengths (B,)."""
        # A lone surrogate (what Python's surrogateescape gives for a byte that is not UTF-8) is
        # not text the tokenizer accepts: it becomes U+FFFD, the replacement character.
        sentences = [[_SURROGATES.sub("\ufffd", word) for word in tokens] for tokens in _check_token_lists(token_lists)]
        encoded = self.tokenizer(sentences, is_split_into_words=True, truncation=True, max_length=self.max_pieces,
                                 padding=True, return_tensors="pt")
        lengths = torch.tensor([len(s) for s in sentences], dtype=torch.long)
        casing = casing_tensor(sentences, int(lengths.max()) if len(sentences) else 0)
        word_index = word_index_from_word_ids(encoded, encoded["input_ids"].shape[1])
        full = encoded["attention_mask"].sum(1) >= self.max_pieces
        if len(sentences) and bool((full & (word_index.max(1).values + 1 < lengths)).any()):
            warnings.warn(f"crfkit: a sentence has more than max_pieces = {self.max_pieces} word pieces; the "
                          "encoder sees only its first pieces, and the words past them are tagged from their "
                          "casing and the CRF alone. Split long sentences (python -m crfkit.tag --tokenize does) "
                          "or raise max_pieces.", stacklevel=2)
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"],
                "word_index": word_index, "casing": casing, "lengths": lengths}

    def _words(self, batch: Mapping[str, Tensor], pieces: Tensor) -> Tensor:
        """(B, P, H) piece states -> (B, L, H) word states (word_pooling over each word's pieces)."""
        if torch.compiler.is_exporting():  # torch.export (crfkit/export/pt2.py)
            return pool_word_pieces(pieces, batch["word_index"], batch["casing"].shape[1], self.word_pooling)
        words, _ = align_to_words(pieces, batch["word_index"], num_words=batch["lengths"], reduce=self.word_pooling)
        return words

    def _with_casing(self, batch: Mapping[str, Tensor], words: Tensor) -> Tensor:
        if self.casing is None:
            return words
        return torch.cat([words, self.casing(batch["casing"][:, :words.shape[1]])], dim=-1)

    def word_features(self, batch: Mapping[str, Tensor]) -> Tensor:
        """(B, L, H + casing_dim): the encoder's last layer per word, with the casing embedding."""
        pieces = self.encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        return self._with_casing(batch, self._words(batch, pieces))

    def describe(self) -> str:
        name = os.path.basename(str(self.encoder_name).rstrip("/")) or str(self.encoder_name)
        casing = "" if self.casing is None else f", casing {self.casing.embedding_dim}"
        return f"{name} ({self.num_layers} layers){casing}, CRF"

    def emissions_from_features(self, features: Tensor) -> Tensor:
        return self.head(self.dropout(features))

    def emissions_and_hidden(self, batch: Mapping[str, Tensor], layer: int) -> tuple[Tensor, Tensor]:
        """(emissions (B, L, T), encoder layer `layer` per word (B, L, H)); layer 0 is the
        embedding output, layer num_layers the last."""
        check_int("layer", layer, minimum=0, maximum=self.num_layers, type_error=ValueError)
        out = self.encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           output_hidden_states=True)
        emissions = self.emissions_from_features(self._with_casing(batch, self._words(batch, out.last_hidden_state)))
        return emissions, self._words(batch, out.hidden_states[layer])

    def layer_groups(self) -> list[tuple[str, list[nn.Parameter]]]:
        """embeddings, encoder layers 0 .. N-1, then "output" (casing, linear layer, CRF)."""
        groups: dict[str, list[nn.Parameter]] = {"embeddings": []}
        groups.update({f"layer {i}": [] for i in range(self.num_layers)})
        groups["output"] = []
        for name, parameter in self.named_parameters():
            match = _LAYER.search(name[len("encoder."):]) if name.startswith("encoder.") else None
            if match:
                groups[f"layer {int(match.group(1))}"].append(parameter)
            elif name.startswith("encoder."):
                # the embeddings, and any pooler (unused by the tagger) with them
                groups["embeddings"].append(parameter)
            else:
                groups["output"].append(parameter)
        return [(name, params) for name, params in groups.items() if params]

    # ------------------------------------------------------------------ optimisation
    def parameter_groups(self, learning_rate: float, head_learning_rate: Optional[float] = None,
                         layer_decay: float = 1.0, weight_decay: float = 0.0, **_: Any) -> list[dict[str, Any]]:
        """Encoder layer i of N gets learning_rate * layer_decay ** (N - 1 - i), the embeddings
        learning_rate * layer_decay ** N; the casing embedding, linear layer and CRF get
        head_learning_rate (default learning_rate). No weight decay on biases and norms."""
        head_rate = learning_rate if head_learning_rate is None else head_learning_rate
        groups: dict[tuple[float, float], list[nn.Parameter]] = {}
        for name, parameter in self.named_parameters():
            if not parameter.requires_grad:
                continue
            if name.startswith("encoder."):
                inner = name[len("encoder."):]
                match = _LAYER.search(inner)
                if match:
                    depth = self.num_layers - 1 - int(match.group(1))
                elif "embeddings" in inner:
                    depth = self.num_layers
                else:
                    depth = 0
                rate = learning_rate * layer_decay ** depth
            else:
                rate = head_rate
            no_decay = parameter.dim() < 2 or "LayerNorm" in name or "layer_norm" in name
            decay = 0.0 if no_decay or name.startswith("crf.") else weight_decay
            groups.setdefault((rate, decay), []).append(parameter)
        return [{"params": params, "lr": rate, "weight_decay": decay} for (rate, decay), params in groups.items()]

    # ------------------------------------------------------------------ saving
    def config(self) -> dict[str, Any]:
        return {"encoder": self.encoder_name, "dropout": self.dropout_rate,
                "casing_dim": 0 if self.casing is None else self.casing.embedding_dim,
                "num_layers": self.num_layers, "max_pieces": self.max_pieces, "word_pooling": self.word_pooling}

    def save_extra(self, directory: str) -> None:
        target = os.path.join(directory, ENCODER_DIR)
        self.tokenizer.save_pretrained(target)
        self.encoder.config.save_pretrained(target)

    @classmethod
    def build_from_saved(cls, directory: str, labels: list[str], config: dict[str, Any]) -> "TransformerCRFTagger":
        config = dict(config)
        config["num_layers"] = None  # the saved encoder config already has the kept layers
        encoder = os.path.join(directory, ENCODER_DIR)
        if not os.path.isfile(os.path.join(encoder, "config.json")):
            raise FileNotFoundError(f"{os.path.join(encoder, 'config.json')} does not exist: a saved "
                                    f"TransformerCRFTagger keeps its tokenizer and encoder configuration in "
                                    f"{ENCODER_DIR}/ (copy the whole folder {directory!r})")
        try:
            return cls(labels, **config, _saved_encoder=encoder)
        except OSError as error:  # transformers: a tokenizer file missing or unreadable in encoder/
            raise ValueError(f"{encoder} holds no usable tokenizer / encoder configuration: {error}") from None


def pool_word_pieces(pieces: Tensor, word_index: Tensor, num_words: int, reduce: str = "first") -> Tensor:
    """crfkit.distill.align_to_words(pieces, word_index, num_words, reduce)[0] for export (torch.export,
    crfkit/export/pt2.py; the ONNX exporter, crfkit/export/onnx.py):
    pieces (B, P, H), word_index (B, P) (-1: no word) -> (B, num_words, H), zero for a word with
    no piece, without the argument checks and the Python ints read from tensors there (num_words
    comes from a shape). "first" gathers the same rows (identical values); "mean" sums by a
    batched matrix product (equal to rounding); "max" takes a masked maximum over a
    (B, num_words, P, H) tensor."""
    B, P, _ = pieces.shape
    member = word_index.unsqueeze(1) == torch.arange(num_words, device=pieces.device).view(1, -1, 1)   # (B, W, P)
    has_piece = member.any(2, keepdim=True)                                                           # (B, W, 1)
    if reduce == "first":
        position = torch.arange(P, device=pieces.device).view(1, 1, -1).expand_as(member)
        first = torch.where(member, position, P).amin(2).clamp(max=max(P - 1, 0))                     # (B, W)
        words = pieces.gather(1, first.unsqueeze(2).expand(-1, -1, pieces.shape[2]))
    elif reduce == "mean":
        weights = member.to(pieces.dtype)
        words = torch.bmm(weights, pieces) / weights.sum(2, keepdim=True).clamp(min=1)
    else:
        masked = torch.where(member.unsqueeze(3), pieces.unsqueeze(1), float("-inf"))
        words = masked.amax(2)
    return torch.where(has_piece, words, 0.0)


def _load_encoder(transformers, path: str, config) -> nn.Module:
    # The saved sentence encoders carry a pooler the tagger drops; transformers reports those
    # weights as unexpected at warning level, which is noise here.
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return transformers.AutoModel.from_pretrained(path, config=config, add_pooling_layer=False)
    except TypeError:  # encoders without a pooler take no such argument
        return transformers.AutoModel.from_pretrained(path, config=config)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _encoder_from_config(transformers, config) -> nn.Module:
    try:
        return transformers.AutoModel.from_config(config, add_pooling_layer=False)
    except TypeError:
        return transformers.AutoModel.from_config(config)
