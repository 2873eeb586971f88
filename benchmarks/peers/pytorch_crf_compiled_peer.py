"""pytorch-crf under torch.compile: the same `torchcrf.CRF` as the pytorch-crf peer (see
pytorch_crf_peer.py for its conventions), with its log Z and its decoder compiled by
`torch.compile` (default inductor backend, mode "default", dynamic=False: one graph per shape,
specialised, the fastest code torch.compile makes for a fixed shape).

- log Z: `torch.compile(crf._compute_normalizer)`, the private method the peer's forward calls
  (the same function the pytorch-crf peer times eagerly). Its Python loop over time is unrolled
  into one graph per sentence length; under autograd (log Z fwd+bwd, marginals) AOTAutograd
  compiles the backward too.
- Viterbi: `torch.compile(crf.decode)`: the forward max-sum recursion compiles into a graph;
  the per-sentence backtrace (`.item()` per position) and the argument checks are graph breaks
  and run as Python between compiled graphs, as they do for a user who compiles decode.
- TIMED AFTER WARM-UP: `bind` calls the compiled function twice before returning it (the first
  call compiles, the second checks that no recompilation is left), so the time reported is
  that of compiled code and never includes compilation (which takes seconds per shape, more
  for long sentences, and is paid again for every new sentence length). torch.compile keeps
  one graph per shape, grad mode and function; the adapter raises dynamo's recompile limit to
  64 and makes hitting it an error (`fail_on_recompile_limit_hit`), so that a silent fall-back
  to eager code can never be timed as compiled. Inductor compiles in-process
  (`compile_threads = 1`): no pool of compile workers competes with the timings.
- sentences longer than MAX_LENGTH = 256 positions are skipped ("skipped: ..."): compilation
  grows much faster than linearly with the unrolled length. On the 2-core benchmark VM (another
  job on the second core), cold compiles of the log Z (no inductor cache) took 85 s without grad
  and 154 s with grad at (B, L, T) = (256, 128, 37), and 368 s without grad at (1, 512, 9), where
  the grad graph was still compiling after a further 8 minutes. Every (1, 512, 9) cell would cost
  tens of minutes of compilation per process (the memory measurement runs each cell in a fresh
  one).
- ops, parameters, masks and layouts as the pytorch-crf peer; no marginals of its own (autograd
  of the compiled log Z), no k-best.
"""
from __future__ import annotations

import torch

from .pytorch_crf_peer import PytorchCrf


def _configure_compile() -> None:
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    dynamo_config.fail_on_recompile_limit_hit = True
    inductor_config.compile_threads = 1


class PytorchCrfCompiled(PytorchCrf):
    name = "pytorch-crf-compiled"
    module = "torchcrf"
    dist = "pytorch-crf"
    WARMUP_CALLS = 2
    MAX_LENGTH = 256

    def skip_reason(self, op, x, k=None):
        L = x.emissions.shape[1]
        if L > self.MAX_LENGTH:
            return (f"compiling the loop over L = {L} positions takes many minutes (skipped above "
                    f"L = {self.MAX_LENGTH}; see the adapter's docstring)")
        return None

    def __init__(self) -> None:
        super().__init__()
        _configure_compile()
        self.version = f"{self.version} (torch {torch.__version__.split('+')[0]})"

    def _setup(self, x):
        state = super()._setup(x)
        crf = state["crf"]
        state["log_z"] = torch.compile(crf._compute_normalizer, dynamic=False)
        state["decode"] = torch.compile(crf.decode, dynamic=False)
        return state

    def _log_z(self, state, emissions):
        return state["log_z"](emissions.transpose(0, 1), state["mask_tf"])

    def _viterbi(self, state):
        return state["decode"](state["x"].emissions, state["mask"])

    def bind(self, op, x, k=None):
        fn, convert = super().bind(op, x, k)
        for _ in range(self.WARMUP_CALLS):  # compilation happens here, untimed
            fn()
        return fn, convert
