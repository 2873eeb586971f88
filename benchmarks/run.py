"""Time crfkit's core ops, compiled vs reference, over the grid of benchmarks/cases.py.

    python benchmarks/run.py [--quick | --full | --targets | --shapes BxLxT,...] [--out PATH]

For every cell (op, B, L, T, K), in one process:
  1. correctness: the compiled result is compared with the reference (cases.check_case);
     a cell that disagrees is reported WRONG and not timed;
  2. timing: torch.utils.benchmark.Timer(...).blocked_autorange(min_run_time=0.5) of one call
     of the public function under each backend (compiled, reference, and numba when installed), with torch's default
     number of threads
     (--threads N to change it); the median is reported in ms. Reference cells whose single call would exceed the budget
     (--budget, 10 s) are "skipped: too slow". Each backend is timed in --rounds (3)
     interleaved rounds and its smallest round median is reported, since on a small shared
     machine a competing process distorts timings badly; the share of the CPUs that OTHER
     processes used during the cell is recorded too (use --threads 1 for steadier numbers there).
  3. roofline: the least time the op's necessary arithmetic and memory traffic take at rates
     measured on this machine in the same run (benchmarks/roofline), and the compiled op's
     fraction of it; beside it the "call floor", the same call at (B, 1, T), which shows how
     much of a small call is fixed cost rather than kernel work.
Writes <out>.md and <out>.json (machine, versions, command, date, cells) and prints the
markdown. ratio = reference ms / compiled ms; tokens/s = B * L / compiled seconds (padded
positions count as tokens).

--targets runs the shapes of the project's targets, (32, 128, 9), (256, 128, 37) and
(1, 512, 9), with K = 5 and 15 (about 10 minutes: the reference is slow there); --shapes picks
any shapes the same way. --limit N and --ops a,b cut the grid (to smoke-test a code path, e.g.
--full --limit 3).
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
import time
from pathlib import Path
from typing import List, Optional

import torch
import torch.utils.benchmark as tbench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cases  # noqa: E402  (benchmarks/ is not a package)
import roofline  # noqa: E402

import crfkit  # noqa: E402

HERE = Path(__file__).resolve().parent
BUSY = 0.10  # warn when other processes used more than this share of the CPUs during a cell


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit(folder: Path = HERE) -> Optional[str]:
    """`git describe` of the checkout holding folder (default: this one); None outside git."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=folder, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(argv: List[str]) -> dict:
    info = crfkit.backend_info()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", *argv]),
        "machine": {
            "cpu": cpu_model(),
            "processor": platform.processor(),
            "platform": platform.platform(),
            "nproc": os.cpu_count(),
            "nproc_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch_num_threads": torch.get_num_threads(),
            "load_average_at_start": list(os.getloadavg()),
        },
        "python": platform.python_version(),
        "torch": torch.__version__,
        "crfkit": crfkit.__version__,
        "crfkit_git": git_commit(),
        "backend_info": {k: (list(v) if isinstance(v, tuple) else v) for k, v in info.items()},
    }


class OtherLoad:
    """Share of the machine's CPU time that OTHER processes used between start() and stop():
    0 on an idle machine; on a small shared machine anything above ~0.1 makes timings noisy
    (a torch thread that loses its core stalls every parallel region)."""

    def start(self) -> "OtherLoad":
        self.begin = self._sample()
        return self

    def stop(self) -> Optional[float]:
        end = self._sample()
        if self.begin is None or end is None:
            return None
        (busy0, own0, t0), (busy1, own1, t1) = self.begin, end
        capacity = (t1 - t0) * (os.cpu_count() or 1)
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / capacity if capacity > 0 else None

    @staticmethod
    def _sample():
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user .. steal
        times = os.times()
        return busy, times.user + times.system, time.perf_counter()


