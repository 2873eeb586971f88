"""Write docs/REPRODUCTION.md, docs/reproduction.json and docs/kbest_ablation.png from the records
that `python -m crfkit.pipeline` runs append to WORKDIR/results.jsonl (never typed by hand).

    python examples/reproduction_report.py --workdir runs/full [--workdir runs/mpnet ...]
    python examples/reproduction_report.py --from-docs      # from docs/reproduction.json's records alone

Tables: the multi-grained distillation paper's Table 1 on CoNLL-2003 (mean and spread over the
seeds that finished, the paper's number beside), the K ablation (table and plot), uncertainty
against equal weighting (its Table 3), the loss combinations (its Table 2), the training-step
benchmark (benchmarks/results/training_step.json) and the issue's targets with verdicts.
docs/reproduction_notes.md (hand-written commentary, no numbers) is appended when present.
More than one --workdir (a run per teacher, e.g. the MPNet-base one): their records are merged; the
tables keep to the teacher most students name, the others are listed by teacher and encoder.

The students issue (issue 60: the g100* variants, the 100-d GloVe student with character
features) has a section of its own: one table per (teacher, student architecture, dataset), every
row judged against the baseline g100 (the same student on gold labels alone; it belongs to no
teacher and serves every teacher's table of its student) by paired differences over the seeds
both have, with a seeded bootstrap interval and an exact sign test; the ordering SEQ > TOKEN-POS
> alone is judged with the same intervals, once it has five seeds (ORDERING_SEEDS). Records
written since the tool recorded `distilled` (2026-12-02) name a teacher only when they use one:
for them `teacher_sha256` None means no teacher, never the main one. Cross-fitting's fold
teachers (variant teacher_fold) are in no table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import statistics
from pathlib import Path
from typing import Sequence

from crfkit._validation import cli_int
from crfkit.tool.records import relative_command

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# CoNLL-2003 test F1 reported by "Multi-Grained Knowledge Distillation for Named Entity
# Recognition" (Zhou et al., NAACL 2021) with a BERT-base + CRF teacher: Tables 1, 2 and 3.
PAPER = {"teacher": 92.03, "vanilla": 80.08, "te": 88.35, "te_token_em": 88.46, "te_token_pos": 88.66,
         "te_seq": 89.54, "te_da": 90.69, "te_da_token_em": 90.49, "te_da_token_pos": 90.98, "te_da_seq": 91.17,
         "te_seq_equal": 89.26, "te_da_seq_equal": 91.09, "te_da_seq_token_pos": 91.07,
         "te_da_seq_no_fuzzy": 90.77, "te_da_seq_no_kbest_ce": 90.97}
TABLE1 = [("teacher", "teacher (MiniLM-L6 + CRF; the paper: BERT-base + CRF)"),
          ("vanilla", "vanilla BiLSTM+CRF"), ("glove", "BiLSTM+CRF on GloVe 50d (no teacher; not in the paper)"),
          ("te", "+ TE"), ("te_token_em", "+ TE + TOKEN-EM"), ("te_token_pos", "+ TE + TOKEN-POS"),
          ("te_seq", "+ TE + SEQ"), ("te_exact_kl", "+ TE + exact CRF KL (crfkit; not in the paper)"),
          ("te_da", "+ TE + DA"), ("te_da_token_em", "+ TE + DA + TOKEN-EM"),
          ("te_da_token_pos", "+ TE + DA + TOKEN-POS"), ("te_da_seq", "+ TE + DA + SEQ (the paper's student)"),
          ("te_da_exact_kl", "+ TE + DA + exact CRF KL (crfkit)"),
          ("glove_seq", "GloVe student + SEQ (not in the paper)"),
          ("glove_exact_kl", "GloVe student + exact CRF KL (crfkit; not in the paper)")]
TABLE2 = [("te_da_seq", "SEQ (hard + fuzzy + k-best CE)"), ("te_da_seq_token_pos", "+ TOKEN-POS"),
          ("te_da_seq_no_fuzzy", "- fuzzy"), ("te_da_seq_no_kbest_ce", "- k-best CE")]
TABLE3 = [("te_seq", "te_seq_equal", "without DA"), ("te_da_seq", "te_da_seq_equal", "with DA")]
RECORD_FIELDS = ("run", "variant", "K", "teacher_sha256", "seed", "dev_f1", "test_f1", "params", "trainable_params",
                 "sentences_per_s", "wall_s", "epochs", "command", "git", "machine", "date", "losses", "weighting",
                 "test_sentences", "da_pool")
# fields of the records written since 2026-12-02 (issue 60), kept when a record has them: records
# written before lack them (and are kept without them)
NEW_RECORD_FIELDS = ("distilled", "student", "dataset", "pool_sentences", "crossfit_folds", "gradual_unfreezing",
                     "fold", "folds", "fold_sentences", "config_sha256")
TEACHERLESS = ("vanilla", "glove")  # Table 1's students that no teacher shapes
MAIN_POOL = "news"  # the DA pool of Table 1 (pipeline --full: --da-news, no Tang augmentation)
STUDENTS_ISSUE = "g100"   # issue 60's student: its variants' prefix; "g100" itself is its baseline
FOLD_TEACHER = "teacher_fold"   # cross-fitting's fold teachers: not students, in no table
# the ordering of issue 60 (SEQ > TOKEN-POS > the student alone), without and with DA
ORDERING = (("without DA", "g100_seq", "g100_token_pos", "g100"),
            ("with DA", "g100_da_seq", "g100_da_token_pos", "g100_da"))
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 60   # fixed: the intervals, and so the docs, are the same on every rebuild
CONFIDENCE = 0.95
# a student row of the tool's report.json: "BiLSTM+CRF g100_seq, K = 5, seed 0"
REPORT_ROW = re.compile(r"^(?P<kind>.+?) (?P<variant>[^\s,]+)(?:, K = (?P<k>\d+))?, seed (?P<seed>-?\d+)$")


def read_jsonl(path: Path) -> list[dict]:
    """The records of a results.jsonl (a line cut short by a kill is skipped)."""
    records = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def is_new(record: dict) -> bool:
    """Whether a record was written since runs record `distilled` (2026-12-02): then its
    teacher_sha256 None means that it uses no teacher (the teacher's own record has no
    `distilled`; a fold teacher's says false and names its own weights)."""
    return "distilled" in record


def in_old_tables(record: dict) -> bool:
    """Whether a record belongs to the paper's tables (not issue 60's student, not a fold teacher)."""
    return not record["variant"].startswith(STUDENTS_ISSUE) and record["variant"] != FOLD_TEACHER


def record_key(record: dict) -> tuple:
    """What makes two records runs of the same thing (the later replaces the earlier); the
    teacher last (see load_records)."""
    return (record["variant"], record.get("K"), record["seed"], record["pool"], record.get("student"),
            record.get("dataset"), record.get("crossfit_folds") or 0, record.get("fold"), record["teacher_sha256"])


def load_records(workdirs: Sequence[Path], previous: dict) -> list[dict]:
    """The latest record per (variant, K, seed, DA pool, student, dataset, cross-fitting, teacher):
    those already in docs/reproduction.json (`previous`, so that records of earlier sessions are
    kept when their workdir is gone), then each workdir's results.jsonl. A record's teacher is the
    digest of the teacher's weights (a teacher's own record names its own); records written before
    the pipeline recorded it (teacher_sha256 None, no `distilled`) count as the main teacher's (see
    main_teacher). A record with `distilled` false names no teacher because it uses none."""
    latest = {}
    records = list(previous.get("records", []))
    for workdir in workdirs:
        path = workdir / "results.jsonl"
        if not path.exists():
            raise SystemExit(f"{path} does not exist: run python -m crfkit.pipeline --workdir {workdir} first")
        records += read_jsonl(path)
    for record in records:
        kept = {k: record.get(k) for k in RECORD_FIELDS}
        kept.update({k: record[k] for k in NEW_RECORD_FIELDS if k in record})
        kept["command"] = without_machine_paths(kept["command"])
        # the tool records its pool's name ("news", "articles20000"); older records its contents only
        kept["pool"] = (record.get("pool") or None) if is_new(record) else pool_name(record)
        latest[record_key(kept)] = kept
    main = main_teacher(r for r in latest.values() if in_old_tables(r))
    unnamed = [key for key, r in latest.items() if main is not None and not is_new(r) and key[-1] is None
               and key[:-1] + (main,) in latest]
    for key in unnamed:  # superseded by a later record of the same run that names the main teacher
        del latest[key]
    return sorted(latest.values(), key=lambda r: (r["variant"], r.get("K") or 0, r["seed"], r["pool"] or "",
                                                  r["teacher_sha256"] or "", r.get("student") or "",
                                                  r.get("dataset") or "", r.get("crossfit_folds") or 0,
                                                  r.get("fold") or 0))


def without_machine_paths(command: str | None) -> str | None:
    """A recorded command as run from inside its work folder (--workdir / --output_dir): its
    absolute paths relative to that folder, the folder itself "." (records of runs made before
    the tool wrote them so carry the machine's paths)."""
    if not command:
        return command
    words = shlex.split(command)
    for flag in ("--workdir", "--output_dir", "--output-dir"):
        if flag in words[:-1]:
            workdir = words[words.index(flag) + 1]
            if os.path.isabs(workdir):
                return relative_command(words, workdir, base=workdir)
    return command


def shown(workdir: Path) -> str:
    """A work folder as the docs name it: relative to the repository when inside it, else by its
    own name (no machine paths in the docs)."""
    try:
        return str(Path(workdir).resolve().relative_to(ROOT))
    except ValueError:
        return Path(workdir).name


def main_teacher(records) -> str | None:
    """The teacher whose students fill the tables: the digest that most student records name."""
    counts: dict[str, int] = {}
    for r in records:
        if r["variant"] not in ("teacher", FOLD_TEACHER) and r.get("teacher_sha256"):
            counts[r["teacher_sha256"]] = counts.get(r["teacher_sha256"], 0) + 1
    return max(counts, key=counts.get) if counts else None


def by_teacher(records: list[dict]) -> tuple[str | None, list[dict], dict[str, list[dict]]]:
    """The main teacher, its records (with those that name none) and, per other teacher, its own.
    Those that name none: records written before records named the teacher, and baselines that
    use no teacher (`distilled` false: the tables' vanilla and GloVe rows, which the other
    teachers' targets share too)."""
    main = main_teacher(records)
    others = {}
    for r in records:
        if r.get("teacher_sha256") not in (None, main):
            others.setdefault(r["teacher_sha256"], []).append(r)
    return main, [r for r in records if r.get("teacher_sha256") in (None, main)], others


def encoder_name(teacher_record: dict | None) -> str:
    """The encoder a teacher was fine-tuned from, read from its record's command (the pipeline's
    --teacher-encoder: "minilm" by default, "mpnet", or a folder, named by its last part)."""
    if teacher_record is None:
        return "?"

    def named(value: str) -> str:  # a folder by its last part that is not the tool's own "teacher/model"
        parts = [p for p in value.rstrip("/").split("/") if p not in ("", ".", "..")]
        meaningful = [p for p in parts if p not in ("model", "teacher")]
        return (meaningful or parts or [value])[-1]

    words = shlex.split(teacher_record.get("command") or "")
    for i, word in enumerate(words):
        for flag in ("--teacher-encoder", "--teacher_model_name_or_path"):  # the pipeline's, the tool's
            if word == flag and i + 1 < len(words):
                return named(words[i + 1])
            if word.startswith(flag + "="):
                return named(word.split("=", 1)[1])
    return "minilm"


def pool_name(record: dict) -> str | None:
    """The DA pool of a run ("news", "augment 1", "news + augment 1"), None for runs without DA.
    Records written before the pipeline recorded its pool used one Tang et al. augmentation of
    each train sentence and nothing else."""
    from crfkit.training import VARIANTS

    variant = VARIANTS.get(record["variant"])
    if variant is None or not variant.da:
        return None
    pool = record.get("da_pool") or {"news": 0, "augment": 1}
    parts = (["news"] if pool.get("news") else []) + ([f"augment {pool['augment']}"] if pool.get("augment") else [])
    return " + ".join(parts)


def summary(records: list[dict], variant: str, k: int | None = None, default_k: int = 5,
            pool: str = MAIN_POOL) -> dict | None:
    """Mean, sample standard deviation, min / max of test F1 over seeds for one variant and K
    (and, for the DA variants, one DA pool)."""
    chosen = [r for r in records if r["variant"] == variant and r["pool"] in (None, pool)
              and (r.get("K") is None or r.get("K") == (k if k is not None else default_k))]
    if not chosen:
        return None
    test = [r["test_f1"] for r in chosen]
    dev = [r["dev_f1"] for r in chosen]
    return {"n": len(chosen), "test_mean": statistics.fmean(test),
            "test_std": statistics.stdev(test) if len(test) > 1 else None, "test_min": min(test), "test_max": max(test),
            "dev_mean": statistics.fmean(dev), "params": chosen[0]["params"],
            "trainable_params": chosen[0].get("trainable_params"),
            "sentences_per_s": statistics.fmean(r["sentences_per_s"] for r in chosen),
            "wall_s": statistics.fmean(r["wall_s"] for r in chosen),
            "seeds": sorted(r["seed"] for r in chosen)}


def _mean_spread(s: dict) -> str:
    return f"{s['test_mean']:.2f}" + (f" ± {s['test_std']:.2f}" if s["test_std"] is not None else "")


def _f1(s: dict | None) -> str:
    return "not run yet" if s is None else f"{_mean_spread(s)} (n = {s['n']})"


def _paper(variant: str) -> str:
    return f"{PAPER[variant]:.2f}" if variant in PAPER else "-"


def build(workdirs: Path | Sequence[Path], ablation_variant: str, default_k: int) -> tuple[str, dict]:
    workdirs = [Path(workdirs)] if isinstance(workdirs, (str, Path)) else [Path(w) for w in workdirs]
    # the main run's: its report stage gives the side-by-side speeds (none: the docs' own records)
    workdir = workdirs[0] if workdirs else Path(os.devnull)
    previous = DOCS / "reproduction.json"
    previous = json.loads(previous.read_text()) if previous.exists() else {}
    all_records = load_records(workdirs, previous)
    main, records, other_teachers = by_teacher([r for r in all_records if in_old_tables(r)])
    names = [shown(w) for w in workdirs] or [shown(Path(w.strip())) for w in previous.get("workdir", "").split(",")
                                             if w.strip()]
    out = {"generated": datetime.datetime.now().isoformat(timespec="seconds"),
           "workdir": ", ".join(names), "records": all_records}
    lines = ["# Reproducing multi-grained k-best distillation on CoNLL-2003", "",
             "Written by `python examples/reproduction_report.py` from the run records of `python -m crfkit.pipeline` "
             f"(`{'`, `'.join(f'{w}/results.jsonl' for w in names)}`, commands as run from inside that work folder; "
             "every record, with its command, seed, "
             "commit and machine, is in "
             "`docs/reproduction.json`). Test F1 is entity-level (seqeval, strict IOB2) on the CoNLL-2003 test "
             "split, read once per finished run; model selection used the validation split only. "
             "Mean ± sample standard deviation over the seeds that finished (n). The paper's numbers are its "
             "BERT-base teacher's and students' (\"Multi-Grained Knowledge Distillation for Named Entity "
             "Recognition\", NAACL 2021); the teacher here is MiniLM-L6 (22.7M parameters), the only English "
             "encoder of that size available offline, so the two columns measure different teachers.", ""]
    machines = sorted({r["machine"] for r in all_records})
    lines += ["Machines: " + "; ".join(machines), ""]

    lines += ["## Table 1: CoNLL-2003 test F1", "",
              f"K = {default_k} for the SEQ variants. Speed: sentences per second tagging 512 test sentences, "
              "batch 32, "
              "measured when each run finished, while other runs shared the machine (the side-by-side measurement "
              "below is the one to compare).", "",
              "| model | ours: test F1 | paper | dev F1 | parameters (trainable) | sentences/s | wall time |",
              "|---|---|---|---|---|---|---|"]
    table1 = {}
    elsewhere = {r["variant"] for rows in other_teachers.values() for r in rows}
    for variant, label in TABLE1:
        s = summary(records, variant, None, default_k)
        table1[variant] = s
        if s is None:
            missing = "only with another teacher (below)" if variant in elsewhere else "not run yet"
            lines.append(f"| {label} | {missing} | {_paper(variant)} | | | | |")
            continue
        params = f"{s['params'] / 1e6:.1f}M" + (f" ({s['trainable_params'] / 1e6:.2f}M)"
                                                if s.get("trainable_params") is not None else "")
        lines.append(f"| {label} | {_f1(s)} | {_paper(variant)} | {s['dev_mean']:.2f} | {params} | "
                     f"{s['sentences_per_s']:.0f} | {s['wall_s'] / 60:.0f} min |")
    out["table1"] = table1

    lines += ["", f"## K ablation ({ablation_variant})", "", "| K | test F1 | dev F1 |", "|---|---|---|"]
    ablation = {}
    for k in (1, 3, 5, 10, 15):
        s = summary(records, ablation_variant, k, default_k)
        ablation[k] = s
        dev = "" if s is None else f"{s['dev_mean']:.2f}"
        lines.append(f"| {k} | {_f1(s)} | {dev} |")
    out["k_ablation"] = {"variant": ablation_variant, "rows": ablation}
    done = [(k, s) for k, s in ablation.items() if s is not None]
    if len(done) >= 2:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ks = [k for k, _ in done]
        means = [s["test_mean"] for _, s in done]
        errors = [s["test_std"] or 0.0 for _, s in done]
        ax.errorbar(ks, means, yerr=errors, marker="o", capsize=3, label=f"{ablation_variant} (test F1)")
        ax.set_xlabel("K (teacher sequences)")
        ax.set_ylabel("CoNLL-2003 test F1")
        ax.set_xticks(ks)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(DOCS / "kbest_ablation.png", dpi=120)
        lines += ["", "![test F1 against K](kbest_ablation.png)"]

    lines += ["", "## Uncertainty against equal weighting (the paper's Table 3)", "",
              "| data | uncertainty | equal | paper: uncertainty / equal |", "|---|---|---|---|"]
    for auto, equal, label in TABLE3:
        a, e = summary(records, auto, None, default_k), summary(records, equal, None, default_k)
        lines.append(f"| {label} | {_f1(a)} | {_f1(e)} | {_paper(auto)} / {_paper(equal)} |")

    other_pools = sorted({(r["variant"], r["pool"]) for r in records if r["pool"] not in (None, MAIN_POOL)})
    if other_pools:
        lines += ["", "## Other DA pools", "",
                  f"Table 1's DA rows pool the train text with real news ({MAIN_POOL}); these runs pooled other "
                  "text (augment N: N of Tang et al.'s augmentations of each train sentence).", "",
                  "| variant | pool | test F1 | dev F1 | Table 1's pool: test F1 |", "|---|---|---|---|---|"]
        for variant, pool in other_pools:
            s = summary(records, variant, None, default_k, pool)
            lines.append(f"| {variant} | {pool} | {_f1(s)} | {s['dev_mean']:.2f} | "
                         f"{_f1(summary(records, variant, None, default_k))} |")

    lines += ["", "## Loss combinations (the paper's Table 2, with TE + DA)", "",
              "| losses | ours: test F1 | paper |", "|---|---|---|"]
    for variant, label in TABLE2:
        lines.append(f"| {label} | {_f1(summary(records, variant, None, default_k))} | {_paper(variant)} |")

    tabled = {v for v, _ in TABLE1 + TABLE2} | {v for pair in TABLE3 for v in pair[:2]} | {ablation_variant}
    others = sorted({(r["variant"], r.get("K")) for r in records if r["variant"] not in tabled},
                    key=lambda vk: (vk[0], vk[1] or 0))
    if others:
        lines += ["", "## Other students", "",
                  "Variants outside the tables above (for example seed 002's stage-wise schedule, "
                  "`te_da_stagewise`, and the appendix's small transformer student, `bp2_*`).", "",
                  "| variant | K | test F1 | dev F1 | parameters (trainable) | sentences/s |",
                  "|---|---|---|---|---|---|"]
        for variant, k in others:
            s = summary(records, variant, k, default_k)
            lines.append(f"| {variant} | {k if k is not None else '-'} | {_f1(s)} | {s['dev_mean']:.2f} | "
                         f"{s['params'] / 1e6:.1f}M ({(s['trainable_params'] or 0) / 1e6:.2f}M) | "
                         f"{s['sentences_per_s']:.0f} |")

    if other_teachers:
        lines += ["", "## Runs with another teacher", "",
                  "Teachers of the same encoder retrained with the same command and seed whose weights came out "
                  "different (another machine: floating-point sums in another order), teachers of another encoder "
                  "(for example MPNet-base), and the students distilled from each. They stay out of the tables "
                  f"above, which all share one teacher (`{(main or '?')[:12]}`).", "",
                  "| teacher | encoder | variant | K | seed | test F1 | paper | dev F1 | machine | date |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for digest, rows in sorted(other_teachers.items()):
            rows = sorted(rows, key=lambda r: (r["variant"] != "teacher", r["variant"], r.get("K") or 0, r["seed"]))
            encoder = encoder_name(next((r for r in rows if r["variant"] == "teacher"), None))
            for r in rows:
                lines.append(f"| `{digest[:12]}` | {encoder} | {r['variant']} | "
                             f"{r.get('K') if r.get('K') is not None else '-'} | {r['seed']} | {r['test_f1']:.2f} | "
                             f"{_paper(r['variant'])} | {r['dev_f1']:.2f} | {r['machine']} | {r['date']} |")

    side_by_side = workdir / "report.json"
    report = json.loads(side_by_side.read_text()) if side_by_side.exists() else None
    if report is not None and report_of_students_issue(report):  # measured for issue 60's section instead
        report = None
    report = report or previous.get("side_by_side")
    if report:  # from this workdir's report stage, else the one already in docs/reproduction.json
        lines += ["", "## Tagging speed, measured side by side", "",
                  f"From the pipeline's report stage (`{report['command']}`, git {report['git']}, {report['date']}, "
                  f"{report['machine']}): tagging the first {report['throughput_sentences']} test sentences, batch "
                  f"{report['batch_size']}, every model in the same process one after the other.", "",
                  "| model | test F1 | sentences/s | vs teacher |", "|---|---|---|---|"]
        for row in report["rows"]:
            lines.append(f"| {row['model']} | {row['test_f1']:.2f} | {row['sentences_per_s']:.0f} | "
                         f"{row['speedup']:.1f}x |")
        out["side_by_side"] = report

    step = ROOT / "benchmarks" / "results" / "training_step.json"
    if step.exists():
        bench = json.loads(step.read_text())
        lines += ["", "## The CRF's share of a training step", "",
                  f"From `benchmarks/results/training_step.md` (`{bench['command']}`, {bench['machine']}, "
                  f"{bench['date']}): median ms per batch of {bench['batch_size']}, forward + backward.", "",
                  "| model | step with crfkit's CRF | step with pytorch-crf | CRF share, crfkit "
                  "| CRF share, pytorch-crf |",
                  "|---|---|---|---|---|"]
        for name, m in bench["models"].items():
            lines.append(f"| {name} | {m['step_crfkit']:.1f} | {m['step_peer']:.1f} | {100 * m['share_crfkit']:.1f}% | "
                         f"{100 * m['share_peer']:.1f}% |")

    lines += ["", "## Targets", ""] + targets(table1)
    for digest, rows in sorted(other_teachers.items()):
        own = {variant: summary(rows, variant, None, default_k) for variant, _ in TABLE1}
        if own["teacher"] is None or not any(s for v, s in own.items() if v not in TEACHERLESS + ("teacher",)):
            continue
        for variant in TEACHERLESS:  # these students never see a teacher: the main table's runs serve
            own[variant] = own[variant] or table1.get(variant)
        encoder = encoder_name(next((r for r in rows if r["variant"] == "teacher"), None))
        lines += ["", f"With the {encoder} teacher `{digest[:12]}` (its students only; vanilla and GloVe from "
                  "Table 1):", ""] + targets(own)
    speeds = students_side_by_side(workdirs, previous)
    if speeds:
        out["students_side_by_side"] = speeds
    if any(r["variant"].startswith(STUDENTS_ISSUE) for r in all_records):
        section, out["students_issue"] = students_section(all_records, speeds, default_k)
        lines += [""] + section
    architectures = ROOT / "benchmarks" / "results" / "tagging_speed.json"
    if architectures.exists():
        lines += [""] + tagging_speed_section(json.loads(architectures.read_text()))
    notes = DOCS / "reproduction_notes.md"
    if notes.exists():
        lines += ["", notes.read_text().strip()]
    return "\n".join(lines) + "\n", out


def tagging_speed_section(bench: dict) -> list[str]:
    """benchmarks/results/tagging_speed.json as a section: the students against teacher
    architectures no teacher was trained on here (a `fresh:` model: an untrained head, which does
    not change its speed), measured side by side; informational, not a target's measurement."""
    rows = bench["rows"]
    first = rows[0]["model"]
    lines = ["## Tagging speed against other teacher architectures", "",
             f"From `benchmarks/results/tagging_speed.md` (`{bench['command']}`, git {bench['git']}, {bench['date']}, "
             f"{bench['machine']}, {bench['threads']} thread(s)): {bench['sentences']} CoNLL-2003 test sentences, "
             f"batch {bench['batch_size']}, interleaved rounds; a ratio is the median of the per-round ratios. "
             "A model marked untrained is an encoder with a fresh head: its speed is its architecture's, its "
             "tags mean nothing. The issue-60 speed target is read from the trained teacher's report above.", "",
             f"| model | architecture | parameters | sentences/s | vs {first} |", "|---|---|---|---|---|"]
    for r in rows:
        untrained = " (untrained)" if str(r["source"]).startswith("fresh:") else ""
        lines.append(f"| {r['model']}{untrained} | {r['describe']} | {r['params'] / 1e6:.1f}M | "
                     f"{r['sentences_per_s']:.0f} | {r['vs_first']:.2f}x |")
    students = [r for r in rows if r["describe"].startswith("BiLSTM")]
    teachers = [r for r in rows if not r["describe"].startswith("BiLSTM")]
    if students and teachers:
        lines.append("")
    for student in students:
        for teacher in teachers:
            ratios = sorted(s / t for s, t in zip(student["rounds"], teacher["rounds"]))
            lines.append(f"- {student['model']} over {teacher['model']}: {statistics.median(ratios):.1f}x "
                         f"(rounds {ratios[0]:.1f}x to {ratios[-1]:.1f}x)")
    return lines


def targets(table1: dict) -> list[str]:
    def mean(v):
        s = table1.get(v)
        return None if s is None else s["test_mean"]

    rows = []
    teacher = mean("teacher")
    rows.append("- teacher at least 88 F1: "
                f"{'not run yet' if teacher is None else f'{teacher:.2f}, ' + ('met' if teacher >= 88 else 'NOT met')}")
    students = {v: mean(v) for v in table1 if v not in ("teacher",) + TEACHERLESS and mean(v) is not None}
    glove = mean("glove")
    vanilla = mean("vanilla")
    if students and teacher is not None and vanilla is not None:
        best = max(students, key=students.get)
        gap, gain = teacher - students[best], students[best] - vanilla
        rows.append(f"- best distilled student ({best}, {students[best]:.2f}) within 1.5 F1 of the teacher: gap "
                    f"{gap:.2f}, {'met' if gap <= 1.5 else 'NOT met'}; at least 5 F1 above vanilla ({vanilla:.2f}): "
                    f"+{gain:.2f}, {'met' if gain >= 5 else 'NOT met'}")
        if glove is not None:
            rows.append(f"- best distilled student against the GloVe baseline without a teacher ({glove:.2f}): "
                        f"{students[best] - glove:+.2f}")
    seq, pos, te = mean("te_seq"), mean("te_token_pos"), mean("te")
    if None not in (seq, pos, te):
        def spread(v):
            return f"{_mean_spread(table1[v])}, n = {table1[v]['n']}"
        rows.append(f"- SEQ ({spread('te_seq')}) > TOKEN-POS ({spread('te_token_pos')}) > TE ({spread('te')}): "
                    f"{'met' if seq > pos > te else 'NOT met'} (on the means)")
    return rows or ["- not enough runs yet"]


# ---------------------------------------------------------------------- the students issue (issue 60)
def sign_test(differences: Sequence[float]) -> float:
    """Two-sided exact sign test (binomial, p = 1/2) of paired differences; ties (0) are dropped.
    1.0 when no difference is non-zero."""
    positive = sum(1 for d in differences if d > 0)
    negative = sum(1 for d in differences if d < 0)
    n = positive + negative
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(positive, negative) + 1))
    return min(1.0, 2 * tail / 2 ** n)


