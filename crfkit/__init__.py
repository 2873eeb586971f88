"""crfkit: fast, exact linear-chain CRF operations for PyTorch.

    import crfkit
    log_z = crfkit.log_partition(emissions, transitions, lengths)          # (B,)
    best = crfkit.kbest_viterbi(emissions, transitions, k=5, lengths=lengths)
    best.scores, best.paths, best.log_probs                                 # (B,5), (B,5,L), (B,5)

See crfkit.functional for shapes and conventions, crfkit.backend_info() for which
implementation runs, crfkit.build_extension() (`python -m crfkit.build`) to compile the kernels
for the running torch where the installed package has none (crfkit/_build.py). The layers above
the CRF ops (crfkit.distill, crfkit.taggers, crfkit.training) are imported on first use, so
`import crfkit` loads the ops only.
"""
import importlib

from . import constraints, reference
from .backends import (backend_info, build_extension, cached_memory, release_cached_memory, set_backend,
                       use_backend)
from .backends.deferred_errors import check_errors, deferred_errors
from .distribution import LinearChainCRF
from .entities import EntityMarginals, MBRDecode, entity_marginals, mbr_decode
from .functional import (
    BestPath,
    KBest,
    Samples,
    expected_transition_counts,
    kbest_viterbi,
    lengths_from_mask,
    log_partition,
    marginals,
    partial_nll,
    sample,
    sequence_score,
    viterbi,
)
from .nn import CRF
from ._version import __version__ as __version__

_LAZY_SUBMODULES = ("calibration", "compat", "data", "distill", "taggers", "training")


def __getattr__(name: str):
    # crfkit.distill etc. on first attribute access (PEP 562), as `import crfkit.distill` would.
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BestPath",
    "CRF",
    "EntityMarginals",
    "KBest",
    "LinearChainCRF",
    "MBRDecode",
    "Samples",
    "backend_info",
    "build_extension",
    "cached_memory",
    "check_errors",
    "constraints",
    "deferred_errors",
    "distill",
    "entity_marginals",
    "expected_transition_counts",
    "kbest_viterbi",
    "lengths_from_mask",
    "log_partition",
    "marginals",
    "mbr_decode",
    "partial_nll",
    "reference",
    "release_cached_memory",
    "sample",
    "sequence_score",
    "set_backend",
    "use_backend",
    "viterbi",
]