def median_ms(fn, min_run_time: float) -> float:
    """Median in ms of one call of fn, by blocked_autorange (with torch's current thread count)."""
    timer = tbench.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def run_cell(case: cases.Case, budget_s: float, min_run_time: float, rounds: int,
             rates: Optional[roofline.Rates] = None) -> dict:
    """Check one cell, then time it; returns the row of the report.

    Timing: `rounds` rounds, each a blocked_autorange median of the compiled op then of the
    reference op (and of the numba op when numba is installed); the reported time of a backend
    is its smallest round median (the round least disturbed by other processes). A reference
    whose single call takes over a second gets one round only. With `rates`, the cell's
    roofline (benchmarks/roofline) and the compiled op's fraction of it are added.
    """
    check = cases.check_case(case, budget_s)
    row = {"op": case.op, "B": case.B, "L": case.L, "T": case.T, "K": case.K, "status": check.status,
           "compiled_ms": None, "reference_ms": None, "ratio": None, "tokens_per_s": None,
           "reference_note": None, "other_load": None, "compiled_rounds_ms": [], "reference_rounds_ms": [],
           "numba_ms": None, "numba_status": None, "numba_rounds_ms": [], "roofline": None}
    if check.wrong:
        return row
    if check.reference_skipped:
        row["reference_note"] = f"skipped: too slow (one call ~{check.reference_estimate_s:.2g} s)"
    with_numba = "numba" in crfkit.backends.available()
    if with_numba:
        row["numba_status"] = cases.check_against_compiled(case, "numba")
        with_numba = not row["numba_status"].startswith(("WRONG", "ERROR"))
    load = OtherLoad().start()
    for r in range(rounds):
        row["compiled_rounds_ms"].append(median_ms(cases.callable_for(case, "compiled"), min_run_time))
        if with_numba:
            row["numba_rounds_ms"].append(median_ms(cases.callable_for(case, "numba"), min_run_time))
        if not check.reference_skipped and (r == 0 or check.reference_s < 1.0):
            row["reference_rounds_ms"].append(median_ms(cases.callable_for(case, "reference"), min_run_time))
    row["other_load"] = load.stop()
    row["compiled_ms"] = min(row["compiled_rounds_ms"])
    row["tokens_per_s"] = case.B * case.L / (row["compiled_ms"] / 1e3)
    if row["reference_rounds_ms"]:
        row["reference_ms"] = min(row["reference_rounds_ms"])
        row["ratio"] = row["reference_ms"] / row["compiled_ms"]
    if row["numba_rounds_ms"]:
        row["numba_ms"] = min(row["numba_rounds_ms"])
    if rates is not None:
        tokens = int(cases.inputs_for(case).lengths.sum())
        bound = roofline.lower_bound_s(case.op, tokens, case.B, case.L, case.T, case.K, rates)
        floor_s = median_ms(cases.floor_callable_for(case, "compiled"), min_run_time) / 1e3
        compiled_s = row["compiled_ms"] / 1e3
        row["roofline"] = {**bound, "fraction": bound["bound_s"] / compiled_s, "call_floor_s": floor_s,
                           "fraction_with_floor": min(1.0, (bound["bound_s"] + floor_s) / compiled_s)}
        if "minimal_bound_s" in bound:
            row["roofline"]["minimal_fraction"] = bound["minimal_bound_s"] / compiled_s
    return row


