"""BiLSTMCRFTagger: word embeddings + casing (+ optional character CNN) -> BiLSTM -> linear -> CRF.

    words = BiLSTMCRFTagger.build_vocabulary(train_sentences)
    student = BiLSTMCRFTagger(crfkit.data.CONLL2003_TAGS, words, embedding_dim=384)
    student.load_teacher_embeddings(teacher)       # TE: the teacher's piece table, frozen
    student.predict([["EU", "rejects", "German", "call"]])

hidden_size is the BiLSTM's total width, split between the two directions (NCRF++'s convention,
the toolkit the multi-grained distillation paper builds on): hidden_size=300 gives 150 per
direction. Words are lower-cased by default (the embeddings that can be transferred here, the
teachers' and GloVe's, are uncased); the casing embedding keeps the capitalisation.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from .._files import read_json
from .._validation import check_int, check_number
from ..data import Vocabulary
from .base import CRFTagger, _check_token_lists
from .casing import NUM_CASING_CLASSES, PAD_CASING, casing_tensor

__all__ = ["BiLSTMCRFTagger"]

VOCAB_NAME = "vocab.json"
PAD, UNK = "<pad>", "<unk>"


class BiLSTMCRFTagger(CRFTagger):
    """labels: T tag names. words: the word vocabulary, index 0 = "<pad>", 1 = "<unk>" (use
    build_vocabulary). chars: the character vocabulary for char_cnn (same convention; default: the
    characters of words). embedding_dim, hidden_size (total over both directions), num_layers,
    dropout (on the embeddings and on the BiLSTM output), casing_dim (0: none), char_cnn with
    char_dim / char_filters / char_kernel, lowercase (look words up lower-cased),
    lowercase_fallback (lowercase=False: a word missing from the cased vocabulary is looked up
    lower-cased, then capitalised; for cased tables such as packaged.neuroner_vectors'), freeze_embeddings (no
    gradient to the word table, as TE does)."""

    def __init__(self, labels: Sequence[str], words: Sequence[str], scheme: Optional[str] = "BIO",
                 embedding_dim: int = 100, hidden_size: int = 300, num_layers: int = 1, dropout: float = 0.5,
                 casing_dim: int = 16, char_cnn: bool = False, chars: Optional[Sequence[str]] = None,
                 char_dim: int = 30, char_filters: int = 50, char_kernel: int = 3, lowercase: bool = True,
                 freeze_embeddings: bool = False, lowercase_fallback: bool = False):
        super().__init__(labels, scheme)
        for name, value, low in (("embedding_dim", embedding_dim, 1), ("hidden_size", hidden_size, 2),
                                 ("num_layers", num_layers, 1), ("casing_dim", casing_dim, 0),
                                 ("char_dim", char_dim, 1), ("char_filters", char_filters, 1),
                                 ("char_kernel", char_kernel, 1)):
            check_int(name, value, minimum=low, type_error=ValueError)
        if hidden_size % 2:
            raise ValueError(f"hidden_size is split over two directions and must be even, got {hidden_size}")
        check_number("dropout", dropout, minimum=0, maximum=1, open_maximum=True)
        words = list(words)
        if words[:2] != [PAD, UNK]:
            raise ValueError(f"words must start with {PAD!r}, {UNK!r} (use BiLSTMCRFTagger.build_vocabulary)")
        self.vocabulary = Vocabulary(words[2:], lowercase=lowercase, lowercase_fallback=lowercase_fallback)
        if len(self.vocabulary) != len(words):
            raise ValueError("words must be distinct (after lower-casing when lowercase=True)")
        self.lowercase, self.lowercase_fallback = lowercase, lowercase_fallback
        self.embedding_dim, self.hidden_size, self.dropout_rate = embedding_dim, hidden_size, float(dropout)
        self.word_embedding = nn.Embedding(len(words), embedding_dim, padding_idx=0)
        self.freeze_embeddings(freeze_embeddings)
        self.casing = nn.Embedding(NUM_CASING_CLASSES, casing_dim, padding_idx=PAD_CASING) if casing_dim else None
        width = embedding_dim + casing_dim
        self.char_vocabulary = None
        self.char_settings = {"char_dim": char_dim, "char_filters": char_filters, "char_kernel": char_kernel}
        if char_cnn:
            chars = list(chars) if chars is not None else [PAD, UNK] + sorted({c for w in words[2:] for c in w})
            if chars[:2] != [PAD, UNK]:
                raise ValueError(f"chars must start with {PAD!r}, {UNK!r}")
            self.char_vocabulary = Vocabulary(chars[2:])
            self.char_embedding = nn.Embedding(len(chars), char_dim, padding_idx=0)
            self.char_conv = nn.Conv1d(char_dim, char_filters, char_kernel, padding=char_kernel // 2)
            width += char_filters
        self.embedding_dropout = nn.Dropout(dropout)
        self.lstm = nn.LSTM(width, hidden_size // 2, num_layers=num_layers, batch_first=True, bidirectional=True,
                            dropout=dropout if num_layers > 1 else 0.0)
        self.output_dropout = nn.Dropout(dropout)
        self.head = nn.Linear(hidden_size, self.num_tags)

    # ------------------------------------------------------------------ vocabulary and embeddings
    @staticmethod
    def build_vocabulary(sentences: Iterable, extra_words: Iterable[str] = (), min_count: int = 1,
                         lowercase: bool = True) -> list[str]:
        """["<pad>", "<unk>", words of sentences (tokens) seen min_count times, most frequent
        first, then extra_words not yet in]. sentences: crfkit.data.Sentence or word lists."""
        counts: Counter[str] = Counter()
        for sentence in sentences:
            tokens = getattr(sentence, "tokens", sentence)
            counts.update(w.lower() if lowercase else w for w in tokens)
        words = [w for w, c in counts.most_common() if c >= min_count]
        seen = set(words)
        for w in extra_words:
            w = w.lower() if lowercase else w
            if w not in seen and w not in (PAD, UNK):
                seen.add(w)
                words.append(w)
        return [PAD, UNK, *words]

    def freeze_embeddings(self, freeze: bool = True) -> None:
        """Stop (or restore) gradient to the word table."""
        self.word_embedding.weight.requires_grad_(not freeze)
        self.frozen_embeddings = bool(freeze)

    def load_teacher_embeddings(self, teacher, freeze: bool = True, multi_piece: str = "mean"):
        """TE: fill the word table from a TransformerCRFTagger's piece embeddings (a word the
        teacher splits gets the mean of its pieces; crfkit.distill.transfer_embeddings), reduced by
        SVD when the table is narrower than the teacher. Returns the TransferReport."""
        from ..distill.embeddings import svd_reduce, transfer_embeddings

        table = teacher.encoder.get_input_embeddings().weight.detach().float()
        if table.shape[1] != self.embedding_dim:
            table = svd_reduce(table, self.embedding_dim)
        report = transfer_embeddings(self.word_embedding, table, self.vocabulary, teacher.tokenizer, freeze=False,
                                     multi_piece=multi_piece, special_tokens={UNK: teacher.tokenizer.unk_token})
        self.freeze_embeddings(freeze)
        return report

    def load_word_vectors(self, words: Sequence[str], vectors: Tensor, freeze: bool = False) -> int:
        """Copy pretrained vectors (N, embedding_dim), e.g. GloVe, into the rows of the same words
        (looked up lower-cased when lowercase=True). Returns the number of rows written."""
        vectors = torch.as_tensor(vectors, dtype=self.word_embedding.weight.dtype)
        if vectors.dim() != 2 or vectors.shape[1] != self.embedding_dim or vectors.shape[0] != len(words):
            raise ValueError(f"vectors must be ({len(words)}, {self.embedding_dim}), got {tuple(vectors.shape)}")
        rows, sources = [], []
        index = self.vocabulary.to_dict()
        for i, w in enumerate(words):
            row = index.get(w.lower() if self.lowercase else w)   # exact rows only: no fallback here
            if row is not None and row > 1:
                rows.append(row)
                sources.append(i)
        with torch.no_grad():
            if rows:
                self.word_embedding.weight[torch.tensor(rows)] = vectors[torch.tensor(sources)]
        self.freeze_embeddings(freeze)
        return len(rows)

    def load_word_vector_tables(self, tables: Sequence[tuple[Sequence[str], Tensor, bool]],
                                freeze: bool = True) -> list[int]:
        """Fill the word table with pretrained tables side by side: tables[j] = (words (N_j,),
        vectors (N_j, D_j), uncased) goes into the D_j columns after those of tables[:j] (the D_j
        must add up to embedding_dim). A vocabulary word's part of table j is its own vector,
        looked up as it is spelled and then lower-cased (only lower-cased when uncased); a word
        without one there gets zeros in those columns, so "no vector in this table" is one
        consistent input rather than noise. Returns the number of rows filled from each table."""
        widths = [int(torch.as_tensor(vectors).shape[-1]) for _, vectors, _ in tables]
        if sum(widths) != self.embedding_dim:
            raise ValueError(f"the tables' widths {widths} must add up to embedding_dim ({self.embedding_dim})")
        filled, column = [], 0
        weight = self.word_embedding.weight
        with torch.no_grad():
            weight.zero_()
            for (words, vectors, uncased), width in zip(tables, widths):
                vectors = torch.as_tensor(vectors, dtype=weight.dtype)
                if vectors.dim() != 2 or vectors.shape[0] != len(words):
                    raise ValueError(f"a table's vectors must be ({len(words)}, D), got {tuple(vectors.shape)}")
                index = {w: i for i, w in reversed(list(enumerate(words)))}   # a word seen twice: its first row
                rows, sources = [], []
                for row, w in enumerate(self.vocabulary):
                    found = None if uncased else index.get(w)
                    found = index.get(w.lower()) if found is None else found
                    if row > 1 and found is not None:
                        rows.append(row)
                        sources.append(found)
                if rows:
                    weight[torch.tensor(rows), column:column + width] = vectors[torch.tensor(sources)]
                filled.append(len(rows))
                column += width
        self.freeze_embeddings(freeze)
        return filled

    # ------------------------------------------------------------------ inputs
    def featurize(self, token_lists: Sequence[Sequence[str]]) -> dict[str, Tensor]:
        """B sentences -> words / casing (B, L) (0 = padding), chars (B, L, C) with char_cnn,
        lengths (B,). Each input is one flat list of ids written through a mask of the real
        positions (row-major, so the words in order): a tensor per word instead was a fifth of
        predict's time."""
        sentences = _check_token_lists(token_lists)
        lengths = torch.tensor([len(s) for s in sentences], dtype=torch.long)
        L = int(lengths.max()) if len(sentences) else 0
        real = torch.arange(L) < lengths.unsqueeze(1)                                   # (B, L)
        words = torch.zeros((len(sentences), L), dtype=torch.long)
        words[real] = torch.tensor([i for s in sentences for i in self.vocabulary.encode(s)], dtype=torch.long)
        batch = {"words": words, "casing": casing_tensor(sentences, L), "lengths": lengths}
        if self.char_vocabulary is not None:
            flat = [w for s in sentences for w in s]
            C = max(map(len, flat), default=1)
            word_lengths = torch.zeros((len(sentences), L), dtype=torch.long)
            word_lengths[real] = torch.tensor([len(w) for w in flat], dtype=torch.long)
            chars = torch.zeros((len(sentences), L, C), dtype=torch.long)
            chars[torch.arange(C) < word_lengths.unsqueeze(2)] = torch.tensor(
                [c for w in flat for c in self.char_vocabulary.encode(w)], dtype=torch.long)
            batch["chars"] = chars
        return batch

    def word_features(self, batch: Mapping[str, Tensor]) -> Tensor:
        """(B, L, hidden_size): the BiLSTM's outputs, both directions."""
        x, lengths = self._lstm_inputs(batch), batch["lengths"]
        B, L = x.shape[:2]
        if torch.compiler.is_exporting():  # torch.export (crfkit/export/pt2.py: L >= 1 there)
            return self._bilstm_unpacked(x, lengths)
        if L == 0:  # a batch of empty sentences: nothing to run the LSTM over
            return x.new_zeros(B, 0, self.hidden_size)
        if (not self.training and x.device.type == "cpu" and isinstance(self.lstm, nn.LSTM)
                and B * L <= 1.5 * int(lengths.sum())):
            # On the CPU a padded LSTM runs its input projection as one matrix product, a packed one
            # step by step: about 1.7x slower for 32 sentences of one length, even at a third of
            # padding (benchmarks/results/predict_order.md). predict's longest-first batches pad
            # little. Only in eval mode: training keeps the packed run (its batches pad more). Not
            # for quantize_student's int8 LSTM, which has no float weights to run.
            return self._bilstm_unpacked(x, lengths)
        # pack_padded_sequence refuses length 0; such a sentence's outputs are never read.
        packed = pack_padded_sequence(x, lengths.clamp(min=1).cpu(), batch_first=True, enforce_sorted=False)
        output, _ = self.lstm(packed)
        output, _ = pad_packed_sequence(output, batch_first=True, total_length=L)
        return output

    def _lstm_inputs(self, batch: Mapping[str, Tensor]) -> Tensor:
        """(B, L, width): each word's embedding, casing embedding and character features, after dropout."""
        words = batch["words"]
        features = [self.word_embedding(words)]
        if self.casing is not None:
            features.append(self.casing(batch["casing"]))
        if self.char_vocabulary is not None:
            chars = batch["chars"]
            B, L, C = chars.shape
            embedded = self.char_embedding(chars.reshape(B * L, C)).transpose(1, 2)   # (B*L, char_dim, C)
            convolved = self.char_conv(embedded).masked_fill((chars.reshape(B * L, 1, C) == 0), float("-inf"))
            pooled = convolved.max(dim=2).values
            features.append(torch.where(torch.isfinite(pooled), pooled, 0.0).reshape(B, L, self.char_conv.out_channels))
        return self.embedding_dropout(torch.cat(features, dim=-1))

    def _bilstm_unpacked(self, x: Tensor, lengths: Tensor) -> Tensor:
        """The BiLSTM over padded x (B, L, width) -> (B, L, hidden_size) without packing: what
        word_features runs under torch.export, which traces it with a dynamic batch and length
        (pack_padded_sequence sorts by length on the host, which the export cannot follow).
        Each layer is two one-direction LSTMs with the layer's own weights: the forward one over
        the padded rows (a real position sees only those before it), the backward one over each
        row reversed within its length (so it starts at the sentence's last word, as packing
        makes it), then reversed back. Real positions get the packed run's outputs (to rounding:
        the matrix products have other shapes), padded ones zeros as pad_packed_sequence gives;
        a length-0 sentence runs one step, as word_features' lengths.clamp(min=1) makes it."""
        B, L = x.shape[0], x.shape[1]
        steps = lengths.clamp(min=1).unsqueeze(1)                          # (B, 1)
        positions = torch.arange(L, device=x.device).unsqueeze(0)           # (1, L)
        real = positions < steps                                            # (B, L)
        # Position i of a sentence of n steps read backwards: n - 1 - i inside it, i past it.
        # The permutation is its own inverse: the same gather puts the outputs back in order.
        backwards = torch.where(real, steps - 1 - positions, positions).unsqueeze(2)  # (B, L, 1)
        lstm, width = self.lstm, self.lstm.hidden_size
        hidden = x
        for layer in range(lstm.num_layers):
            outputs = []
            for reverse in (False, True):
                suffix = f"_l{layer}_reverse" if reverse else f"_l{layer}"
                weights = [getattr(lstm, name + suffix) for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
                inputs = hidden.gather(1, backwards.expand(B, L, hidden.shape[2])) if reverse else hidden
                # Two zero states, not one tensor twice: the export's while_loop refuses aliased inputs.
                h0, c0 = x.new_zeros(1, B, width), x.new_zeros(1, B, width)
                out = torch.lstm(inputs, (h0, c0), weights, True, 1, 0.0, self.training, False, True)[0]
                outputs.append(out.gather(1, backwards.expand(B, L, width)) if reverse else out)
            hidden = torch.cat(outputs, dim=2)
            if layer + 1 < lstm.num_layers:  # nn.LSTM's dropout between layers
                hidden = nn.functional.dropout(hidden, lstm.dropout, self.training)
        return hidden.masked_fill(~real.unsqueeze(2), 0.0)

    def describe(self) -> str:
        parts = [f"BiLSTM {self.lstm.num_layers}x(2x{self.hidden_size // 2})",
                 f"words {self.embedding_dim}-d{' frozen' if self.frozen_embeddings else ''}"
                 f"{'' if self.lowercase else ', cased'}"]
        if self.char_vocabulary is not None:
            parts.append(f"char CNN {self.char_settings['char_filters']}")
        if self.casing is not None:
            parts.append(f"casing {self.casing.embedding_dim}")
        return ", ".join(parts) + ", CRF"

    def emissions_from_features(self, features: Tensor) -> Tensor:
        return self.head(self.output_dropout(features))

    def layer_groups(self) -> list[tuple[str, list[nn.Parameter]]]:
        """"input" (word table unless frozen, casing, character CNN), "lstm", "output" (linear
        layer and CRF)."""
        lstm = list(self.lstm.parameters())
        output = [*self.head.parameters(), *self.crf.parameters()]
        left_out = {id(p) for p in lstm + output}
        if self.frozen_embeddings:
            left_out.add(id(self.word_embedding.weight))
        inputs = [p for p in self.parameters() if id(p) not in left_out]
        return [(name, params) for name, params in (("input", inputs), ("lstm", lstm), ("output", output)) if params]

    # ------------------------------------------------------------------ saving
    def config(self) -> dict[str, Any]:
        return {"embedding_dim": self.embedding_dim, "hidden_size": self.hidden_size,
                "num_layers": self.lstm.num_layers, "dropout": self.dropout_rate,
                "casing_dim": 0 if self.casing is None else self.casing.embedding_dim,
                "char_cnn": self.char_vocabulary is not None, **self.char_settings,
                "lowercase": self.lowercase, "freeze_embeddings": self.frozen_embeddings,
                **({"lowercase_fallback": True} if self.lowercase_fallback else {})}

    def save_extra(self, directory: str) -> None:
        vocab = {"words": list(self.vocabulary)}
        if self.char_vocabulary is not None:
            vocab["chars"] = list(self.char_vocabulary)
        with open(os.path.join(directory, VOCAB_NAME), "w") as f:
            json.dump(vocab, f, ensure_ascii=False)

    @classmethod
    def build_from_saved(cls, directory: str, labels: list[str], config: dict[str, Any]) -> "BiLSTMCRFTagger":
        path = os.path.join(directory, VOCAB_NAME)
        vocab = read_json(path, "a saved BiLSTMCRFTagger's vocabulary")
        chars = vocab.get("chars") if isinstance(vocab, dict) else None
        if (not isinstance(vocab, dict) or not isinstance(vocab.get("words"), list)
                or not all(isinstance(w, str) for w in vocab["words"] + (chars or []))
                or not isinstance(chars, (list, type(None)))):
            raise ValueError(f"{path} must be a JSON object with 'words' (and, with char_cnn, 'chars'): lists of str")
        if config.get("char_cnn") and chars is None:
            raise ValueError(f"{path} has no 'chars' but the tagger has a character CNN (char_cnn = true)")
        for name, items in (("words", vocab["words"]), ("chars", chars)):
            if items is not None and items[:2] != [PAD, UNK]:
                raise ValueError(f"{path}: {name!r} must start with {PAD!r}, {UNK!r}, got {items[:2]}")
        return cls(labels, vocab["words"], chars=chars, **config)
