"""Training taggers with transformers' Trainer (accelerate underneath).

The Trainer brings the training loop, checkpoints in safetensors with full resume (optimizer,
scheduler, RNG states, data position), torchrun / DDP, early stopping, progress bars and JSON
logs. crfkit adds only what a CRF tagger needs on top:
- TaggingObjective is the model the Trainer optimises (the tagger plus the loss weights and the
  hidden projection, so that one model holds every trainable parameter); it computes each
  configured loss term by its entry in the registry crfkit.training.LOSS_TERMS;
- DistillationTrainer's compute_loss is the configured loss of TaggingCollator's batch (the
  adaptive weighting's step included); it builds the optimizer from the model's parameter groups
  (layer-wise learning-rate decay, a larger rate for the head and CRF), evaluates by Viterbi
  decoding and seqeval entity F1, and logs each loss term and the learned loss weights beside
  the total;
- fit_tagger() wires these together: model selection and early stopping on the validation F1,
  resume from the last checkpoint in output_dir, the best tagger saved to output_dir/model;
- fit_tagger_gradually() runs fit_tagger once per round of crfkit.distill.GradualUnfreezing,
  unfreezing from the top down (the multi-stage distillation paper's gradual unfreezing).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from .. import distill
from .._distributed import is_main_process
from .._files import atomic_write, ensure_writable_directory
from .._validation import check_int, check_number
from .._optional import require
from .data import IGNORE_INDEX, TaggingCollator, check_gold_tags
from .metrics import make_compute_metrics
from .objectives import ObjectiveConfig, TaggingObjective

transformers = require("transformers", "pip install transformers accelerate")

__all__ = ["DistillationTrainer", "RunClock", "TaggerTrainer", "TaggerTrainingArguments", "fit_tagger",
           "fit_tagger_gradually", "frozen_word_table", "init_distributed"]

MODEL_DIR = "model"
PROJECTION_FILE = "hidden_projection.safetensors"


@dataclass
class TaggerTrainingArguments(transformers.TrainingArguments):
    """transformers.TrainingArguments plus the tagger's learning-rate layout.

    head_learning_rate: rate of the linear layer, casing embedding, CRF and loss weights (default
    learning_rate). layer_decay: encoder layer i of N trains at learning_rate * layer_decay **
    (N - 1 - i) (the multi-grained distillation paper's teacher uses 0.9). patience: evaluations
    without a better validation F1 before training stops."""

    head_learning_rate: Optional[float] = field(default=None, metadata={"help": "rate of head, CRF and loss weights"})
    layer_decay: float = field(default=1.0, metadata={"help": "layer-wise learning-rate decay towards the input"})
    patience: int = field(default=5, metadata={"help": "early-stopping patience (evaluations)"})

    def __post_init__(self):
        # checked before TrainingArguments' own set-up, which may take seconds (devices, accelerate)
        if self.head_learning_rate is not None:
            check_number("head_learning_rate", self.head_learning_rate, minimum=0, open_minimum=True,
                         type_error=ValueError)
        check_number("layer_decay", self.layer_decay, minimum=0, maximum=1, open_minimum=True, type_error=ValueError)
        check_int("patience", self.patience, minimum=1, type_error=ValueError)
        super().__post_init__()


class RunClock(transformers.TrainerCallback):
    """The wall time of a run summed over the processes that trained it (a run killed and resumed,
    or continued in a later session), not only the last one's. The sum is kept in
    directory/wall_time.json and written at every checkpoint (and by save()), so a killed process
    counts up to its last checkpoint: the steps after it are trained again by the next process,
    whose time counts instead. Pass it in fit_tagger's callbacks; seconds() gives the total."""

    FILE = "wall_time.json"

    def __init__(self, directory: str):
        self.path = os.path.join(directory, self.FILE)
        self.before = 0.0
        if os.path.isfile(self.path):
            with open(self.path) as f:
                self.before = float(json.load(f)["seconds"])
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return self.before + time.perf_counter() - self.start

    def save(self) -> None:
        """Write the total so far; only the main process writes (under torchrun every rank calls
        this, and two ranks renaming one temporary file race: the second finds it gone)."""
        if not is_main_process():
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        atomic_write(self.path, json.dumps({"seconds": round(self.seconds(), 1)}).encode())

    def on_save(self, args, state, control, **kwargs):
        self.save()


class DistillationTrainer(transformers.Trainer):
    """A Trainer for TaggingObjective models: see the module docstring. select_on: "f1"
    (validation by Viterbi decoding) or "loss" (validation by the objective's own loss, for the
    representation loss alone)."""

    # compute_loss returns a per-batch mean: the Trainer divides it by the accumulation steps
    loss_is_scaled_for_ga = False

    def __init__(self, *args, select_on: str = "f1", **kwargs):
        super().__init__(*args, **kwargs)
        self.select_on = select_on
        self.loss_terms: dict[str, torch.Tensor] = {}   # the last training batch's terms, detached

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            args = self.args
            objective = self.model if model is None else model
            groups = objective.parameter_groups(args.learning_rate, head_learning_rate=args.head_learning_rate,
                                                layer_decay=args.layer_decay, weight_decay=args.weight_decay)
            self.optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                               eps=args.adam_epsilon)
        return self.optimizer

    # train_sampling_strategy="group_by_length": transformers' LengthGroupedSampler (batches of
    # similar length from shuffled megabatches, the longest first; evaluation in seeded groups),
    # given each item's word count. The stock samplers measure an item's input_ids, which tagging
    # items do not have (they hold words), and raise. On a CPU most of a random batch of CoNLL
    # sentences is padding (benchmarks/results/length_grouping.md).
    def _get_train_sampler(self, train_dataset=None):
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if self.args.train_sampling_strategy == "group_by_length" and dataset is not None:
            return self._by_word_count(dataset, self.args.train_batch_size * self.args.gradient_accumulation_steps)
        return super()._get_train_sampler(train_dataset)

    def _get_eval_sampler(self, eval_dataset):
        if self.args.train_sampling_strategy == "group_by_length" and eval_dataset is not None:
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
            return self._by_word_count(eval_dataset, self.args.eval_batch_size, torch.Generator().manual_seed(seed))
        return super()._get_eval_sampler(eval_dataset)

    @staticmethod
    def _by_word_count(items, batch_size: int, generator=None):
        from transformers.trainer_pt_utils import LengthGroupedSampler

        return LengthGroupedSampler(batch_size, lengths=[len(item["tokens"]) for item in items], generator=generator)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The configured loss of one training batch: the objective's terms (LOSS_TERMS) combined
        by its weighting, the adaptive one at this step. The terms are computed in the model's
        forward, called through the wrapper the Trainer put around it: under torchrun, DDP must see
        every parameter the loss uses (the loss weights and the hidden projection too) in that
        forward."""
        objective = self.accelerator.unwrap_model(model)
        objective.progress = (self.state.global_step, self.state.max_steps)
        outputs = model(**inputs)
        self.loss_terms = {name: outputs[f"loss_{name}"] for name in objective.objective_config.losses}
        return (outputs["loss"], outputs) if return_outputs else outputs["loss"]

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Validation: (gold CRF NLL, Viterbi paths (B, L) padded with -100, gold tags)."""
        inputs = self._prepare_inputs(inputs)
        if self.select_on == "loss":
            with torch.no_grad():
                return model(**inputs)["loss"].detach(), None, None
        tagger = self.accelerator.unwrap_model(model).tagger
        with torch.no_grad():
            emissions = tagger.emissions(inputs)
            lengths, tags = inputs["lengths"], inputs["tags"][:, :emissions.shape[1]]
            loss = tagger.crf.nll(emissions, tags, lengths=lengths).detach()
            paths = None
            if not prediction_loss_only:
                paths = tagger.crf.decode(emissions, lengths=lengths).paths
                paths = paths.masked_fill(paths < 0, IGNORE_INDEX)
        return loss, paths, tags

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and len(self.loss_terms) > 1:
            logs.update({f"loss_{name}": round(float(value), 4) for name, value in self.loss_terms.items()})
            objective = self.accelerator.unwrap_model(self.model)
            if objective.weighting is not None:
                for name, weight in zip(objective.objective_config.losses, objective.weighting.weights.tolist()):
                    logs[f"weight_{name}"] = round(weight, 4)
        super().log(logs, *args, **kwargs)


