"""Per-call time of crfkit's public ops for two builds side by side (the ATen build and the stable-ABI
build of issue 58), alternating rounds in fresh processes.

    python benchmarks/abi_ab.py --old OLD_CHECKOUT --new NEW_CHECKOUT [--rounds 3]
        [--out benchmarks/results/stable_abi_ab]

Each round runs this file with --child in a process whose sys.path starts with one checkout (its
crfkit and crfkit._C), one thread (torch.set_num_threads(1)), and times every case with
torch.utils.benchmark's blocked_autorange; the report gives each side's median over rounds and
new / old. The tiny shape is the per-call floor (host time: argument checks, dispatch, and for a
differentiable call the autograd formula); the large shapes are the kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# (name, B, L, T, differentiable)
CASES = [
    ("log_partition", 1, 4, 3, False),
    ("viterbi", 1, 4, 3, False),
    ("kbest_viterbi k=5", 1, 4, 3, False),
    ("log_partition fwd+bwd", 1, 4, 3, True),
    ("viterbi fwd+bwd", 1, 4, 3, True),
    ("log_partition", 32, 128, 9, False),
    ("viterbi", 32, 128, 9, False),
    ("kbest_viterbi k=5", 32, 128, 9, False),
    ("log_partition fwd+bwd", 32, 128, 9, True),
    ("log_partition fwd+bwd", 256, 128, 37, True),
    ("viterbi", 256, 128, 37, False),
]


def child() -> dict:
    import torch
    import torch.utils.benchmark as benchmark

    import crfkit

    torch.set_num_threads(1)
    torch.manual_seed(0)
    extension = crfkit.backend_info().get("extension")
    out = {"backend": crfkit.backend_info()["backend"], "extension": os.path.basename(str(extension)),
           "times_us": {}}
    for name, B, L, T, grad in CASES:
        emissions = torch.randn(B, L, T, requires_grad=grad)
        transitions = torch.randn(T, T, requires_grad=grad)
        if name.startswith("log_partition"):
            def call():
                z = crfkit.log_partition(emissions, transitions)
                if grad:
                    z.sum().backward()
        elif name.startswith("viterbi"):
            def call():
                scores, _ = crfkit.viterbi(emissions, transitions)
                if grad:
                    scores.sum().backward()
        else:
            def call():
                crfkit.kbest_viterbi(emissions, transitions, k=5)
        call()
        timer = benchmark.Timer(stmt="call()", globals={"call": call}, num_threads=1)
        measurement = timer.blocked_autorange(min_run_time=0.5)
        out["times_us"][f"{name} ({B}, {L}, {T})"] = measurement.median * 1e6
    return out


def run_side(checkout: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env, cwd=checkout,
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="checkout with the old build (crfkit/_C*.so built in place)")
    parser.add_argument("--new", help="checkout with the new build")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="runs/bench/stable_abi_ab")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child()))
        return
    if not (args.old and args.new):
        parser.error("--old and --new are required")
    rounds = {"old": [], "new": []}
    for _ in range(args.rounds):
        for side in ("old", "new"):
            rounds[side].append(run_side(getattr(args, side)))
    import torch

    from crfkit.tool.records import git_commit, machine_description

    rows = list(rounds["old"][0]["times_us"])
    lines = [
        "# Per-call time: ATen build (old) vs stable-ABI build (new)",
        "",
        f"Command: `python benchmarks/abi_ab.py --old OLD --new NEW --rounds {args.rounds}`; commit "
        f"{git_commit()}; machine: {machine_description()}; torch {torch.__version__}; one thread; the median "
        f"over {args.rounds} alternating rounds of each side's blocked_autorange median.",
        f"Old extension: `{os.path.basename(str(rounds['old'][0]['extension']))}`, new: "
        f"`{os.path.basename(str(rounds['new'][0]['extension']))}`.",
        "",
        "| case (B, L, T) | old us | new us | new / old |",
        "|---|---:|---:|---:|",
    ]
    summary = {}
    for row in rows:
        old = statistics.median(r["times_us"][row] for r in rounds["old"])
        new = statistics.median(r["times_us"][row] for r in rounds["new"])
        summary[row] = {"old_us": old, "new_us": new}
        lines.append(f"| {row} | {old:.1f} | {new:.1f} | {new / old:.2f} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump({"rounds": rounds, "summary": summary, "machine": machine_description(),
                   "torch": torch.__version__}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
