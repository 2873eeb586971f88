"""AllenNLP compatibility: `from crfkit.compat.allennlp import ConditionalRandomField,
allowed_transitions` replaces the same names from `allennlp.modules.conditional_random_field`
(AllenNLP 2.10).

Same constructor, parameters and state_dict keys (`transitions`, `_constraint_mask`,
`start_transitions`, `end_transitions`, so AllenNLP checkpoints of the layer load with
`load_state_dict`), initialisation, and results:
- `forward(inputs, tags, mask)` is the log-likelihood summed over the batch; as in AllenNLP,
  the constraints do NOT enter it (they only restrict decoding);
- `viterbi_tags(logits, mask, top_k)` returns AllenNLP's lists of (tags, score); a forbidden
  transition costs -10000 there, as in AllenNLP, so the scores are AllenNLP's ones and a path
  is returned even when every path breaks a constraint;
- `allowed_transitions(constraint_type, labels)` gives AllenNLP's (from, to) pairs, the last
  two indices standing for START and END.
The log-likelihood, Viterbi and k-best Viterbi run through crfkit.functional (compiled
kernels, one batched call) instead of AllenNLP's per-time-step and per-sentence Python loops.

Differences from AllenNLP, on inputs where its result is not meaningful:
- Masks must be left-aligned (a run of True per sentence, then False; a hole raises
  ValueError). AllenNLP's forward accepts holes but then scores a transition out of the hole
  that its normaliser skips.
- A sentence with no real token (all-False mask) has log-likelihood 0 and the Viterbi result
  ([], 0.0); AllenNLP scores its first token anyway in forward and returns ([], -10000.0).
- top_k lists the allowed sequences exactly as AllenNLP does; past them it goes on with the
  forbidden sequences ranked by their penalised score, T ** length sequences at most. There
  AllenNLP's k-best also runs through its START / END sentinel states, so its list can repeat
  a sequence with another (penalised) score and is filled to top_k beyond T ** length.
- Tags at masked positions are ignored (AllenNLP indexes with them, so they must be valid).
- Ties between equally scored paths follow crfkit's rule (crfkit.functional's docstring).
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .. import functional as crf_ops
from .._arguments import HALF_DTYPES
from .._validation import check_int
from ..reference import log_likelihood_from_scores

# A decoded sentence: its tags and their score.
ViterbiDecoding = Tuple[List[int], float]

# AllenNLP marks a forbidden transition with this score rather than -inf (kept for identical
# scores, and so that a sentence whose every path is forbidden still gets one).
_FORBIDDEN_SCORE = -10000.0


class _Scheme(NamedTuple):
    """AllenNLP's rules for one tagging scheme, over label prefixes ("O", "B", "I", ...).

    A transition from label a to label b (neither START nor END) is allowed when
    a's prefix is in `free_from` (None: any prefix) and b's prefix in `free_to`, or when
    a's prefix is in `chunk_from`, b's prefix in `chunk_to`, and both have the same entity.
    """

    first: Tuple[str, ...]   # prefixes START may move to
    last: Tuple[str, ...]    # prefixes that may move to END
    free_from: Optional[Tuple[str, ...]]
    free_to: Tuple[str, ...]
    chunk_from: Tuple[str, ...]
    chunk_to: Tuple[str, ...]


# Written out from AllenNLP's documented rules. Not built on crfkit.constraints on purpose:
# AllenNLP splits a label into its first character (the prefix) and the rest (the entity,
# e.g. "-PER"), names the single-tag and last-tag prefixes U and L (BIOUL), never allows "O"
# under BMES and simply never allows a label with an unknown prefix, where crfkit.constraints
# splits on "-", uses BIOES and rejects such labels. Only the same rules give the same pairs.
_SCHEMES: Dict[str, _Scheme] = {
    "BIO": _Scheme(first=("O", "B"), last=("O", "B", "I"),
                   free_from=None, free_to=("O", "B"), chunk_from=("B", "I"), chunk_to=("I",)),
    "IOB1": _Scheme(first=("O", "I"), last=("O", "B", "I"),
                    free_from=None, free_to=("O", "I"), chunk_from=("B", "I"), chunk_to=("B",)),
    "BIOUL": _Scheme(first=("O", "B", "U"), last=("O", "L", "U"),
                     free_from=("O", "L", "U"), free_to=("O", "B", "U"), chunk_from=("B", "I"), chunk_to=("I", "L")),
    "BMES": _Scheme(first=("B", "S"), last=("E", "S"),
                    free_from=("E", "S"), free_to=("B", "S"), chunk_from=("B", "M"), chunk_to=("M", "E")),
}


def _transition_allowed(scheme: _Scheme, from_label: Tuple[str, str], to_label: Tuple[str, str]) -> bool:
    (from_prefix, from_entity), (to_prefix, to_entity) = from_label, to_label
    if to_prefix == "START" or from_prefix == "END":
        return False
    if from_prefix == "START":
        return to_prefix in scheme.first
    if to_prefix == "END":
        return from_prefix in scheme.last
    if (scheme.free_from is None or from_prefix in scheme.free_from) and to_prefix in scheme.free_to:
        return True
    return from_prefix in scheme.chunk_from and to_prefix in scheme.chunk_to and from_entity == to_entity


def allowed_transitions(constraint_type: str, labels: Dict[int, str]) -> List[Tuple[int, int]]:
    """The (from, to) index pairs a tagging scheme allows, in AllenNLP's format.

    Args:
        constraint_type: "BIO", "IOB1", "BIOUL" or "BMES" (as spelled).
        labels: {index: label} for indices 0 .. n-1, e.g. a vocabulary's index-to-token map;
            a label is its prefix (first character) followed by its entity ("B-PER": "B", "-PER").

    Returns:
        The allowed pairs over n + 2 indices, n standing for START and n + 1 for END, listed
        with `from` in the order of `labels` then START, END, and `to` in the same order
        within each `from` (AllenNLP's order). Pass it as ConditionalRandomField(constraints=...).

    Raises:
        ValueError: unknown constraint_type, or a label that is not a non-empty str.
    """
    scheme = _SCHEMES.get(constraint_type)
    if scheme is None:
        raise ValueError(f"constraint_type must be one of {tuple(_SCHEMES)}, got {constraint_type!r}")
    nodes = []
    for index, label in labels.items():
        if not isinstance(label, str) or not label:
            raise ValueError(f"labels must map indices to non-empty str labels, got {index!r}: {label!r}")
        nodes.append((index, (label[0], label[1:])))
    nodes += [(len(labels), ("START", "")), (len(labels) + 1, ("END", ""))]
    return [(from_index, to_index)
            for from_index, from_label in nodes
            for to_index, to_label in nodes
            if _transition_allowed(scheme, from_label, to_label)]


class ConditionalRandomField(nn.Module):
    """Linear-chain CRF with AllenNLP's interface; batch first: inputs (B, L, T).

    Args:
        num_tags: T.
        constraints: optional list of allowed (from, to) pairs over T + 2 indices, T being
            START and T + 1 END (see allowed_transitions); every other transition, first and
            last tag is forbidden when decoding. Default: everything allowed.
        include_start_end_transitions: learn scores for the first and last tag (default True).

    Attributes:
        transitions: (T, T) parameter indexed [from, to] (AllenNLP's convention, and crfkit's).
        start_transitions, end_transitions: (T,) parameters, or None without start / end.
        _constraint_mask: (T + 2, T + 2) 1.0 where allowed, 0.0 where forbidden. A Parameter
            with requires_grad=False, as AllenNLP registers it, so that both list the same
            named_parameters and state_dict entries.
    """

    def __init__(self, num_tags: int, constraints: Optional[Sequence[Tuple[int, int]]] = None,
                 include_start_end_transitions: bool = True) -> None:
        super().__init__()
        self.num_tags = check_int("num_tags", num_tags, minimum=1, type_error=ValueError)
        # Registered in AllenNLP's order, so that state_dict lists the keys as it does.
        self.transitions = nn.Parameter(torch.empty(num_tags, num_tags))
        self._constraint_mask = nn.Parameter(self._mask_of(num_tags, constraints), requires_grad=False)
        self.include_start_end_transitions = include_start_end_transitions
        if include_start_end_transitions:
            self.start_transitions = nn.Parameter(torch.empty(num_tags))
            self.end_transitions = nn.Parameter(torch.empty(num_tags))
        else:
            self.start_transitions = None
            self.end_transitions = None
        self.reset_parameters()

    @staticmethod
    def _mask_of(num_tags: int, constraints) -> Tensor:
        size = num_tags + 2
        if constraints is None:
            return torch.ones(size, size)
        mask = torch.zeros(size, size)
        for pair in constraints:
            if len(pair) != 2 or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < size
                                         for i in pair):
                raise ValueError(f"constraints must be (from, to) pairs of ints in [0, num_tags + 2 = {size}), "
                                 f"got {pair!r}")
            mask[pair[0], pair[1]] = 1.0
        return mask

    def reset_parameters(self) -> None:
        """AllenNLP's initialisation, drawn in its order: transitions Xavier-normal,
        start / end transitions standard normal."""
        nn.init.xavier_normal_(self.transitions)
        if self.include_start_end_transitions:
            nn.init.normal_(self.start_transitions)
            nn.init.normal_(self.end_transitions)

    def extra_repr(self) -> str:
        return f"num_tags={self.num_tags}, include_start_end_transitions={self.include_start_end_transitions}"

    def forward(self, inputs: Tensor, tags: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """Log-likelihood log P(tags | inputs) summed over the batch: () tensor, to be MAXIMISED.
        The constraints do not enter it (as in AllenNLP).

        Args:
            inputs: (B, L, T) emission scores (logits).
            tags: (B, L) integer tags.
            mask: optional (B, L), True (nonzero) at real tokens, left-aligned. Default: all True.
        """
        self._validate("inputs", inputs, tags, mask)
        lengths = None if mask is None else crf_ops.lengths_from_mask(mask)
        inputs, transitions, start, end = self._in_one_dtype(inputs, self.transitions, self.start_transitions,
                                                             self.end_transitions)
        score = crf_ops.sequence_score(inputs, transitions, tags, lengths, start, end)
        log_z = crf_ops.log_partition(inputs, transitions, lengths, start, end)
        log_likelihood = log_likelihood_from_scores(score, log_z)
        return log_likelihood.sum()

    def viterbi_tags(self, logits: Tensor, mask: Optional[Tensor] = None,
                     top_k: Optional[int] = None) -> Union[List[ViterbiDecoding], List[List[ViterbiDecoding]]]:
        """Best tag sequences under the constraints (Viterbi, or exact k-best Viterbi).

        Args:
            logits: (B, L, T) emission scores.
            mask: optional (B, L), True at real tokens, left-aligned.
            top_k: None for the best sequence only, or k >= 1.

        Returns:
            top_k None: B pairs (tags, score), tags a list of ints as long as the sentence.
            top_k = k: B lists of up to k such pairs, best first (fewer only when a sentence
            has fewer than k tag sequences). A score is the path's total: emissions,
            transitions, start / end scores, and -10000 per forbidden transition, first or
            last tag.
        """
        check_int("top_k", top_k, minimum=1, optional=True, type_error=ValueError)
        self._validate("logits", logits, None, mask)
        lengths = None if mask is None else crf_ops.lengths_from_mask(mask)
        with torch.no_grad():  # decoding: nothing to differentiate
            logits, transitions, start, end = self._in_one_dtype(logits, *self._decoding_scores())
            if top_k is None:
                scores, paths = crf_ops.viterbi(logits, transitions, lengths, start, end)
                scores, paths = scores.unsqueeze(1), paths.unsqueeze(1)
            else:
                scores, paths, _ = crf_ops.kbest_viterbi(logits, transitions, top_k, lengths, start, end)
        sentence_lengths = [logits.shape[1]] * logits.shape[0] if lengths is None else lengths.tolist()
        decodings = [
            [(path[:length], score) for path, score in zip(sentence_paths, sentence_scores)
             if score != float("-inf")]  # k-best rows beyond the sentence's T ** length sequences
            for sentence_paths, sentence_scores, length in zip(paths.tolist(), scores.tolist(), sentence_lengths)
        ]
        if top_k is None:
            return [sentence[0] for sentence in decodings]
        return decodings

    def _decoding_scores(self) -> Tuple[Tensor, Tensor, Tensor]:
        """(transitions (T, T), start (T,), end (T,)) with AllenNLP's -10000 at forbidden
        entries, from the parameters (zeros without start / end) and _constraint_mask.

        allowed * score + (1 - allowed) * -10000: AllenNLP's arithmetic, so that a mask with
        values other than 0 / 1 (loaded from a checkpoint) scales the scores as it does there."""
        T = self.num_tags
        allowed = self._constraint_mask.detach()
        start_index, end_index = T, T + 1

        def constrained(score: Optional[Tensor], allowed_part: Tensor) -> Tensor:
            penalty = _FORBIDDEN_SCORE * (1 - allowed_part)
            return penalty if score is None else score.detach() * allowed_part + penalty

        return (constrained(self.transitions, allowed[:T, :T]),
                constrained(self.start_transitions, allowed[start_index, :T]),
                constrained(self.end_transitions, allowed[:T, end_index]))

    @staticmethod
    def _in_one_dtype(emissions: Tensor, transitions: Tensor, start: Optional[Tensor], end: Optional[Tensor]):
        """crfkit's ops need the scores in the emissions' dtype: use the promoted dtype of both,
        as AllenNLP's arithmetic on them does (float64 inputs with float32 parameters give
        float64). Half-precision pairs are left to crfkit (computed in float32)."""
        dtype = torch.promote_types(emissions.dtype, transitions.dtype)
        if dtype in HALF_DTYPES:
            return emissions, transitions, start, end
        return tuple(None if x is None else x.to(dtype) for x in (emissions, transitions, start, end))

    def _validate(self, name: str, emissions: Tensor, tags: Optional[Tensor], mask: Optional[Tensor]) -> None:
        if not isinstance(emissions, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (batch, seq_len, num_tags), got {type(emissions).__name__}")
        if emissions.dim() != 3 or emissions.shape[2] != self.num_tags:
            raise ValueError(f"{name} must have shape (batch, seq_len, num_tags = {self.num_tags}), "
                             f"got {tuple(emissions.shape)}")
        for other_name, other in (("tags", tags), ("mask", mask)):
            if other is None:
                continue
            if not isinstance(other, Tensor):
                raise TypeError(f"{other_name} must be a torch.Tensor (batch, seq_len), got {type(other).__name__}")
            if other.shape != emissions.shape[:2]:
                raise ValueError(f"{other_name} must have shape (batch, seq_len) = {tuple(emissions.shape[:2])} "
                                 f"of {name}, got {tuple(other.shape)}")
