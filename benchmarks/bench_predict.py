"""Tagging speed of tagger.predict for two checkouts side by side (before and after a change to
featurizing, batching or the BiLSTM), alternating rounds in fresh processes.

    python benchmarks/bench_predict.py --before OLD_CHECKOUT --after NEW_CHECKOUT \
        --teacher DIR --student DIR [--rounds 3] [--out benchmarks/results/predict_order]

Each round runs this file with --child in a process whose sys.path starts with one checkout, one
thread, and measures what the pipeline's records measure (crfkit.training.tagging_throughput:
predict over the first 512 CoNLL-2003 test sentences, batch 32, repeated for 2 s) for the
teacher and the student. The after side's child also times the student's BiLSTM alone, packed
(nn.LSTM over pack_padded_sequence, as training runs it) and padded (_bilstm_unpacked), over the
batches of 32 in test order and longest first, and says how much of each is padding. The
report gives each side's median over rounds, after / before, and how many sentences' tags differ
between the two checkouts (the change must not change a tag).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

SENTENCES, BATCH = 512, 32


def _best_seconds(function, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - begin)
    return best


def _lstm_times(student, sentences) -> dict:
    """Sentences/s of the student's BiLSTM alone, packed and padded, on in-order and longest-first batches."""
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence

    out = {}
    orders = {"in order": sentences, "longest first": sorted(sentences, key=len, reverse=True)}
    for name, ordered in orders.items():
        with torch.no_grad():
            inputs = []
            for begin in range(0, len(ordered), BATCH):
                batch = student.featurize(ordered[begin:begin + BATCH])
                inputs.append((student._lstm_inputs(batch), batch["lengths"]))
            padded = sum(x.shape[0] * x.shape[1] for x, _ in inputs)
            words = sum(int(lengths.sum()) for _, lengths in inputs)

            def packed():
                for x, lengths in inputs:
                    student.lstm(pack_padded_sequence(x, lengths.clamp(min=1), batch_first=True, enforce_sorted=False))

            def unpacked():
                for x, lengths in inputs:
                    student._bilstm_unpacked(x, lengths)

            out[name] = {"padding": 1 - words / padded, "packed": len(ordered) / _best_seconds(packed),
                         "padded": len(ordered) / _best_seconds(unpacked)}
    return out


def child(teacher_dir: str, student_dir: str) -> dict:
    import torch

    from crfkit import data
    from crfkit.taggers import load_tagger
    from crfkit.training.evaluation import tagging_throughput

    torch.set_num_threads(1)
    sentences = [list(s.tokens) for s in data.load_conll2003("test")[:SENTENCES]]
    out: dict = {"models": {}}
    for name, directory in (("teacher", teacher_dir), ("student", student_dir)):
        tagger = load_tagger(directory).eval()
        speed = tagging_throughput(tagger, sentences, batch_size=BATCH)
        tags = tagger.predict(sentences, batch_size=BATCH)
        out["models"][name] = {"sentences_per_s": speed["sentences_per_s"],
                               "tags": [hashlib.sha256(json.dumps(t).encode()).hexdigest()[:16] for t in tags]}
        if name == "student" and hasattr(tagger, "_lstm_inputs"):   # the after side: torch's LSTM either way
            out["lstm"] = _lstm_times(tagger, sentences)
    return out


def run_side(checkout: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    result = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--teacher", args.teacher,
                             "--student", args.student], env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _git(checkout: str) -> str:
    return subprocess.run(["git", "-C", checkout, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="the checkout before the change")
    parser.add_argument("--after", default=".", help="the checkout after it (default: this one)")
    parser.add_argument("--teacher", required=True, help="a trained TransformerCRFTagger folder")
    parser.add_argument("--student", required=True, help="a trained BiLSTMCRFTagger folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="runs/bench/predict_order", help="output path without extension")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.teacher, args.student)))
        return 0
    if not args.before:
        parser.error("--before is required")
    from crfkit.tool.records import machine_description

    sides: dict[str, list[dict]] = {"before": [], "after": []}
    for round_ in range(args.rounds):
        for side in ("before", "after"):
            sides[side].append(run_side(getattr(args, side), args))
            print(f"round {round_ + 1} {side}:",
                  {m: round(v["sentences_per_s"]) for m, v in sides[side][-1]["models"].items()}, flush=True)
    report = {"command": shlex.join(["python", "benchmarks/bench_predict.py", *sys.argv[1:]]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine_description(),
              "git_before": _git(args.before), "git_after": _git(args.after), "threads": 1, "models": {}, "lstm": {}}
    for model in ("teacher", "student"):
        medians = {side: statistics.median(r["models"][model]["sentences_per_s"] for r in runs)
                   for side, runs in sides.items()}
        differ = sum(a != b for a, b in zip(sides["before"][0]["models"][model]["tags"],
                                            sides["after"][0]["models"][model]["tags"]))
        report["models"][model] = {**medians, "ratio": medians["after"] / medians["before"], "tags_differ": differ}
    for order in sides["after"][0]["lstm"]:
        runs = [r["lstm"][order] for r in sides["after"]]
        report["lstm"][order] = {"padding": runs[0]["padding"],
                                 **{k: statistics.median(r[k] for r in runs) for k in ("packed", "padded")}}
    m = report["models"]
    report["student_over_teacher"] = {side: m["student"][side] / m["teacher"][side] for side in ("before", "after")}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    lines = ["# tagger.predict before and after: longest-first batches, padded BiLSTM, flat featurizing", "",
             f"- command: `{report['command']}`", f"- machine: {report['machine']}, one thread per process",
             f"- date: {report['date']}; before git {report['git_before']}, after git {report['git_after']}", "",
             f"Sentences per second of `tagging_throughput` (predict over the first {SENTENCES} CoNLL-2003 test "
             f"sentences, batch {BATCH}), median over {args.rounds} alternating rounds, each a fresh process.", "",
             "| model | before | after | after / before | sentences whose tags differ |", "|---|---|---|---|---|"]
    for model, r in m.items():
        lines.append(f"| {model} | {r['before']:.0f} | {r['after']:.0f} | {r['ratio']:.2f}x | {r['tags_differ']} |")
    s = report["student_over_teacher"]
    lines += ["", f"Student over teacher: {s['before']:.1f}x before, {s['after']:.1f}x after.", "",
              "The student's BiLSTM alone (sentences/s over the same batches, median over the after side's "
              "rounds):", "", "| batches | padding | packed | padded | padded / packed |", "|---|---|---|---|---|"]
    for order, r in report["lstm"].items():
        lines.append(f"| {order} | {100 * r['padding']:.0f}% | {r['packed']:.0f} | {r['padded']:.0f} | "
                     f"{r['padded'] / r['packed']:.2f}x |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
