"""crfkit: fast, exact linear-chain CRF operations for PyTorch.

    import crfkit
    log_z = crfkit.log_partition(emissions, transitions, lengths)          # (B,)
    best = crfkit.kbest_viterbi(emissions, transitions, k=5, lengths=lengths)
    best.paths, best.scores, best.log_probs                                 # (B,5,L), (B,5), (B,5)

See crfkit.functional for shapes and conventions, crfkit.backend_info() for which
implementation runs.
"""
from . import constraints, reference
from .backends import backend_info, set_backend, use_backend
from .functional import (
    KBest,
    kbest_viterbi,
    lengths_from_mask,
    log_partition,
    marginals,
    sequence_score,
    viterbi,
)
from .nn import CRF

__version__ = "0.1.0"

__all__ = [
    "CRF",
    "KBest",
    "backend_info",
    "constraints",
    "kbest_viterbi",
    "lengths_from_mask",
    "log_partition",
    "marginals",
    "reference",
    "sequence_score",
    "set_backend",
    "use_backend",
    "viterbi",
]
