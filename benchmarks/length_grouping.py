"""What batching by length saves a training epoch on this machine: epochs of CoNLL-2003 train
in random batches and in transformers' LengthGroupedSampler batches, timed forward + backward.

    python benchmarks/length_grouping.py --model "MiniLM teacher=fresh:minilm" \
        --model "g100 student=runs/.../model" [--threads 1] [--rounds 3] [--batches 50] \
        [--out benchmarks/results/length_grouping]

A model is NAME=FOLDER or NAME=fresh:ENCODER, as in benchmarks/tagging_speed.py. Both orders cover
the whole train set as one epoch would (the sampler's megabatches shrink on a small dataset, so a
sample of sentences would group worse than training does): "random" is a seeded permutation in
batches (train_sampling_strategy="random"), "grouped" the sampler's order ("group_by_length", as
crfkit.training's Trainer builds it from word counts). Padding is counted over the whole epoch;
the time is that of --batches batches drawn (seeded) from each epoch, each the CRF negative
log-likelihood of the tagger's emissions and its backward (no optimizer step: the same in both),
per real word. The two alternate within each round; the speed-up is the median over rounds of
random over grouped seconds per real word, which is what an epoch's time scales with.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shlex
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

def epoch_orders(lengths: list[int], batch_size: int, seed: int = 0) -> dict[str, list[list[int]]]:
    """One epoch's batches of indices: {"random": a seeded permutation, "grouped": LengthGroupedSampler's}."""
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    permutation = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    grouped = list(LengthGroupedSampler(batch_size, lengths=lengths, generator=torch.Generator().manual_seed(seed)))
    cut = lambda order: [order[i:i + batch_size] for i in range(0, len(order), batch_size)]  # noqa: E731
    return {"random": cut(permutation), "grouped": cut(grouped)}


def padded_words(lengths: list[int], batches: list[list[int]]) -> float:
    """Words the batches hold with padding, over the real words."""
    return sum(max(lengths[i] for i in b) * len(b) for b in batches) / sum(lengths[i] for b in batches for i in b)


def measure(tagger, sentences, batch_size: int, batches: int, rounds: int, seed: int = 0) -> dict:
    from crfkit.training import TaggingCollator, tagging_items

    items = tagging_items(sentences)
    lengths = [len(item["tokens"]) for item in items]
    epochs = epoch_orders(lengths, batch_size, seed)
    picked = {name: random.Random(seed).sample(order, min(batches, len(order))) for name, order in epochs.items()}
    collate = TaggingCollator(tagger)
    batched = {name: [collate([items[i] for i in b]) for b in chosen] for name, chosen in picked.items()}
    words = {name: sum(lengths[i] for b in chosen for i in b) for name, chosen in picked.items()}
    tagger.train()

    def one_pass(name) -> float:
        begin = time.perf_counter()
        for batch in batched[name]:
            tagger.zero_grad(set_to_none=True)
            emissions = tagger.emissions(batch)
            tags = batch["tags"][:, :emissions.shape[1]]
            tagger.crf.nll(emissions, tags, lengths=batch["lengths"]).mean().backward()
        return (time.perf_counter() - begin) / words[name]

    one_pass("grouped")   # warm-up
    per_word: dict[str, list[float]] = {"random": [], "grouped": []}
    for r in range(rounds):
        for name in (("random", "grouped") if r % 2 == 0 else ("grouped", "random")):
            per_word[name].append(one_pass(name))
    ratios = [a / b for a, b in zip(per_word["random"], per_word["grouped"])]
    return {"sentences": len(items), "timed_batches": len(picked["random"]),
            "padded_over_real_words": {name: round(padded_words(lengths, order), 3) for name, order in epochs.items()},
            "us_per_real_word": {name: 1e6 * statistics.median(v) for name, v in per_word.items()},
            "speedup": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, metavar="NAME=FOLDER|NAME=fresh:ENCODER")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=50, help="batches timed from each epoch (default 50)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="the sample's and the sampler's seed")
    parser.add_argument("--out", default="runs/bench/length_grouping", help="output path without extension")
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
    from tagging_speed import _load   # this folder's sibling script: one way to name a model

    torch.set_num_threads(args.threads)
    train = load_conll2003("train")
    rows = []
    for name, where in models:
        tagger = _load(where)
        rows.append({"model": name, "source": where, "describe": tagger.describe(),
                     **measure(tagger, train, args.batch_size, args.batches, args.rounds, args.seed)})
        print(rows[-1], flush=True)
    git = git_commit()
    report = {"command": shlex.join(["python", "benchmarks/length_grouping.py", *(argv or sys.argv[1:])]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine_description(),
              "git": git, "threads": args.threads, "batch_size": args.batch_size, "seed": args.seed, "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    lines = ["# Batches by length against random batches: one training pass", "",
             f"- command: `{report['command']}`", f"- machine: {report['machine']}; {args.threads} thread(s)",
             f"- date: {report['date']}, git {git}", "",
             f"One epoch of the {len(train)} CoNLL-2003 train sentences in random batches of {args.batch_size} and "
             f"in transformers' LengthGroupedSampler batches (seed {args.seed}); padding over the whole epoch; "
             f"forward + backward of the CRF loss (no optimizer step) on {args.batches} batches drawn from each, per "
             f"real word; {args.rounds} alternating rounds, the median.", "",
             "| model | architecture | padded / real words, random | grouped | µs per real word, random | grouped "
             "| speed-up | range over rounds |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pad, sec = r["padded_over_real_words"], r["us_per_real_word"]
        lines.append(f"| {r['model']} | {r['describe']} | {pad['random']:.2f} | {pad['grouped']:.2f} | "
                     f"{sec['random']:.0f} | {sec['grouped']:.0f} | {r['speedup']:.2f}x | "
                     f"{r['speedup_range'][0]:.2f} - {r['speedup_range'][1]:.2f} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
