"""What crfkit buys a tagger in training: the CRF's share of one training step (forward + backward,
batch 32) for the pipeline's teacher and student, beside the same models with pytorch-crf's CRF.

    python benchmarks/bench_training_step.py [--teacher DIR] [--student DIR] [--out PATH]

For each model (the MiniLM + CRF teacher, the BiLSTM + CRF student; trained folders from the
pipeline, or freshly initialised ones of the same architecture when none is given), on the same
batches of 32 real CoNLL-2003 train sentences, in one process:
  step     emissions, CRF negative log-likelihood and backward, with crfkit's CRF and with
           pytorch-crf's (torchcrf.CRF, batch_first, mask from the lengths; it has no constraints,
           so it is given the same unconstrained transitions), no optimizer step;
  crf      the CRF part alone: NLL forward + backward from precomputed emissions.
Each is the median over --repeats rounds of the whole batch list, interleaved (crfkit, peer,
crfkit, ...). Needs `pip install --no-deps pytorch-crf==0.7.2`. Writes <out>.md / .json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent


def _timed(function, batches) -> float:
    begin = time.perf_counter()
    for batch in batches:
        function(batch)
    return (time.perf_counter() - begin) / len(batches) * 1e3


def measure(tagger, sentences, labels, repeats: int, batch_size: int) -> dict:
    from torchcrf import CRF as PeerCRF

    from crfkit.training import TaggingCollator, tagging_items

    collate = TaggingCollator(tagger)
    items = tagging_items(sentences)
    batches = [collate(items[i:i + batch_size]) for i in range(0, len(items) - batch_size + 1, batch_size)]
    tagger.train()
    peer = PeerCRF(len(labels), batch_first=True)
    transitions, start, end = tagger.crf.transitions, tagger.crf.start, tagger.crf.end
    with torch.no_grad():  # the same scores in both CRFs (pytorch-crf cannot hold the -inf constraints)
        peer.transitions.copy_(transitions)
        peer.start_transitions.copy_(start)
        peer.end_transitions.copy_(end)
    unconstrained = (transitions, start, end)

    def crfkit_loss(emissions, batch):
        from crfkit.distill import crf_nll

        return crf_nll(emissions, unconstrained[0], batch["tags"], batch["lengths"], unconstrained[1], unconstrained[2])

    def peer_loss(emissions, batch):
        mask = torch.arange(emissions.shape[1])[None, :] < batch["lengths"][:, None]
        return -peer(emissions, batch["tags"].clamp(min=0), mask=mask, reduction="mean")

    def step(loss_fn):
        def run(batch):
            tagger.zero_grad(set_to_none=True)
            peer.zero_grad(set_to_none=True)
            loss_fn(tagger.emissions(batch), batch).backward()
        return run

    with torch.no_grad():
        cached = [(tagger.emissions(b).detach(), b) for b in batches]

    def crf_only(loss_fn):
        def run(pair):
            emissions = pair[0].clone().requires_grad_()
            loss_fn(emissions, pair[1]).backward()
        return run

    # both CRFs give the same loss on these unconstrained scores
    for emissions, batch in cached[:2]:
        a, b = crfkit_loss(emissions, batch), peer_loss(emissions, batch)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)
    results = {"step_crfkit": [], "step_peer": [], "crf_crfkit": [], "crf_peer": []}
    step(crfkit_loss)(batches[0])
    step(peer_loss)(batches[0])
    for _ in range(repeats):
        results["step_crfkit"].append(_timed(step(crfkit_loss), batches))
        results["step_peer"].append(_timed(step(peer_loss), batches))
        results["crf_crfkit"].append(_timed(crf_only(crfkit_loss), cached))
        results["crf_peer"].append(_timed(crf_only(peer_loss), cached))
    out = {name: statistics.median(values) for name, values in results.items()}
    out["share_crfkit"] = out["crf_crfkit"] / out["step_crfkit"]
    out["share_peer"] = out["crf_peer"] / out["step_peer"]
    out["batches"] = len(batches)
    out["mean_words"] = sum(float(b["lengths"].float().mean()) for b in batches) / len(batches)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", help="a trained TransformerCRFTagger folder (default: fresh MiniLM + CRF)")
    parser.add_argument("--student", help="a trained BiLSTMCRFTagger folder (default: fresh, TE-sized)")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(HERE.parent / "runs" / "bench" / "training_step"),
                        help="output path without extension (--out benchmarks/results/training_step updates the "
                        "committed results)")
    args = parser.parse_args(argv)

    from crfkit import data
    from crfkit.tool.records import machine_description
    from crfkit.taggers import BiLSTMCRFTagger, TransformerCRFTagger, load_tagger

    labels = list(data.CONLL2003_TAGS)
    train = data.load_conll2003("train")
    sentences = random.Random(0).sample(train, args.batches * args.batch_size)
    torch.manual_seed(0)
    teacher = load_tagger(args.teacher) if args.teacher else TransformerCRFTagger(labels)
    if args.student:
        student = load_tagger(args.student)
    else:
        student = BiLSTMCRFTagger(labels, BiLSTMCRFTagger.build_vocabulary(train), embedding_dim=384)
    report = {"command": shlex.join(["python", *sys.argv]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": machine_description(), "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                                      capture_output=True, text=True).stdout.strip(),
              "batch_size": args.batch_size, "models": {}}
    for name, tagger in (("teacher", teacher), ("student", student)):
        report["models"][name] = measure(tagger, sentences, labels, args.repeats, args.batch_size)
        print(name, report["models"][name], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# One training step: crfkit's CRF against pytorch-crf's in the same taggers", "",
             f"- command: `{report['command']}`", f"- machine: {report['machine']}", f"- date: {report['date']}, "
             f"git {report['git']}", "",
             f"Median ms per batch of {args.batch_size} CoNLL-2003 train sentences (forward + backward, no optimizer "
             f"step), over {args.repeats} interleaved rounds of {args.batches} batches.", "",
             "| model | step, crfkit CRF | step, pytorch-crf | CRF alone, crfkit | CRF alone, pytorch-crf "
             "| CRF share of the step, crfkit | CRF share, pytorch-crf | step speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m in report["models"].items():
        lines.append(f"| {name} | {m['step_crfkit']:.1f} | {m['step_peer']:.1f} | {m['crf_crfkit']:.2f} | "
                     f"{m['crf_peer']:.2f} | {100 * m['share_crfkit']:.1f}% | {100 * m['share_peer']:.1f}% | "
                     f"{m['step_peer'] / m['step_crfkit']:.2f}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