def paired_interval(differences: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                    confidence: float = CONFIDENCE) -> dict:
    """Mean of paired differences (one per seed), its percentile bootstrap interval over seeds
    (resamples of the seeds with replacement, numpy's generator seeded with `seed`: the same
    interval on every rebuild) and the sign test's p. With fewer than 2 pairs: no interval (low,
    high None)."""
    import numpy as np

    d = np.asarray(list(differences), dtype=float)
    n = len(d)
    result = {"n": n, "mean": round(float(d.mean()), 6) if n else None, "low": None, "high": None,
              "p": sign_test(d.tolist()), "resamples": resamples, "confidence": confidence}
    if n >= 2:
        rng = np.random.default_rng(seed)
        means = d[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
        low, high = np.quantile(means, [(1 - confidence) / 2, (1 + confidence) / 2])
        result["low"], result["high"] = round(float(low), 6), round(float(high), 6)
    return result


def paired(row: dict | None, base: dict | None) -> dict | None:
    """The paired comparison of two rows (see student_rows) over the seeds both have."""
    if row is None or base is None:
        return None
    seeds = sorted(set(row["by_seed"]) & set(base["by_seed"]))
    result = paired_interval([round(row["by_seed"][s] - base["by_seed"][s], 6) for s in seeds])
    result["seeds"] = seeds
    return result


def interval_verdict(p: dict | None) -> str:
    if p is None or p["n"] == 0:
        return "not run yet"
    if p["low"] is None:
        return "not resolved (n < 2)"
    if p["low"] > 0:
        return "holds"
    if p["high"] < 0:
        return "does not hold"
    return "not resolved (interval spans 0)"


# Issue 60 judges the ordering over five seeds: a percentile bootstrap of fewer pairs says little
# (of 2 positive pairs its interval is always above 0), so below this the ordering is not judged.
ORDERING_SEEDS = 5


def ordering_verdict(p: dict | None) -> str:
    """interval_verdict where the comparison has ORDERING_SEEDS pairs or more, else "not judged"."""
    if p is not None and 0 < p["n"] < ORDERING_SEEDS:
        return f"not judged ({p['n']} of {ORDERING_SEEDS} seeds)"
    return interval_verdict(p)


def _interval(p: dict | None) -> str:
    if p is None or p["n"] == 0:
        return "-"
    return "n < 2" if p["low"] is None else f"[{p['low']:+.2f}, {p['high']:+.2f}]"


def _difference(p: dict | None) -> str:
    if p is None or p["n"] == 0:
        return "no common seeds" if p is not None else "-"
    return (f"{p['mean']:+.2f} over {p['n']} seed{'s' if p['n'] != 1 else ''}, 95% bootstrap {_interval(p)}, "
            f"sign test p = {p['p']:.3g}")


def report_of_students_issue(report: dict) -> bool:
    """Whether a report.json times issue 60's students only (then it is not Table 1's side by side)."""
    variants = [m["variant"] for m in (REPORT_ROW.match(row["model"]) for row in report.get("rows", [])[1:]) if m]
    return bool(variants) and all(v.startswith(STUDENTS_ISSUE) for v in variants)


def students_side_by_side(workdirs: Sequence[Path], previous: dict) -> list[dict]:
    """The issue-60 students' tagging speed against their teacher measured in one process: the
    rows of each work folder's report.json (the tool's report stage), matched to that folder's
    records by (variant, K, seed); the folder's teacher is the one its teacher record names. Those
    already in docs/reproduction.json are kept (a rebuild without the work folder loses none)."""
    entries = {}

    def key(e):
        return (e["teacher_sha256"], e["variant"], e.get("K"), e["seed"], e.get("pool"), e.get("crossfit_folds") or 0,
                e.get("student"), e.get("dataset"))

    for e in previous.get("students_side_by_side", []):
        entries[key(e)] = e
    for workdir in workdirs:
        path, results = workdir / "report.json", workdir / "results.jsonl"
        if not path.exists() or not results.exists():
            continue
        report = json.loads(path.read_text())
        own = read_jsonl(results)
        teachers = [r for r in own if r["variant"] == "teacher" and r.get("teacher_sha256")]
        rows = report.get("rows") or []
        if not teachers or not rows or not rows[0]["model"].startswith("teacher"):
            continue
        teacher = teachers[-1]
        for row in rows[1:]:
            match = REPORT_ROW.match(row["model"])
            if match is None or not match["variant"].startswith(STUDENTS_ISSUE):
                continue
            k = int(match["k"]) if match["k"] else None
            runs = [r for r in own if r["variant"] == match["variant"] and r.get("K") == k
                    and r["seed"] == int(match["seed"])]
            if not runs:
                continue
            r = runs[-1]
            e = {"teacher_sha256": teacher["teacher_sha256"], "variant": r["variant"], "K": k, "seed": r["seed"],
                 "pool": r.get("pool") or None, "crossfit_folds": r.get("crossfit_folds") or 0,
                 "student": r.get("student"), "dataset": r.get("dataset"),
                 "sentences_per_s": row["sentences_per_s"], "teacher_sentences_per_s": rows[0]["sentences_per_s"],
                 "speedup": row["speedup"], "workdir": shown(workdir), "machine": report.get("machine"),
                 "date": report.get("date")}
            entries[key(e)] = e
    return sorted(entries.values(), key=lambda e: tuple("" if v is None else str(v) for v in key(e)))


def _row_key(r: dict) -> tuple:
    return (r["variant"], r.get("K"), r.get("pool"), r.get("crossfit_folds") or 0)


def _row_order(key: tuple) -> tuple:
    from crfkit.training import VARIANTS

    names = list(VARIANTS)
    variant, k, pool, crossfit = key
    return (names.index(variant) if variant in names else len(names), variant, k or 0, pool or "", crossfit)


def student_rows(records: list[dict]) -> dict[tuple, dict]:
    """Per (variant, K, pool, cross-fitting folds): test F1 over seeds (mean, sample sd, n), dev
    F1, each seed's test F1 (the pairs), the records' mean tagging speed."""
    grouped: dict[tuple, list[dict]] = {}
    for r in records:
        grouped.setdefault(_row_key(r), []).append(r)
    rows = {}
    for key in sorted(grouped, key=_row_order):
        chosen = grouped[key]
        test = [r["test_f1"] for r in chosen]
        rows[key] = {"variant": key[0], "K": key[1], "pool": key[2], "crossfit_folds": key[3], "n": len(chosen),
                     "distilled": any(r.get("distilled") for r in chosen),
                     "pool_sentences": max((r.get("pool_sentences") or 0 for r in chosen), default=0) or None,
                     "test_mean": round(statistics.fmean(test), 6),
                     "test_std": round(statistics.stdev(test), 6) if len(test) > 1 else None,
                     "dev_mean": round(statistics.fmean(r["dev_f1"] for r in chosen), 6),
                     "by_seed": {r["seed"]: r["test_f1"] for r in chosen},
                     "sentences_per_s": statistics.fmean(r["sentences_per_s"] for r in chosen)}
    return rows


def _find(rows: dict, variant: str, k=None, pool=None, crossfit=0) -> dict | None:
    return rows.get((variant, k, pool, crossfit))


def _speed(row: dict, teacher: str | None, teacher_record: dict | None, speeds: list[dict],
           student: str, dataset) -> dict | None:
    """A row's tagging speed against its teacher: side by side (report.json) where this student
    architecture was timed with this teacher, whichever variant (every variant of one student
    tags with the same network), else the ratio of the row's records' own speeds (each run's,
    measured when it finished). Of several side-by-side reports, the newest (the last code;
    predict got faster over time) gives the mean over its rows."""
    same = [e for e in speeds if e["teacher_sha256"] == teacher and e["student"] == student
            and e["dataset"] == dataset]
    if same:
        newest = max(e.get("date") or "" for e in same)
        chosen = [e for e in same if (e.get("date") or "") == newest]
        return {"ratio": statistics.fmean(e["speedup"] for e in chosen), "n": len(chosen), "source": "side by side",
                "date": newest or None}
    if teacher_record is None or not teacher_record.get("sentences_per_s"):
        return None
    return {"ratio": row["sentences_per_s"] / teacher_record["sentences_per_s"], "n": row["n"], "source": "records"}


def _speed_text(speed: dict | None) -> str:
    if speed is None:
        return "-"
    return f"{speed['ratio']:.1f}x" + (" (records)" if speed["source"] == "records" else "")


def _row_name(row: dict) -> str:
    parts = [row["variant"]]
    if row["K"] is not None:
        parts.append(f"K = {row['K']}")
    if row["pool"]:
        parts.append(f"pool {row['pool']}")
    if row["crossfit_folds"]:
        parts.append(f"cross-fit {row['crossfit_folds']}")
    return ", ".join(parts)


def students_section(records: list[dict], speeds: list[dict], default_k: int = 5) -> tuple[list[str], dict]:
    """The section of issue 60 (see the module's docstring): its lines and its data."""
    issue = [r for r in records if r["variant"].startswith(STUDENTS_ISSUE)]
    teachers = {r["teacher_sha256"]: r for r in records if r["variant"] == "teacher" and r.get("teacher_sha256")}
    shared: dict[tuple, list[dict]] = {}   # (student, dataset): runs that use no teacher, every teacher's
    distilled: dict[tuple, list[dict]] = {}   # (teacher, student, dataset): its students
    for r in issue:
        if r.get("distilled") is False or not r.get("teacher_sha256"):
            shared.setdefault((r.get("student"), r.get("dataset")), []).append(r)
        else:
            distilled.setdefault((r["teacher_sha256"], r.get("student"), r.get("dataset")), []).append(r)
    tables = sorted(distilled, key=lambda t: tuple(v or "" for v in t))
    tables += [(None, student, dataset) for student, dataset in sorted(shared, key=lambda t: tuple(v or "" for v in t))
               if not any(t[1:] == (student, dataset) for t in distilled)]

    lines = ["## Students issue (issue 60)", "",
             "Issue 60's student (variants g100*: 100-d cased GloVe beside GloVe 50d, character CNN; the "
             "architecture as the records' `student` string), one table per teacher, student and dataset. "
             "Every row is compared with the baseline g100 (the same student trained on gold labels alone; "
             "it uses no teacher, so it serves every teacher's table of its student) over the seeds both "
             "have: the mean paired difference of test F1, a 95% percentile bootstrap interval over seeds "
             f"({BOOTSTRAP_RESAMPLES:,} resamples, numpy's generator seeded with {BOOTSTRAP_SEED}) and the "
             "two-sided exact sign test's p (with 5 pairs its smallest value is 0.0625). Speed: the "
             "student's sentences per second over the teacher's, measured side by side in one run "
             "(the work folder's report.json; the newest one that timed this student architecture, whichever "
             "variant: every variant tags with the same network) where that was done, else \"(records)\": the "
             "ratio of the speeds each run recorded when it finished, while other runs may have shared the machine."]
    folds = [r for r in records if r["variant"] == FOLD_TEACHER]
    if folds:
        tests = [r["test_f1"] for r in folds]
        lines += ["", f"Cross-fitting fold teachers ({FOLD_TEACHER}; not students, in no table): {len(folds)} "
                      f"record(s), test F1 {min(tests):.2f} to {max(tests):.2f}."]
    data: dict = {"bootstrap": {"resamples": BOOTSTRAP_RESAMPLES, "seed": BOOTSTRAP_SEED, "confidence": CONFIDENCE},
                  "tables": []}
    target_lines: list[str] = []
    for teacher, student, dataset in tables:
        own = distilled.get((teacher, student, dataset), []) + shared.get((student, dataset), [])
        rows = student_rows(own)
        teacher_record = teachers.get(teacher) if teacher else None
        encoder = encoder_name(teacher_record) if teacher_record else "?"
        teacher_f1 = teacher_record["test_f1"] if teacher_record else None
        base = _find(rows, STUDENTS_ISSUE)
        if teacher is None:
            title = "no teacher yet"
        else:
            title = f"teacher `{teacher[:12]}` ({encoder}" + (
                f", test F1 {teacher_f1:.2f})" if teacher_f1 is not None else ", its record is not here)")
        lines += ["", f"### {title}; student `{student or '?'}`; {dataset or 'dataset not recorded'}", "",
                  "| variant | K | pool (sentences) | cross-fit | test F1 | dev F1 | vs g100: mean difference (pairs) "
                  "| 95% bootstrap | sign test p | gap to teacher | speed vs teacher |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        table = {"teacher_sha256": teacher, "encoder": encoder if teacher else None, "teacher_test_f1": teacher_f1,
                 "student": student, "dataset": dataset, "rows": [], "ordering": [], "targets": []}
        for key, row in rows.items():
            comparison = None if row is base else paired(row, base)
            gap = None if teacher_f1 is None else round(teacher_f1 - row["test_mean"], 6)
            speed = _speed(row, teacher, teacher_record, speeds, student, dataset) if teacher else None
            pool = "-" if not row["pool"] else row["pool"] + (
                f" ({row['pool_sentences']:,})" if row["pool_sentences"] else "")
            if row is base:
                against = ("the baseline", "", "")
            elif comparison is None:
                against = ("no baseline run", "-", "-")
            elif comparison["n"] == 0:
                against = ("no common seeds", "-", "-")
            else:
                against = (f"{comparison['mean']:+.2f} ({comparison['n']})", _interval(comparison),
                           f"{comparison['p']:.3g}")
            lines.append(f"| {row['variant']} | {row['K'] if row['K'] is not None else '-'} | {pool} | "
                         f"{row['crossfit_folds'] or '-'} | {_f1(row)} | {row['dev_mean']:.2f} | {against[0]} | "
                         f"{against[1]} | {against[2]} | {'-' if gap is None else f'{gap:.2f}'} | "
                         f"{_speed_text(speed)} |")
            table["rows"].append({**{k: v for k, v in row.items() if k != "by_seed"},
                                  "test_f1_by_seed": {str(s): v for s, v in sorted(row["by_seed"].items())},
                                  "vs_baseline": comparison, "gap_to_teacher": gap, "speed_vs_teacher": speed})
        if teacher is not None:
            ordering = ordering_lines(rows, default_k)
            table["ordering"] = ordering
            if ordering:
                lines += ["", "The ordering SEQ > TOKEN-POS > the student alone (paired over seeds, K = "
                          f"{default_k} for SEQ; judged with {ORDERING_SEEDS} seeds or more):", ""]
                lines += [f"- {o['line']}" for o in ordering]
            table["targets"] = students_targets(rows, base, teacher_f1, teacher, teacher_record, speeds, student,
                                                dataset, ordering)
            target_lines += ["", f"With the {encoder} teacher `{teacher[:12]}` and the student `{student or '?'}`:",
                             ""] + [f"- {t['line']}" for t in table["targets"]]
        data["tables"].append(table)
    if target_lines:
        lines += ["", "### Targets (issue 60)"] + target_lines
    return lines, data


def ordering_lines(rows: dict, default_k: int) -> list[dict]:
    """Issue 60's ordering, without and with DA, for each pool and cross-fitting setting that
    has SEQ or TOKEN-POS runs: SEQ against TOKEN-POS, TOKEN-POS against the student alone (g100,
    or g100_da on the same pool: no cross-fitting, it reads no teacher output on the train text),
    each paired over seeds and judged only with ORDERING_SEEDS seeds or more; the chain holds when
    both hold."""
    out: list[dict] = []
    for form, seq_variant, pos_variant, alone_variant in ORDERING:
        settings = sorted({(key[2], key[3]) for key in rows if key[0] in (seq_variant, pos_variant)},
                          key=lambda s: (s[0] or "", s[1]))
        for pool, crossfit in settings:
            seq = _find(rows, seq_variant, default_k, pool, crossfit)
            pos = _find(rows, pos_variant, None, pool, crossfit)
            alone = _find(rows, alone_variant, None, pool, 0) or _find(rows, alone_variant, None, pool, crossfit)
            where = ", ".join([form] + ([f"pool {pool}"] if pool else []) +
                              ([f"cross-fit {crossfit}"] if crossfit else []))
            steps = []
            for (upper, upper_name), (lower, lower_name) in (((seq, "SEQ"), (pos, "TOKEN-POS")),
                                                             ((pos, "TOKEN-POS"), (alone, "alone"))):
                comparison = paired(upper, lower)
                verdict = ordering_verdict(comparison)
                names = (f"{upper['variant'] if upper else '(not run)'} against "
                         f"{lower['variant'] if lower else '(not run)'}")
                steps.append(verdict)
                out.append({"setting": where, "comparison": f"{upper_name} > {lower_name}", "paired": comparison,
                            "verdict": verdict,
                            "line": f"{upper_name} > {lower_name} ({where}; {names}): "
                                    + (f"{_difference(comparison)}: " if comparison and comparison["n"] else "")
                                    + verdict})
            chain = ("holds" if all(v == "holds" for v in steps) else
                     "does not hold" if "does not hold" in steps else
                     "not run yet" if "not run yet" in steps else
                     f"not judged (fewer than {ORDERING_SEEDS} seeds)" if any(v.startswith("not judged") for v in steps)
                     else "not resolved")
            out.append({"setting": where, "comparison": "SEQ > TOKEN-POS > alone", "paired": None, "verdict": chain,
                        "line": f"SEQ > TOKEN-POS > alone ({where}): {chain}"})
    return out


def students_targets(rows: dict, base: dict | None, teacher_f1: float | None, teacher: str,
                     teacher_record: dict | None, speeds: list[dict], student, dataset,
                     ordering: list[dict]) -> list[dict]:
    """Issue 60's targets for one teacher's table, each with its verdict from the records."""
    best_row = max((r for r in rows.values() if r["distilled"]), key=lambda r: r["test_mean"], default=None)
    if best_row is None:
        return [{"target": "best", "verdict": None, "line": "no distilled student yet"}]
    best = f"{_row_name(best_row)}: {_f1(best_row)}"
    out: list[dict] = []
    if teacher_f1 is None:
        out.append({"target": "best", "verdict": None, "line": f"best distilled student ({best}): the teacher's "
                                                               "record is not here, its gap is not judged"})
    else:
        gap = teacher_f1 - best_row["test_mean"]
        met = best_row["test_mean"] >= 91.0 and gap <= 1.0
        out.append({"target": "best", "verdict": "met" if met else "NOT met", "value": best_row["test_mean"],
                    "gap": round(gap, 6),
                    "line": f"best distilled student ({best}) at least 91.0 F1 and within 1.0 of its teacher "
                            f"({teacher_f1:.2f}): gap {gap:.2f}, {'met' if met else 'NOT met'}"})
    comparison = paired(best_row, base)
    if comparison is None or comparison["n"] == 0:
        out.append({"target": "baseline", "verdict": None,
                    "line": "at least 1.0 F1 above the baseline g100 (same student, same seeds): "
                            + ("no baseline run" if comparison is None else "no seeds in common") + ", not judged"})
    else:
        met = comparison["mean"] >= 1.0
        sure = ("" if comparison["low"] is None else
                "; the interval is above 1.0" if comparison["low"] >= 1.0 else
                "; the interval is below 1.0" if comparison["high"] < 1.0 else "; the interval contains 1.0")
        # A teacher that scores below the student it is to lift bounds what its targets can add: say so
        # beside the verdict, it is the measurement that explains a miss.
        weaker = ("" if teacher_f1 is None or base is None or teacher_f1 >= base["test_mean"] else
                  f"; the teacher itself ({teacher_f1:.2f}) is {base['test_mean'] - teacher_f1:.2f} F1 below "
                  "this baseline")
        out.append({"target": "baseline", "verdict": "met" if met else "NOT met", "paired": comparison,
                    "teacher_below_baseline": bool(weaker),
                    "line": f"at least 1.0 F1 above the baseline g100 ({_f1(base)}; paired): "
                            f"{_difference(comparison)}, {'met' if met else 'NOT met'}{sure}{weaker}"})
    speed = _speed(best_row, teacher, teacher_record, speeds, student, dataset)
    if speed is None:
        out.append({"target": "speed", "verdict": None, "line": "at least 20x the teacher's sentences per second: "
                                                                "not measured"})
    else:
        met = speed["ratio"] >= 20
        how = (f"measured side by side in one run of {speed['date']}, this student's architecture"
               if speed["source"] == "side by side" else
               "from the records' sentences_per_s, each measured when its run finished, NOT side by side")
        out.append({"target": "speed", "verdict": "met" if met else "NOT met", "speed": speed,
                    "line": f"at least 20x the teacher's sentences per second: {speed['ratio']:.1f}x ({how}, "
                            f"n = {speed['n']}), {'met' if met else 'NOT met'}"})
    for o in ordering:
        if o["comparison"] == "SEQ > TOKEN-POS > alone":
            out.append({"target": "ordering", "verdict": o["verdict"], "setting": o["setting"],
                        "line": f"the ordering {o['line']} (see above)"})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", action="append", help="a pipeline workdir (default runs/full); repeat "
                        "for runs with other teachers")
    parser.add_argument("--ablation-variant", default="te_da_seq")
    parser.add_argument("--k", type=cli_int(minimum=1), default=5, help="the K of the SEQ rows of Table 1")
    parser.add_argument("--from-docs", action="store_true", help="rebuild from the records already in "
                        "docs/reproduction.json alone (no work folder: e.g. on a machine without the runs)")
    args = parser.parse_args(argv)
    if args.from_docs and args.workdir:
        parser.error("--from-docs reads no work folder: give it or --workdir, not both")
    DOCS.mkdir(exist_ok=True)
    workdirs = [] if args.from_docs else [Path(w) for w in args.workdir or ["runs/full"]]
    text, data = build(workdirs, args.ablation_variant, args.k)
    (DOCS / "REPRODUCTION.md").write_text(text)
    (DOCS / "reproduction.json").write_text(json.dumps(data, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