# ---- report -------------------------------------------------------------------------------------
def _ms(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def _load(load: List[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)


def _load_share(row: dict) -> str:
    return "-" if row["other_load"] is None else f"{100 * row['other_load']:.0f}%"


def _row_cells(row: dict) -> List[str]:
    reference = _ms(row["reference_ms"]) if row["reference_note"] is None else row["reference_note"]
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.1f}x"
    tokens = "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:.3g}"
    load = _load_share(row)
    numba = _ms(row.get("numba_ms")) if row.get("numba_ms") is not None else (row.get("numba_status") or "-")
    roof = row.get("roofline")
    minimal = f" (minimal {100 * roof['minimal_fraction']:.1f}%)" if roof and "minimal_fraction" in roof else ""
    roof_cells = ["-", "-", "-", "-"] if not roof else [
        f"{roof['bound_s'] * 1e3:.3g} ({roof['limit']})", f"{100 * roof['fraction']:.1f}%{minimal}",
        _ms(1e3 * roof["call_floor_s"]) if "call_floor_s" in roof else "-",
        f"{100 * roof['fraction_with_floor']:.1f}%" if "fraction_with_floor" in roof else "-"]
    return [row["op"], str(row["B"]), str(row["L"]), str(row["T"]), "-" if row["K"] is None else str(row["K"]),
            _ms(row["compiled_ms"]), reference, ratio, numba, *roof_cells, tokens, load, row["status"]]


def _table(header: List[str], rows: List[List[str]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


def summary(rows: List[dict]) -> List[dict]:
    """The headline cells and how they compare with the project's targets."""
    B, L, T = cases.HEADLINE_SHAPE
    out = []
    for (op, k), target in cases.TARGETS.items():
        row = next((r for r in rows if (r["op"], r["B"], r["L"], r["T"], r["K"]) == (op, B, L, T, k)), None)
        name = f"{op}" + (f" K={k}" if k is not None else "") + f" (B={B}, L={L}, T={T})"
        if row is None:
            out.append({"cell": name, "target": target, "row": None, "verdict": "not in this run"})
            continue
        ratio = row["ratio"]
        if row["status"].startswith(("WRONG", "ERROR")):
            verdict = "WRONG"
        elif ratio is None:
            verdict = "no ratio"
        else:
            verdict = "meets target" if ratio >= target else "BELOW target"
            if (row["other_load"] or 0) > BUSY:
                verdict += " (unreliable: the machine was busy)"
        out.append({"cell": name, "target": target, "row": row, "verdict": verdict})
    return out


def markdown(env: dict, rows: List[dict], heads: List[dict], grid_name: str) -> str:
    m = env["machine"]
    lines = [f"# crfkit core ops on CPU: compiled vs reference ({grid_name} grid)", ""]
    lines += ["## Summary (targets: ratio reference / compiled)", ""]
    lines += _table(["cell", "compiled ms", "reference ms", "ratio", "target", "verdict", "others' CPU",
                     "correctness"], [
        [h["cell"], _ms(h["row"]["compiled_ms"]) if h["row"] else "-",
         _ms(h["row"]["reference_ms"]) if h["row"] else "-",
         f"{h['row']['ratio']:.1f}x" if h["row"] and h["row"]["ratio"] else "-",
         f">= {h['target']:g}x", h["verdict"], _load_share(h["row"]) if h["row"] else "-",
         h["row"]["status"] if h["row"] else "-"]
        for h in heads])
    wrong = [r for r in rows if r["status"].startswith(("WRONG", "ERROR"))]
    lines += ["", f"{len(rows)} cells, {len(wrong)} WRONG / ERROR, "
              f"{sum(r['reference_note'] is not None for r in rows)} reference cells skipped as too slow.", ""]
    busy = [r for r in rows if (r["other_load"] or 0) > BUSY]
    if busy:
        lines += [f"**Warning: other processes used more than {BUSY:.0%} of the CPUs during {len(busy)} of "
                  f"{len(rows)} cells (column \"others' CPU\"): their timings are unreliable, especially "
                  "with more than one torch thread. Rerun on an idle machine (or with --threads 1).**", ""]
    lines += ["## Setup", "",
              f"- command: `{env['command']}`",
              f"- date: {env['date']}",
              f"- machine: {m['cpu']}, {m['nproc']} CPUs ({m['nproc_available']} available), "
              f"torch threads: {m['torch_num_threads']}; {m['platform']}; load average (1, 5, 15 min) "
              f"{_load(m['load_average_at_start'])} at start, {_load(m['load_average_at_end'])} at end",
              f"- torch {env['torch']}, python {env['python']}, crfkit {env['crfkit']} (git {env['crfkit_git']})",
              f"- backend_info: `{env['backend_info']}`",
              "- measured: one call of the public crfkit function under `crfkit.use_backend(backend)`, "
              "float32, seeded inputs (emissions randn*3, transitions / start / end randn, ragged "
              "lengths in [L/2, L]); median of torch.utils.benchmark blocked_autorange "
              f"(min_run_time {env['min_run_time']} s), the smallest of {env['rounds']} interleaved rounds. "
              "tokens/s = B*L / compiled time. "
              "Correctness is checked against the reference before timing. "
              "others' CPU: share of the machine's CPU time used by other processes during the cell.",
              ""]
    rates = env.get("roofline_rates")
    if rates:
        lines += ["## Roofline", "",
                  "Rates measured in this run by benchmarks/roofline/probe.cpp (built with the kernels' flags, "
                  f"{rates['threads']} threads): {rates['fma_double'] / 1e9:.3g} G double multiply-adds/s, "
                  f"{rates['exp_double'] / 1e9:.3g} G exponentials/s, {rates['max_plus_float'] / 1e9:.3g} G "
                  f"float max-plus updates/s, {rates['copy_bytes'] / 1e9:.3g} GB/s copy bandwidth. "
                  "\"roofline ms\" is the least time an op's necessary work takes at these rates "
                  "(work model and caveats: benchmarks/roofline/__init__.py); \"of roofline\" = roofline / compiled "
                  "time (100% = at the bound). \"call floor ms\" is the same public call on one position per "
                  "sentence, (B, 1, T), timed the same way: what a call costs besides its kernels' work (argument "
                  "checks, dispatch, outputs, threads, autograd), which no kernel speed removes; \"of roofline + "
                  "floor\" = (roofline + call floor) / compiled time. It separates the kernels' efficiency from "
                  "the fixed cost of a call at small shapes; the targets are judged on \"of roofline\". For "
                  "k-best, \"of roofline\" counts the sorted-list merge (K T^2 max-plus updates per position), "
                  "which crfkit's pruned merge mostly skips, so it can pass 100%; \"minimal\" beside it counts "
                  "only what any exact k-best must do (T^2 + T (K - 1) per position), the stricter measure.", ""]
    lines += ["## Ops", ""] + [f"- `{name}`: {op.doc}" for name, op in cases.OPS.items()] + [""]
    lines += ["## All cells", ""]
    lines += _table(["op", "B", "L", "T", "K", "compiled ms", "reference ms", "ratio", "numba ms",
                     "roofline ms", "of roofline", "call floor ms", "of roofline + floor", "compiled tokens/s",
                     "others' CPU", "correctness"],
                    [_row_cells(r) for r in rows])
    return "\n".join(lines) + "\n"


def _parse_shapes(text: str) -> List[tuple]:
    """"32x128x9,256x128x37" -> [(32, 128, 9), (256, 128, 37)]"""
    try:
        shapes = [tuple(int(n) for n in item.lower().split("x")) for item in text.split(",") if item]
    except ValueError:
        shapes = []
    if not shapes or any(len(shape) != 3 or min(shape) < 1 for shape in shapes):
        raise SystemExit(f"--shapes must be comma-separated BxLxT with positive sizes, got {text!r}")
    return shapes


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    grid = parser.add_mutually_exclusive_group()
    grid.add_argument("--quick", action="store_true", help="the quick subset (default)")
    grid.add_argument("--full", action="store_true", help="the full grid (long: reference cells up to ~10 s each)")
    grid.add_argument("--targets", action="store_true",
                      help="the shapes of the project's targets: " + ", ".join(map(str, cases.TARGET_SHAPES)))
    grid.add_argument("--shapes", help="comma-separated shapes BxLxT, e.g. 32x128x9,256x128x37 (K = 5, 15)")
    parser.add_argument("--out", help="output path without extension "
                        "(default runs/bench/core_cpu, or core_cpu_quick with --quick: outside the tracked files; "
                        "--out benchmarks/results/NAME updates the committed results)")
    parser.add_argument("--limit", type=int, help="keep the first N cells of the grid")
    parser.add_argument("--ops", help="comma-separated ops to keep: " + ", ".join(cases.OPS))
    parser.add_argument("--budget", type=float, default=cases.REFERENCE_BUDGET_S,
                        help="skip reference cells whose single call would exceed this many seconds "
                             "(default %(default)s)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads(N) first (default: torch's default); "
                        "1 gives steadier numbers on a small machine that other processes share")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timing rounds per cell; the smallest round median is reported (default %(default)s)")
    parser.add_argument("--min-run-time", type=float, default=0.5, help="blocked_autorange min_run_time (s)")
    parser.add_argument("--no-roofline", action="store_true",
                        help="skip the roofline (it builds benchmarks/roofline/probe.cpp on first use)")
    args = parser.parse_args(argv[1:])

    full = args.full
    shapes = cases.TARGET_SHAPES if args.targets else _parse_shapes(args.shapes) if args.shapes else None
    grid_name = "full" if full else "targets" if args.targets else "shapes" if shapes else "quick"
    if args.threads:
        torch.set_num_threads(args.threads)
    default_out = {"full": "core_cpu", "quick": "core_cpu_quick"}.get(grid_name, f"core_cpu_{grid_name}")
    out = Path(args.out) if args.out else HERE.parent / "runs" / "bench" / default_out
    grid_cases = cases.grid(full, args.limit, args.ops.split(",") if args.ops else None, shapes)
    env = environment(argv)
    env["min_run_time"] = args.min_run_time
    env["reference_budget_s"] = args.budget
    env["rounds"] = args.rounds

    rates = None
    if not args.no_roofline:
        rates = roofline.measure_rates()
        env["roofline_rates"] = rates.as_dict()
    rows = []
    for i, case in enumerate(grid_cases, 1):
        row = run_cell(case, args.budget, args.min_run_time, args.rounds, rates)
        rows.append(row)
        print(f"[{i}/{len(grid_cases)}] " + " | ".join(_row_cells(row)), file=sys.stderr, flush=True)

    env["machine"]["load_average_at_end"] = list(os.getloadavg())
    heads = summary(rows)
    text = markdown(env, rows, heads, grid_name)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.md").write_text(text)
    report = {**env, "grid": grid_name, "summary": [
        {"cell": h["cell"], "target_ratio": h["target"], "verdict": h["verdict"],
         "ratio": h["row"]["ratio"] if h["row"] else None,
         "other_load": h["row"]["other_load"] if h["row"] else None} for h in heads], "cells": rows}
    Path(f"{out}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(text)
    print(f"wrote {out}.md and {out}.json", file=sys.stderr)
    return 1 if any(r["status"].startswith(("WRONG", "ERROR")) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
