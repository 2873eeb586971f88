"""What a trained teacher's distillation targets carry beyond the gold labels, per text: the
CoNLL-2003 train text the students learn from (read from the pipeline's teacher-label cache),
the DA pool in the same cache, and the validation text (the teacher run again, optional).

    python examples/teacher_targets.py --workdir runs/full --workdir runs/mpnet

For each workdir (one teacher, its `labels-k*` cache and `teacher/model`; with `--crossfit N`,
also its fold caches, read as the text "train, cross-fitted": each fold labelled by the fold
teacher that never saw it), and each text:
the teacher's probability of its best sequence and of the gold one, how often its best sequence
is the gold one, the mass of its K best, and the share of each target off the gold labels
(sequence level: 1 - p(gold sequence); token level: 1 - the mean marginal of the gold tag).
The sequence- and token-level losses of the students differ from the gold-label loss by about
that share, so it measures what those losses can add on each text. Writes docs/teacher_targets.md
and .json (with the command, commit and machine).
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

import torch

import crfkit
from crfkit import data, distill
from crfkit._validation import cli_int
from crfkit.tool.records import file_sha256, git_commit, machine_description
from crfkit.taggers import load_tagger

DOCS = Path(__file__).resolve().parent.parent / "docs"
TAG_INDEX = {tag: i for i, tag in enumerate(data.CONLL2003_TAGS)}


def _statistics(emissions, transitions, start, end, lengths, kbest_log_probs, gold=None) -> dict:
    """Per-sentence sums of one padded batch. emissions (B, L, T), kbest_log_probs (B, K) (-inf
    on missing rows), gold (B, L) tag ids or None (unlabelled text; 0 at padded positions)."""
    p_k = kbest_log_probs.exp()
    sums = {"sentences": len(lengths), "tokens": int(lengths.sum()), "p_best": p_k[:, 0].sum().item(),
            "p_best_over_0.99": (p_k[:, 0] >= 0.99).sum().item(), "top5_mass": p_k[:, :5].sum().item(),
            "top15_mass": p_k[:, :15].sum().item()}
    if gold is not None:
        mask = torch.arange(gold.shape[1])[None, :] < lengths[:, None]
        log_z = crfkit.log_partition(emissions, transitions, lengths, start, end)
        p_gold = (crfkit.sequence_score(emissions, transitions, gold, lengths, start, end) - log_z).exp()
        best = crfkit.viterbi(emissions, transitions, lengths, start, end).paths
        marginals = crfkit.marginals(emissions, transitions, lengths, start, end)
        gold_marginal = marginals.gather(2, gold.unsqueeze(2)).squeeze(2)
        fifth = p_k[:, min(4, p_k.shape[1] - 1)] * (1 - 1e-4)  # the 5th best probability, less rounding
        sums.update({"p_gold": p_gold.sum().item(),
                     "best_is_gold": ((best == gold) | ~mask).all(1).sum().item(),
                     "token_accuracy": ((best == gold) & mask).sum().item(),
                     "gold_in_top5": ((p_gold > 0) & (p_gold >= fifth)).sum().item(),
                     "gold_tag_marginal": (gold_marginal * mask).sum().item()})
    return sums


def _add(total: dict, part: dict) -> None:
    for key, value in part.items():
        total[key] = total.get(key, 0) + value


def _means(sums: dict) -> dict:
    n, tokens = sums["sentences"], sums["tokens"]
    out = {"sentences": n, "tokens": tokens}
    for key in ("p_best", "p_best_over_0.99", "top5_mass", "top15_mass", "p_gold", "best_is_gold", "gold_in_top5"):
        if key in sums:
            out[key] = sums[key] / n
    for key in ("token_accuracy", "gold_tag_marginal"):
        if key in sums:
            out[key] = sums[key] / tokens
    return out


def _gold(sentences, L: int) -> torch.Tensor:
    gold = torch.zeros(len(sentences), L, dtype=torch.long)
    for b, sentence in enumerate(sentences):
        gold[b, :len(sentence.tags)] = torch.tensor([TAG_INDEX[t] for t in sentence.tags])
    return gold


CROSSFIT_TEXT = "train, cross-fitted ({folds} folds)"


def cached_sums(cache_dir: Path, train: list, batch_size: int = 256) -> dict:
    """Per-text sums of one cache: {text: sums}. The transfer set's cache: its train text (gold
    from CoNLL-2003 train) and its DA pool. A cross-fitting fold cache (its manifest's
    train_sentences is [lo, hi]): the fold train[lo:hi], labelled by the fold teacher that never
    saw it, each read with its own cache's teacher CRF."""
    cache = distill.load_cache(str(cache_dir))
    corpus = cache.manifest["corpus"]
    transitions, start, end = cache.teacher_crf()
    if isinstance(corpus["train_sentences"], list):
        lo, hi = corpus["train_sentences"]
        texts = {CROSSFIT_TEXT.format(folds=cache.manifest["teacher"]["folds"]): (range(0, hi - lo), lo)}
    else:
        n = corpus["train_sentences"]
        texts = {"train": (range(0, n), 0), "DA pool": (range(n, len(cache)), None)}
    out = {}
    for text, (ids, offset) in texts.items():
        total: dict = {}
        for first in range(ids.start, ids.stop, batch_size):
            batch_ids = list(range(first, min(first + batch_size, ids.stop)))
            batch = cache.batch(batch_ids)
            gold = None
            if offset is not None:
                sentences = [train[offset + i] for i in batch_ids]
                if any(len(s.tokens) != int(n) for s, n in zip(sentences, batch.lengths)):
                    raise ValueError(f"{cache_dir}: the cache's sentences are not CoNLL-2003 train in order")
                gold = _gold(sentences, batch.emissions.shape[1])
            _add(total, _statistics(batch.emissions, transitions, start, end, batch.lengths,
                                    batch.kbest.log_probs, gold))
        if total:
            out[text] = total
    return out


