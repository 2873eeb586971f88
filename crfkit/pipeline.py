"""The main job: distil a transformer+CRF tagger into a small BiLSTM+CRF tagger on CoNLL-2003.

    python -m crfkit.pipeline                       # quick defaults: about 15 minutes on 2 CPU cores
    python -m crfkit.pipeline --full                # the full-size settings (hours)
    python -m crfkit.pipeline --runs vanilla te_da_seq@10 --seeds 0 1 2
    torchrun --nproc_per_node=2 -m crfkit.pipeline  # the same, over two processes (gloo on CPU)

Stages, each resumable (run the same command again after a kill, and it continues from the last
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
import datetime
import functools
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import dataclass, replace
from typing import Any, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from . import _validation, data, distill  # noqa: E402
from ._distributed import is_main_process  # noqa: E402
from ._files import atomic_write, ensure_writable_directory  # noqa: E402
from .taggers import BiLSTMCRFTagger, TransformerCRFTagger, load_tagger  # noqa: E402

QUICK = {"teacher_epochs": 1.0, "train_sentences": 0, "dev_sentences": 1000, "student_epochs": 6.0,
         "runs": ["vanilla", "te_seq"], "seeds": [0], "da_augment": 0, "da_news": False, "cache_k": None}
FULL = {"teacher_epochs": 4.0, "train_sentences": 0, "dev_sentences": 0, "student_epochs": 50.0,
        "runs": ["vanilla", "glove", "te", "te_token_em", "te_token_pos", "te_seq", "te_da", "te_da_seq",
                 "te_exact_kl"],
        "seeds": [0, 1, 2], "da_augment": 0, "da_news": True, "cache_k": 15}
STAGES = ("teacher", "label", "students", "report")
RESULT = "result.json"      # in a run's folder: its record, written (atomically) when it finishes
RESULTS = "results.jsonl"   # in the workdir: every finished run's record, one per line


@dataclass(frozen=True)
class RunSpec:
    """One student run: a variant of crfkit.training.VARIANTS, K (teacher paths), a seed, and for
    the DA variants the pool ("news", "aug1", "news-aug1"), so runs on different pools never
    share a folder."""

    variant: str
    k: int
    seed: int
    pool: str = ""

    @property
    def name(self) -> str:
        return f"{self.variant}-k{self.k}-seed{self.seed}" + (f"-{self.pool}" if self.pool else "")


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
    parser.add_argument("--seeds", nargs="+", type=count, help="student seeds (" + _default("seeds") + ")")
    parser.add_argument("--student-epochs", type=positive, help=_default("student_epochs"))
    parser.add_argument("--student-lr", type=positive, default=1e-3, help="default 1e-3")
    parser.add_argument("--student-hidden", type=positive_int, default=300,
                        help="BiLSTM width, both directions together: even (default 300)")
    parser.add_argument("--student-dropout", type=_validation.cli_number(minimum=0, maximum=1, open_maximum=True),
                        default=0.5, help="default 0.5")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="training batch size (default 32)")
    parser.add_argument("--patience", type=positive_int, default=5,
                        help="early stopping on validation F1, in evaluations (default 5)")
    parser.add_argument("--da-news", action=argparse.BooleanOptionalAction,
                        help="DA pool: the 2,687 sentences of real news in gensim's test data, teacher-labelled "
                        "(default: off, on with --full)")
    parser.add_argument("--da-augment", type=count, help="DA pool: Tang et al. samples per train sentence, "
                        "teacher-labelled (" + _default("da_augment") + ")")
    parser.add_argument("--teacher-hidden-layer", type=count, default=3,
                        help="the teacher layer that the hidden loss (te_da_stagewise) distils: 3 of MiniLM's 6, "
                        "half way up as in the multi-stage paper (6-7 of 12); 0 is the embeddings")
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
    try:
        args.run_specs = [_parse_run(text, args.k, seed) for text in args.runs for seed in args.seeds]
    except ValueError as error:
        parser.error(f"argument --runs: {error}")
    if not (args.da_augment or args.da_news) and any(_variant(spec).da for spec in args.run_specs):
        parser.error("the DA variants need a pool of unlabelled text: give --da-news or --da-augment 1 (or more)")
    pool = "-".join((["news"] if args.da_news else []) + ([f"aug{args.da_augment}"] if args.da_augment else []))
    args.run_specs = [replace(spec, pool=pool) if _variant(spec).da else spec for spec in args.run_specs]
    largest = max([spec.k for spec in args.run_specs], default=args.k)
    args.cache_k = args.cache_k or largest
    if args.cache_k < largest:
        parser.error(f"--cache-k {args.cache_k} is below the largest K asked for ({largest})")
    return args


def _parse_run(text: str, default_k: int, seed: int) -> RunSpec:
    from .training import VARIANTS

    variant, at, k = text.partition("@")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    if not at:
        return RunSpec(variant, default_k, seed)
    if not (k.isdecimal() and int(k) >= 1):
        raise ValueError(f"K in {text!r} must be a positive int (VARIANT@K, e.g. te_seq@10), got {k!r}")
    return RunSpec(variant, int(k), seed)


# --------------------------------------------------------------------------- helpers
def _log(message: str) -> None:
    if is_main_process():
        print(f"[crfkit.pipeline {datetime.datetime.now():%H:%M:%S}] {message}", flush=True)


@functools.lru_cache(maxsize=None)
def git_commit() -> Optional[str]:
    """The checkout's commit (+dirty) when first asked: main() asks at start, so a record names the
    code its process ran, not a commit made while it trained."""
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _training_arguments(output_dir: str, args, **overrides):
    from .training import TaggerTrainingArguments

    settings = dict(output_dir=output_dir, per_device_train_batch_size=args.batch_size,
                    per_device_eval_batch_size=64, eval_strategy="epoch", save_strategy="epoch", save_total_limit=2,
                    logging_steps=50, report_to="none", use_cpu=not torch.cuda.is_available(), seed=args.seed,
                    patience=args.patience, disable_tqdm=not is_main_process(), dataloader_num_workers=0)
    settings.update(overrides)
    return TaggerTrainingArguments(**settings)


class Corpus:
    """The splits, and the transfer set the teacher labels (train text, then the DA pool)."""

    def __init__(self, args):
        self.train = data.load_conll2003("train")
        if args.train_sentences:
            self.train = self.train[:args.train_sentences]
        self.dev_all = data.load_conll2003("valid")
        self.dev = self.dev_all[:args.dev_sentences] if args.dev_sentences else self.dev_all
        self.test = data.load_conll2003("test")
        if args.eval_sentences:
            self.dev_all, self.test = self.dev_all[:args.eval_sentences], self.test[:args.eval_sentences]
        # The pool depends on --da-news and --da-augment only (not on the runs asked for), so that
        # every run of a workdir shares one teacher-label cache.
        self.pool: list[tuple[str, ...]] = []
        self.pool_description = {"news": 0, "augment": args.da_augment}
        if args.da_news:
            self.pool = data.load_news_sentences()
            self.pool_description["news"] = len(self.pool)
        if args.da_augment:
            augmented = distill.augment_sentences(self.train, distill.PosUnigrams.from_sentences(self.train),
                                                  n_iter=args.da_augment, seed=0)
            self.pool += [tuple(a.tokens) for a in augmented]

    @property
    def transfer(self) -> list[tuple[str, ...]]:
        return [tuple(s.tokens) for s in self.train] + self.pool


def _variant(spec: RunSpec):
    from .training import VARIANTS

    return VARIANTS[spec.variant]


# --------------------------------------------------------------------------- stages
def train_teacher(args, corpus: Corpus) -> str:
    """Stage 1: returns the saved teacher's folder."""
    import transformers

    from .training import RunClock, fit_tagger, tagging_items

    out = os.path.join(args.workdir, "teacher")
    model_dir = os.path.join(out, "model")
    if _finished_record(args, out) is not None:
        _log(f"teacher: done already ({model_dir})")
        return model_dir
    _log(f"teacher: fine-tuning {args.teacher_encoder} + CRF on {len(corpus.train)} sentences, "
         f"{args.teacher_epochs:g} epoch(s)")
    transformers.set_seed(args.seed)
    teacher = TransformerCRFTagger(data.CONLL2003_TAGS, encoder=args.teacher_encoder)
    training = _training_arguments(out, args, num_train_epochs=args.teacher_epochs, learning_rate=args.teacher_lr,
                                   head_learning_rate=args.teacher_head_lr, layer_decay=args.layer_decay,
                                   weight_decay=0.01, warmup_steps=0.1)
    clock = RunClock(out)  # the wall time over every process that trained it (resumed runs)
    trainer = fit_tagger(teacher, tagging_items(corpus.train), tagging_items(corpus.dev), training,
                         callbacks=[clock])
    if is_main_process():
        # its weights' digest, as the students' records name their teacher
        _finish_run(args, corpus, trainer.model.tagger, out,
                    {"variant": "teacher", "K": None, "seed": args.seed,
                     "teacher_sha256": file_sha256(os.path.join(model_dir, "model.safetensors"))},
                    clock, trainer)
    _barrier()
    return model_dir


