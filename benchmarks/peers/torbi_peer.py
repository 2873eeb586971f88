"""torbi (PyPI `torbi`), maxrmorrison/torbi: batched Viterbi decoding in C++ / CUDA, a PyTorch
operator `torch.ops.torbi.viterbi_decode`. Decoding only: no log Z, marginals nor k-best.

Which torbi runs here: the newest release, 1.4.1, is a wheel only, with prebuilt `_C.pt<torch>`
libraries for torch 2.6 to 2.11; on torch 2.13 its `import torbi` finds no `_C.pt213cpu` file,
and loading the 2.11 (or any other) CPU library fails on an undefined C++ symbol of torch
(`torch::Library::_def(...)`): a binary built against another torch. The newest sdist, 1.3.3
(its csrc/viterbi.cpp and ops.cpp are those of the repository's main branch; the 1.4.1 wheel
ships no C++ sources to compare) builds against the installed
torch with `pip install --no-deps --no-build-isolation torbi==1.3.3` (install.sh).
Its dependencies are not installed (`--no-deps`): torbi declares torch (never reinstalled
here), torchaudio (which would bring a torch of its own), torchutil, yapecs, tqdm and numpy, and
its package `__init__` imports yapecs and, through its submodules, torchutil. The adapter needs
none of them: it loads the compiled library of the installed package (`torch.ops.load_library`,
as that `__init__` does) without running the package `__init__`, and calls the operator.

Conventions (read from torbi/csrc/viterbi.cpp and torbi/viterbi.py, 1.3.3):
- `viterbi_decode(observation (N, T, S) float32, batch_frames (N,) int32, transition (S, S)
  float32, initial (S,) float32) -> indices (N, T) int32`: scores in LOG space (torbi's
  `from_probabilities(..., log_probs=True)` only adds a 1e-38 floor through exp / log first);
  max-plus, so unnormalised scores decode exactly.
- transition is indexed [to, from] by the CPU kernel (`probability[j * S + s] =
  posterior[s] + transition[j * S + s]`, maximised over s for the next state j): the adapter
  passes crfkit's transitions transposed (contiguous, prepared untimed); `initial` = start.
- no end scores: end[t] is added to the last frame of each sentence, inside the timed call
  (one indexed add on a copy of the emissions).
- lengths: `batch_frames`, left-aligned; positions past a sentence's length hold copies of its
  last tag (set to -1 for the check). No scores are returned: crfkit rescores the paths.
- `torbi.decode` (the Python wrapper) calls `torch.set_num_threads(num_threads)` on every call;
  the operator is called directly so that the benchmark's thread count stays as set. The CPU
  kernel loops over the sentences one after the other and parallelises (at::parallel_for)
  within each time step, over the states.
"""
from __future__ import annotations

import glob
import os

import torch

from .base import Peer, PeerUnavailable, mask_paths, package_folder, rescore


def _load_operator():
    if hasattr(torch.ops, "torbi") and hasattr(torch.ops.torbi, "viterbi_decode"):
        return torch.ops.torbi
    folder = package_folder("torbi", "torbi")
    libraries = sorted(glob.glob(os.path.join(folder, "_C*.so")))
    if not libraries:
        raise PeerUnavailable(f"torbi: no compiled library (_C*.so) in {folder}")
    errors = []
    for path in libraries:  # a wheel holds one per torch version; only one can load
        try:
            torch.ops.load_library(path)
            return torch.ops.torbi
        except (OSError, RuntimeError) as error:
            errors.append(f"{os.path.basename(path)}: {str(error).strip().splitlines()[-1][:160]}")
    raise PeerUnavailable("torbi: no compiled library loads with torch " + torch.__version__ + " ("
                          + "; ".join(errors[:3]) + (f"; {len(errors) - 3} more" if len(errors) > 3 else "")
                          + "): build it from the sdist, see install.sh")


class Torbi(Peer):
    name = "torbi"
    module = "torch.ops.torbi (torbi's compiled library)"
    dist = "torbi"
    native = frozenset({"viterbi"})

    def _load(self):
        return _load_operator()

    def _setup(self, x):
        B = x.emissions.shape[0]
        return {"x": x, "frames": x.lengths.to(torch.int32), "last": x.lengths - 1, "rows": torch.arange(B),
                "emissions": x.emissions.detach().float().contiguous(),
                "transition": x.transitions.detach().float().t().contiguous(),
                "initial": x.start.detach().float().contiguous(), "end": x.end.detach().float()}

    def _viterbi(self, state):
        observation = state["emissions"].clone()
        observation[state["rows"], state["last"]] += state["end"]
        return self.lib.viterbi_decode(observation, state["frames"], state["transition"], state["initial"])

    def _viterbi_convert(self, state, out):
        x = state["x"]
        paths = mask_paths(out.long(), x.lengths)
        return paths, rescore(x, paths)
