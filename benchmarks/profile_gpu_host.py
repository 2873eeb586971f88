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
"""
from __future__ import annotations

import argparse
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
    args = parser.parse_args(argv)
    import crfkit

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