def label_transfer_set(args, corpus: Corpus, teacher_dir: str, with_hidden: bool = False):
    """Stage 2: the teacher-label cache over corpus.transfer. with_hidden: a second cache that
    also holds the teacher's layer --teacher-hidden-layer per word, over corpus.transfer and then
    the validation text (the hidden loss is selected on its validation loss)."""
    import functools

    teacher = load_tagger(teacher_dir).eval()
    if with_hidden and args.teacher_hidden_layer > teacher.num_layers:
        raise SystemExit(f"--teacher-hidden-layer {args.teacher_hidden_layer}: the teacher "
                         f"({args.teacher_encoder}) has layers 0 (embeddings) .. {teacher.num_layers}")
    sentences = corpus.transfer + ([tuple(s.tokens) for s in corpus.dev] if with_hidden else [])
    weights = file_sha256(os.path.join(teacher_dir, "model.safetensors"))
    # named by K, corpus size and teacher, and described without paths, so a moved workdir reuses it
    name = f"labels-k{args.cache_k}-n{len(sentences)}-{weights[:8]}"
    directory = os.path.join(args.workdir, name + (f"-hidden{args.teacher_hidden_layer}" if with_hidden else ""))
    _log(f"label: teacher's {args.cache_k} best paths for {len(sentences)} sentences -> {directory}")
    corpus_info = {"train_sentences": len(corpus.train), "da_pool": len(corpus.pool), "da_augment": args.da_augment}
    if corpus.pool_description["news"]:  # recorded only when used, so caches without news keep their manifest
        corpus_info["da_news"] = corpus.pool_description["news"]
    teacher_output = teacher.teacher_output
    if with_hidden:
        corpus_info.update(dev_sentences=len(corpus.dev), hidden_layer=args.teacher_hidden_layer)
        teacher_output = functools.partial(teacher.teacher_output, hidden_layer=args.teacher_hidden_layer)
    return distill.label_corpus(teacher_output, sentences, directory, k=args.cache_k, batch_size=64,
                                with_emissions=True, with_hidden=with_hidden, label_names=list(data.CONLL2003_TAGS),
                                teacher_info={"encoder": args.teacher_encoder, "weights_sha256": weights},
                                corpus_info=corpus_info)


