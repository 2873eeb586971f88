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
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
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
TEACHERLESS = ("vanilla", "glove")  # Table 1's students that no teacher shapes
MAIN_POOL = "news"  # the DA pool of Table 1 (pipeline --full: --da-news, no Tang augmentation)


def load_records(workdirs: Sequence[Path], previous: dict) -> list[dict]:
    """The latest record per (variant, K, seed, DA pool, teacher): those already in
    docs/reproduction.json (`previous`, so that records of earlier sessions are kept when their
    workdir is gone), then each workdir's results.jsonl. A record's teacher is the digest of the teacher's
    weights (a teacher's own record names its own); records written before the pipeline recorded it
    (teacher_sha256 None) count as the main teacher's (see main_teacher)."""
    latest = {}
    records = list(previous.get("records", []))
    for workdir in workdirs:
        path = workdir / "results.jsonl"
        if not path.exists():
            raise SystemExit(f"{path} does not exist: run python -m crfkit.pipeline --workdir {workdir} first")
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for record in records:
        kept = {k: record.get(k) for k in RECORD_FIELDS}
        kept["command"] = without_machine_paths(kept["command"])
        kept["pool"] = pool_name(record)
        latest[(record["variant"], record.get("K"), record["seed"], kept["pool"], kept["teacher_sha256"])] = kept
    main = main_teacher(latest.values())
    unnamed = [key for key in latest if main is not None and key[-1] is None and key[:-1] + (main,) in latest]
    for key in unnamed:  # superseded by a later record of the same run that names the main teacher
        del latest[key]
    return sorted(latest.values(), key=lambda r: (r["variant"], r.get("K") or 0, r["seed"], r["pool"] or "",
                                                  r["teacher_sha256"] or ""))


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
    counts = {}
    for r in records:
        if r["variant"] != "teacher" and r.get("teacher_sha256"):
            counts[r["teacher_sha256"]] = counts.get(r["teacher_sha256"], 0) + 1
    return max(counts, key=counts.get) if counts else None


def by_teacher(records: list[dict]) -> tuple[str | None, list[dict], dict[str, list[dict]]]:
    """The main teacher, its records (with those that name none) and, per other teacher, its own."""
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
    words = shlex.split(teacher_record.get("command") or "")
    for i, word in enumerate(words):
        if word == "--teacher-encoder" and i + 1 < len(words):
            return os.path.basename(words[i + 1].rstrip("/")) or words[i + 1]
        if word.startswith("--teacher-encoder="):
            return os.path.basename(word.split("=", 1)[1].rstrip("/"))
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
    main, records, other_teachers = by_teacher(all_records)
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
    report = json.loads(side_by_side.read_text()) if side_by_side.exists() else previous.get("side_by_side")
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
    notes = DOCS / "reproduction_notes.md"
    if notes.exists():
        lines += ["", notes.read_text().strip()]
    return "\n".join(lines) + "\n", out


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