TaggerTrainer = DistillationTrainer   # the former name


def fit_tagger(tagger, train_items: Sequence[dict], dev_items: Sequence[dict], args: TaggerTrainingArguments,
               objective: ObjectiveConfig = ObjectiveConfig(), cache=None, resume: bool = True,
               callbacks: Sequence = (), hidden_projection: Optional[nn.Module] = None) -> DistillationTrainer:
    """Train tagger on train_items (crfkit.training.tagging_items), select and early-stop on the
    F1 of dev_items, and save the best tagger to args.output_dir/model (rank 0).

    objective: the loss (ObjectiveConfig); distillation losses read the teacher's labels from
    cache (a TeacherLabelCache over the corpus that the items' ids index). resume: continue from
    the last checkpoint in args.output_dir if there is one. callbacks: more TrainerCallbacks.
    hidden_projection: for the hidden loss (see TaggingObjective); saved beside the model as
    hidden_projection.safetensors. With the hidden loss alone, selection and early stopping use
    the validation loss instead of F1, so dev_items need cache ids (the teacher labels the
    validation text too; its gold tags are not used).
    objective.labelled_only: train on the items with gold tags alone (the DA pool's are left out).
    objective.unfreeze_embeddings: a word table frozen by design (TE, GloVe) trains in this run
    too, and is frozen again when it ends (the saved tagger still says frozen).
    Checked before training starts: output_dir can be written (PermissionError,
    NotADirectoryError), and every gold sentence's tags are the tagger's labels in a sequence its
    CRF allows (ValueError naming the item; crfkit.training.check_gold_tags).
    Returns the trainer, its model holding the best weights (trainer.model.tagger).
    """
    train_items, dev_items = list(train_items), list(dev_items)
    if objective.labelled_only:   # e.g. the multi-stage paper's L_CE stage, on the labelled data D_l
        train_items = [item for item in train_items if item["tags"] is not None]
    for name, items, use in (("train_items", train_items, "train on"), ("dev_items", dev_items, "select on")):
        if not items:
            raise ValueError(f"{name} is empty: fit_tagger needs at least one sentence to {use}")
    ensure_writable_directory(args.output_dir, "output_dir")  # now, not at the first checkpoint
    check_gold_tags(train_items, tagger, "train_items")
    check_gold_tags(dev_items, tagger, "dev_items")
    if args.eval_strategy == "no" or args.save_strategy != args.eval_strategy:
        raise ValueError("fit_tagger selects the best model on validation: give eval_strategy and save_strategy "
                         f"the same value (got {args.eval_strategy!r} and {args.save_strategy!r})")
    if objective.needs_teacher and cache is None:
        raise ValueError(f"the losses {objective.losses} need a teacher-label cache (cache=...)")
    if cache is not None and objective.needs_teacher and objective.k > cache.k:
        raise ValueError(f"objective.k = {objective.k} but the cache holds only K = {cache.k} paths per sentence")
    select_on = "f1" if objective.trains_emissions else "loss"
    if select_on == "loss" and any(item["id"] is None for item in dev_items):
        raise ValueError("the hidden loss alone is selected on validation loss: dev_items need cache ids")
    args.load_best_model_at_end = True
    args.metric_for_best_model = select_on
    args.greater_is_better = select_on == "f1"
    args.remove_unused_columns = False
    args.label_names = ["tags"]
    per_sentence = getattr(cache, "per_sentence_crf", False)   # cross-fitted teachers: each batch brings its CRFs
    model = TaggingObjective(tagger, objective,
                             cache.teacher_crf() if objective.needs_teacher_crf and not per_sentence else None,
                             hidden_projection=hidden_projection if objective.needs_teacher_hidden else None,
                             per_sentence_teacher_crf=per_sentence)
    collator = TaggingCollator(tagger, cache=cache if objective.needs_teacher or _any_unlabelled(train_items) else None,
                               k=objective.k if cache is not None else None,
                               teacher_emissions="teacher_emissions" in objective.teacher_fields,
                               teacher_hidden="teacher_hidden" in objective.teacher_fields)
    eval_items = dev_items if select_on == "loss" else [dict(item, id=None) for item in dev_items]
    trainer = DistillationTrainer(
        model=model, args=args, data_collator=collator, train_dataset=train_items,
        eval_dataset=eval_items, compute_metrics=make_compute_metrics(tagger.labels, tagger.scheme),
        select_on=select_on,
        callbacks=[transformers.EarlyStoppingCallback(early_stopping_patience=args.patience), *callbacks],
    )
    checkpoint = transformers.trainer_utils.get_last_checkpoint(args.output_dir) if (
        resume and os.path.isdir(args.output_dir)) else None
    table = frozen_word_table(tagger) if objective.unfreeze_embeddings else None
    try:
        if table is not None:
            table.requires_grad_(True)   # before train() builds the optimizer from the trainable parameters
        trainer.train(resume_from_checkpoint=checkpoint)
    finally:
        if table is not None:
            table.requires_grad_(False)
    if is_main_process():
        trainer.model.tagger.save_pretrained(os.path.join(args.output_dir, MODEL_DIR))
        if model.hidden_projection is not None:
            from safetensors.torch import save_model

            save_model(model.hidden_projection, os.path.join(args.output_dir, PROJECTION_FILE))
    return trainer


