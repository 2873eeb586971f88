"""The distillation job's stages over one work folder, each resumable (run the same command again
after a kill and it continues from the last checkpoint; finished runs are skipped):

1. teacher   fine-tune TransformerCRFTagger (encoder + casing + CRF) on the training data, with
             layer-wise learning-rate decay, keeping the best epoch on validation (or take a
             trained crfkit teacher as it is, scored once);
2. label     the teacher labels the transfer set (the training text, then the DA pool) into a
             teacher-label cache: its K best paths with log-probabilities, its emissions and CRF;
3. students  one run per (variant, K, seed): BiLSTMCRFTagger (or a small transformer) students,
             early-stopped on validation F1; the test data is scored once, when a run finishes;
4. report    crfkit.tool.report over the records: test F1, parameters and tagging speed.

Layout of the work folder: config.json (the resolved arguments, which every record names),
teacher/ (model/, result.json), labels-k{K}-n{N}-{teacher}/ (the cache), students/{run}/
(model/, result.json), results.jsonl (one record per finished run), report.md / report.json.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from .. import distill
from .._distributed import is_main_process
from .._files import atomic_write
from ..taggers import BiLSTMCRFTagger, TransformerCRFTagger, load_tagger
from ..taggers.base import CONFIG_NAME, TAGGER_FORMAT
from ..training import VARIANTS, ObjectiveConfig, Variant
from ..training.objectives import hidden_projection_for
from .arguments import ConfigurationError, DataArguments, DistillationArguments, resolved_configuration
from .datasets import TaggingData
from .records import (command_line, file_sha256, finished_record, git_commit, log, machine_description,
                      write_result)

__all__ = ["CONFIG_FILE", "DistillationJob", "RunSpec", "is_trained_teacher", "plan_runs"]

CONFIG_FILE = "config.json"
# GloVe rows beside NeuroNER's in the "glove100" table: its 100k most frequent words (GloVe's
# file order) keep the student's file at about 80 MB; NeuroNER's table already covers every
# CoNLL word, so these serve the DA pool's and a user's other words.
GLOVE100_EXTRA_WORDS = 100_000
# the teacher's columns in the "glove100_te" table: its piece table reduced by SVD (as the
# multi-stage paper reduces mBERT's), so that the file stays near the glove100 student's size
# (MPNet's 768 columns over ~130k words would be 400 MB) and the teacher's part is not 5x the rest
GLOVE100_TE_DIM = 100


@dataclass(frozen=True)
class RunSpec:
    """One student run: a variant (a name of crfkit.training.VARIANTS, or "losses-..." for an
    explicit list of losses), K (teacher paths), a seed, and for runs on the DA pool the pool's
    name, so runs on different pools never share a folder."""

    variant: str
    k: int
    seed: int
    pool: str = ""
    crossfit: int = 0

    @property
    def name(self) -> str:
        return (f"{self.variant}-k{self.k}-seed{self.seed}" + (f"-{self.pool}" if self.pool else "")
                + (f"-xf{self.crossfit}" if self.crossfit else ""))


def custom_variant(distillation: DistillationArguments) -> Optional[tuple[str, Variant]]:
    """The run of --losses (its name and Variant), or None."""
    if not distillation.losses:
        return None
    objective = ObjectiveConfig(tuple(distillation.losses), weighting=distillation.weighting, k=distillation.k,
                                temperature=distillation.temperature)
    name = "losses-" + "+".join(objective.losses) + (f"-{objective.weighting}" if len(objective.losses) > 1 else "")
    return name, Variant(distillation.embeddings, da=distillation.da, objective=objective)


def pool_name(data: DataArguments) -> str:
    parts = (["news"] if data.da_news else []) + ([f"articles{data.da_news_articles}"] if data.da_news_articles
                                                  else []) + (["text"] if data.unlabelled_file else []) + (
        [f"aug{data.da_augment}"] if data.da_augment else [])
    return "-".join(parts)


def plan_runs(distillation: DistillationArguments, data: DataArguments) -> tuple[list[RunSpec], int, dict]:
    """(the runs in order, the cache's K, {variant name: Variant}) of the arguments. Raises
    ValueError for DA runs without a pool."""
    variants = dict(VARIANTS)
    named = []
    for text in distillation.runs:
        variant, at, k = text.partition("@")
        named.append((variant, int(k) if at else distillation.k))
    custom = custom_variant(distillation)
    if custom is not None:
        variants[custom[0]] = custom[1]
        named.append((custom[0], distillation.k))
    pool = pool_name(data)
    if not pool and any(variants[name].da for name, _ in named):
        raise ValueError("the DA runs need a pool of unlabelled text: give --unlabelled_file, --da_news, "
                         "--da_news_articles N or --da_augment 1 (or more)")
    # cross-fitting changes the teacher's labels of the train text: runs that read none are the same either way
    specs = [RunSpec(name, k, seed, pool if variants[name].da else "",
                     distillation.crossfit_folds if any(o.needs_teacher for o in variants[name].objectives) else 0)
             for name, k in named for seed in distillation.seeds]
    largest = max([spec.k for spec in specs], default=distillation.k)
    cache_k = distillation.cache_k or largest
    if cache_k < largest:
        raise ValueError(f"--cache_k {cache_k} is below the largest K asked for ({largest})")
    return specs, cache_k, variants


def is_trained_teacher(path: str) -> bool:
    """Whether path is the folder of a saved crfkit tagger (not an encoder to fine-tune)."""
    config = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config):
        return False
    try:
        with open(config, encoding="utf-8") as f:
            return json.load(f).get("format") == TAGGER_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


class DistillationJob:
    """The stages over one work folder (training.output_dir) for the parsed arguments (see
    crfkit.tool.arguments) and the loaded data (crfkit.tool.datasets.load_data)."""

    def __init__(self, arguments, tagging: TaggingData, command: Optional[str] = None):
        self.data_args, self.teacher_args, self.student_args, self.distillation, self.training = arguments
        self.data = tagging
        self.workdir = self.training.output_dir
        self.command = command or command_line("crfkit.distill", self.workdir)
        self.runs, self.cache_k, self.variants = plan_runs(self.distillation, self.data_args)
        self.configuration = resolved_configuration(arguments)
        self.given_teacher = is_trained_teacher(self.teacher_args.teacher_model_name_or_path)
        self.teacher_dir = (self.teacher_args.teacher_model_name_or_path if self.given_teacher
                            else os.path.join(self.workdir, "teacher", "model"))
        self.encoder = self.teacher_args.teacher_model_name_or_path

    # ------------------------------------------------------------------ helpers
    def write_configuration(self) -> None:
        if is_main_process():
            text = json.dumps(self.configuration, indent=2, sort_keys=True) + "\n"
            atomic_write(os.path.join(self.workdir, CONFIG_FILE), text.encode("utf-8"))

    def stage_arguments(self, output_dir: str, **overrides):
        """The training arguments of one stage: the parsed ones with output_dir and overrides."""
        from ..training import TaggerTrainingArguments

        base = self.training
        accepted = {f.name for f in dataclasses.fields(TaggerTrainingArguments) if f.init}
        values = {name: value for name, value in base.to_dict().items() if name in accepted}
        values.update(output_dir=output_dir, disable_tqdm=not is_main_process() or bool(base.disable_tqdm),
                      report_to="none" if base.report_to in ([], ["none"], None) else base.report_to)
        values.update(overrides)
        return TaggerTrainingArguments(**values)

    def record_fields(self) -> dict:
        config = os.path.join(self.workdir, CONFIG_FILE)
        return {"config": CONFIG_FILE, "config_sha256": file_sha256(config) if os.path.isfile(config) else None,
                "data": self.data.description.get("dataset") or self.data.description.get("train_file")}

    def _variant(self, spec: RunSpec) -> Variant:
        return self.variants[spec.variant]

    # ------------------------------------------------------------------ stage 1
    def train_teacher(self) -> str:
        """Returns the teacher's folder (trained here, or the given one, scored once)."""
        import transformers

        from ..training import RunClock, fit_tagger, tagging_items

        out = os.path.join(self.workdir, "teacher")
        if finished_record(self.workdir, out) is not None:
            log(f"teacher: done already ({self.teacher_dir})")
            return self.teacher_dir
        clock = RunClock(out)
        trainer = None
        if self.given_teacher:
            teacher = load_tagger(self.teacher_dir)
            if tuple(teacher.labels) != self.data.labels or teacher.scheme != self.data.scheme:
                raise ConfigurationError(f"the teacher in {self.teacher_dir} tags {teacher.labels} ({teacher.scheme}); "
                                         f"the data has {list(self.data.labels)} ({self.data.scheme})")
            log(f"teacher: the trained tagger in {self.teacher_dir}, scored once")
        else:
            log(f"teacher: fine-tuning {self.encoder} + CRF on {len(self.data.train)} sentences, "
                f"{self.teacher_args.teacher_epochs:g} epoch(s)")
            transformers.set_seed(self.training.seed)
            teacher = TransformerCRFTagger(self.data.labels, encoder=self.encoder, scheme=self.data.scheme)
            arguments = self.teacher_training_arguments(out)
            trainer = fit_tagger(teacher, tagging_items(self.data.train), tagging_items(self.data.selection),
                                 arguments, callbacks=[clock])
            teacher = trainer.model.tagger
        if is_main_process():
            self.finish_run(teacher, out, {"variant": "teacher", "K": None, "seed": self.training.seed,
                                           "teacher_sha256": self.teacher_sha256()}, clock, trainer)
        _barrier()
        return self.teacher_dir

    def teacher_training_arguments(self, output_dir: str):
        """The teacher's fine-tuning recipe (the teacher and every fold teacher share it)."""
        sampling = ({"train_sampling_strategy": "group_by_length"} if self.teacher_args.teacher_group_by_length
                    else {})
        return self.stage_arguments(output_dir, num_train_epochs=self.teacher_args.teacher_epochs,
                                    learning_rate=self.teacher_args.teacher_learning_rate,
                                    head_learning_rate=self.teacher_args.teacher_head_learning_rate,
                                    layer_decay=self.teacher_args.teacher_layer_decay, weight_decay=0.01,
                                    warmup_steps=0.1, **sampling)

    def teacher_sha256(self, teacher_dir: Optional[str] = None) -> str:
        return file_sha256(os.path.join(teacher_dir or self.teacher_dir, "model.safetensors"))

    # ------------------------------------------------------------------ cross-fitting
    def folds(self) -> list[tuple[int, int]]:
        """The cross-fitting folds: N contiguous blocks [lo, hi) of the training sentences (CoNLL's
        documents are contiguous, so a block keeps most documents whole)."""
        n, N = len(self.data.train), self.distillation.crossfit_folds
        return [(round(i * n / N), round((i + 1) * n / N)) for i in range(N)]

    def fold_teacher_dir(self, fold: int) -> str:
        return os.path.join(self.workdir, f"teacher-fold{fold}of{self.distillation.crossfit_folds}", "model")

    def train_fold_teacher(self, fold: int) -> None:
        """Cross-fitting teacher `fold` of N: fine-tuned as the teacher is (the same encoder, recipe
        and seed; selected on the same validation sentences) on the training text without fold
        `fold`, and scored once like the teacher (variant "teacher_fold"). Nothing when done already."""
        import transformers

        from ..training import RunClock, fit_tagger, tagging_items

        out = os.path.dirname(self.fold_teacher_dir(fold))
        if finished_record(self.workdir, out) is not None:
            return
        encoder = load_tagger(self.teacher_dir).encoder_name if self.given_teacher else self.encoder
        lo, hi = self.folds()[fold]
        train = self.data.train[:lo] + self.data.train[hi:]
        log(f"teacher fold {fold}: fine-tuning {encoder} + CRF on {len(train)} sentences (all but [{lo}, {hi}))")
        transformers.set_seed(self.training.seed)
        teacher = TransformerCRFTagger(self.data.labels, encoder=encoder, scheme=self.data.scheme)
        arguments = self.teacher_training_arguments(out)
        clock = RunClock(out)
        trainer = fit_tagger(teacher, tagging_items(train), tagging_items(self.data.selection), arguments,
                             callbacks=[clock])
        if is_main_process():
            self.finish_run(trainer.model.tagger, out, {
                "variant": "teacher_fold", "K": None, "seed": self.training.seed, "fold": fold,
                "folds": len(self.folds()), "fold_sentences": [lo, hi], "distilled": False,
                "teacher_sha256": self.teacher_sha256(self.fold_teacher_dir(fold)), "dataset":
                self.record_fields()["data"]}, clock, trainer)
        _barrier()

    # ------------------------------------------------------------------ stage 2
    def label_transfer_set(self, with_hidden: bool = False, layer: Optional[int] = None, general: bool = False):
        """The teacher-label cache over the transfer set. with_hidden: a second cache that also
        holds the teacher's layer per word (layer: None for --teacher_hidden_layer, -1 for its last,
        as Variant.teacher_hidden_layer), over the transfer set and then the selection text (the
        hidden loss is selected on its validation loss). general: label with the teacher's encoder
        as it was before fine-tuning (a fresh head; only its hidden layer means anything), the
        adaptive-weight paper's first stage (ObjectiveConfig.teacher == "general")."""
        teacher = load_tagger(self.teacher_dir).eval()
        if general:
            torch.manual_seed(0)   # the untrained head's k best are stored too: the same ones every time
            teacher = TransformerCRFTagger(self.data.labels, encoder=teacher.encoder_name,
                                           scheme=self.data.scheme).eval()
        if layer is None:
            layer = self.teacher_args.teacher_hidden_layer
        elif layer == -1:
            layer = teacher.num_layers
        if with_hidden and layer > teacher.num_layers:
            raise ConfigurationError(f"--teacher_hidden_layer {layer}: the teacher ({self.encoder}) has layers "
                             f"0 (embeddings) .. {teacher.num_layers}")
        sentences = self.data.transfer + ([tuple(s.tokens) for s in self.data.selection] if with_hidden else [])
        weights = self.teacher_sha256()
        if general:  # named by the encoder instead of the fine-tuned weights
            weights = hashlib.sha256(f"general {teacher.encoder_name}".encode()).hexdigest()
        # named by K, corpus size and teacher, and described without paths, so a moved workdir reuses it
        name = f"labels-k{self.cache_k}-n{len(sentences)}-{'general-' if general else ''}{weights[:8]}"
        directory = os.path.join(self.workdir, name + (f"-hidden{layer}" if with_hidden else ""))
        log(f"label: teacher's {self.cache_k} best paths for {len(sentences)} sentences -> {directory}")
        pool = self.data.description["pool"]
        corpus_info = {"train_sentences": len(self.data.train), "da_pool": len(self.data.pool),
                       "da_augment": pool["augment"]}
        if pool["news"]:  # recorded only when used, so caches without news keep their manifest
            corpus_info["da_news"] = pool["news"]
        if "news_articles" in pool:
            corpus_info["da_news_articles"] = pool["news_articles"]
        if "unlabelled" in pool:
            corpus_info["unlabelled"] = pool["unlabelled"]
        if "dataset" not in self.data.description:
            corpus_info["labels"] = list(self.data.labels)
        teacher_output = teacher.teacher_output
        if with_hidden:
            corpus_info.update(dev_sentences=len(self.data.selection), hidden_layer=layer)
            teacher_output = functools.partial(teacher.teacher_output, hidden_layer=layer)
        return distill.label_corpus(teacher_output, sentences, directory, k=self.cache_k, batch_size=64,
                                    with_emissions=True, with_hidden=with_hidden, label_names=list(self.data.labels),
                                    teacher_info={"encoder": teacher.encoder_name, "weights_sha256": weights}
                                    if not general else {"encoder": teacher.encoder_name, "general": True},
                                    corpus_info=corpus_info)

    def label_folds(self, cache):
        """The cross-fitted labels: fold i of the training text labelled by fold teacher i (a cache
        each, labelled as the transfer set is), then the DA pool's labels from cache (the teacher
        trained on everything), joined into one distill.CacheUnion with the transfer set's ids."""
        if not self.distillation.crossfit_folds:
            return None
        parts = []
        for fold, (lo, hi) in enumerate(self.folds()):
            directory = self.fold_teacher_dir(fold)
            if not os.path.isfile(os.path.join(directory, "config.json")):
                raise ConfigurationError(f"no trained fold teacher in {directory}: run the 'teacher' stage with "
                                         f"--crossfit_folds {self.distillation.crossfit_folds} first")
            teacher = load_tagger(directory).eval()
            weights = self.teacher_sha256(directory)
            sentences = [tuple(s.tokens) for s in self.data.train[lo:hi]]
            name = f"labels-k{self.cache_k}-n{len(sentences)}-{weights[:8]}-fold{fold}of{len(self.folds())}"
            log(f"label: fold teacher {fold}'s {self.cache_k} best paths for train sentences [{lo}, {hi}) -> {name}")
            parts.append(distill.label_corpus(
                teacher.teacher_output, sentences, os.path.join(self.workdir, name), k=self.cache_k, batch_size=64,
                with_emissions=True, label_names=list(self.data.labels),
                teacher_info={"encoder": teacher.encoder_name, "weights_sha256": weights, "fold": fold,
                              "folds": len(self.folds())},
                corpus_info={"train_sentences": [lo, hi], **({} if "dataset" not in self.data.description
                                                            else {"dataset": self.data.description["dataset"]})}))
        n = len(self.data.train)
        if self.data.pool:
            parts.append((cache, n, n + len(self.data.pool)))
        return distill.CacheUnion(parts)

    # ------------------------------------------------------------------ stage 3
    def build_student(self, embeddings: str) -> BiLSTMCRFTagger:
        """The student of every BiLSTM variant: lower-cased words, a casing embedding, a BiLSTM
        (--student_hidden, --student_layers, --student_dropout, --student_char_cnn) and a CRF with
        the data's constraints. The word table:
        "teacher" (TE): the train words plus the teacher's whole-word pieces, rows copied from the
            teacher's embedding table (its width) and frozen;
        "glove": the train words plus the vectors' words (--word_vectors_file, or GloVe 6B 50d),
            their rows, frozen (train words without a vector keep a random row);
        "random": the train words seen at least twice (so <unk> is trained on the singletons),
            random rows of the teacher's width, trained;
        "glove100": cased words, looked up lower-cased when missing (NeuroNER's rule): the train
            words, NeuroNER's 28,983 and GloVe's GLOVE100_EXTRA_WORDS most frequent; each row is
            its NeuroNER 100-d vector beside its GloVe 50-d one (150 wide, zeros where a table
            lacks the word), frozen. Uses no teacher.
        "glove100_te": the glove100 table with GLOVE100_TE_DIM more columns: each word's teacher
            vector (crfkit.distill.teacher_word_vectors of its lower-cased form: the mean of its
            pieces, zeros where the teacher has none) in the teacher's table reduced by SVD."""
        from ..packaged import glove_vectors, neuroner_vectors
        from ..taggers.vectors import read_word2vec_text

        train = self.data.train
        settings = dict(scheme=self.data.scheme, hidden_size=self.student_args.student_hidden,
                        num_layers=self.student_args.student_layers, dropout=self.student_args.student_dropout,
                        char_cnn=self.student_args.student_char_cnn)
        if embeddings in ("glove100", "glove100_te"):
            neuroner, glove = neuroner_vectors(), glove_vectors()
            glove = (glove[0][:GLOVE100_EXTRA_WORDS], glove[1][:GLOVE100_EXTRA_WORDS])
            words = BiLSTMCRFTagger.build_vocabulary(train, extra_words=neuroner[0] + glove[0], lowercase=False)
            tables = [(neuroner[0], torch.from_numpy(neuroner[1]), False), (glove[0], torch.from_numpy(glove[1]), True)]
            if embeddings == "glove100_te":
                tables.append(self._teacher_word_table(words, GLOVE100_TE_DIM))
            student = BiLSTMCRFTagger(self.data.labels, words, embedding_dim=sum(t[1].shape[1] for t in tables),
                                      lowercase=False, lowercase_fallback=True, **settings)
            student.load_word_vector_tables(tables, freeze=True)
            return student
        teacher = load_tagger(self.teacher_dir)
        width = teacher.encoder.get_input_embeddings().weight.shape[1]
        vectors = None
        if embeddings == "teacher":
            pieces = [p for p in teacher.tokenizer.get_vocab() if p.isalnum()]
            words = BiLSTMCRFTagger.build_vocabulary(train, extra_words=sorted(pieces))
        elif embeddings == "glove":
            path = self.student_args.word_vectors_file
            vectors = read_word2vec_text(path) if path else glove_vectors()
            words = BiLSTMCRFTagger.build_vocabulary(train, extra_words=vectors[0])
            width = vectors[1].shape[1]
        else:
            words = BiLSTMCRFTagger.build_vocabulary(train, min_count=2)
        student = BiLSTMCRFTagger(self.data.labels, words, embedding_dim=width, **settings)
        if embeddings == "teacher":
            student.load_teacher_embeddings(teacher, freeze=True)
        elif embeddings == "glove":
            student.load_word_vectors(vectors[0], torch.from_numpy(vectors[1]), freeze=True)
        return student

    def _teacher_word_table(self, words, dim: int) -> tuple[list[str], torch.Tensor, bool]:
        """(lower-cased words, their teacher vectors (N, dim), uncased) for load_word_vector_tables:
        the teacher's piece table reduced to dim columns by SVD, a word's vector the mean of its
        pieces (zeros for a word with the teacher's unknown piece)."""
        teacher = load_tagger(self.teacher_dir)
        table = distill.svd_reduce(teacher.encoder.get_input_embeddings().weight.detach().float(), dim)
        lowered = sorted({w.lower() for w in words})
        vectors, _, _ = distill.teacher_word_vectors(lowered, table, teacher.tokenizer)
        return lowered, vectors, True

    def train_student(self, cache, spec: RunSpec, general_cache=None) -> Optional[dict]:
        """general_cache: the general encoder's hidden cache, for the stages that read it."""
        import transformers

        from ..training import RunClock, fit_tagger, fit_tagger_gradually, tagging_items

        out = os.path.join(self.workdir, "students", spec.name)
        done = finished_record(self.workdir, out)
        if done is not None:
            return done
        variant = self._variant(spec)
        objectives = [replace(o, k=spec.k) if o.needs_teacher else o for o in variant.objectives]
        items = tagging_items(self.data.train)
        if variant.da:
            items += tagging_items(self.data.pool, first_id=len(self.data.train), with_tags=False)
        needs_hidden = any(o.needs_teacher_hidden for o in objectives)
        # the hidden cache labelled the selection text after the transfer set (see label_transfer_set)
        dev_items = tagging_items(self.data.selection, first_id=len(self.data.transfer) if needs_hidden else 0)
        transformers.set_seed(spec.seed)
        if variant.transformer_layers:
            # the teacher's recipe (layer-wise decay, a larger head rate) on the encoder's first layers
            encoder = load_tagger(self.teacher_dir).encoder_name if self.given_teacher else self.encoder
            student = TransformerCRFTagger(self.data.labels, encoder=encoder, scheme=self.data.scheme,
                                           num_layers=variant.transformer_layers)
            settings = dict(learning_rate=self.teacher_args.teacher_learning_rate,
                            head_learning_rate=self.teacher_args.teacher_head_learning_rate,
                            layer_decay=self.teacher_args.teacher_layer_decay, weight_decay=0.01)
        else:
            student = self.build_student(variant.embeddings)
            settings = dict(learning_rate=self.student_args.student_learning_rate, lr_scheduler_type="constant",
                            max_grad_norm=5.0)
        projection = None
        if needs_hidden:  # GELU(W h + b) (or h W) from the student's word features to the teacher's layer
            width = student.word_features(student.featurize([["a"]])).shape[-1]
            projection = hidden_projection_for(objectives, width, cache[len(self.data.transfer)].hidden.shape[1])

        def make_args(directory):
            return self.stage_arguments(directory, num_train_epochs=self.student_args.student_epochs, seed=spec.seed,
                                        **settings)

        clock = RunClock(out)  # the wall time over every process and stage that trained it
        trainer = None
        for stage, objective in enumerate(objectives, 1):
            stage_out = out if len(objectives) == 1 else os.path.join(out, f"stage{stage}")
            log(f"student {spec.name}" + (f", stage {stage} of {len(objectives)}" if len(objectives) > 1 else "")
                + f": {len(items)} training sentences, losses {objective.losses}"
                + (f" ({objective.weighting} weighting, K = {spec.k})" if len(objective.losses) > 1 else ""))
            saved = os.path.join(stage_out, "model")
            if os.path.isfile(os.path.join(saved, "config.json")):  # this stage finished earlier: never train it on
                student = load_tagger(saved).train()
                if projection is not None:   # nor lose what it taught the hidden projection
                    _load_projection(projection, stage_out)
                continue
            stage_cache = general_cache if objective.teacher == "general" else cache
            if stage_cache is None:
                raise ConfigurationError(f"{spec.name}, stage {stage}: no label cache of the {objective.teacher} "
                                         "teacher was made")
            if variant.gradual_unfreezing:
                trainer = fit_tagger_gradually(student, items, dev_items, make_args, stage_out, objective=objective,
                                               cache=stage_cache, hidden_projection=projection,
                                               callbacks=[clock]) or trainer
                if is_main_process():
                    student.save_pretrained(saved)   # the stage's result: its last round's best
                _barrier()
                continue
            trainer = fit_tagger(student, items, dev_items, make_args(stage_out), objective=objective,
                                 cache=stage_cache, hidden_projection=projection, callbacks=[clock])
            student = trainer.model.tagger
        record = None
        if is_main_process():
            if len(objectives) > 1:  # the last stage's tagger is the run's model
                student.save_pretrained(os.path.join(out, "model"))
            final = objectives[-1]
            record = self.finish_run(student, out, {
                "run": spec.name, "variant": spec.variant, "distilled": variant.distilled,
                "teacher_sha256": self.teacher_sha256() if variant.distilled else None,
                "student": student.describe(),
                "dataset": self.record_fields()["data"], "pool": spec.pool or None,
                "pool_sentences": len(self.data.pool) if variant.da else 0, "crossfit_folds": spec.crossfit,
                "K": spec.k if any(o.uses_kbest for o in objectives) else None,
                "da_pool": self.data.description["pool"] if variant.da else None, "seed": spec.seed,
                "losses": [list(o.losses) for o in objectives] if len(objectives) > 1 else list(final.losses),
                "weighting": final.weighting, **({"gradual_unfreezing": True} if variant.gradual_unfreezing else {})},
                clock, trainer)
        _barrier()
        return record

    def finish_run(self, tagger, out: str, fields: dict, clock, trainer=None) -> dict:
        """Score the finished run once on validation and test, record it, append to results.jsonl.
        clock: the run's RunClock (wall_s: its training time over every process, without the
        scoring below). trainer: the last stage's (None when every stage had finished before)."""
        import datetime

        from ..training.evaluation import evaluate_tagger, tagging_throughput

        wall_s = clock.seconds()
        clock.save()
        tagger.eval()
        dev = evaluate_tagger(tagger, self.data.validation)
        test = evaluate_tagger(tagger, self.data.test)
        speed = tagging_throughput(tagger, [s.tokens for s in self.data.test[:512]],
                                   batch_size=self.training.per_device_train_batch_size)
        record = {**fields, "dev_f1": round(100 * dev["f1"], 2), "test_f1": round(100 * test["f1"], 2),
                  "dev": dev, "test": test, "test_sentences": len(self.data.test), "params": tagger.num_parameters(),
                  "trainable_params": tagger.num_parameters(trainable_only=True),
                  "sentences_per_s": round(speed["sentences_per_s"], 1), "wall_s": round(wall_s, 1),
                  "epochs": trainer.state.epoch if trainer else None,
                  "train_sampling_strategy": trainer.args.train_sampling_strategy if trainer else None,
                  "best_checkpoint": _relative(trainer.state.best_model_checkpoint, self.workdir) if trainer else None,
                  **self.record_fields(), "command": self.command, "git": git_commit(),
                  "machine": machine_description(), "date": datetime.datetime.now().isoformat(timespec="seconds")}
        write_result(self.workdir, out, record)
        log(f"{fields['variant']}: dev F1 {record['dev_f1']:.2f}, test F1 {record['test_f1']:.2f}, "
            f"{record['sentences_per_s']:.0f} sentences/s, {wall_s / 60:.1f} min")
        return record

    # ------------------------------------------------------------------ all of it
    def run(self) -> list[dict]:
        """The stages asked for, in order; returns the records of the student runs."""
        from .report import write_report

        stages = self.distillation.stages
        git_commit()  # read now: the records name the code this process runs
        self.write_configuration()
        log(f"work folder {self.workdir}; stages {', '.join(stages)}; {len(self.runs)} student run(s); "
            f"{machine_description()}")
        # a teacher is needed unless every run is a baseline on gold labels with its own word table
        needs_teacher = "report" in stages or any(
            self._variant(spec).distilled or self._variant(spec).embeddings in ("random", "teacher", "pretrained")
            for spec in self.runs)
        crossfit = any(spec.crossfit for spec in self.runs)
        if "teacher" in stages:
            teachers = [(os.path.join(self.workdir, "teacher"), self.train_teacher)]
            if crossfit:
                teachers += [(os.path.dirname(self.fold_teacher_dir(fold)),
                              functools.partial(self.train_fold_teacher, fold)) for fold in range(len(self.folds()))]
            share_teacher_training(self.workdir, teachers)
        elif needs_teacher and not os.path.isfile(os.path.join(self.teacher_dir, "config.json")):
            raise ConfigurationError(f"no trained teacher in {self.teacher_dir}: run the 'teacher' stage first")

        def needs(spec, what):
            return any(getattr(o, what) for o in self._variant(spec).objectives)

        needs_cache = any(needs(spec, "needs_teacher") or self._variant(spec).da for spec in self.runs)
        # the hidden caches: (layer, general) -> cache, layer as Variant.teacher_hidden_layer
        hidden_keys = {}
        for spec in self.runs:
            if needs(spec, "needs_teacher_hidden"):
                variant = self._variant(spec)
                hidden_keys[(variant.teacher_hidden_layer, False)] = None
                if any(o.teacher == "general" for o in variant.objectives):
                    hidden_keys[(variant.teacher_hidden_layer, True)] = None
        cache = crossfit_cache = None
        hidden_caches: dict = {}
        if "label" in stages or "students" in stages:
            if needs_cache:
                cache = self.label_transfer_set()
            if hidden_keys:
                if crossfit:
                    raise ConfigurationError("--crossfit_folds does not cover the hidden loss (te_da_stagewise): "
                                             "run it without cross-fitting")
                for layer, general in hidden_keys:
                    hidden_caches[(layer, general)] = self.label_transfer_set(with_hidden=True, layer=layer,
                                                                              general=general)
            if crossfit:
                crossfit_cache = self.label_folds(cache)
        records = []
        if "students" in stages:
            for spec in self.runs:
                if needs(spec, "needs_teacher_hidden"):
                    layer = self._variant(spec).teacher_hidden_layer
                    records.append(self.train_student(hidden_caches[(layer, False)], spec,
                                                      hidden_caches.get((layer, True))))
                    continue
                records.append(self.train_student(crossfit_cache if spec.crossfit else cache, spec))
        else:
            records = [finished_record(self.workdir, os.path.join(self.workdir, "students", spec.name))
                       for spec in self.runs]
        records = [r for r in records if r is not None]
        if "report" in stages and is_main_process():
            write_report(self.workdir, self.teacher_dir, records, self.data.test,
                         batch_size=self.training.per_device_train_batch_size, command=self.command)
        return records


TRAINING_LOCK = ".training.lock"   # in a teacher's folder: held (flock) by the process training it


def share_teacher_training(workdir: str, teachers: list[tuple[str, Callable[[], object]]]) -> None:
    """Train the teachers (folder, train) in order, sharing them with other processes given the
    same command: a teacher whose TRAINING_LOCK another process holds is skipped, and waited for
    once the others are done; if that process died before finishing it (the kernel drops an flock
    with its process), this one trains it. So two lanes can split the N cross-fitting teachers;
    only one of them may run the label stage (the label cache takes one writer). train() itself
    returns at once for a finished teacher. Under torchrun every rank trains every teacher
    together, in order, without locks."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        for _, train in teachers:
            train()
        return
    import filelock

    taken_elsewhere = []
    for folder, train in teachers:
        if finished_record(workdir, folder) is not None:
            train()   # logs that it is done (the teacher) or returns (a fold teacher)
            continue
        os.makedirs(folder, exist_ok=True)
        lock = filelock.FileLock(os.path.join(folder, TRAINING_LOCK), thread_local=False)
        try:
            lock.acquire(blocking=False)
        except filelock.Timeout:
            log(f"{_relative(folder, workdir)}: another process is training it; on to the next teacher")
            taken_elsewhere.append((folder, train, lock))
            continue
        try:
            train()
        finally:
            lock.release()
    for folder, train, lock in taken_elsewhere:
        log(f"{_relative(folder, workdir)}: waiting for the process training it")
        with lock:
            train()


def _load_projection(projection, stage_out: str) -> None:
    """Load the hidden projection a finished stage saved (in stage_out, or in its last unfreezing
    round), if it saved one."""
    from safetensors.torch import load_model

    from ..training.trainer import PROJECTION_FILE

    rounds = sorted((int(name[len("unfreeze"):]), name) for name in os.listdir(stage_out)
                    if name.startswith("unfreeze") and name[len("unfreeze"):].isdigit())
    for directory in [os.path.join(stage_out, name) for _, name in reversed(rounds)] + [stage_out]:
        path = os.path.join(directory, PROJECTION_FILE)
        if os.path.isfile(path):
            load_model(projection, path)
            return


def _relative(path: Optional[str], workdir: str) -> Optional[str]:
    """path relative to the work folder (records carry no machine paths)."""
    return None if path is None else os.path.relpath(path, workdir)


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
