"""TorchCRF (PyPI `TorchCRF`, `import TorchCRF`), s14t284/TorchCRF.

Conventions (read from TorchCRF/__init__.py, 1.1.0):
- `TorchCRF.CRF(num_labels, pad_idx=None, use_gpu=True)`: BATCH-FIRST, emissions `h` (B, L, T).
- parameters `trans_matrix[from, to]` ("transition matrix format (source, destination)"),
  `start_trans`, `end_trans`: overwritten with crfkit's.
- mask (B, L) bool, left-aligned (sequence lengths are `mask.sum(1)`).
- log Z: the private `_compute_denominator_log_likelihood(h, mask)` (forward(h, labels, mask)
  also computes the gold-path numerator).
- Viterbi: `viterbi_decode(h, mask)` returns a list of tag lists and NO scores (per-sentence
  Python backtrace that inserts at the front of a list); rescored by crfkit for the check.
- no marginals (the adapter differentiates its log Z), no k-best.
"""
from __future__ import annotations

from .base import ModulePeer


class TorchCrf(ModulePeer):
    name = "TorchCRF"
    module = "TorchCRF"
    dist = "TorchCRF"
    native = frozenset({"log_partition", "viterbi"})
    transitions_attr, start_attr, end_attr = "trans_matrix", "start_trans", "end_trans"

    def _make(self, num_tags):
        return self.lib.CRF(num_tags, use_gpu=False)

    def _log_z(self, state, emissions):
        return state["crf"]._compute_denominator_log_likelihood(emissions, state["mask"])

    def _viterbi(self, state):
        return state["crf"].viterbi_decode(state["x"].emissions, state["mask"])
