"""hmmlearn (PyPI `hmmlearn`, `import hmmlearn._hmmc`): the C++ forward-backward and Viterbi
behind hmmlearn's HMM classes, called one sentence at a time.

hmmlearn's public models (`CategoricalHMM`, `GaussianHMM`, ...) compute the frame
log-probabilities from their own emission distributions, so none of them takes given score
frames. Their `_BaseHMM` calls the pybind11 module `hmmlearn._hmmc`, which does: the adapter
calls it directly (read from hmmlearn's ext/_hmmc.cpp and base.py, 0.3.3):
- `forward_log(startprob, transmat, log_frameprob)` -> (log P(x), fwd (N, T)),
  `backward_log(startprob, transmat, log_frameprob)` -> bwd (N, T),
  `compute_log_xi_sum(fwd, transmat, bwd, log_frameprob)` -> (T, T) log of the expected
  transition counts, `viterbi(startprob, transmat, log_frameprob)` -> (best log-score, path).
  All float64 numpy, ONE sequence per call (N frames, T states); the batch is a Python loop.
- startprob and transmat are PROBABILITIES: each function takes their log itself and never
  checks that they sum to 1, and every recursion stays in log space (logsumexp / max). So a
  linear-chain CRF is passed exactly as exp(start) and exp(transitions) (transmat[from, to],
  the orientation of `log_transmat(i, j)`, i -> j): log Z, marginals and Viterbi are exact
  for unnormalised scores, not only for an HMM. (The scaled "forward_scaling" variant works in
  probability space and would overflow on these scores; it is not used.)
- no end scores: crfkit's end[t] is added to the last frame of each sentence (in setup), so
  log P(x) is log Z with the end scores and the last backward column (0) is right.
- lengths: each sentence is its own (length, T) frame array (length 0 is not representable;
  the benchmark's sentences are at least L/2 long).

What is timed (inputs already in its layout: float64 frames per sentence, exp(start),
exp(transitions), prepared untimed):
- log Z fwd: `forward_log` per sentence.
- marginals: `forward_log` + `backward_log` per sentence and the posteriors
  exp(fwd + bwd - log P(x)), as `_BaseHMM._compute_posteriors_log` does (numpy).
- log Z fwd+bwd: hmmlearn has no autograd: the gradient is its own forward-backward, i.e. the
  marginals as above (d log Z / d emissions) plus `compute_log_xi_sum` per sentence, exponentiated
  and summed over the batch (d log Z / d transitions); the same numbers crfkit's backward returns.
- Viterbi: `viterbi` per sentence; its log-score is the path score, returned by the peer.
- no k-best.
The arithmetic is float64 (crfkit's is float32 here), so hmmlearn's results are compared with
crfkit's under the same tolerances as every peer.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .base import NATIVE, Peer, pad_paths


class Hmmlearn(Peer):
    name = "hmmlearn"
    module = "hmmlearn._hmmc"
    dist = "hmmlearn"
    native = frozenset({"log_partition", "marginals", "viterbi"})
    returns_scores = frozenset({"viterbi"})

    def how(self, op: str) -> Optional[str]:
        if op == "log_partition_fwd_bwd":
            return "its own forward-backward: forward_log, backward_log, compute_log_xi_sum"
        return NATIVE if op in self.native else None

    def _setup(self, x):
        lengths = [int(n) for n in x.lengths]
        emissions = x.emissions.detach().double()
        frames = []
        for b, n in enumerate(lengths):
            f = emissions[b, :n].clone()
            f[n - 1] += x.end.detach().double()
            frames.append(np.ascontiguousarray(f.numpy()))
        return {"x": x, "frames": frames, "lengths": lengths,
                "startprob": np.exp(x.start.detach().double().numpy()),
                "transmat": np.ascontiguousarray(np.exp(x.transitions.detach().double().numpy()))}

    def _log_z_all(self, state):
        forward = self.lib.forward_log
        startprob, transmat = state["startprob"], state["transmat"]
        return [forward(startprob, transmat, f)[0] for f in state["frames"]]

    def _forward_backward(self, state, with_counts: bool):
        """Per sentence: log P(x), posteriors (n, T) and, with_counts, the summed expected
        transition counts (T, T)."""
        lib, startprob, transmat = self.lib, state["startprob"], state["transmat"]
        log_z, posteriors = [], []
        counts = np.zeros_like(transmat) if with_counts else None
        for f in state["frames"]:
            log_prob, fwd = lib.forward_log(startprob, transmat, f)
            bwd = lib.backward_log(startprob, transmat, f)
            log_z.append(log_prob)
            posteriors.append(np.exp(fwd + bwd - log_prob))
            if with_counts:
                counts += np.exp(lib.compute_log_xi_sum(fwd, transmat, bwd, f))
        return log_z, posteriors, counts

    def _pad(self, state, rows) -> torch.Tensor:
        B, L, T = state["x"].emissions.shape
        out = torch.zeros(B, L, T)
        for b, (n, row) in enumerate(zip(state["lengths"], rows)):
            out[b, :n] = torch.from_numpy(row).float()
        return out

    def bind(self, op, x, k=None):
        if op == "log_partition_fwd_bwd":
            state = self._setup(x)

            def fn():
                return self._forward_backward(state, with_counts=True)

            def convert(out):
                log_z, posteriors, counts = out
                return (torch.tensor(log_z, dtype=torch.float32), self._pad(state, posteriors),
                        torch.from_numpy(counts).float())
            return fn, convert
        if op == "log_partition":
            state = self._setup(x)
            return (lambda: self._log_z_all(state)), (lambda out: (torch.tensor(out, dtype=torch.float32),))
        return super().bind(op, x, k)

    def _marginals(self, state):
        return self._forward_backward(state, with_counts=False)[1]

    def _marginals_convert(self, state, out):
        return self._pad(state, out)

    def _viterbi(self, state):
        viterbi, startprob, transmat = self.lib.viterbi, state["startprob"], state["transmat"]
        return [viterbi(startprob, transmat, f) for f in state["frames"]]

    def _viterbi_convert(self, state, out):
        L = state["x"].emissions.shape[1]
        return pad_paths([path for _, path in out], L), torch.tensor([s for s, _ in out], dtype=torch.float32)
