"""crfkit.CRF: a linear-chain CRF layer (nn.Module) over the functional ops.

Familiar to pytorch-crf users, with two deliberate differences:
- batch first always: emissions (B, L, T);
- CRF(...)(emissions, tags) returns the NEGATIVE log-likelihood, a loss to minimise
  (pytorch-crf returns the log-likelihood; crf.log_likelihood(...) gives that).
Masks from pytorch-crf / AllenNLP are accepted as `mask` (B, L) bool, with holes or left padding
if need be (crfkit.functional: masked positions are skipped and the chain joins across them);
`allowed` (B, L, T) bool restricts the tags of each position (partial labels, forced tags), and
crf(emissions, allowed=...) is the partial-annotation loss (crfkit.partial_nll). Under
torch.jit.script masks must be left-aligned and `allowed` is not taken.

torch.jit.script(crf) works (with crfkit's compiled extension loaded): each method's
`torch.jit.is_scripting()` branch runs the TorchScript form of the front end (crfkit/_scripting.py),
which calls the compiled ops directly; scripted decode / kbest return BestPath / KBest named
tuples, and errors arrive as torch.jit.Error carrying the eager message.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from . import _scripting
from . import functional as crf_ops
from ._validation import CRF_REDUCTIONS, check_int, check_reduction
from .constraints import Constraints
from .reference import log_likelihood_from_scores



def reduce_per_sentence(values: Tensor, reduction: str, lengths: Optional[Tensor] = None,
                        batch_and_length: Optional[Tuple[int, int]] = None) -> Tensor:
    """values (B,) per sentence -> reduced as `reduction` says (one of CRF_REDUCTIONS): 'none',
    'sum', 'mean' over sentences, or 'token_mean' (the sum over the real tokens: lengths.sum(),
    or B * L when lengths is None; batch_and_length = (B, L)). An empty batch, or one without a
    real token, gives 0 (with zero gradients), not the NaN of 0 / 0."""
    if reduction == "none":
        return values
    if reduction == "sum" or values.numel() == 0:
        return values.sum()
    if reduction == "mean":
        return values.mean()
    if lengths is None:
        assert batch_and_length is not None, "token_mean without lengths needs batch_and_length"
        return values.sum() / max(batch_and_length[0] * batch_and_length[1], 1)
    return values.sum() / lengths.sum().clamp(min=1)


class CRF(nn.Module):
    """Linear-chain CRF with learnable transitions (T, T) [from, to] and start / end scores (T,).

    Args:
        num_tags: T.
        constraints: optional crfkit.constraints.Constraints (e.g. from
            crfkit.constraints.allowed_transitions(labels, "BIO")); forbidden transitions,
            first and last tags are -inf in every operation (training and decoding).
        include_start_end: learn start / end scores (default True).
    """

    def __init__(self, num_tags: int, constraints: Optional[Constraints] = None, include_start_end: bool = True):
        super().__init__()
        self.num_tags = check_int("num_tags", num_tags, minimum=1, type_error=ValueError)
        self.transitions = nn.Parameter(torch.empty(num_tags, num_tags))
        self.start = nn.Parameter(torch.empty(num_tags)) if include_start_end else None
        self.end = nn.Parameter(torch.empty(num_tags)) if include_start_end else None
        if constraints is not None and constraints.num_tags != num_tags:
            raise ValueError(f"constraints are for {constraints.num_tags} tags, the CRF has {num_tags}")
        masks = constraints.as_scores(torch.float32) if constraints is not None else (None, None, None)
        # Additive 0 / -inf masks; buffers so they follow .to(device) and land in state_dict.
        self.register_buffer("transition_mask", masks[0])
        self.register_buffer("start_mask", masks[1])
        self.register_buffer("end_mask", masks[2])
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p in (self.transitions, self.start, self.end):
            if p is not None:
                nn.init.uniform_(p, -0.1, 0.1)

    def extra_repr(self) -> str:
        return f"num_tags={self.num_tags}, constrained={self.transition_mask is not None}"

    def __prepare_scriptable__(self) -> "CRF":
        # torch.jit.script calls this first: a clear error where the compiled ops are missing,
        # instead of TorchScript's "unknown builtin op crfkit::...".
        _scripting.require_compiled_ops("crfkit.CRF")
        return self

    # The scores the ops see: parameters plus constraint masks.
    def _parameters_for(self, emissions: Tensor):
        def masked(p, mask):
            if p is None:
                return None if mask is None else mask
            return p if mask is None else p + mask

        return (masked(self.transitions, self.transition_mask), masked(self.start, self.start_mask),
                masked(self.end, self.end_mask))

    def constrained_parameters(self):
        """(transitions (T, T), start (T,) or None, end (T,) or None) with the constraint masks
        added: what the functional ops (e.g. crfkit.kbest_viterbi for distillation) need."""
        return self._parameters_for(None)

    def _check_emissions(self, emissions) -> None:
        # Checked here, not left to the ops: they would name the transitions, which the caller never passed.
        if isinstance(emissions, Tensor) and emissions.dim() == 3 and emissions.shape[2] != self.num_tags:
            raise ValueError(f"emissions must have num_tags = {self.num_tags} (the CRF's) in its last dimension, "
                             f"got shape {tuple(emissions.shape)}")

    def _op(self, op, emissions: Tensor, *extra, lengths=None, mask=None, allowed=None):
        """op(emissions, transitions, *extra, lengths, start, end, mask=..., allowed=...) of crfkit.functional
        with this CRF's scores."""
        self._check_emissions(emissions)
        transitions, start, end = self._parameters_for(emissions)
        return op(emissions, transitions, *extra, lengths, start, end, mask=mask, allowed=allowed)

    @torch.jit.export
    def log_partition(self, emissions: Tensor, lengths: Optional[Tensor] = None,
                      mask: Optional[Tensor] = None, allowed: Optional[Tensor] = None) -> Tensor:
        """log Z per sentence: (B,) (of the allowed sequences when allowed (B, L, T) is given)."""
        if torch.jit.is_scripting():
            _scripting.check_no_allowed(allowed)
            em, tr, ln, st, en = self._scripted_args(emissions, lengths, mask)
            return torch.ops.crfkit.log_partition(em, tr, ln, st, en)
        return self._op(crf_ops.log_partition, emissions, lengths=lengths, mask=mask, allowed=allowed)

    @torch.jit.export
    def log_likelihood(self, emissions: Tensor, tags: Tensor, lengths: Optional[Tensor] = None,
                       mask: Optional[Tensor] = None) -> Tensor:
        """log P(tags | x) per sentence: (B,), <= 0."""
        if torch.jit.is_scripting():
            em, tr, ln, st, en = self._scripted_args(emissions, lengths, mask)
            score = _scripting.sequence_score(em, tr, tags, ln, st, en)
            return _scripting.log_likelihood_from_scores(score, torch.ops.crfkit.log_partition(em, tr, ln, st, en))
        score = self._op(crf_ops.sequence_score, emissions, tags, lengths=lengths, mask=mask)
        return log_likelihood_from_scores(score, self.log_partition(emissions, lengths, mask))

    @torch.jit.export
    def nll(self, emissions: Tensor, tags: Optional[Tensor] = None, lengths: Optional[Tensor] = None,
            mask: Optional[Tensor] = None, reduction: str = "mean", allowed: Optional[Tensor] = None) -> Tensor:
        """Negative log-likelihood of gold tags (B, L), >= 0; or, with allowed (B, L, T) bool instead
        of tags, of the allowed set: -log P(y in allowed | x) (partial annotation, crfkit.partial_nll).

        reduction: 'mean' over sentences (default), 'sum', 'none' (per sentence, (B,)),
        or 'token_mean' (sum divided by the number of real tokens).
        """
        if torch.jit.is_scripting():
            _scripting.check_no_allowed(allowed)
            if tags is None:
                raise ValueError("tags is required (allowed is not taken under torch.jit.script)")
            _scripting.check_reduction(reduction)
            _scripting.check_emissions(emissions)
            lengths = self._scripted_lengths(emissions, lengths, mask)
            return reduce_per_sentence(-self.log_likelihood(emissions, tags, lengths, None), reduction, lengths,
                                       (emissions.shape[0], emissions.shape[1]))
        check_reduction(reduction, CRF_REDUCTIONS)
        if tags is not None and allowed is None:
            per_sentence = -self.log_likelihood(emissions, tags, lengths, mask)
        elif allowed is not None and tags is None:
            self._check_emissions(emissions)
            transitions, start, end = self._parameters_for(emissions)
            per_sentence = crf_ops.partial_nll(emissions, transitions, allowed, lengths, start, end, mask=mask)
        else:
            raise ValueError("give tags (gold tags, (B, L)) or allowed (the allowed tags, (B, L, T)), exactly one")
        if mask is not None and isinstance(mask, Tensor):
            lengths = (mask != 0).sum(1)
        return reduce_per_sentence(per_sentence, reduction, lengths, (emissions.shape[0], emissions.shape[1]))

    forward = nll

    @torch.jit.export
    def decode(self, emissions: Tensor, lengths: Optional[Tensor] = None,
               mask: Optional[Tensor] = None, allowed: Optional[Tensor] = None) -> crf_ops.BestPath:
        """Viterbi: BestPath(scores (B,), paths (B, L) int64 with -1 at padding); the best allowed
        path where allowed (B, L, T) is given."""
        if torch.jit.is_scripting():
            _scripting.check_no_allowed(allowed)
            em, tr, ln, st, en = self._scripted_args(emissions, lengths, mask)
            scores, paths = torch.ops.crfkit.viterbi(em, tr, ln, st, en)
            return crf_ops.BestPath(scores, paths)
        return self._op(crf_ops.viterbi, emissions, lengths=lengths, mask=mask, allowed=allowed)

    @torch.jit.export
    def kbest(self, emissions: Tensor, k: int, lengths: Optional[Tensor] = None,
              mask: Optional[Tensor] = None, allowed: Optional[Tensor] = None) -> crf_ops.KBest:
        """k best distinct paths with scores and true log-probabilities (see crfkit.kbest_viterbi);
        with allowed (B, L, T), the k best consistent with those partial labels."""
        if torch.jit.is_scripting():
            _scripting.check_no_allowed(allowed)
            em, tr, ln, st, en = self._scripted_args(emissions, lengths, mask)
            scores, paths, log_probs = _scripting.kbest_viterbi(em, tr, k, ln, st, en)
            return crf_ops.KBest(scores, paths, log_probs)
        return self._op(crf_ops.kbest_viterbi, emissions, k, lengths=lengths, mask=mask, allowed=allowed)

    @torch.jit.export
    def marginals(self, emissions: Tensor, lengths: Optional[Tensor] = None, mask: Optional[Tensor] = None,
                  allowed: Optional[Tensor] = None) -> Tensor:
        """P(y_i = t | x): (B, L, T) (given that y is allowed, where allowed (B, L, T) is given)."""
        if torch.jit.is_scripting():
            _scripting.check_no_allowed(allowed)
            em, tr, ln, st, en = self._scripted_args(emissions, lengths, mask)
            return torch.ops.crfkit.marginals(em, tr, ln, st, en)
        return self._op(crf_ops.marginals, emissions, lengths=lengths, mask=mask, allowed=allowed)

    # ---- under torch.jit.script (crfkit/_scripting.py): the eager checks, in TorchScript ----------
    def _scripted_parameters(self) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """_parameters_for() in TorchScript: the parameters plus the constraint masks."""
        # The buffers, typed (nn.Module's __getattr__ gives type checkers Tensor | Module).
        transition_mask: Optional[Tensor] = self.transition_mask  # type: ignore[assignment]
        start_mask: Optional[Tensor] = self.start_mask  # type: ignore[assignment]
        end_mask: Optional[Tensor] = self.end_mask  # type: ignore[assignment]
        transitions: Tensor = self.transitions
        if transition_mask is not None:
            transitions = transitions + transition_mask
        start: Optional[Tensor] = self.start
        if start_mask is not None:
            start = start_mask if start is None else start + start_mask
        end: Optional[Tensor] = self.end
        if end_mask is not None:
            end = end_mask if end is None else end + end_mask
        return transitions, start, end

    def _scripted_lengths(self, emissions: Tensor, lengths: Optional[Tensor],
                          mask: Optional[Tensor]) -> Optional[Tensor]:
        """_lengths() in TorchScript."""
        if mask is not None:
            if lengths is not None:
                raise ValueError("give lengths or mask, not both")
            _scripting.check_emissions(emissions)
            if mask.shape != emissions.shape[:2]:
                raise ValueError(f"mask must have shape (batch, seq_len) = {emissions.shape[:2]} of emissions "
                                 f"{emissions.shape}, got {mask.shape}")
            return _scripting.lengths_from_mask(mask)
        return lengths

    def _scripted_args(self, emissions: Tensor, lengths: Optional[Tensor],
                       mask: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """_args() then crfkit._arguments.prepare, in TorchScript: the ops' five arguments."""
        if emissions.dim() == 3 and emissions.shape[2] != self.num_tags:
            raise ValueError(f"emissions must have num_tags = {self.num_tags} (the CRF's) in its last dimension, "
                             f"got shape {emissions.shape}")
        transitions, start, end = self._scripted_parameters()
        lengths = self._scripted_lengths(emissions, lengths, mask)
        return _scripting.prepare(emissions, transitions, lengths, start, end)
