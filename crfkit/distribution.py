"""crfkit.LinearChainCRF: a linear-chain CRF as a distribution over tag sequences, in the
style of torch.distributions and torch-struct, computed with crfkit's ops.

    teacher = crfkit.LinearChainCRF(teacher_emissions, teacher_transitions, lengths)
    student = crfkit.LinearChainCRF(student_emissions, student_transitions, lengths)
    teacher.kbest(5).log_probs                 # (B, 5)
    teacher.cross_entropy(student)             # (B,)  -E_teacher[log P_student(y)], exact
    teacher.kl_divergence(student)             # (B,)  KL(teacher || student), exact

Shapes: emissions (B, L, T); transitions (T, T) [from, to], or per example (B, T, T) / (B, L, T, T);
lengths (B,) or a mask (B, L) with holes; start, end (T,) or (B, T); allowed (B, L, T) bool
(crfkit.functional's module docstring). Everything per sentence is (B,). The exact entropy, cross
entropy and KL divergence use the unary marginals and the expected transition counts (pairwise
marginals summed over positions, or per position for per-position transitions): O(n T^2) per
sentence, no enumeration.

Sentences that allow no sequence at all (every sequence forbidden, log Z = -inf) have no
distribution; their entropy, cross entropy and KL divergence are defined as 0 so that one such
sentence cannot turn a batch loss into NaN, and log_prob is -inf there, with gradient 0. A
length-0 sentence has one (empty) sequence: its entropy, cross entropy and KL divergence are 0
too.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import functional as crf_ops
from . import reference
from ._arguments import apply_mask_and_allowed, per_example_form, prepare
from .reference import log_likelihood_from_scores


class LinearChainCRF:
    """A batch of B linear-chain CRF distributions P(y | x) = exp(s(x, y) - log Z(x)).

    Args:
        emissions: (B, L, T) scores of tag t at position i.
        transitions: (T, T) scores of moving from tag s to tag t (-inf forbids).
        lengths: (B,) int, sentence b is positions 0 .. lengths[b] - 1 (default: all L).
        start, end: (T,) optional scores of the first / last tag.

    The arguments are checked at construction (same rules and messages as the ops). Results are
    computed on demand; log_partition and marginals are cached, so use a new object after
    changing the tensors in place.
    """

    def __init__(self, emissions: Tensor, transitions: Tensor, lengths: Optional[Tensor] = None,
                 start: Optional[Tensor] = None, end: Optional[Tensor] = None, *, mask: Optional[Tensor] = None,
                 allowed: Optional[Tensor] = None):
        # Validate now so that mistakes surface where the object is made. The distribution is
        # held in the form the backends take (crfkit._arguments: mask and allowed applied, real
        # positions moved to the front where the mask has holes, compute dtype, start / end
        # filled in); position-wise results are moved back through self._layout.
        self._layout = None
        if mask is not None or allowed is not None:
            emissions, transitions, lengths, self._layout = apply_mask_and_allowed(emissions, transitions, lengths,
                                                                                   mask, allowed)
        self._prepared_args = prepare(emissions, transitions, lengths, start, end)
        self.emissions, self.transitions = emissions, transitions
        self.start, self.end = start, end
        self.lengths = self._prepared_args[2]  # (B,) int64, always filled in
        self._log_partition: Optional[Tensor] = None
        self._marginals: Optional[Tensor] = None

    def __repr__(self) -> str:
        B, L, T = self.emissions.shape
        return f"LinearChainCRF(batch={B}, seq_len={L}, num_tags={T})"

    @property
    def batch_shape(self) -> torch.Size:
        return self.emissions.shape[:1]

    @property
    def num_tags(self) -> int:
        return self.emissions.shape[2]

    def _args(self):
        return self.emissions, self.transitions, self.lengths, self.start, self.end

    # ---- the core ops ----------------------------------------------------------------------
    @property
    def log_partition(self) -> Tensor:
        """log Z per sentence: (B,)."""
        if self._log_partition is None:
            self._log_partition = crf_ops.log_partition(*self._args())
        return self._log_partition

    partition = log_partition  # torch-struct's name (it is the log partition there too)

    @property
    def marginals(self) -> Tensor:
        """P(y_i = t | x): (B, L, T), zero at padded positions."""
        return self._original(self._compact_marginals(), 1)

    def _compact_marginals(self) -> Tensor:
        if self._marginals is None:
            self._marginals = crf_ops.marginals(*self._args())
        return self._marginals

    def _original(self, x: Tensor, dim: int) -> Tensor:
        return x if self._layout is None else self._layout.to_original(x, dim)

    def expected_transition_counts(self) -> Tensor:
        """E[number of s -> t transitions]: (B, T, T) (pairwise marginals summed over positions)."""
        return crf_ops.expected_transition_counts(*self._args())

    def log_prob(self, tags: Tensor) -> Tensor:
        """log P(tags | x): tags (B, L) -> (B,), or (B, N, L) -> (B, N) (at the original positions)."""
        if self._layout is not None and isinstance(tags, Tensor) and tags.dim() in (2, 3):
            tags = self._layout.to_compact(tags, tags.dim() - 1)
        scores = crf_ops.sequence_score(self.emissions, self.transitions, tags, self.lengths, self.start, self.end)
        return log_likelihood_from_scores(scores, self.log_partition)

    @property
    def argmax(self) -> Tensor:
        """The most probable tag sequence: (B, L) int64, -1 at padded positions. (torch-struct
        returns a one-hot structure here; tags are what sequence labelling needs.)"""
        return self._original(crf_ops.viterbi(*self._args()).paths, 1)

    @property
    def max(self) -> Tensor:
        """The score of the most probable sequence: (B,)."""
        return crf_ops.viterbi(*self._args()).scores

    def kbest(self, k: int) -> crf_ops.KBest:
        """The k most probable distinct sequences: KBest(scores (B, k), paths (B, k, L),
        log_probs (B, k)); see crfkit.kbest_viterbi."""
        emissions, transitions, lengths, start, end = self._args()
        best = crf_ops.kbest_viterbi(emissions, transitions, k, lengths, start, end)
        return best._replace(paths=self._original(best.paths, 2))

    # ---- information measures --------------------------------------------------------------
    def expected_score(self, other: "LinearChainCRF") -> Tensor:
        """E_{y ~ self}[s_other(x, y)]: (B,), the expectation under this distribution of the
        score that `other` gives each sequence. Linear in other's emissions, transitions, start
        and end, so its gradient with respect to them is this distribution's marginals."""
        self._check_compatible(other)
        if self._marginals is None:  # both from one forward-backward where the backend can
            self._marginals, counts = crf_ops.marginals_and_transition_counts(*self._args())
        else:
            counts = self.expected_transition_counts()
        mu = self._marginals  # (B, L, T); counts (B, T, T)
        other_emissions, other_transitions, _, other_start, other_end = other._prepared_args
        B, L, T = mu.shape
        if other_transitions.dim() == 4 and other_transitions.shape[1] > 1:
            # Per-position scores: the expectation needs this distribution's pairwise marginals
            # at each position (B, L, T, T), from the reference (autograd through its log Z).
            emissions, transitions, lengths, start, end = self._prepared_args
            per_position = per_example_form(transitions, start, end, B, T)[0].expand(B, L, T, T)
            counts = reference.transition_gradients(emissions, per_position, lengths, start, end)
        elif other_transitions.dim() == 4:
            other_transitions = other_transitions[:, 0]  # (B, T, T)

        def weighted(weights, scores):
            # Where this distribution puts no mass, other's score (maybe -inf, or NaN padding)
            # must not matter, in the value or in any gradient: select it away before multiplying.
            return weights * torch.where(weights > 0, scores, torch.zeros_like(scores))

        total = (weighted(mu, other_emissions).sum((1, 2))
                 + weighted(counts, other_transitions.expand_as(counts)).flatten(1).sum(1))
        if L > 0:
            last = (self.lengths - 1).clamp(min=0).view(B, 1, 1).expand(B, 1, T)
            mu_last = mu.gather(1, last).squeeze(1)  # (B, T); zero for length-0 sentences
            total = (total + weighted(mu[:, 0], other_start.expand(B, T)).sum(1)
                     + weighted(mu_last, other_end.expand(B, T)).sum(1))
        return total

    def entropy(self) -> Tensor:
        """H(P) = log Z - E_P[s(x, y)]: (B,), >= 0."""
        return self._no_distribution_is_zero(self.log_partition - self.expected_score(self))

    def cross_entropy(self, other: "LinearChainCRF") -> Tensor:
        """H(self, other) = -E_{y ~ self}[log P_other(y)] = log Z_other - E_self[s_other]: (B,).

        +inf where this distribution gives mass to a sequence that `other` forbids."""
        return self._no_distribution_is_zero(other.log_partition - self.expected_score(other))

    def kl_divergence(self, other: "LinearChainCRF") -> Tensor:
        """KL(self || other) = H(self, other) - H(self): (B,), >= 0 up to rounding."""
        return self.cross_entropy(other) - self.entropy()

    def _no_distribution_is_zero(self, value: Tensor) -> Tensor:
        return torch.where(self.log_partition == float("-inf"), torch.zeros_like(value), value)

    def _check_compatible(self, other) -> None:
        if not isinstance(other, LinearChainCRF):
            raise TypeError(f"other must be a crfkit.LinearChainCRF, got {type(other).__name__}")
        if other.emissions.shape != self.emissions.shape:
            raise ValueError(f"the two CRFs must have the same (batch, seq_len, num_tags), got "
                             f"{tuple(self.emissions.shape)} and {tuple(other.emissions.shape)}")
        if not torch.equal(self.lengths, other.lengths):
            raise ValueError("the two CRFs must have the same lengths")
        same_layout = (self._layout is None and other._layout is None) or (
            self._layout is not None and other._layout is not None
            and torch.equal(self._layout.order, other._layout.order))
        if not same_layout:
            raise ValueError("the two CRFs must have the same mask")
