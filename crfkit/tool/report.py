"""The report of a work folder, built from its run records: test F1, parameters and tagging speed
of the teacher and each student, the speeds measured side by side in one process.

    python -m crfkit.tool.report runs/mydata          # after the job: report.md and report.json
    python -m crfkit.tool.report runs/wnut16/work --out docs/wnut16_report.md

Writes WORKDIR/report.md (a table) and WORKDIR/report.json (its rows, the machine, the command).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Optional, Sequence

from .. import _validation
from ..taggers import load_tagger
from .records import RESULT, command_line, git_commit, machine_description, read_results

__all__ = ["write_report", "main"]


def _model_dir(workdir: str, record: dict) -> str:
    return os.path.join(workdir, "students", record["run"], "model")


def _kind(tagger) -> str:
    layers = getattr(tagger, "num_layers", None)
    if type(tagger).__name__ == "TransformerCRFTagger":
        return f"{tagger.encoder_name if os.sep not in tagger.encoder_name else 'encoder'} {layers} layers + CRF"
    return "BiLSTM+CRF"


def write_report(workdir: str, teacher_dir: str, records: Sequence[dict], test_sentences: Sequence,
                 batch_size: int = 32, command: Optional[str] = None, out: Optional[str] = None,
                 rounds: int = 3) -> dict:
    """Write report.md / report.json for the teacher (workdir/teacher/result.json) and the given
    student records, timing every model on the first 512 test sentences at batch_size in `rounds`
    interleaved rounds (crfkit.training.evaluation.side_by_side_throughput: a row's speed is its
    median, "vs teacher" the median of its per-round ratios). out: the path of the .md file to
    write instead of workdir/report.md (its .json beside it)."""
    from ..training.evaluation import side_by_side_throughput

    with open(os.path.join(workdir, "teacher", RESULT), encoding="utf-8") as f:
        teacher_record = json.load(f)
    sentences = [s.tokens for s in test_sentences[:512]]
    teacher = load_tagger(teacher_dir)
    students = [load_tagger(_model_dir(workdir, record)) for record in records]
    speeds = side_by_side_throughput([teacher, *students], sentences, batch_size=batch_size, rounds=rounds)
    rows = [{"model": f"teacher ({teacher.encoder_name if os.sep not in teacher.encoder_name else 'encoder'} + CRF)",
             "test_f1": teacher_record["test_f1"], "dev_f1": teacher_record["dev_f1"],
             "params": teacher_record["params"], "sentences_per_s": speeds[0]["sentences_per_s"], "speedup": 1.0,
             "rounds": speeds[0]["rounds"]}]
    for record, student, speed in zip(records, students, speeds[1:]):
        k = f", K = {record['K']}" if record.get("K") else ""
        rows.append({"model": f"{_kind(student)} {record['variant']}{k}, seed {record['seed']}",
                     "test_f1": record["test_f1"], "dev_f1": record["dev_f1"], "params": record["params"],
                     "trainable_params": record["trainable_params"], "sentences_per_s": speed["sentences_per_s"],
                     "speedup": speed["vs_first"], "speedup_range": speed["vs_first_range"],
                     "rounds": speed["rounds"]})
    result = {"rows": rows, "machine": machine_description(), "git": git_commit(),
              "command": command or command_line("crfkit.tool.report"),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "batch_size": batch_size,
              "throughput_sentences": len(sentences), "rounds": rounds, "data": teacher_record.get("data")}
    lines = ["| model | test F1 | dev F1 | parameters (trainable) | sentences/s | vs teacher |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        params = f"{row['params'] / 1e6:.1f}M" + (f" ({row['trainable_params'] / 1e6:.2f}M)"
                                                  if "trainable_params" in row else "")
        lines.append(f"| {row['model']} | {row['test_f1']:.2f} | {row['dev_f1']:.2f} | {params} | "
                     f"{row['sentences_per_s']:.0f} | {row['speedup']:.1f}x |")
    table = "\n".join(lines)
    summary = _seed_summary(records)
    if summary:
        table += "\n\nTest F1 over seeds (mean ± sample standard deviation, n seeds):\n\n" + summary
        result["over_seeds"] = _seed_groups(records)
    data = teacher_record.get("data") or "the data"
    name = "CoNLL-2003 English" if data == "conll2003" else f"`{data}`"
    header = (f"{name}, entity F1 (seqeval, strict). Speed: tagging the first {len(sentences)} test sentences, "
              f"batch {batch_size}, {result['machine']}, measured side by side in one run: {rounds} "
              "interleaved rounds, a model's median speed and the median of its per-round ratios to the teacher.\n")
    markdown = out or os.path.join(workdir, "report.md")
    with open(os.path.splitext(markdown)[0] + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    with open(markdown, "w", encoding="utf-8") as f:
        runs = (f"- the runs: `{teacher_record['command']}` (the teacher's record; the work folder's "
                f"`config.json` holds every argument), git {teacher_record.get('git')}\n"
                if teacher_record.get("command") else "")
        f.write(f"# crfkit distillation report\n\n- command: `{result['command']}`\n{runs}- git: {result['git']}\n"
                f"- date: {result['date']}\n\n{header}\n{table}\n")
    print("\n" + header + "\n" + table + "\n", flush=True)
    return result


def _seed_groups(records: Sequence[dict]) -> list[dict]:
    """One entry per (variant, K) with its seeds' test F1: mean, sample standard deviation, n."""
    import statistics

    groups: dict = {}
    for record in records:
        groups.setdefault((record["variant"], record.get("K")), []).append(record["test_f1"])
    return [{"variant": variant, "K": k, "n": len(scores), "mean": round(statistics.mean(scores), 2),
             "sd": round(statistics.stdev(scores), 2) if len(scores) > 1 else None}
            for (variant, k), scores in groups.items()]