def build_student(args, corpus: Corpus, teacher_dir: str, embeddings: str) -> BiLSTMCRFTagger:
    """The one student configuration of every variant: lower-cased words, a casing embedding, a
    BiLSTM (--student-hidden, --student-dropout) and a BIO-constrained CRF. The word table:
    "teacher" (TE): the train words plus the teacher's whole-word pieces, rows copied from the
        teacher's embedding table (its width) and frozen;
    "glove": the train words plus GloVe's 400k words, GloVe 6B 50d rows, frozen (train words
        GloVe lacks keep a random row);
    "random": the train words seen at least twice (so <unk> is trained on the singletons), random
        rows of the teacher's width, trained."""
    teacher = load_tagger(teacher_dir)
    width = teacher.encoder.get_input_embeddings().weight.shape[1]
    vectors = None
    if embeddings == "teacher":
        pieces = [p for p in teacher.tokenizer.get_vocab() if p.isalnum()]
        words = BiLSTMCRFTagger.build_vocabulary(corpus.train, extra_words=sorted(pieces))
    elif embeddings == "glove":
        from .taggers.vectors import glove_vectors

        vectors = glove_vectors()
        words = BiLSTMCRFTagger.build_vocabulary(corpus.train, extra_words=vectors[0])
        width = vectors[1].shape[1]
    else:
        words = BiLSTMCRFTagger.build_vocabulary(corpus.train, min_count=2)
    student = BiLSTMCRFTagger(data.CONLL2003_TAGS, words, embedding_dim=width, hidden_size=args.student_hidden,
                              dropout=args.student_dropout)
    if embeddings == "teacher":
        student.load_teacher_embeddings(teacher, freeze=True)
    elif embeddings == "glove":
        student.load_word_vectors(vectors[0], torch.from_numpy(vectors[1]), freeze=True)
    return student