def fit_tagger_gradually(tagger, train_items: Sequence[dict], dev_items: Sequence[dict],
                         make_args: Callable[[str], TaggerTrainingArguments], output_dir: str,
                         objective: ObjectiveConfig = ObjectiveConfig(), cache=None,
                         hidden_projection: Optional[nn.Module] = None,
                         callbacks: Sequence = ()) -> Optional[DistillationTrainer]:
    """Gradual unfreezing (the multi-stage distillation paper's Algorithm 1) over fit_tagger:
    round r trains the top r layers of tagger.layer_groups() (the hidden projection counts as the
    top layer of the hidden loss, whose stage leaves out the "output" layer it does not train),
    each round to its best validation score, the next round starting from that best; the rounds
    are those of crfkit.distill.GradualUnfreezing.

    make_args(directory) -> the TaggerTrainingArguments of one round (output_dir = directory);
    rounds go to output_dir/unfreeze1, unfreeze2, ...; a finished round is loaded, not retrained,
    so a killed run resumes in the round it stopped in. Parameters frozen by design (a TE table)
    stay frozen, unless objective.unfreeze_embeddings: then the frozen word table is the bottom
    layer, unfrozen in the last round alone (the multi-stage paper's "when the last layer (word
    embeddings) is unfrozen, the entire network is trained end-to-end"). Every requires_grad flag
    is restored at the end. callbacks: as fit_tagger's, for every round.
    Returns the last round's trainer (None when every round had finished before).
    """
    from safetensors.torch import load_model

    from ..taggers import load_tagger

    hidden_alone = objective.needs_teacher_hidden and not objective.trains_emissions
    layers = [(name, params) for name, params in tagger.layer_groups() if not (hidden_alone and name == "output")]
    table = frozen_word_table(tagger) if objective.unfreeze_embeddings else None
    if table is not None:
        layers.insert(0, ("word embeddings", [table]))
    round_objective = replace(objective, unfreeze_embeddings=False)   # the schedule decides, not each round
    if objective.needs_teacher_hidden:
        if hidden_projection is None:
            raise ValueError("the hidden loss needs hidden_projection")
        if any(True for _ in hidden_projection.parameters()):   # an identity HiddenStateMSE has none
            layers.append(("hidden projection", list(hidden_projection.parameters())))
    modules = [tagger] + ([hidden_projection] if hidden_projection is not None else [])
    schedule = distill.GradualUnfreezing(layers, [p for module in modules for p in module.parameters()])
    trainer = None
    with schedule:   # every requires_grad flag comes back, after an exception too
        for round_ in range(1, len(schedule) + 1):
            out = os.path.join(output_dir, f"unfreeze{round_}")
            schedule.apply(round_)
            if os.path.isfile(os.path.join(out, MODEL_DIR, "config.json")):   # finished earlier
                tagger.load_state_dict(load_tagger(os.path.join(out, MODEL_DIR)).state_dict())
                if objective.needs_teacher_hidden:
                    load_model(hidden_projection, os.path.join(out, PROJECTION_FILE))
                continue
            trainer = fit_tagger(tagger, train_items, dev_items, make_args(out), objective=round_objective,
                                 cache=cache, hidden_projection=hidden_projection, callbacks=callbacks)
    return trainer


def frozen_word_table(tagger) -> Optional[nn.Parameter]:
    """The tagger's word table when it is frozen by design (a BiLSTMCRFTagger's TE or GloVe table,
    frozen_embeddings), else None (a table that trains anyway, or a tagger without one)."""
    if not getattr(tagger, "frozen_embeddings", False):
        return None
    return tagger.word_embedding.weight


def init_distributed() -> None:
    """Under torchrun (WORLD_SIZE > 1), initialise the default process group once, first: gloo on
    the CPU, nccl with CUDA. The teacher-label cache and the Trainer both join an existing group;
    letting each create (and the cache destroy) its own made gloo's second rendezvous flaky."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_available() and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


def _any_unlabelled(items: Sequence[dict[str, Any]]) -> bool:
    return any(item["tags"] is None for item in items)
