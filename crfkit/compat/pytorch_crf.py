"""pytorch-crf compatibility: `from crfkit.compat.pytorch_crf import CRF` replaces
`from torchcrf import CRF` (pytorch-crf 0.7.2).

Same constructor, parameter names (`start_transitions`, `end_transitions`, `transitions`, so a
torchcrf state_dict loads with `load_state_dict`, and ours into torchcrf), initialisation,
input layout (sequence first unless `batch_first=True`) and return values: `forward` gives the
LOG-likelihood (not crfkit.CRF's negative one) and `decode` lists of tag lists. The
computation runs through crfkit.functional (sequence_score, log_partition, viterbi), i.e. its
compiled kernels instead of a Python loop over time steps.

Differences from torchcrf, all on inputs where torchcrf's result is not meaningful or raises:
- The mask may have holes, left padding or an off first time step: masked positions are skipped
  and the chain joins across them (crfkit.functional), so the result is the log-likelihood of
  the tags at the on positions; a sentence with no on position has the one empty sequence
  (log-likelihood 0). torchcrf requires the first time step on, and given a mask with holes its
  normaliser carries the scores across the hole while its numerator scores the transition out
  of the hole's tag: its result is not a log-likelihood there. Under torch.jit.script the mask
  must be left-aligned (a run of on positions, then off ones; no other restriction).
- Tags at masked positions are ignored (torchcrf indexes its transitions with them, so padding
  values such as -100 raise IndexError there).
- Tie-breaking between equally scored paths in `decode` follows crfkit's rule
  (crfkit.functional's docstring); torchcrf's depends on `Tensor.max`.

torch.jit.script(CRF(...)) works as torchcrf's does (forward and decode), with crfkit's compiled
extension loaded: the `torch.jit.is_scripting()` branches run crfkit/_scripting.py, which calls
the compiled ops directly. Errors of a scripted module arrive as torch.jit.Error carrying the
eager message.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import _scripting
from .. import functional as crf_ops
from .._arguments import HALF_DTYPES
from .._validation import CRF_REDUCTIONS, check_int, check_reduction
from ..nn import reduce_per_sentence
from ..reference import log_likelihood_from_scores



class CRF(nn.Module):
    """Linear-chain CRF with pytorch-crf's interface.

    Args:
        num_tags: T, the number of tags.
        batch_first: whether inputs are (batch, seq_len, ...) instead of (seq_len, batch, ...).

    Attributes:
        start_transitions: (T,) score of each first tag.
        end_transitions: (T,) score of each last tag.
        transitions: (T, T) score of moving from tag i to tag j, indexed [from, to] (the
            convention of both torchcrf and crfkit, so the parameter is passed as is).
    All three are drawn from U(-0.1, 0.1) in this order, as torchcrf does: under the same seed
    both modules start with the same values.
    """

    def __init__(self, num_tags: int, batch_first: bool = False) -> None:
        check_int("num_tags", num_tags, minimum=1, type_error=ValueError)
        super().__init__()
        self.num_tags = num_tags
        self.batch_first = batch_first
        self.start_transitions = nn.Parameter(torch.empty(num_tags))
        self.end_transitions = nn.Parameter(torch.empty(num_tags))
        self.transitions = nn.Parameter(torch.empty(num_tags, num_tags))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw every parameter from U(-0.1, 0.1)."""
        for parameter in (self.start_transitions, self.end_transitions, self.transitions):
            nn.init.uniform_(parameter, -0.1, 0.1)

    def __repr__(self) -> str:
        # pytorch-crf's repr, which its own test suite checks: the class name and num_tags only.
        return f"{self.__class__.__name__}(num_tags={self.num_tags})"

    def __prepare_scriptable__(self) -> "CRF":
        # torch.jit.script calls this first: a clear error where the compiled ops are missing.
        _scripting.require_compiled_ops("crfkit.compat.pytorch_crf.CRF")
        return self

    def forward(self, emissions: Tensor, tags: Tensor, mask: Optional[Tensor] = None,
                reduction: str = "sum") -> Tensor:
        """Log-likelihood log P(tags | emissions), to be MAXIMISED (negate it for a loss).

        Args:
            emissions: (L, B, T), or (B, L, T) with batch_first.
            tags: (L, B) integer tags, or (B, L) with batch_first.
            mask: optional (L, B), or (B, L) with batch_first: on (nonzero) for real tokens,
                anywhere (see the module docstring). Default: all on.
            reduction: 'none' -> (B,); 'sum' (default) -> () summed over sentences;
                'mean' -> () averaged over sentences; 'token_mean' -> () sum divided by the
                number of real tokens.

        Raises:
            ValueError naming the argument: emissions not 3-dimensional or with a last
            dimension other than num_tags, tags or mask of a shape other than
            emissions.shape[:2], a mask with values other than 0 / 1, an unknown reduction.
        """
        if torch.jit.is_scripting():
            return self._scripted_forward(emissions, tags, mask, reduction)
        self._validate(emissions, tags=tags, mask=mask)
        check_reduction(reduction, CRF_REDUCTIONS)
        emissions, tags, mask = self._batch_first(emissions, tags, mask)
        transitions, start, end, emissions = self._scores(emissions)
        score = crf_ops.sequence_score(emissions, transitions, tags, start=start, end=end, mask=mask)
        log_z = crf_ops.log_partition(emissions, transitions, start=start, end=end, mask=mask)
        log_likelihood = log_likelihood_from_scores(score, log_z)
        lengths = None if mask is None else (mask != 0).sum(1)
        return reduce_per_sentence(log_likelihood, reduction, lengths, emissions.shape[:2])

    @torch.jit.export
    def decode(self, emissions: Tensor, mask: Optional[Tensor] = None) -> List[List[int]]:
        """Most likely tag sequence of each sentence (Viterbi).

        Args:
            emissions: (L, B, T), or (B, L, T) with batch_first.
            mask: optional, as in forward.

        Returns:
            B lists of ints, list b as long as sentence b (its number of on mask positions).
        """
        if torch.jit.is_scripting():
            return self._scripted_decode(emissions, mask)
        self._validate(emissions, mask=mask)
        emissions, _, mask = self._batch_first(emissions, None, mask)
        with torch.no_grad():  # the paths are integers: nothing to differentiate
            transitions, start, end, emissions = self._scores(emissions)
            paths = crf_ops.viterbi(emissions, transitions, start=start, end=end, mask=mask).paths
        rows = paths.tolist()
        if mask is None:
            return rows
        return _tags_of_on_positions(rows)

    def _validate(self, emissions: Tensor, tags: Optional[Tensor] = None, mask: Optional[Tensor] = None) -> None:
        layout = "(batch, seq_len" if self.batch_first else "(seq_len, batch"
        if not isinstance(emissions, Tensor):
            raise TypeError(f"emissions must be a torch.Tensor {layout}, num_tags), got {type(emissions).__name__}")
        if emissions.dim() != 3:
            raise ValueError(f"emissions must have 3 dimensions {layout}, num_tags), "
                             f"got shape {tuple(emissions.shape)}")
        if emissions.shape[2] != self.num_tags:
            raise ValueError(f"emissions must have num_tags = {self.num_tags} in its last dimension, "
                             f"got shape {tuple(emissions.shape)}")
        if tags is not None:
            if not isinstance(tags, Tensor):
                raise TypeError(f"tags must be a torch.Tensor {layout}), got {type(tags).__name__}")
            if tags.shape != emissions.shape[:2]:
                raise ValueError(f"tags must have the shape of emissions' first two dimensions "
                                 f"{tuple(emissions.shape[:2])}, got {tuple(tags.shape)}")
        if mask is not None:
            if not isinstance(mask, Tensor):
                raise TypeError(f"mask must be a torch.Tensor {layout}), got {type(mask).__name__}")
            if mask.shape != emissions.shape[:2]:
                raise ValueError(f"mask must have the shape of emissions' first two dimensions "
                                 f"{tuple(emissions.shape[:2])}, got {tuple(mask.shape)}")
        seq_len = emissions.shape[1] if self.batch_first else emissions.shape[0]
        if seq_len == 0:
            # torchcrf scores the first time step of every sentence, so it needs one.
            raise ValueError(f"emissions must have at least one time step, got shape {tuple(emissions.shape)}")

    def _batch_first(self, emissions: Tensor, tags: Optional[Tensor],
                     mask: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """(emissions (B, L, T), tags (B, L) or None, mask (B, L) or None for all on): crfkit's
        layout. Transposed views: crfkit copies them to contiguous memory itself."""
        if not self.batch_first:
            emissions = emissions.transpose(0, 1)
            tags = None if tags is None else tags.transpose(0, 1)
            mask = None if mask is None else mask.transpose(0, 1)
        return emissions, tags, mask

    def _scores(self, emissions: Tensor):
        """(transitions, start, end, emissions) in one dtype, as crfkit's ops require.

        torchcrf adds the parameters to the emissions, so its result has their promoted dtype
        (float64 emissions with float32 parameters give float64); the same promotion here.
        Half-precision emissions with float32 parameters promote to float32, which crfkit
        computes in anyway; all-half inputs are left to crfkit (computed in float32).
        """
        dtype = torch.promote_types(emissions.dtype, self.transitions.dtype)
        parameters = (self.transitions, self.start_transitions, self.end_transitions)
        if dtype in HALF_DTYPES:
            return (*parameters, emissions)
        return (*(p.to(dtype) for p in parameters), emissions.to(dtype))

    # ---- under torch.jit.script (crfkit/_scripting.py): the eager steps above, in TorchScript ----
    def _scripted_validate(self, emissions: Tensor, tags: Optional[Tensor], mask: Optional[Tensor]) -> None:
        layout = "(batch, seq_len" if self.batch_first else "(seq_len, batch"
        if emissions.dim() != 3:
            raise ValueError(f"emissions must have 3 dimensions {layout}, num_tags), got shape {emissions.shape}")
        if emissions.shape[2] != self.num_tags:
            raise ValueError(f"emissions must have num_tags = {self.num_tags} in its last dimension, "
                             f"got shape {emissions.shape}")
        if tags is not None and tags.shape != emissions.shape[:2]:
            raise ValueError(f"tags must have the shape of emissions' first two dimensions "
                             f"{emissions.shape[:2]}, got {tags.shape}")
        if mask is not None and mask.shape != emissions.shape[:2]:
            raise ValueError(f"mask must have the shape of emissions' first two dimensions "
                             f"{emissions.shape[:2]}, got {mask.shape}")
        seq_len = emissions.shape[1] if self.batch_first else emissions.shape[0]
        if seq_len == 0:
            raise ValueError(f"emissions must have at least one time step, got shape {emissions.shape}")

    def _scripted_inputs(self, emissions: Tensor, mask: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor,
                                                                                  Tensor, Optional[Tensor]]:
        """_batch_first() and _scores() then crfkit._arguments.prepare: the ops' five arguments
        (emissions (B, L, T), transitions, lengths, start, end) and the mask's lengths (or None)."""
        if not self.batch_first:
            emissions = emissions.transpose(0, 1)
            mask = None if mask is None else mask.transpose(0, 1)
        lengths = None if mask is None else _scripting.lengths_from_mask(mask)
        dtype = torch.promote_types(emissions.dtype, self.transitions.dtype)
        transitions, start, end = self.transitions, self.start_transitions, self.end_transitions
        if not _scripting._is_half(dtype):
            transitions, start, end, emissions = (transitions.to(dtype), start.to(dtype), end.to(dtype),
                                                  emissions.to(dtype))
        em, tr, ln, st, en = _scripting.prepare(emissions, transitions, lengths, start, end)
        return em, tr, ln, st, en, lengths

    def _scripted_forward(self, emissions: Tensor, tags: Tensor, mask: Optional[Tensor], reduction: str) -> Tensor:
        self._scripted_validate(emissions, tags, mask)
        _scripting.check_reduction(reduction)
        em, tr, ln, st, en, lengths = self._scripted_inputs(emissions, mask)
        tags = tags if self.batch_first else tags.transpose(0, 1)
        score = _scripting.sequence_score(em, tr, tags, ln, st, en)
        log_z = torch.ops.crfkit.log_partition(em, tr, ln, st, en)
        log_likelihood = _scripting.log_likelihood_from_scores(score, log_z)
        return reduce_per_sentence(log_likelihood, reduction, lengths, (em.shape[0], em.shape[1]))

    def _scripted_decode(self, emissions: Tensor, mask: Optional[Tensor]) -> List[List[int]]:
        self._scripted_validate(emissions, None, mask)
        with torch.no_grad():
            em, tr, ln, st, en, lengths = self._scripted_inputs(emissions, mask)
            paths = torch.ops.crfkit.viterbi(em, tr, ln, st, en)[1]
        rows: List[List[int]] = paths.tolist()
        if lengths is None:
            return rows
        sizes: List[int] = lengths.tolist()
        return [rows[b][:sizes[b]] for b in range(len(rows))]


def _tags_of_on_positions(rows: List[List[int]]) -> List[List[int]]:
    """Viterbi rows (-1 at the off positions) -> the tags of the on positions. (A function of its own:
    TorchScript parses CRF.decode's eager branch too, and has no comprehension ifs.)"""
    return [[tag for tag in row if tag >= 0] for row in rows]

