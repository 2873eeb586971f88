"""crfkit.training: train crfkit taggers with transformers' Trainer, on gold tags or by
distillation from a teacher's labels (crfkit.distill losses, named by configuration).

    from crfkit.training import TaggerTrainingArguments, VARIANTS, fit_tagger, tagging_items
    args = TaggerTrainingArguments("runs/student", num_train_epochs=30, eval_strategy="epoch",
                                   save_strategy="epoch", learning_rate=1e-3)
    trainer = fit_tagger(student, tagging_items(train), tagging_items(dev), args,
                         objective=VARIANTS["te_seq"].objective, cache=teacher_label_cache)

Needs transformers and accelerate (pip install transformers accelerate) and seqeval.
"""
from .data import TaggingCollator, check_gold_tags, tagging_items
from .metrics import entity_scores, make_compute_metrics
from .objectives import (LOSS_TERMS, LOSSES, VARIANTS, WEIGHTINGS, LossTerm, ObjectiveConfig, StudentOutputs,
                         TaggingObjective, Variant)
from .trainer import (DistillationTrainer, RunClock, TaggerTrainer, TaggerTrainingArguments, fit_tagger,
                      fit_tagger_gradually, init_distributed)

__all__ = ["DistillationTrainer", "LOSSES", "LOSS_TERMS", "LossTerm", "ObjectiveConfig", "RunClock", "StudentOutputs",
           "TaggerTrainer", "TaggerTrainingArguments", "TaggingCollator", "TaggingObjective", "VARIANTS", "Variant",
           "WEIGHTINGS", "check_gold_tags", "entity_scores", "fit_tagger", "fit_tagger_gradually", "init_distributed",
           "make_compute_metrics", "tagging_items"]
