"""pytorch-crf (PyPI `pytorch-crf`, `import torchcrf`), kmkurn/pytorch-crf.

Conventions (read from torchcrf/__init__.py, 0.7.2):
- `torchcrf.CRF(num_tags, batch_first=False)`: TIME-FIRST by default; emissions (L, B, T)
  (batch_first=True transposes them inside the public methods). The private methods used here
  take time-first tensors, so the adapter passes `emissions.transpose(0, 1)` (a view).
- parameters `transitions[from, to]` (the forward step is `score.unsqueeze(2) + transitions +
  emissions.unsqueeze(1)`, reduced over dim 1 = from), `start_transitions`, `end_transitions`:
  overwritten with crfkit's transitions / start / end.
- mask (L, B) byte/bool, left-aligned, the first position of every sentence must be on
  (empty sentences are rejected).
- log Z: the private `_compute_normalizer(emissions_tf, mask_tf)` (the public forward returns the
  log-likelihood of given tags, i.e. also walks the gold path in a second Python loop).
- Viterbi: `decode(emissions, mask)` returns a list of tag lists and NO scores (a batched max
  over time, then a per-sentence Python backtrace); scores are rescored by crfkit for the check.
- no marginals (the adapter differentiates its log Z), no k-best.
"""
from __future__ import annotations

from .base import ModulePeer


class PytorchCrf(ModulePeer):
    name = "pytorch-crf"
    module = "torchcrf"
    dist = "pytorch-crf"
    native = frozenset({"log_partition", "viterbi"})

    def _make(self, num_tags):
        return self.lib.CRF(num_tags, batch_first=True)

    def _log_z(self, state, emissions):
        return state["crf"]._compute_normalizer(emissions.transpose(0, 1), state["mask_tf"])

    def _viterbi(self, state):
        return state["crf"].decode(state["x"].emissions, state["mask"])
