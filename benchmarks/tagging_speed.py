"""Tagging speed of teachers and students side by side: interleaved rounds in one process.

    python benchmarks/tagging_speed.py --model "MiniLM teacher=runs/minilm/teacher/model" \
        --model "MPNet-base + CRF=fresh:mpnet" --model "g100 student=runs/.../model" \
        [--threads 1] [--rounds 5] [--out benchmarks/results/tagging_speed]

A model is NAME=FOLDER (a saved tagger) or NAME=fresh:ENCODER (a TransformerCRFTagger of that
encoder, 'minilm', 'mpnet' or a folder, with an untrained head: its weights do not change how fast
it tags, so this times a teacher architecture that has not been fine-tuned here). The timing is
the pipeline report stage's, crfkit.training.evaluation.side_by_side_throughput (predict over the
first 512 CoNLL-2003 test sentences, batch 32, at least 2 s per model per round, interleaved
rounds, ratios to the first model taken within each round); this script adds models that are not
in a work folder, such as an encoder no teacher was trained on here.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _load(spec: str):
    from crfkit import data
    from crfkit.taggers import TransformerCRFTagger, load_tagger

    if spec.startswith("fresh:"):
        import torch

        torch.manual_seed(0)
        return TransformerCRFTagger(list(data.CONLL2003_TAGS), encoder=spec[len("fresh:"):]).eval()
    return load_tagger(spec).eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, metavar="NAME=FOLDER|NAME=fresh:ENCODER",
                        help="a model to time (repeat; the first is the one the others are compared with)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default="runs/bench/tagging_speed", help="output path without extension")
    args = parser.parse_args(argv)
    models = []
    for spec in args.model:
        name, sep, where = spec.partition("=")
        if not sep or not name or not where:
            parser.error(f"argument --model: expected NAME=FOLDER or NAME=fresh:ENCODER, got {spec!r}")
        models.append((name, where))

    import torch

    from crfkit.packaged import load_conll2003
    from crfkit.tool.records import git_commit, machine_description
    from crfkit.training.evaluation import side_by_side_throughput

    torch.set_num_threads(args.threads)
    sentences = [list(s.tokens) for s in load_conll2003("test")[:512]]
    taggers = [_load(where) for _, where in models]
    speeds = side_by_side_throughput(taggers, sentences, batch_size=args.batch_size, rounds=args.rounds)
    first = models[0][0]
    rows = [{"model": name, "source": where, "describe": tagger.describe(), "params": tagger.num_parameters(),
             **speed} for (name, where), tagger, speed in zip(models, taggers, speeds)]
    git = git_commit()
    report = {"command": shlex.join(["python", "benchmarks/tagging_speed.py", *(argv or sys.argv[1:])]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine_description(),
              "git": git, "threads": args.threads, "batch_size": args.batch_size, "sentences": len(sentences),
              "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    lines = ["# Tagging speed, side by side", "", f"- command: `{report['command']}`",
             f"- machine: {report['machine']}; {args.threads} thread(s)", f"- date: {report['date']}, git {git}", "",
             f"`tagging_throughput`: predict over the first {len(sentences)} CoNLL-2003 test sentences, batch "
             f"{args.batch_size}, at least 2 s per model per round; {args.rounds} interleaved rounds in one process. "
             f"'vs {first}': the median over rounds of the model's speed over {first}'s in the same round, with "
             "the rounds' range. A `fresh:` model has an untrained head (its speed is its architecture's).", "",
             f"| model | architecture | parameters | sentences/s | vs {first} | range over rounds |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['describe']} | {r['params'] / 1e6:.1f}M | {r['sentences_per_s']:.0f} | "
                     f"{r['vs_first']:.2f}x | {r['vs_first_range'][0]:.2f} - {r['vs_first_range'][1]:.2f} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
