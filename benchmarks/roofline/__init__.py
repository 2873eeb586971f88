"""A roofline per op: the least time this machine could take for the arithmetic and memory
traffic an op must do, from rates measured in the same run.

    rates = measure_rates()                      # probe.cpp, built with the kernels' flags
    bound_s = lower_bound_s(op, lengths, L, T, K, rates)
    fraction = bound_s / measured_s              # 1.0 = at the roofline

Work an op must do, per real position (N = sum of lengths; padding is never touched):
    log_partition          T^2 multiply-adds (the scaled T x T product) + T exponentials
    marginals              2 T^2 multiply-adds (forward and backward products) + T exponentials
    log_partition_fwd_bwd  3 T^2 multiply-adds (forward, backward, pairwise marginals for the
                           transitions' gradient) + T exponentials
    viterbi                T^2 max-plus updates
    kbest (K)              K T^2 max-plus updates (each of the T*K list entries picks the best
                           of T list heads) + log Z's work (for the log-probabilities)
    kbest, minimal         T^2 + T (K - 1) max-plus updates (each tag's best predecessor, a
                           Viterbi step, and the K - 1 further entries of its list) + log Z's
                           work; equal to the count above at K = 1
    sample (K = n draws)   log Z's work (the forward filtering) + n T max-plus updates (each
                           draw's perturbed logits and their argmax), + per padded position
                           2 n T logarithms, counted as exponentials (the Gumbels -log(-log U)
                           the caller draws), and n T float32 noise values written and read
    sample_without (K = n) the same, + 4 n exponentials per real position (the truncated Gumbels
                           of the n children that make the next beams: log1mexp and softplus;
                           the kernel skips the other children's)
The k-best count is that of the sorted-list merge (the algorithm the project's issue names);
crfkit's pruned merge skips most of it on typical scores (it merges only the lists that can
still reach a tag's K best), so a k-best fraction can pass 100%. The minimal count is what any
exact k-best must do at least; its fraction ("minimal_fraction" in the results) is the stricter
measure of how much of the machine the k-best kernels use. Both are reported.
Multiply-adds are counted at the double rate (the probability-space path accumulates in
double), exponentials at the rate of crfkit's vectorised exp. Compute time is the sum over the
kinds of work (they share the vector units); memory time is the bytes read and written
(float32 emissions of the real positions, outputs of the padded shape) at the measured copy
bandwidth; the bound is the larger of the two.

This is a throughput bound: it assumes perfect vector use, no dependency stalls and no
per-call overhead, which the sequential recursions over positions cannot fully reach, so read
the fraction as "how much of the machine the kernel uses".
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, asdict
from pathlib import Path
from typing import Optional

import torch

HERE = Path(__file__).resolve().parent
_PROBE = None


def _probe():
    """Build (once, cached by torch in ~/.cache/torch_extensions) and load probe.cpp."""
    global _PROBE
    if _PROBE is None:
        from torch.utils.cpp_extension import load

        # This machine's rates: its own -march, also when crfkit is a dispatch build (whose
        # kernels run at the best level this CPU has).
        arch = os.environ.get("CRFKIT_ARCH", "native")
        arch = "native" if arch == "dispatch" else arch
        flags = ["-O3", "-std=c++20", "-fopenmp"] + ([f"-march={arch}"] if arch != "none" else [])
        _PROBE = load(name="crfkit_roofline_probe", sources=[str(HERE / "probe.cpp")],
                      extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    return _PROBE


@dataclass
class Rates:
    """Per second, on all threads: multiply-adds (double, float), exponentials, max-plus
    updates (float), and copy bandwidth in bytes (read + written)."""

    fma_double: float
    fma_float: float
    exp_double: float
    max_plus_float: float
    copy_bytes: float
    threads: int

    def as_dict(self) -> dict:
        return asdict(self)


def _rate(fn, work_per_repeat: float, repeats: int, tries: int = 3) -> float:
    fn(max(1, repeats // 20))  # warm up
    best = min(fn(repeats) for _ in range(tries))
    return work_per_repeat * repeats / best


def measure_rates(copy_mib: int = 256) -> Rates:
    """Measure every rate now (about a second): best of 3 timings each."""
    probe = _probe()
    torch.set_num_threads(torch.get_num_threads())  # propagate torch's count to OpenMP
    threads = probe.threads()
    per_pass = probe.lanes() * threads
    rates = {
        "fma_double": _rate(probe.fma_double, per_pass, 400_000),
        "fma_float": _rate(probe.fma_float, per_pass, 400_000),
        "exp_double": _rate(probe.exp_double, per_pass, 40_000),
        "max_plus_float": _rate(probe.max_plus_float, per_pass, 400_000),
    }
    source = torch.empty(copy_mib * 2**20 // 4, dtype=torch.float32).fill_(1.0)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(5):
        begin = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - begin)
    rates["copy_bytes"] = 2 * source.numel() * 4 / best
    return Rates(**rates, threads=threads)


def work(op: str, tokens: int, B: int, L: int, T: int, K: Optional[int] = None) -> dict:
    """The arithmetic and bytes an op must do: tokens = N real positions, (B, L, T) the padded
    shape, K for k-best. See the module docstring."""
    emissions_in = 4 * tokens * T  # float32, real positions only
    padded_out = 4 * B * L * T
    if op == "log_partition":
        return dict(fma=tokens * T * T, exp=tokens * T, max_plus=0, bytes=emissions_in)
    if op == "marginals":
        return dict(fma=2 * tokens * T * T, exp=tokens * T, max_plus=0, bytes=emissions_in + padded_out)
    if op == "log_partition_fwd_bwd":
        return dict(fma=3 * tokens * T * T, exp=tokens * T, max_plus=0, bytes=2 * emissions_in + padded_out)
    if op == "viterbi":
        return dict(fma=0, exp=0, max_plus=tokens * T * T, bytes=emissions_in + 8 * B * L)
    if op == "kbest":
        return dict(fma=tokens * T * T, exp=tokens * T, max_plus=K * tokens * T * T,
                    bytes=emissions_in + 8 * B * K * L)
    if op == "sample":  # K = n draws; the front end also scores them (not counted)
        return dict(fma=tokens * T * T, exp=tokens * T + 2 * B * L * K * T, max_plus=K * tokens * T,
                    bytes=emissions_in + 8 * B * L * K * T + 8 * B * K * L)
    if op == "sample_without":  # K = n rows, stochastic beam search
        return dict(fma=tokens * T * T, exp=tokens * T + 2 * B * L * K * T + 4 * K * tokens, max_plus=K * tokens * T,
                    bytes=emissions_in + 8 * B * L * K * T + 8 * B * K * L)
    if op == "kbest_minimal":
        return dict(fma=tokens * T * T, exp=tokens * T, max_plus=tokens * (T * T + T * (K - 1)),
                    bytes=emissions_in + 8 * B * K * L)
    raise ValueError(f"no work model for op {op!r}")


def lower_bound_s(op: str, tokens: int, B: int, L: int, T: int, K: Optional[int], rates: Rates) -> dict:
    """{'compute_s', 'memory_s', 'bound_s', 'limit'}: the roofline time of one call; for k-best
    also 'minimal_bound_s', the bound of the minimal count (see the module docstring)."""
    def bound(w: dict) -> tuple:
        compute = w["fma"] / rates.fma_double + w["exp"] / rates.exp_double + w["max_plus"] / rates.max_plus_float
        return compute, w["bytes"] / rates.copy_bytes

    compute, memory = bound(work(op, tokens, B, L, T, K))
    result = {"compute_s": compute, "memory_s": memory, "bound_s": max(compute, memory),
              "limit": "compute" if compute >= memory else "memory"}
    if op == "kbest":
        result["minimal_bound_s"] = max(bound(work("kbest_minimal", tokens, B, L, T, K)))
    return result
