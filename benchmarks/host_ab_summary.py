"""Summarise the host_ab stage of tools/gpu_checks.sh: the host's time per call of two builds.

    python benchmarks/host_ab_summary.py gpu_out/host_ab.log [--title TEXT] [--about LINE ...] [--out PATH]

The stage runs benchmarks/profile_gpu_host.py and its --breakdown against AB_OLD's build and this
tree's, alternating, AB_ROUNDS times. This prints one Markdown table per kind of row: for each
row, the old and the new build's figure in every round, their medians and new / old. The host
figures of single rounds vary by tens of percent from round to round (50 calls each, a shared
machine's CPU), so read the medians of several rounds, and their direction over many rows.
"""
from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict
from pathlib import Path

ROUND = re.compile(r"== round (\d+), (old|new)")


def parse(text: str):
    """{(kind, row): {side: [figure per round]}}: kind "host" (deferred mode, GPU busy: the issue's
    host cost), "call" (a whole synchronised call, deferred) or "piece" (--breakdown)."""
    figures = defaultdict(lambda: defaultdict(list))
    side, seen = None, set()
    for line in text.splitlines():
        match = ROUND.match(line)
        if match:
            side, seen = match.group(2), set()
            continue
        if side is None or not line.startswith("|") or "---" in line:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("op", "shape"):
            continue
        if tuple(cells) in seen:  # profile_gpu_host.py prints its table twice
            continue
        seen.add(tuple(cells))
        if len(cells) == 8 and cells[4] == "deferred":  # op | B | L | T | mode | call us | host us | busy
            row = f"{cells[0]} ({cells[1]}, {cells[2]}, {cells[3]})"
            figures[("host", row)][side].append(float(cells[6]))
            figures[("call", row)][side].append(float(cells[5]))
        elif len(cells) == 4:  # shape | piece | host us | busy
            figures[("piece", f"{cells[0]}: {cells[1]}")][side].append(float(cells[2]))
    return figures


def tables(figures) -> str:
    titles = {
        "host": "Host us per call, deferred mode, GPU kept busy (`profile_gpu_host.py`; issue target 30 us)",
        "call": "Whole synchronised call us, deferred mode (`profile_gpu_host.py`)",
        "piece": "Host us per piece, deferred mode, GPU kept busy (`profile_gpu_host.py --breakdown`)",
    }
    out = []
    for kind, title in titles.items():
        rows = [(row, sides) for (k, row), sides in figures.items() if k == kind]
        if not rows:
            continue
        out += [f"### {title}", "", "| row | old rounds | new rounds | old median | new median | new / old |",
                "|---|---|---|---|---|---|"]
        for row, sides in rows:
            old, new = sides.get("old", []), sides.get("new", [])
            if not old or not new:
                continue
            o, n = statistics.median(old), statistics.median(new)
            out.append(f"| {row} | {', '.join(f'{v:.1f}' for v in old)} | {', '.join(f'{v:.1f}' for v in new)} "
                       f"| {o:.1f} | {n:.1f} | {n / o:.2f} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log")
    parser.add_argument("--title", default=None)
    parser.add_argument("--about", action="append", default=[],
                        help="a line under the title (the command, commits, device); repeatable")
    parser.add_argument("--out", default=None, help="also write the tables to this .md file")
    args = parser.parse_args(argv)
    text = tables(parse(Path(args.log).read_text()))
    if args.about:
        text = "\n".join(f"- {line}" for line in args.about) + "\n\n" + text
    if args.title:
        text = f"# {args.title}\n\n{text}"
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
