"""pytorchcrf (PyPI `pytorchcrf`, `import pytorchcrf`): pytorch-crf with a batched Viterbi
backtrace and an n-best decoder (Feiyang Niu).

Conventions (read from pytorchcrf/pytorch_crf.py, 1.2.0):
- `pytorchcrf.CRF(num_tags, batch_first=False)`: TIME-FIRST by default (as pytorch-crf); the
  adapter builds it with batch_first=True for decode and passes time-first views to the
  private log Z.
- parameters `transitions[from, to]`, `start_transitions`, `end_transitions`: overwritten with
  crfkit's.
- mask: converted to uint8 inside decode (torch.where then warns that uint8 conditions are
  deprecated; the warning is silenced here); left-aligned, first position on.
- log Z: the private `_compute_normalizer(emissions_tf, mask_tf)` (same code as pytorch-crf).
- Viterbi / n-best: `decode(emissions, mask, nbest=K)` returns a tensor (K, B, L) of TAGS ONLY,
  no scores, with `pad_tag` (0) at padding; nbest=1 runs the batched 1-best decoder.
  Scores are rescored by crfkit for the check.
  On recent torch the n-best decoder fails with "view size is not compatible with input
  tensor's size and stride": the adapter runs the peer's own `_viterbi_decode_nbest`
  recompiled from its source with `.view(` -> `.reshape(` (a runtime patch in a subclass;
  site-packages untouched). Its first step keeps the top K of only T candidates, so
  K > num_tags raises ("selected index k out of range").
- no marginals (the adapter differentiates its log Z).
"""
from __future__ import annotations

import warnings

from .base import ModulePeer, mask_paths, rescore, reshape_instead_of_view

warnings.filterwarnings("ignore", message="where received a uint8 condition tensor")


class PytorchCrfNbest(ModulePeer):
    name = "pytorchcrf"
    module = "pytorchcrf"
    dist = "pytorchcrf"
    native = frozenset({"log_partition", "viterbi", "kbest"})

    def __init__(self) -> None:
        super().__init__()
        self.cls = reshape_instead_of_view(self.lib.CRF, "_viterbi_decode_nbest")

    def _make(self, num_tags):
        return self.cls(num_tags, batch_first=True)

    def _log_z(self, state, emissions):
        return state["crf"]._compute_normalizer(emissions.transpose(0, 1), state["mask_tf"])

    def _viterbi(self, state):
        return state["crf"].decode(state["x"].emissions, state["mask"])

    def _viterbi_convert(self, state, out):
        x = state["x"]
        paths = mask_paths(out[0], x.lengths)
        return paths, rescore(x, paths)

    def _kbest(self, state, k):
        return state["crf"].decode(state["x"].emissions, state["mask"], nbest=k)

    def _kbest_convert(self, state, out, k):
        x = state["x"]
        paths = mask_paths(out.permute(1, 0, 2), x.lengths)  # (K, B, L) -> (B, K, L)
        return paths, rescore(x, paths)