def _seed_summary(records: Sequence[dict]) -> str:
    groups = _seed_groups(records)
    if all(group["n"] == 1 for group in groups):
        return ""
    lines = ["| variant | K | test F1 | n |", "|---|---|---|---|"]
    for group in groups:
        spread = f" ± {group['sd']:.2f}" if group["sd"] is not None else ""
        lines.append(f"| {group['variant']} | {group['K'] or '-'} | {group['mean']:.2f}{spread} | {group['n']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """The report of a finished work folder from its records (results.jsonl), the test data read
    from the folder's config.json."""
    from .arguments import parse_arguments
    from .datasets import load_data

    parser = argparse.ArgumentParser(prog="python -m crfkit.tool.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", help="a work folder of python -m crfkit.distill")
    parser.add_argument("--out", help="write the report to this .md file (and its .json beside it) instead of "
                        "WORKDIR/report.md, e.g. docs/wnut16_report.md")
    parser.add_argument("--rounds", type=_validation.cli_int(minimum=1), default=3,
                        help="interleaved timing rounds; each model's speed is its median over them (default 3)")
    args = parser.parse_args(argv)
    if args.out is not None and not args.out.endswith(".md"):
        parser.error(f"argument --out: expected a path ending in .md, got {args.out!r}")
    config = os.path.join(args.workdir, "config.json")
    if not os.path.isfile(config):
        parser.error(f"{config} does not exist: not a work folder of python -m crfkit.distill")
    arguments = parse_arguments([config])
    tagging = load_data(arguments[0])
    records = [r for r in read_results(args.workdir) if r.get("variant") != "teacher" and "run" in r]
    teacher_dir = arguments[1].teacher_model_name_or_path
    from .job import is_trained_teacher

    if not is_trained_teacher(teacher_dir):
        teacher_dir = os.path.join(args.workdir, "teacher", "model")
    write_report(args.workdir, teacher_dir, records, tagging.test,
                 batch_size=arguments[4].per_device_train_batch_size, out=args.out, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