def train_student(args, corpus: Corpus, teacher_dir: str, cache, spec: RunSpec) -> dict:
    import transformers

    from .training import RunClock, fit_tagger, fit_tagger_gradually, tagging_items

    out = os.path.join(args.workdir, "students", spec.name)
    done = _finished_record(args, out)
    if done is not None:
        return done
    variant = _variant(spec)
    objectives = [replace(o, k=spec.k) if o.needs_teacher else o for o in variant.objectives]
    items = tagging_items(corpus.train)
    if variant.da:
        items += tagging_items(corpus.pool, first_id=len(corpus.train), with_tags=False)
    needs_hidden = any(o.needs_teacher_hidden for o in objectives)
    # the hidden cache labelled the validation text after the transfer set (see label_transfer_set)
    dev_items = tagging_items(corpus.dev, first_id=len(corpus.transfer) if needs_hidden else 0)
    transformers.set_seed(spec.seed)
    if variant.transformer_layers:
        # the teacher's recipe (layer-wise decay, a larger head rate) on the encoder's first layers
        student = TransformerCRFTagger(data.CONLL2003_TAGS, encoder=args.teacher_encoder,
                                       num_layers=variant.transformer_layers)
        settings = dict(learning_rate=args.teacher_lr, head_learning_rate=args.teacher_head_lr,
                        layer_decay=args.layer_decay, weight_decay=0.01)
    else:
        student = build_student(args, corpus, teacher_dir, variant.embeddings)
        settings = dict(learning_rate=args.student_lr, lr_scheduler_type="constant", max_grad_norm=5.0)
    projection = None
    if needs_hidden:  # GELU(W h + b) from the student's word features to the teacher's layer
        width = student.word_features(student.featurize([["a"]])).shape[-1]
        projection = distill.GeluProjectionLoss(width, cache[len(corpus.transfer)].hidden.shape[1])

    def make_args(directory):
        return _training_arguments(directory, args, num_train_epochs=args.student_epochs, seed=spec.seed, **settings)

    clock = RunClock(out)  # the wall time over every process and stage that trained it
    trainer = None
    for stage, objective in enumerate(objectives, 1):
        stage_out = out if len(objectives) == 1 else os.path.join(out, f"stage{stage}")
        _log(f"student {spec.name}" + (f", stage {stage} of {len(objectives)}" if len(objectives) > 1 else "")
             + f": {len(items)} training sentences, losses {objective.losses}"
             + (f" ({objective.weighting} weighting, K = {spec.k})" if len(objective.losses) > 1 else ""))
        saved = os.path.join(stage_out, "model")
        if os.path.isfile(os.path.join(saved, "config.json")):  # this stage finished earlier: never train it on
            student = load_tagger(saved).train()
            continue
        if variant.gradual_unfreezing:
            trainer = fit_tagger_gradually(student, items, dev_items, make_args, stage_out, objective=objective,
                                           cache=cache, hidden_projection=projection, callbacks=[clock]) or trainer
            if is_main_process():
                student.save_pretrained(saved)   # the stage's result: its last round's best
            _barrier()
            continue
        trainer = fit_tagger(student, items, dev_items, make_args(stage_out), objective=objective, cache=cache,
                             hidden_projection=projection, callbacks=[clock])
        student = trainer.model.tagger
    record = None
    if is_main_process():
        if len(objectives) > 1:  # the last stage's tagger is the run's model
            student.save_pretrained(os.path.join(out, "model"))
        final = objectives[-1]
        record = _finish_run(args, corpus, student, out,
                             {"run": spec.name, "variant": spec.variant,
                              "teacher_sha256": file_sha256(os.path.join(teacher_dir, "model.safetensors")),
                              "K": spec.k if any(o.uses_kbest for o in objectives) else None,
                              "da_pool": corpus.pool_description if variant.da else None,
                              "seed": spec.seed, "losses": [list(o.losses) for o in objectives] if len(objectives) > 1
                              else list(final.losses), "weighting": final.weighting,
                              **({"gradual_unfreezing": True} if variant.gradual_unfreezing else {})},
                             clock, trainer)
    _barrier()
    return record


