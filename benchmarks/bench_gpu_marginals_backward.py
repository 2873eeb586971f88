"""The gradients of the marginals and of the expected transition counts on a GPU: crfkit's kernel
(csrc/cuda/marginals_backward.cu) against autograd through the reference (what crfkit did on
CUDA before it) and through torch-struct.

    python benchmarks/bench_gpu_marginals_backward.py [--op marginals|expected_transition_counts]
                                                      [--shapes 1x128x9,32x128x9] [--min-time 0.3]
                                                      [--out PATH]

Per shape (float32, full lengths, random scores), the median ms of one whole call of
`op(em, tr)` forward + `torch.autograd.grad(out, (em, tr), V)` for a random V of the output's
shape (torch.cuda.Event around it, host work included, as bench_gpu.py): crfkit with its kernel,
crfkit with the kernel switched off (compiled._KERNELS: autograd twice through
crfkit.reference), and torch-struct's LinearChainCRF marginals differentiated by autograd, where
it is installed. The reference path is checked against the kernel first (float32 tolerance).
Prints a Markdown table; --out writes <out>.md / .json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import median_ms  # noqa: E402
from bench_gpu_time_parallel import torch_struct_calls  # noqa: E402
import run as core_run  # noqa: E402

import crfkit  # noqa: E402
from crfkit.backends import compiled  # noqa: E402

DEFAULT_SHAPES = "1x128x9,32x128x9,256x128x9,32x512x9,1024x128x37"


OPS = ("marginals", "expected_transition_counts")


def inputs(op, B, L, T):
    g = torch.Generator().manual_seed(B * 7919 + L * 31 + T)
    em = torch.randn(B, L, T, generator=g).cuda()
    tr = torch.randn(T, T, generator=g).cuda()
    ln = torch.full((B,), L, dtype=torch.long).cuda()
    v = torch.randn(*((B, L, T) if op == "marginals" else (B, T, T)), generator=g).cuda()
    return em, tr, ln, v


@contextlib.contextmanager
def kernel_switched_off(op):
    key = (f"{op}_backward", "CUDA")
    saved = compiled._KERNELS[key]
    compiled._KERNELS[key] = False
    try:
        yield
    finally:
        compiled._KERNELS[key] = saved


def crfkit_call(op, em, tr, ln, v):
    def call():
        e, t = em.detach().requires_grad_(), tr.detach().requires_grad_()
        out = getattr(crfkit, op)(e, t, ln)
        return torch.autograd.grad(out, (e, t), v)
    return call


def reference_call(op, em, tr, ln, v):
    call = crfkit_call(op, em, tr, ln, v)

    def without_kernel():
        with kernel_switched_off(op):
            return call()
    return without_kernel


def torch_struct_call(op, em, tr, ln, v):
    if not torch_struct_calls(em, tr, ln):  # not installed
        return None
    from torch_struct import LinearChainCRF

    def call():
        e, t = em.detach().requires_grad_(), tr.detach().requires_grad_()
        phi = e[:, 1:, :, None] + t.t()[None, None]  # as bench_gpu_time_parallel.torch_struct_calls
        phi = torch.cat([phi[:, :1] + e[:, :1, None, :], phi[:, 1:]], 1)
        edge = LinearChainCRF(phi, lengths=ln).marginals  # (B, L-1, T[to], T[from])
        if op == "marginals":
            out = torch.cat([edge.sum(-2)[:, :1], edge.sum(-1)], 1)  # (B, L, T) node marginals
        else:
            out = edge.sum(1).transpose(-1, -2)  # (B, T[from], T[to]) transition counts
        return torch.autograd.grad(out, (e, t), v)
    return call


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--op", choices=OPS, default="marginals")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--min-time", type=float, default=0.3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    command = shlex.join(["python", "benchmarks/bench_gpu_marginals_backward.py", *(argv or sys.argv[1:])])
    what = "marginals" if args.op == "marginals" else "expected transition counts"
    lines = [f"# The gradient of the {what} on {torch.cuda.get_device_name()}", "",
             f"`{command}` (commit {core_run.git_commit()}, torch {torch.__version__}, CUDA {torch.version.cuda}). "
             f"Median ms of one whole call: {what} forward + their vector-Jacobian product for "
             "emissions and transitions, float32.", "",
             "| B | L | T | crfkit kernel | autograd over crfkit.reference | torch-struct | vs reference "
             "| vs torch-struct |",
             "|---|---|---|---|---|---|---|---|"]
    records = []
    for shape in args.shapes.split(","):
        B, L, T = (int(x) for x in shape.split("x"))
        data = inputs(args.op, B, L, T)
        kernel, reference = crfkit_call(args.op, *data), reference_call(args.op, *data)
        # Checked in float64 (float32's reference path loses digits in the transitions' sums,
        # which the kernel accumulates in double).
        doubles = [x.double() if x.is_floating_point() else x for x in data]
        got = crfkit_call(args.op, *doubles)()
        for a, b in zip(got, reference_call(args.op, *doubles)()):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
        peer = torch_struct_call(args.op, *data)
        ms = {"kernel": median_ms(kernel, args.min_time), "reference": median_ms(reference, args.min_time)}
        try:
            if peer:
                for a, b in zip(got, peer()):
                    torch.testing.assert_close(a.float(), b, rtol=1e-2, atol=1e-2)
            ms["torch_struct"] = median_ms(peer, args.min_time) if peer else None
        except (RuntimeError, AssertionError) as error:  # out of memory at the largest shapes, ...
            ms["torch_struct"] = None
            print(f"torch-struct failed at {shape}: {error!r}"[:300], flush=True)
        peer_cell = "-" if ms["torch_struct"] is None else f"{ms['torch_struct']:.3g}"
        vs_peer = "-" if ms["torch_struct"] is None else f"{ms['torch_struct'] / ms['kernel']:.1f}x"
        lines.append(f"| {B} | {L} | {T} | {ms['kernel']:.3g} | {ms['reference']:.3g} | {peer_cell} | "
                     f"{ms['reference'] / ms['kernel']:.1f}x | {vs_peer} |")
        print(lines[-1], flush=True)
        records.append({"B": B, "L": L, "T": T, "ms": ms})
        del data, kernel, reference, peer
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out + ".md").write_text(text)
        Path(args.out + ".json").write_text(json.dumps({"command": command, "op": args.op, "git": core_run.git_commit(),
                                                        "device": torch.cuda.get_device_name(),
                                                        "torch": torch.__version__, "cuda": torch.version.cuda,
                                                        "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
