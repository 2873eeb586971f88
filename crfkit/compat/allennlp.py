"""AllenNLP compatibility: `from crfkit.compat.allennlp import ConditionalRandomField,
allowed_transitions` replaces the same names from `allennlp.modules.conditional_random_field`
(AllenNLP 2.10), and so do its three label-weighted variants
ConditionalRandomFieldWeightEmission, ConditionalRandomFieldWeightTrans and
ConditionalRandomFieldWeightLannoy (see their docstrings; they differ from
ConditionalRandomField in forward only).

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
- Masks may have holes (and left padding): masked positions are skipped and the chain joins
  across them (crfkit.functional), in forward and viterbi_tags (which returns the tags of the
  real positions). AllenNLP's forward accepts holes but then scores a transition out of the
  hole that its normaliser skips. (ConditionalRandomFieldWeightLannoy needs left-aligned masks.)
- A sentence with no real token (all-False mask) has log-likelihood 0 and the Viterbi result
  ([], 0.0); AllenNLP scores its first token anyway in forward and returns ([], -10000.0).
- top_k lists the allowed sequences exactly as AllenNLP does; past them it goes on with the
  forbidden sequences ranked by their penalised score, T ** length sequences at most. There
  AllenNLP's k-best also runs through its START / END sentinel states, so its list can repeat
  a sequence with another (penalised) score and is filled to top_k beyond T ** length.
- Tags at masked positions are ignored (AllenNLP indexes with them, so they must be valid).
- Ties between equally scored paths follow crfkit's rule (crfkit.functional's docstring).
- The weighted variants check label_weights when they are built (None, or not num_tags finite
  numbers: ConfigurationError, a ValueError); AllenNLP checks only None there, and a wrong
  length fails in its forward, or broadcasts silently when it is 1.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .. import functional as crf_ops
from .. import reference
from .._arguments import HALF_DTYPES, compute_dtype
from .._validation import check_int
from ..reference import log_likelihood_from_scores

# A decoded sentence: its tags and their score.
ViterbiDecoding = Tuple[List[int], float]


class ConfigurationError(ValueError):
    """A module built with invalid arguments (here: label_weights of the weighted variants).

    Named and shaped after allennlp.common.checks.ConfigurationError, which AllenNLP raises for
    a missing label_weights (`.message`, str() is the message, pickles with it), and a
    ValueError as crfkit's other argument errors are. It is not AllenNLP's class (that would
    mean importing allennlp): `except allennlp.common.checks.ConfigurationError` does not
    catch it; `except ValueError` does.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self):
        return type(self), (self.message,)

    def __str__(self) -> str:
        return self.message


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
            mask: optional (B, L), True (nonzero) at real tokens (holes allowed). Default: all True.
        """
        self._validate("inputs", inputs, tags, mask)
        return self._log_likelihood(inputs, self.transitions, tags, mask)

    def _log_likelihood(self, inputs: Tensor, transitions: Tensor, tags: Tensor, mask: Optional[Tensor]) -> Tensor:
        """sum over the batch of s(tags) - log Z under the given emission and transition scores
        (and the start / end parameters), through crfkit's compiled ops. Arguments validated."""
        inputs, transitions, start, end = self._in_one_dtype(inputs, transitions, self.start_transitions,
                                                             self.end_transitions)
        score = crf_ops.sequence_score(inputs, transitions, tags, start=start, end=end, mask=mask)
        log_z = crf_ops.log_partition(inputs, transitions, start=start, end=end, mask=mask)
        log_likelihood = log_likelihood_from_scores(score, log_z)
        return log_likelihood.sum()

    def viterbi_tags(self, logits: Tensor, mask: Optional[Tensor] = None,
                     top_k: Optional[int] = None) -> Union[List[ViterbiDecoding], List[List[ViterbiDecoding]]]:
        """Best tag sequences under the constraints (Viterbi, or exact k-best Viterbi).

        Args:
            logits: (B, L, T) emission scores.
            mask: optional (B, L), True at real tokens (holes allowed).
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
        with torch.no_grad():  # decoding: nothing to differentiate
            logits, transitions, start, end = self._in_one_dtype(logits, *self._decoding_scores())
            if top_k is None:
                scores, paths = crf_ops.viterbi(logits, transitions, start=start, end=end, mask=mask)
                scores, paths = scores.unsqueeze(1), paths.unsqueeze(1)
            else:
                scores, paths, _ = crf_ops.kbest_viterbi(logits, transitions, top_k, start=start, end=end, mask=mask)
        # The tags of the real positions (-1 elsewhere); k-best rows beyond the sentence's
        # T ** length sequences (score -inf) are left out.
        decodings = [
            [([tag for tag in path if tag >= 0], score) for path, score in zip(sentence_paths, sentence_scores)
             if score != float("-inf")]
            for sentence_paths, sentence_scores in zip(paths.tolist(), scores.tolist())
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


class _LabelWeightedCRF(ConditionalRandomField):
    """What the three weighted variants share: the label_weights buffer, its checks, and
    ConditionalRandomField's decoding (viterbi_tags ignores label_weights, as in AllenNLP: the
    weights only shape the training objective)."""

    def __init__(self, num_tags: int, label_weights: Sequence[float],
                 constraints: Optional[Sequence[Tuple[int, int]]] = None,
                 include_start_end_transitions: bool = True) -> None:
        # The parameters first, as AllenNLP does: same random draws, same state_dict order
        # (transitions, _constraint_mask, start_transitions, end_transitions, label_weights).
        super().__init__(num_tags, constraints, include_start_end_transitions)
        self.register_buffer("label_weights", self._weights_of(self.num_tags, label_weights))

    @staticmethod
    def _weights_of(num_tags: int, label_weights) -> Tensor:
        """label_weights as a (T,) tensor of the default dtype (AllenNLP's torch.Tensor(...))."""
        if label_weights is None:
            raise ConfigurationError("label_weights must be given: a list of num_tags floats, one weight per tag")
        if isinstance(label_weights, (str, bytes)):
            weights = None
        else:
            try:
                weights = torch.as_tensor(label_weights, dtype=torch.get_default_dtype())
            except (TypeError, ValueError, RuntimeError):
                weights = None
        if weights is None or weights.dim() != 1:
            raise ConfigurationError(f"label_weights must be a list of num_tags = {num_tags} floats, "
                                     f"got {label_weights!r}")
        if weights.numel() != num_tags:
            raise ConfigurationError(f"label_weights must have one weight per tag: len(label_weights) must be "
                                     f"num_tags = {num_tags}, got {weights.numel()}")
        if not bool(torch.isfinite(weights).all()):
            raise ConfigurationError(f"label_weights must be finite, got {weights.tolist()}")
        return weights.detach().clone()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, label_weights={self.label_weights.tolist()}"

    def _weighted_scores(self, inputs: Tensor, weight_transitions: bool) -> Tuple[Tensor, Tensor]:
        """(inputs * w[to-tag], transitions, times w[from-tag] if weight_transitions), in the
        dtypes AllenNLP's arithmetic gives (the buffer's and the inputs' promoted)."""
        weights = self.label_weights
        transitions = self.transitions * weights.view(-1, 1) if weight_transitions else self.transitions
        return inputs * weights.view(1, 1, -1), transitions


class ConditionalRandomFieldWeightEmission(_LabelWeightedCRF):
    """AllenNLP's ConditionalRandomFieldWeightEmission: a ConditionalRandomField whose training
    objective weights each tag's emission scores.

    forward is the CRF log-likelihood of the tags in which every emission score of tag t is
    multiplied by label_weights[t], inputs[b, i, t] * w[t], in the path score and in log Z
    alike; transitions, start and end scores are not weighted. With all weights 1 it is
    ConditionalRandomField's forward.

    Args:
        num_tags: T.
        label_weights: T finite floats, one per tag (e.g. larger for rare tags). Required: None,
            another length or non-numbers raise ConfigurationError (a ValueError).
        constraints, include_start_end_transitions: as in ConditionalRandomField (the
            constraints restrict decoding only).

    Attributes: those of ConditionalRandomField, and the buffer `label_weights` (T,), in the
    default dtype, saved in the state_dict as AllenNLP saves it.

    viterbi_tags is ConditionalRandomField's: the weights play no part in decoding.
    """

    def forward(self, inputs: Tensor, tags: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """Emission-weighted log-likelihood summed over the batch: () tensor, to be MAXIMISED.
        Arguments as in ConditionalRandomField.forward."""
        self._validate("inputs", inputs, tags, mask)
        weighted_inputs, transitions = self._weighted_scores(inputs, weight_transitions=False)
        return self._log_likelihood(weighted_inputs, transitions, tags, mask)


class ConditionalRandomFieldWeightTrans(_LabelWeightedCRF):
    """AllenNLP's ConditionalRandomFieldWeightTrans: a ConditionalRandomField whose training
    objective weights each tag's emission and outgoing transition scores.

    forward is the CRF log-likelihood of the tags under the scores inputs[b, i, t] * w[t] and
    transitions[s, t] * w[s] (a transition weighted by the tag it leaves), in the path score and
    in log Z alike; start and end scores are not weighted. With all weights 1 it is
    ConditionalRandomField's forward.

    Args and attributes: as in ConditionalRandomFieldWeightEmission. viterbi_tags is
    ConditionalRandomField's: the weights play no part in decoding.
    """

    def forward(self, inputs: Tensor, tags: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """Emission- and transition-weighted log-likelihood summed over the batch: () tensor, to
        be MAXIMISED. Arguments as in ConditionalRandomField.forward."""
        self._validate("inputs", inputs, tags, mask)
        weighted_inputs, weighted_transitions = self._weighted_scores(inputs, weight_transitions=True)
        return self._log_likelihood(weighted_inputs, weighted_transitions, tags, mask)


class ConditionalRandomFieldWeightLannoy(_LabelWeightedCRF):
    """AllenNLP's ConditionalRandomFieldWeightLannoy: the weighted CRF objective of De Lannoy et
    al., "Weighted conditional random fields for supervised interpatient heartbeat
    classification" (IEEE TBME 2012), where each position counts by the weight of its gold tag.

    For a sentence of n tokens with gold tags y, w = label_weights, forward adds up
        s_w(y) - D_w(y), where
        s_w(y) = start[y_0] + sum_i w[y_i] inputs[i, y_i]
                 + sum_{i >= 1} w[y_{i-1}] transitions[y_{i-1}, y_i] + end[y_{n-1}],
        D_w(y) = sum_{i < n} w[y_i] log z_i + log z_end.
    z_i is the normaliser of the forward algorithm's step i, on the UNWEIGHTED scores: with
    Z_i the sum of exp(score) over all prefixes y_0 .. y_i (start, emissions and transitions up
    to i), log z_0 = log Z_0 and log z_i = log Z_i - log Z_{i-1}; log z_end = log Z - log Z_{n-1}
    is the end transitions' share (0 without start / end transitions). The unweighted sum of the
    log z is log Z, so with all weights 1 this is ConditionalRandomField's forward; otherwise
    it is not a log-likelihood of one distribution (D_w depends on the gold tags).

    Args and attributes: as in ConditionalRandomFieldWeightEmission. viterbi_tags is
    ConditionalRandomField's: the weights play no part in decoding.

    Where AllenNLP's result differs: it accumulates the z_i in probability space (exp of the
    scores, rescaled at each step), which overflows to inf / NaN once a score exceeds the dtype's
    exp range (about 88 in float32); crfkit computes log z_i in log space and stays finite.
    """

    def forward(self, inputs: Tensor, tags: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """Lannoy-weighted objective s_w(y) - D_w(y) summed over the batch: () tensor, to be
        MAXIMISED. Arguments as in ConditionalRandomField.forward."""
        self._validate("inputs", inputs, tags, mask)
        B, L, T = inputs.shape
        lengths = (torch.full((B,), L, dtype=torch.long, device=inputs.device) if mask is None
                   else crf_ops.lengths_from_mask(mask))
        weighted_inputs, weighted_transitions = self._weighted_scores(inputs, weight_transitions=True)
        weighted_inputs, weighted_transitions, start, end = self._in_one_dtype(
            weighted_inputs, weighted_transitions, self.start_transitions, self.end_transitions)
        # The numerator is a path score (weighted emissions and transitions): crfkit's kernel,
        # which also checks the tags at real positions before they index label_weights below.
        numerator = crf_ops.sequence_score(weighted_inputs, weighted_transitions, tags, lengths, start, end)
        return (numerator - self._weighted_normaliser(inputs, tags, lengths)).sum()

    def _weighted_normaliser(self, inputs: Tensor, tags: Tensor, lengths: Tensor) -> Tensor:
        """D_w(y) per sentence: (B,); 0 for a sentence of no token.

        D_w weights each position's share of log Z by that position's gold tag, so it needs
        log Z_i for every prefix, which crfkit's compiled ops do not return (log_partition gives
        log Z of whole sentences, marginals its derivatives): the forward scores come from
        crfkit.reference.forward_log_scores, one differentiable step per position in plain
        PyTorch, as AllenNLP's own loop is."""
        inputs, transitions, start, end = self._in_one_dtype(inputs, self.transitions, self.start_transitions,
                                                             self.end_transitions)
        dtype = compute_dtype(torch.promote_types(inputs.dtype, transitions.dtype))
        inputs, transitions, start, end = (None if x is None else x.to(dtype)
                                           for x in (inputs, transitions, start, end))
        B, L, T = inputs.shape
        valid = torch.arange(L, device=inputs.device) < lengths.unsqueeze(1)  # (B, L)
        alpha = reference.forward_log_scores(inputs, transitions, lengths, start)  # (B, L, T), -inf at padding
        # 0 instead of -inf at padding: the logsumexp stays finite there, so no NaN reaches the
        # gradients through the positions that torch.where discards below.
        alpha = alpha.masked_fill(~valid.unsqueeze(-1), 0)
        log_prefix_z = torch.logsumexp(alpha, dim=2)  # log Z_i: (B, L)
        previous = torch.cat([log_prefix_z.new_zeros(B, 1), log_prefix_z[:, :-1]], dim=1)
        step_log_z = torch.where(valid, log_prefix_z - previous, torch.zeros_like(log_prefix_z))  # log z_i
        gold_weights = self.label_weights.to(dtype)[torch.where(valid, tags, torch.zeros_like(tags))]
        normaliser = (gold_weights * step_log_z).sum(1)
        if end is not None:
            last = (lengths - 1).clamp(min=0)
            last_alpha = alpha[torch.arange(B, device=inputs.device), last]  # (B, T)
            end_log_z = torch.logsumexp(last_alpha + end, dim=1) - log_prefix_z.gather(1, last.unsqueeze(1)).squeeze(1)
            normaliser = normaliser + torch.where(lengths > 0, end_log_z, torch.zeros_like(end_log_z))
        return normaliser
