"""What one crfkit call costs the host on a GPU, checked against deferred error mode.

    python benchmarks/profile_gpu_host.py [--shapes 1x128x9,256x128x9] [--calls 200] [--out PATH]

Per op and shape, in both modes (crfkit.deferred_errors off / on):
  call us   one whole call, synchronised before and after (median of 50): what a B = 1 user
            waits for (issue target for k-best at (1, 128, 9), K = 5: 60 us);
  host us   the host's time per call while the GPU is kept busy by a sleep kernel queued first
            (about 0.1 s), so that the host is the critical path (issue target: 30 us per op
            call). `GPU still busy` says whether the sleep was still running when the host
            had queued its --calls calls: "no" means the host waited for the GPU (checked
            mode's status read), and the figure is not host cost. --calls stays small (50):
            the driver queues about a thousand launches, beyond which every launch waits.
Prints a Markdown table and writes it to <out>.md when --out is given.

    python benchmarks/profile_gpu_host.py --trace [--shapes 1x128x9]

instead prints torch.profiler's CPU-side breakdown of a log Z forward + backward in deferred
mode (where the host's time goes: dispatcher, allocations, launches, the autograd engine).

    python benchmarks/profile_gpu_host.py --breakdown [--shapes 1x128x9]

instead times, in deferred mode with the GPU kept busy, the parts of a call one at a time: an
allocation, one aten launch, each registered op called directly (torch.ops.crfkit.*, no Python
front end), the front end, and the forward + backward with its backward op called on its own,
so that the whole calls' host cost can be split without the profiler's own overhead.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_gpu import wall_ms  # noqa: E402  (one synchronised call, median)


def calls(B, L, T, device):
    import crfkit

    g = torch.Generator().manual_seed(0)
    em = torch.randn(B, L, T, generator=g).to(device)
    tr = torch.randn(T, T, generator=g).to(device)
    ln = torch.full((B,), L, dtype=torch.long, device=device)
    leaf = em.clone().requires_grad_()

    def fwd_bwd():
        torch.autograd.grad(crfkit.log_partition(leaf, tr, ln).sum(), leaf)

    return {
        "log_partition": lambda: crfkit.log_partition(em, tr, ln),
        "log_partition_fwd_bwd": fwd_bwd,
        "marginals": lambda: crfkit.marginals(em, tr, ln),
        "viterbi": lambda: crfkit.viterbi(em, tr, ln),
        "kbest_k5": lambda: crfkit.kbest_viterbi(em, tr, 5, ln),
    }


def parts(B, L, T, device):
    """The pieces of a log Z forward + backward and of the other ops, for --breakdown."""
    import crfkit

    g = torch.Generator().manual_seed(0)
    em = torch.randn(B, L, T, generator=g).to(device)
    tr = torch.randn(T, T, generator=g).to(device)
    st, en = torch.zeros(T, device=device), torch.zeros(T, device=device)
    ln = torch.full((B,), L, dtype=torch.long, device=device)
    leaf = em.clone().requires_grad_()
    small = torch.zeros(8, device=device)
    ops = torch.ops.crfkit
    _, mu, counts = ops.log_partition_with_marginals(em, tr, ln, st, en)
    grad = torch.ones(B, device=device)
    log_z = crfkit.log_partition(leaf, tr, ln).sum()
    weights = torch.randn(T, generator=g).to(device)
    torch_loss = (leaf * weights).sum()

    return {
        "torch.empty(8)": lambda: torch.empty(8, device=device),
        "small.add_(1) (one aten launch)": lambda: small.add_(1),
        "op log_partition": lambda: ops.log_partition(em, tr, ln, st, en),
        "op log_partition_with_marginals": lambda: ops.log_partition_with_marginals(em, tr, ln, st, en),
        "op log_partition_backward_from_marginals": lambda: ops.log_partition_backward_from_marginals(
            grad, mu, counts, ln),
        "op viterbi": lambda: ops.viterbi(em, tr, ln, st, en),
        "op kbest_viterbi K=5": lambda: ops.kbest_viterbi(em, tr, 5, ln, st, en),
        "crfkit.log_partition": lambda: crfkit.log_partition(em, tr, ln),
        "crfkit.log_partition (leaf, forward only)": lambda: crfkit.log_partition(leaf, tr, ln),
        "backward only (retain_graph)": lambda: torch.autograd.grad(log_z, leaf, retain_graph=True),
        "forward + backward": lambda: torch.autograd.grad(crfkit.log_partition(leaf, tr, ln).sum(), leaf),
        # torch's own floor for the same pattern: an aten op's forward + backward through autograd
        "torch only: backward of (leaf * w).sum() (retain_graph)": lambda: torch.autograd.grad(
            torch_loss, leaf, retain_graph=True),
        "torch only: forward + backward of (leaf * w).sum()": lambda: torch.autograd.grad(
            (leaf * weights).sum(), leaf),
    }


def breakdown(shapes, n):
    import crfkit

    lines = [f"# The host's time per call, piece by piece, on {torch.cuda.get_device_name()} "
             f"(torch {torch.__version__}, deferred mode, GPU busy)", "",
             f"- command: `python {' '.join(sys.argv)}`", "",
             "| shape | piece | host us | GPU still busy |", "|---|---|---|---|"]
    for shape in shapes.split(","):
        B, L, T = (int(v) for v in shape.split("x"))
        pieces = list(parts(B, L, T, "cuda").items())
        # the same forward + backward on the sequential kernels (the choice is read at each call)
        pieces.append(("forward + backward, CRFKIT_CUDA_TIME_PARALLEL=never", dict(pieces)["forward + backward"]))
        with crfkit.deferred_errors():
            for name, fn in pieces:
                if "=never" in name:
                    os.environ["CRFKIT_CUDA_TIME_PARALLEL"] = "never"
                for _ in range(5):
                    fn()  # warm-up
                runs = [host_us(fn, n) for _ in range(3)]
                os.environ.pop("CRFKIT_CUDA_TIME_PARALLEL", None)
                host = sorted(r[0] for r in runs)[1]
                busy = all(r[1] for r in runs)
                lines.append(f"| {shape} | {name} | {host:.1f} | {'yes' if busy else 'no'} |")
                print(lines[-1], flush=True)
        crfkit.check_errors()
    return "\n".join(lines) + "\n"


def host_us(fn, n):
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time at ~2 GHz: the host runs ahead
    slept = torch.cuda.Event()
    slept.record()
    begin = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - begin
    busy = not slept.query()
    torch.cuda.synchronize()
    return elapsed / n * 1e6, busy


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1x128x9,256x128x9")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--out", default=None)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--breakdown", action="store_true")
    args = parser.parse_args(argv)
    import crfkit

    if args.breakdown:
        text = breakdown(args.shapes, args.calls)
        if args.out:
            Path(args.out + ".md").write_text(text)
        print(text)
        return 0

    if args.trace:
        for shape in args.shapes.split(","):
            B, L, T = (int(v) for v in shape.split("x"))
            fn = calls(B, L, T, "cuda")["log_partition_fwd_bwd"]
            with crfkit.deferred_errors():
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(50):
                        fn()
                    torch.cuda.synchronize()
            crfkit.check_errors()
            print(f"## log_partition_fwd_bwd {shape}, deferred, 50 calls")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        return 0

    command = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    lines = [f"# Host cost of a crfkit call on {torch.cuda.get_device_name()} (torch {torch.__version__})", "",
             f"- command: `{command}`", "",
             "| op | B | L | T | mode | call us | host us (GPU busy) | GPU still busy |",
             "|---|---|---|---|---|---|---|---|"]
    for shape in args.shapes.split(","):
        B, L, T = (int(v) for v in shape.split("x"))
        for name, fn in calls(B, L, T, "cuda").items():
            for mode in ("checked", "deferred"):
                with crfkit.deferred_errors(mode == "deferred"):
                    for _ in range(5):
                        fn()  # warm-up
                    whole = wall_ms(fn, repeats=50) * 1e3
                    host, busy = host_us(fn, args.calls)
                crfkit.check_errors()
                lines.append(f"| {name} | {B} | {L} | {T} | {mode} | {whole:.1f} | {host:.1f} | "
                             f"{'yes' if busy else 'no'} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out + ".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
