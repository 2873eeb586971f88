"""torch-struct (PyPI `torch-struct`, `import torch_struct`), harvardnlp/pytorch-struct.

Conventions (read from torch_struct/linearchain.py, helpers.py, distributions.py,
semirings/semirings.py, 0.5):
- no CRF module and no parameters: `LinearChainCRF(log_potentials, lengths)` takes edge
  potentials (B, N-1, C, C) with `log_potentials[b, n, z_{n+1}, z_n]`, i.e. [to, FROM]
  (see `LinearChain.hmm`: transition added as given, the emission of z_{n+1} on dim 2, the
  initial state on dim 3). The adapter builds them from crfkit's inputs INSIDE the timed call
  (they are what a user differentiates through):
      edge[b, n, j, i] = transitions[i, j] + emissions[b, n+1, j]
                         + [n == 0] (emissions[b, 0, i] + start[i])
                         + [n == lengths[b] - 2] end[j]
  so start / end are folded into the first / last edge (no start/end parameters of its own).
- lengths (B,) int64, left-aligned; max(lengths) must equal N (sentence 0 has the full length
  here); a length-1 sentence has no edge and cannot be represented.
- log Z: `.partition` (LogSemiring), a parallel scan over time in O(log L) steps of
  (C x C) x (C x C) log-semiring "matmuls" that broadcast to (B, N/2, C, C, C) tensors
  (memory O(B L C^3)); backward by autograd.
- marginals: `.marginals`: edge marginals by autograd (create_graph=True) of log Z, summed here
  to per-position tag marginals.
- Viterbi: `.argmax` (MaxSemiring marginals: one-hot edges by autograd) converted to tags;
  its score `.max` (a second pass) is computed in convert, not timed.
- k-best: `.topk(K)` (KMaxSemiring(K): every semiring product is a (K*K) top-K, and the K paths
  come from K separate backward passes) converted to tags; scores `.kmax(K)` in convert.
- zero of the log semirings is -1e5 (not -inf).
- every op needs autograd enabled (the adapter enables it).
"""
from __future__ import annotations

import math
import warnings

import torch

from .base import Peer, mask_from_lengths

# torch.distributions' validation notice for LinearChainCRF (it declares no arg_constraints)
warnings.filterwarnings("ignore", message=".*does not define `arg_constraints`")


class TorchStruct(Peer):
    name = "torch-struct"
    module = "torch_struct"
    dist = "torch-struct"
    native = frozenset({"log_partition", "marginals", "viterbi", "kbest"})
    returns_scores = frozenset()  # scores come from .max / .kmax, separate passes

    def memory_estimate(self, op, x, k=None):
        B, L, C = x.emissions.shape
        bin_n = 2 ** int(math.ceil(math.log2(max(L - 1, 2))))
        semiring = (k * k) if op == "kbest" else 1
        first_level = 4 * semiring * B * (bin_n // 2) * C ** 3  # the broadcast of the first scan step
        return first_level * (2 if op == "log_partition" else 4)

    def _setup(self, x):
        B, L, T = x.emissions.shape
        if L < 2:
            raise ValueError("torch-struct cannot represent sentences of length 1")
        end_at = torch.zeros(B, L - 1)
        end_at[torch.arange(B), x.lengths - 2] = 1.0  # the edge that enters the last position
        return {"x": x, "tr": x.transitions.detach().clone().requires_grad_(),
                "end_at": end_at, "lengths": x.lengths.clone()}

    def _potentials(self, state, emissions):
        x, tr = state["x"], state["tr"]
        edge = emissions[:, 1:, :, None] + tr.t()  # (B, L-1, to, from)
        first = (emissions[:, 0] + x.start)[:, None, None, :]  # on "from" of edge 0
        edge = torch.cat([edge[:, :1] + first, edge[:, 1:]], dim=1)
        return edge + state["end_at"][:, :, None, None] * x.end[None, None, :, None]

    def _dist(self, state, emissions):
        return self.lib.LinearChainCRF(self._potentials(state, emissions), lengths=state["lengths"])

    def _log_z(self, state, emissions):
        return self._dist(state, emissions).partition

    def _transitions_leaf(self, state):
        return state["tr"]

    @staticmethod
    def _tags(edges, lengths):
        """One-hot edges (..., B, L-1, to, from) -> tags (..., B, L), -1 padded."""
        first = edges[..., 0, :, :].sum(-2).argmax(-1, keepdim=True)
        rest = edges.sum(-1).argmax(-1)
        tags = torch.cat([first, rest], dim=-1)
        valid = mask_from_lengths(lengths, tags.shape[-1])
        return tags.masked_fill(~valid, -1)

    def _marginals(self, state):
        with torch.enable_grad():
            return self._dist(state, state["x"].emissions).marginals

    def _marginals_convert(self, state, out):
        out = out.detach()
        return torch.cat([out[:, :1].sum(-2), out.sum(-1)], dim=1)

    def _viterbi(self, state):
        with torch.enable_grad():
            return self._dist(state, state["x"].emissions).argmax

    def _viterbi_convert(self, state, out):
        x = state["x"]
        with torch.enable_grad():
            score = self._dist(state, x.emissions).max.detach()
        return self._tags(out.detach(), x.lengths), score

    def _kbest(self, state, k):
        return self._dist(state, state["x"].emissions).topk(k)  # enables grad itself

    def _kbest_convert(self, state, out, k):
        x = state["x"]
        scores = self._dist(state, x.emissions).kmax(k).detach().t()  # (K, B) -> (B, K)
        paths = self._tags(out.detach(), x.lengths)  # (K, B, L)
        return paths.transpose(0, 1).contiguous(), scores