def _finish_run(args, corpus: Corpus, tagger, out: str, fields: dict, clock, trainer=None) -> dict:
    """Score the finished run once on validation and test, record it, append to results.jsonl.
    clock: the run's RunClock (wall_s: its training time over every process, without the scoring
    below). trainer: the last stage's (None when every stage had finished before this call)."""
    from .training.evaluation import evaluate_tagger, tagging_throughput

    wall_s = clock.seconds()
    clock.save()
    tagger.eval()
    dev = evaluate_tagger(tagger, corpus.dev_all)
    test = evaluate_tagger(tagger, corpus.test)
    speed = tagging_throughput(tagger, [s.tokens for s in corpus.test[:512]], batch_size=args.batch_size)
    record = {**fields, "dev_f1": round(100 * dev["f1"], 2), "test_f1": round(100 * test["f1"], 2),
              "dev": dev, "test": test, "test_sentences": len(corpus.test), "params": tagger.num_parameters(),
              "trainable_params": tagger.num_parameters(trainable_only=True),
              "sentences_per_s": round(speed["sentences_per_s"], 1), "wall_s": round(wall_s, 1),
              "epochs": trainer.state.epoch if trainer else None,
              "best_checkpoint": trainer.state.best_model_checkpoint if trainer else None,
              "command": shlex.join([os.path.basename(sys.executable), "-m", "crfkit.pipeline", *sys.argv[1:]]),
              "git": git_commit(), "machine": machine_description(),
              "date": datetime.datetime.now().isoformat(timespec="seconds")}
    # result.json marks the run finished: written whole or not at all, then its line in results.jsonl
    atomic_write(os.path.join(out, RESULT), (json.dumps(record, indent=2) + "\n").encode("utf-8"))
    _append_to_results(args.workdir, record)
    _log(f"{fields['variant']}: dev F1 {record['dev_f1']:.2f}, test F1 {record['test_f1']:.2f}, "
         f"{record['sentences_per_s']:.0f} sentences/s, {wall_s / 60:.1f} min")
    return record


def _finished_record(args, out: str) -> Optional[dict]:
    """The record of a finished run in folder out (its result.json), or None when it has not
    finished. Makes sure the record is in results.jsonl too: a kill between writing result.json and
    appending its line would otherwise lose that line for good, the run being skipped from then
    on. A result.json that is not JSON (an older crfkit wrote it in place and was killed) is
    treated as absent: the run resumes from its last checkpoint and is scored again."""
    path = os.path.join(out, RESULT)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError):
        record = None
    if not isinstance(record, dict):
        _log(f"warning: {path} is damaged (not a JSON record); scoring the run again")
        if is_main_process():
            os.unlink(path)
        return None
    if is_main_process():
        _append_to_results(args.workdir, record)
    return record


