"""pyt-crf (PyPI `pyt-crf`, `import pyt_crf`).

Installed with `pip install --no-deps --ignore-requires-python pyt-crf`: its metadata asks for
Python >= 3.12 (and torch >= 2.10), but the code runs on Python 3.11 (see install.sh).

Conventions (read from pyt_crf/crf.py, 0.1.2):
- `pyt_crf.CRF(num_tags, batch_first=True)`: BATCH-FIRST by default, emissions (B, L, T).
- parameters `transitions[from, to]` ("score for moving from tag i to tag j"),
  `start_transitions`, `end_transitions`: overwritten with crfkit's.
- mask (B, L) bool; the first position must be on; holes are allowed (bridged by one
  transition); here left-aligned masks from the lengths.
- forward returns the NEGATIVE log-likelihood (mean by default). log Z: the private
  `_log_partition(emissions, mask)` (a Python loop over time).
- Viterbi: `decode(emissions, mask)` returns a list of tag lists and NO scores (batched max,
  batched backtrace, then `.tolist()` per sentence); rescored by crfkit for the check.
  (`forward_and_decode` fuses log Z and Viterbi in one sweep; not used: the ops are timed apart.)
- no marginals (the adapter differentiates its log Z), no k-best.
"""
from __future__ import annotations

from .base import ModulePeer


class PytCrf(ModulePeer):
    name = "pyt-crf"
    module = "pyt_crf"
    dist = "pyt-crf"
    native = frozenset({"log_partition", "viterbi"})

    def _make(self, num_tags):
        return self.lib.CRF(num_tags, batch_first=True)

    def _log_z(self, state, emissions):
        return state["crf"]._log_partition(emissions, state["mask"])

    def _viterbi(self, state):
        return state["crf"].decode(state["x"].emissions, state["mask"])
