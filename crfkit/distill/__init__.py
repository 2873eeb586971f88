"""crfkit.distill: the losses, weightings and schedules of knowledge distillation for sequence
labelling (docs/METHODS.md states the maths of each), plus the teacher-label cache.

The papers, by the short names the modules use (full references in docs/METHODS.md):
    the multi-grained paper    Zhou et al., *Multi-Grained Knowledge Distillation for Named Entity
                               Recognition* (NAACL 2021)
    the adaptive-weight paper  Ye and Hernandez, *Knowledge Distillation Scheme for Named Entity
                               Recognition Model Based on BERT* (MLBDBI 2023)
    the multi-stage paper      Mukherjee and Awadallah, *Multi-Stage Distillation Framework for
                               Massive Multi-lingual NER* (2020)
    the DistillBiDAF report    *DistillBiDAF*, a Stanford CS224N project report on distilling
                               BERT into BiDAF
    Tang et al.                *Distilling Task-Specific Knowledge from BERT into Simple Neural
                               Networks* (2019)

Modules:
    structured      structure-level losses on CRFs (the multi-grained paper and its comparison points)
    output          output-level losses on logits (the adaptive-weight paper, the DistillBiDAF
                    report, Tang et al.)
    representation  hidden-state and attention losses, layer mapping (the adaptive-weight and
                    multi-stage papers)
    weighting       uncertainty weighting (Kendall et al.) and fixed weights
    schedules       the adaptive-weight paper's adaptive theta_t, linear teacher annealing
    unfreezing      the multi-stage paper's gradual unfreezing schedule (trained by
                    crfkit.training.fit_tagger_gradually)
    alignment       sub-word to word alignment of logits and hidden states
    augment         Tang et al.'s transfer-set augmentation for tagging
    embeddings      teacher embedding transfer and SVD reduction
    cache           the teacher-label cache (sharded, resumable, torchrun-aware)
"""
from .alignment import align_labels_to_pieces, align_to_words, first_piece_mask, word_index_from_word_ids
from .augment import AugmentedSentence, PosUnigrams, augment_sentence, augment_sentences
from .cache import (
    CacheBusyError,
    CachedBatch,
    CachedLabels,
    CacheMismatchError,
    CacheUnion,
    TeacherLabelCache,
    TeacherOutput,
    label_corpus,
    load_cache,
)
from .embeddings import TransferReport, svd_reduce, teacher_word_vectors, transfer_embeddings
from .output import hard_cross_entropy, logit_mse, soft_cross_entropy
from .representation import GeluProjectionLoss, HiddenStateMSE, attention_mse, layer_transfer_loss, uniform_layer_map
from .schedules import AdaptiveTheta, LinearAnnealing, adaptive_kd_loss, adaptive_theta, linear_annealing
from .structured import (
    crf_cross_entropy,
    crf_kl_divergence,
    crf_nll,
    fuzzy_loss,
    kbest_cross_entropy,
    log1mexp,
    token_kd,
    topk_loss,
)
from .unfreezing import GradualUnfreezing
from .weighting import FixedWeights, ScheduledWeights, UncertaintyWeighting

__all__ = [
    "AdaptiveTheta",
    "AugmentedSentence",
    "CacheBusyError",
    "CacheMismatchError",
    "CacheUnion",
    "CachedBatch",
    "CachedLabels",
    "FixedWeights",
    "GeluProjectionLoss",
    "GradualUnfreezing",
    "HiddenStateMSE",
    "LinearAnnealing",
    "PosUnigrams",
    "ScheduledWeights",
    "TeacherLabelCache",
    "TeacherOutput",
    "TransferReport",
    "UncertaintyWeighting",
    "adaptive_kd_loss",
    "adaptive_theta",
    "align_labels_to_pieces",
    "align_to_words",
    "attention_mse",
    "augment_sentence",
    "augment_sentences",
    "crf_cross_entropy",
    "crf_kl_divergence",
    "crf_nll",
    "first_piece_mask",
    "fuzzy_loss",
    "hard_cross_entropy",
    "kbest_cross_entropy",
    "label_corpus",
    "layer_transfer_loss",
    "linear_annealing",
    "load_cache",
    "log1mexp",
    "logit_mse",
    "soft_cross_entropy",
    "svd_reduce",
    "teacher_word_vectors",
    "token_kd",
    "topk_loss",
    "transfer_embeddings",
    "uniform_layer_map",
    "word_index_from_word_ids",
]