def _append_to_results(workdir: str, record: dict) -> None:
    """Append record to workdir/results.jsonl unless it is there already. A line cut short by a
    kill during an earlier append is left as it is (readers skip it); the record goes on a line
    of its own after it."""
    path = os.path.join(workdir, RESULTS)
    text = ""
    if os.path.isfile(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    for line in text.splitlines():
        try:
            if json.loads(line) == record:
                return
        except json.JSONDecodeError:
            continue
    with open(path, "a", encoding="utf-8") as f:
        f.write(("\n" if text and not text.endswith("\n") else "") + json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def report(args, corpus: Corpus, teacher_dir: str, records: list[dict]) -> dict:
    """Stage 4: the table, with the speeds of teacher and students measured side by side now."""
    from .training.evaluation import tagging_throughput

    with open(os.path.join(os.path.dirname(teacher_dir), "result.json")) as f:
        teacher_record = json.load(f)
    sentences = [s.tokens for s in corpus.test[:512]]
    rows = []
    teacher = load_tagger(teacher_dir)
    teacher_speed = tagging_throughput(teacher, sentences, batch_size=args.batch_size)["sentences_per_s"]
    rows.append({"model": f"teacher ({args.teacher_encoder} + CRF)", "test_f1": teacher_record["test_f1"],
                 "dev_f1": teacher_record["dev_f1"], "params": teacher_record["params"],
                 "sentences_per_s": teacher_speed, "speedup": 1.0})
    for record in records:
        run = record.get("run") or RunSpec(record["variant"], record["K"] or args.k, record["seed"]).name
        directory = os.path.join(args.workdir, "students", run, "model")
        speed = tagging_throughput(load_tagger(directory), sentences, batch_size=args.batch_size)["sentences_per_s"]
        k = f", K = {record['K']}" if record.get("K") else ""
        layers = _variant(RunSpec(record["variant"], 0, 0)).transformer_layers
        kind = f"{args.teacher_encoder} {layers} layers + CRF" if layers else "BiLSTM+CRF"
        rows.append({"model": f"{kind} {record['variant']}{k}, seed {record['seed']}",
                     "test_f1": record["test_f1"], "dev_f1": record["dev_f1"], "params": record["params"],
                     "trainable_params": record["trainable_params"], "sentences_per_s": speed,
                     "speedup": speed / teacher_speed})
    result = {"rows": rows, "machine": machine_description(), "git": git_commit(),
              "command": shlex.join([os.path.basename(sys.executable), "-m", "crfkit.pipeline", *sys.argv[1:]]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "batch_size": args.batch_size,
              "throughput_sentences": len(sentences)}
    lines = ["| model | test F1 | dev F1 | parameters (trainable) | sentences/s | vs teacher |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        params = f"{row['params'] / 1e6:.1f}M" + (f" ({row['trainable_params'] / 1e6:.2f}M)"
                                                  if "trainable_params" in row else "")
        lines.append(f"| {row['model']} | {row['test_f1']:.2f} | {row['dev_f1']:.2f} | {params} | "
                     f"{row['sentences_per_s']:.0f} | {row['speedup']:.1f}x |")
    text = "\n".join(lines)
    header = (f"CoNLL-2003 English, entity F1 (seqeval, strict IOB2). Speed: tagging the first {len(sentences)} "
              f"test sentences, batch {args.batch_size}, {result['machine']}, measured side by side in one run.\n")
    with open(os.path.join(args.workdir, "report.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(args.workdir, "report.md"), "w") as f:
        f.write(f"# crfkit pipeline report\n\n- command: `{result['command']}`\n- git: {result['git']}\n"
                f"- date: {result['date']}\n\n{header}\n{text}\n")
    print("\n" + header + "\n" + text + "\n", flush=True)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    try:  # a read-only or mistyped workdir fails now, not at the teacher's first checkpoint
        ensure_writable_directory(args.workdir, "--workdir")
    except OSError as error:
        print(f"python -m crfkit.pipeline: error: argument {error.strerror}", file=sys.stderr)
        return 2
    from .training import init_distributed

    init_distributed()
    git_commit()  # read now: the records name the code this process runs
    _log(f"workdir {args.workdir}; stages {', '.join(args.stages)}; {len(args.run_specs)} student run(s); "
         f"{machine_description()}")
    corpus = Corpus(args)
    teacher_dir = os.path.join(args.workdir, "teacher", "model")
    if "teacher" in args.stages:
        teacher_dir = train_teacher(args, corpus)
    elif not os.path.isfile(os.path.join(teacher_dir, "config.json")):
        raise SystemExit(f"no trained teacher in {teacher_dir}: run the 'teacher' stage first")
    def needs(spec, what):
        return any(getattr(o, what) for o in _variant(spec).objectives)

    needs_cache = any(needs(spec, "needs_teacher") or _variant(spec).da for spec in args.run_specs)
    needs_hidden = any(needs(spec, "needs_teacher_hidden") for spec in args.run_specs)
    cache = hidden_cache = None
    if "label" in args.stages or "students" in args.stages:
        if needs_cache:
            cache = label_transfer_set(args, corpus, teacher_dir)
        if needs_hidden:
            hidden_cache = label_transfer_set(args, corpus, teacher_dir, with_hidden=True)
    records = []
    if "students" in args.stages:
        for spec in args.run_specs:
            chosen = hidden_cache if needs(spec, "needs_teacher_hidden") else cache
            records.append(train_student(args, corpus, teacher_dir, chosen, spec))
    elif "report" in args.stages:
        records = [_load_record(args, spec) for spec in args.run_specs]
        records = [r for r in records if r is not None]
    if "report" in args.stages and is_main_process():
        report(args, corpus, teacher_dir, [r for r in records if r is not None])
    return 0


def _load_record(args, spec: RunSpec) -> Optional[dict[str, Any]]:
    path = os.path.join(args.workdir, "students", spec.name, "result.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


if __name__ == "__main__":
    sys.exit(main())