def cached_texts(caches: list[Path], batch_size: int = 256, train=None) -> dict:
    """{text: means} over the caches of one work folder: the transfer set's, and the fold caches
    of cross-fitting (their folds summed into one cross-fitted train text). train: the labelled
    train sentences (default CoNLL-2003 train)."""
    train = data.load_conll2003("train") if train is None else train
    totals: dict = {}
    for cache_dir in caches:
        for text, sums in cached_sums(cache_dir, train, batch_size).items():
            _add(totals.setdefault(text, {}), sums)
    return {text: _means(sums) for text, sums in totals.items()}


def validation_text(teacher_dir: Path, k: int, max_sentences=None, batch_size: int = 64) -> dict:
    """The teacher run on the validation split (its first max_sentences): {"validation": means}."""
    teacher = load_tagger(str(teacher_dir)).eval()
    sentences = data.load_conll2003("valid", max_sentences=max_sentences)
    total: dict = {}
    for first in range(0, len(sentences), batch_size):
        chunk = sentences[first:first + batch_size]
        out = teacher.teacher_output([tuple(s.tokens) for s in chunk])
        log_probs = crfkit.kbest_viterbi(out.emissions, out.transitions, k, out.lengths, out.start, out.end).log_probs
        _add(total, _statistics(out.emissions, out.transitions, out.start, out.end, out.lengths, log_probs,
                                _gold(chunk, out.emissions.shape[1])))
    return {"validation": _means(total)}


def _percent(value) -> str:
    return "" if value is None else f"{100 * value:.1f}"


