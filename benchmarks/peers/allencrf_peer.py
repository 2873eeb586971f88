"""allencrf (PyPI `allencrf`, `from allencrf.conditional_random_field import
ConditionalRandomField`): AllenNLP's CRF extracted from allennlp (lighttag/allencrf), without
the rest of allennlp.

Conventions (read from allencrf/conditional_random_field.py and viterbi.py, 1.0.2):
- `ConditionalRandomField(num_tags, constraints=None, include_start_end_transitions=True)`:
  BATCH-FIRST logits (B, L, T) (transposed to time-first inside).
- parameters `transitions[from, to]` ("transitions[i, j] is the logit for transitioning from
  state i to state j"), `start_transitions`, `end_transitions` (random normal init):
  overwritten with crfkit's. Constraints apply to decoding only (not used here).
- mask (B, L) bool, left-aligned (the decoder `index_select`s the masked positions).
- log Z: the private `_input_likelihood(logits, mask)` (forward returns the summed
  log-likelihood of given tags).
- Viterbi and k-best: `viterbi_tags(logits, mask, top_k)` loops over the sentences in Python;
  each sentence is padded with START / END sentinel tags (-10000 elsewhere) and decoded by
  `viterbi_decode` with a `torch.topk` over (K * (T+2)) candidates per step; it returns, per
  sentence, a list of (tag list, score) pairs: the scores are the peer's own.
  top_k=None gives the 1-best only (used for the Viterbi op).
- no marginals (the adapter differentiates its log Z).
"""
from __future__ import annotations

import torch

from .base import ModulePeer, pad_paths


class AllenCrf(ModulePeer):
    name = "allencrf"
    module = "allencrf.conditional_random_field"
    dist = "allencrf"
    native = frozenset({"log_partition", "viterbi", "kbest"})
    returns_scores = frozenset({"viterbi", "kbest"})

    def _make(self, num_tags):
        return self.lib.ConditionalRandomField(num_tags)

    def _log_z(self, state, emissions):
        return state["crf"]._input_likelihood(emissions, state["mask"])

    def _viterbi(self, state):
        return state["crf"].viterbi_tags(state["x"].emissions, state["mask"])

    def _viterbi_convert(self, state, out):
        L = state["x"].emissions.shape[1]
        return pad_paths([p for p, _ in out], L), torch.tensor([s for _, s in out], dtype=torch.float32)

    def _kbest(self, state, k):
        return state["crf"].viterbi_tags(state["x"].emissions, state["mask"], top_k=k)

    def _kbest_convert(self, state, out, k):
        B, L = state["x"].emissions.shape[:2]
        paths = torch.full((B, k, L), -1, dtype=torch.long)
        scores = torch.full((B, k), float("-inf"))
        for b, rows in enumerate(out):
            for r, (path, score) in enumerate(rows[:k]):
                paths[b, r] = pad_paths([path], L)[0]
                scores[b, r] = score
        return paths, scores
