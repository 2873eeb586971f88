"""What switching one import buys a pytorch-crf user: torchcrf.CRF against
crfkit.compat.pytorch_crf.CRF, same module state, same inputs, timed in one process.

    python benchmarks/bench_compat.py [--shapes 32x128x9,...] [--threads N] [--out PATH]

For each shape (B, L, T), batch first, a left-aligned mask with lengths spread over [L/2, L]:
  - loss: forward (log-likelihood, reduction 'sum') + backward, as in a training step;
  - decode: Viterbi, returning lists.
Both layers hold the same parameters (torchcrf's state dict loaded into crfkit's), and their
results are compared before timing (log-likelihood within 1e-4 relative, identical paths).
Median ms of torch.utils.benchmark's blocked_autorange, the smaller of --rounds interleaved
rounds. Writes <out>.md and <out>.json (default runs/bench/compat).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils import benchmark

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from crfkit.compat.pytorch_crf import CRF as CompatCRF  # noqa: E402


def _inputs(B: int, L: int, T: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    emissions = torch.randn(B, L, T, generator=generator)
    tags = torch.randint(0, T, (B, L), generator=generator)
    lengths = torch.randint(max(1, L // 2), L + 1, (B,), generator=generator)
    lengths[0] = L
    mask = torch.arange(L)[None, :] < lengths[:, None]
    return emissions, tags, mask


def _median_ms(fn, min_run_time: float) -> float:
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median * 1e3


def measure(shape: tuple[int, int, int], rounds: int, min_run_time: float) -> dict:
    import torchcrf

    B, L, T = shape
    torch.manual_seed(0)
    peer = torchcrf.CRF(T, batch_first=True)
    ours = CompatCRF(T, batch_first=True)
    ours.load_state_dict(peer.state_dict())
    emissions, tags, mask = _inputs(B, L, T)
    llh_peer, llh_ours = peer(emissions, tags, mask), ours(emissions, tags, mask)
    if not torch.allclose(llh_peer, llh_ours, rtol=1e-4, atol=1e-3):
        raise AssertionError(f"{shape}: log-likelihood {llh_ours.item()} differs from torchcrf's {llh_peer.item()}")
    if peer.decode(emissions, mask) != ours.decode(emissions, mask):
        raise AssertionError(f"{shape}: decoded paths differ from torchcrf's")

    def loss(layer):
        def step():
            x = emissions.detach().requires_grad_()
            layer(x, tags, mask).neg().backward()
        return step

    def decode(layer):
        return lambda: layer.decode(emissions, mask)

    cells = {"loss (forward + backward)": (loss(peer), loss(ours)), "decode": (decode(peer), decode(ours))}
    row = {"shape": list(shape)}
    for name, (peer_fn, ours_fn) in cells.items():
        peer_ms, ours_ms = [], []
        for _ in range(rounds):
            peer_ms.append(_median_ms(peer_fn, min_run_time))
            ours_ms.append(_median_ms(ours_fn, min_run_time))
        row[name] = {"torchcrf_ms": min(peer_ms), "crfkit_ms": min(ours_ms), "speedup": min(peer_ms) / min(ours_ms)}
    return row


def _git() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="32x128x9,256x128x37,1x512x9", help="BxLxT,... (default %(default)s)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-run-time", type=float, default=0.5)
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench" / "compat"),
                        help="output path without extension (--out benchmarks/results/compat updates the committed "
                        "result)")
    args = parser.parse_args(argv)
    try:
        import torchcrf
    except ImportError:
        raise SystemExit("needs pytorch-crf: pip install pytorch-crf==0.7.2")
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [tuple(int(n) for n in text.split("x")) for text in args.shapes.split(",")]
    rows = [measure(shape, args.rounds, args.min_run_time) for shape in shapes]
    import crfkit

    given = argv if argv is not None else sys.argv[1:]
    env = {"command": shlex.join(["python", "benchmarks/bench_compat.py", *given]),
           "git": _git(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": f"{_cpu()}, {os.cpu_count()} CPUs, "
                      f"{torch.get_num_threads()} torch threads, load average {os.getloadavg()[0]:.1f}",
           "torch": torch.__version__, "torchcrf": torchcrf.__version__,
           "crfkit_backend": crfkit.backend_info()["backend"]}
    lines = ["# pytorch-crf against crfkit.compat.pytorch_crf", "",
             f"`{env['command']}` at {env['git']}, {env['date']}; {env['machine']}; torch {env['torch']}, "
             f"pytorch-crf {env['torchcrf']}, crfkit backend {env['crfkit_backend']}. Median ms, best of "
             f"{args.rounds} interleaved rounds; results checked equal before timing.", "",
             "| (B, L, T) | op | torchcrf | crfkit.compat | speedup |", "|---|---|---|---|---|"]
    for row in rows:
        for name in ("loss (forward + backward)", "decode"):
            cell = row[name]
            lines.append(f"| {tuple(row['shape'])} | {name} | {cell['torchcrf_ms']:.3f} | {cell['crfkit_ms']:.3f} | "
                         f"{cell['speedup']:.1f}x |")
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({**env, "rows": rows}, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