def markdown(records: list[dict], command: str) -> str:
    lines = ["# What the teacher's targets carry beyond the gold labels", "",
             f"Written by `{command}` (git {records[0]['git']}, {records[0]['date']}, "
             f"{records[0]['machine']}).", "",
             "Per sentence (sequence level) or per word (token level), in percent. *Off gold* is the share of "
             "the target that is not the gold labelling: 1 - p(gold sequence) for SEQ, 1 - the mean marginal of "
             "the gold tag for TOKEN-POS. The students' distillation losses differ from the gold-label loss by "
             "about that share, so it is what they can teach on that text. The DA pool has no gold labels: there "
             "the whole target is what the teacher adds.", "",
             "| teacher | text | sentences | best = gold | word accuracy | p(best) | p(best) >= 0.99 | "
             "top-5 mass | top-15 mass | SEQ off gold | TOKEN-POS off gold |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for record in records:
        for text, m in record["texts"].items():
            seq_off = 1 - m["p_gold"] if "p_gold" in m else None
            token_off = 1 - m["gold_tag_marginal"] if "gold_tag_marginal" in m else None
            lines.append(f"| {record['encoder']} `{record['teacher'][:12]}` | {text} | {m['sentences']} | "
                         f"{_percent(m.get('best_is_gold'))} | {_percent(m.get('token_accuracy'))} | "
                         f"{_percent(m['p_best'])} | {_percent(m['p_best_over_0.99'])} | "
                         f"{_percent(m['top5_mass'])} | {_percent(m['top15_mass'])} | "
                         f"{_percent(seq_off)} | {_percent(token_off)} |")
    return "\n".join(lines) + "\n"


def shown(workdir) -> str:
    """A work folder as the docs name it: relative to the repository when inside it, else by its name."""
    try:
        return str(Path(workdir).resolve().relative_to(Path(__file__).resolve().parent.parent))
    except ValueError:
        return Path(workdir).name


def rewrite_from_docs(out: str) -> int:
    """<out>.md and .json again from the records in <out>.json, with each work folder and each
    --workdir of the recorded command as shown() names it; the numbers are kept as they are."""
    records = json.loads(Path(out + ".json").read_text())
    for record in records:
        record["workdir"] = shown(record["workdir"])
        words = shlex.split(record["command"])
        record["command"] = " ".join(shlex.quote(shown(w) if previous == "--workdir" else w)
                                     for previous, w in zip([None, *words], words))
    Path(out + ".json").write_text(json.dumps(records, indent=1) + "\n")
    Path(out + ".md").write_text(markdown(records, records[0]["command"]))
    print(f"wrote {out}.md and .json")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", action="append",
                        help="a pipeline workdir with teacher/model and one labels-k* cache (and, with --crossfit, "
                        "its labels-k*-fold* caches: the cross-fitted train text); repeat for more")
    parser.add_argument("--from-docs", action="store_true", help="rewrite the docs from the records already in "
                        "<out>.json (no work folder: e.g. on a machine without the runs), their work folders named "
                        "without the machine's path")
    parser.add_argument("--no-validation", action="store_true", help="skip running the teacher on validation")
    parser.add_argument("--validation-sentences", type=cli_int(minimum=1), help="only the first N validation sentences")
    parser.add_argument("--out", default=str(DOCS / "teacher_targets"), help="output path without extension")
    args = parser.parse_args(argv)
    if bool(args.from_docs) == bool(args.workdir):
        parser.error("give --workdir (once or more) or --from-docs")
    if args.from_docs:
        return rewrite_from_docs(args.out)
    # the docs name work folders by their name (or their path in the repository), not the machine's path
    arguments = [shown(a) if previous == "--workdir" else a
                 for previous, a in zip([None, *(argv if argv is not None else sys.argv[1:])],
                                        argv if argv is not None else sys.argv[1:])]
    command = "python " + " ".join(shlex.quote(a) for a in ["examples/teacher_targets.py", *arguments])
    commit = git_commit()  # read now: the record names the code this process runs, not a later edit
    records = []
    for workdir in map(Path, args.workdir):
        caches = sorted(p for p in workdir.glob("labels-k*")
                        if not p.name.split("-")[-1].startswith(("hidden", "fold")))
        if len(caches) != 1:
            raise SystemExit(f"--workdir {workdir}: expected one labels-k* cache, found {[c.name for c in caches]}")
        folds = sorted(workdir.glob("labels-k*-fold*"))
        manifest = json.loads((caches[0] / "manifest.json").read_text())
        record = {"workdir": shown(workdir), "cache": caches[0].name, "encoder": manifest["teacher"]["encoder"],
                  "teacher": manifest["teacher"]["weights_sha256"], "k": manifest["k"],
                  "texts": cached_texts(caches + folds)}
        if folds:
            record["fold_caches"] = [f.name for f in folds]
        if not args.no_validation:
            teacher_dir = workdir / "teacher" / "model"
            if file_sha256(str(teacher_dir / "model.safetensors")) != record["teacher"]:
                raise SystemExit(f"{teacher_dir} is not the teacher that labelled {caches[0]}")
            record["texts"].update(validation_text(teacher_dir, record["k"], args.validation_sentences))
        record.update(git=commit, date=datetime.datetime.now().isoformat(timespec="seconds"),
                      machine=machine_description(), command=command)
        records.append(record)
        print(json.dumps(record["texts"], indent=1), flush=True)
    Path(args.out + ".json").write_text(json.dumps(records, indent=1) + "\n")
    Path(args.out + ".md").write_text(markdown(records, command))
    print(f"wrote {args.out}.md and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
