"""Where the time of one crfkit call on the GPU goes: device kernels against the whole call.

    python benchmarks/profile_gpu.py [--shapes 256x128x9,1x128x9,...] [--ops a,b]

For each op (benchmarks/cases.py) and shape: the wall-clock time of one call (median of 20,
synchronised), and from torch.profiler the summed device time of every kernel the call
launched, by kernel name. The difference is host work: Python, argument checks, launches and
the one device-to-host read of the status words per op. Prints one table; needs a CUDA device.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases  # noqa: E402

OPS = ["log_partition", "log_partition_fwd_bwd", "marginals", "viterbi", "kbest"]


def wall_ms(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def kernel_ms(fn, repeats: int = 5) -> dict:
    """Device time per kernel name, per call (averaged over `repeats` calls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time / 1e3 / repeats
    return dict(per_kernel)


def short_name(kernel: str) -> str:
    """'void crfkit::cuda::(anonymous namespace)::k<float, (...Output)3, 16>(params)' -> 'k<float, (Output)3, 16>'."""
    name = re.sub(r"^void ", "", kernel).replace("crfkit::cuda::(anonymous namespace)::", "")
    # drop the parameter list: the parenthesis matching the last one
    if kernel.startswith("void ") and name.endswith(")"):
        depth = 0
        for at in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[at], 0)
            if depth == 0:
                name = name[:at] if at > 0 else name
                break
    return name[:60]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="256x128x9,1x128x9,32x512x9,1024x128x37")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--k", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("profile_gpu: needs a CUDA device", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| op | B | L | T | call ms | kernels ms | host ms | kernels (ms each) |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        B, L, T = (int(v) for v in shape.split("x"))
        x = cases.make_inputs(B, L, T).to("cuda")
        for op in args.ops.split(","):
            xi = x.with_k(args.k if op == "kbest" else None)
            fn = lambda: cases.OPS[op].run(xi, "compiled")  # noqa: E731
            for _ in range(3):
                fn()
            call = wall_ms(fn)
            kernels = kernel_ms(fn)
            device = sum(kernels.values())
            detail = ", ".join(f"{short_name(name)} {ms:.3f}" for name, ms in
                               sorted(kernels.items(), key=lambda kv: -kv[1])[:4])
            print(f"| {op} | {B} | {L} | {T} | {call:.3f} | {device:.3f} | {call - device:.3f} | {detail} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
