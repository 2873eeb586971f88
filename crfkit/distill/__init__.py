"""crfkit.distill: the losses, weightings and schedules of knowledge distillation for sequence
labelling (../shared/METHODS.md states the maths of each), plus the teacher-label cache.

Modules:
    structured      structure-level losses on CRFs (seed 000 and its comparison points)
    output          output-level losses on logits (seeds 001, 003, 004)
    representation  hidden-state and attention losses, layer mapping (seeds 001, 002)
    weighting       uncertainty weighting (Kendall et al.) and fixed weights
    schedules       seed 001's adaptive theta_t, linear teacher annealing
    unfreezing      seed 002's stage-wise training with gradual unfreezing
    alignment       sub-word to word alignment of logits and hidden states
    augment         Tang et al.'s transfer-set augmentation for tagging
    embeddings      teacher embedding transfer and SVD reduction
    cache           the teacher-label cache (sharded, resumable, torchrun-aware)
"""
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
