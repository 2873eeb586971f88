"""The training objective of a tagger: the CRF loss on gold tags, or a distillation loss built from
crfkit.distill and named by configuration (docs/METHODS.md states each loss).

    config = VARIANTS["te_seq"].objective          # hard + fuzzy + k-best CE, uncertainty-weighted
    objective = TaggingObjective(student, config, teacher_crf=cache.teacher_crf())
    out = objective(**collated_batch)             # {"loss": ..., "loss_hard": ..., ...}

Loss names (each a mean over the batch's sentences):
    hard       -log P_s(y | x) for the gold tags (the teacher's best path on unlabelled text)
    fuzzy      coarse-grained: binary cross entropy on the mass of the teacher's K best
    kbest_ce   fine-grained: cross entropy over the K best, with the residual mass
    token_em   token-level cross entropy between softmax(emissions) of teacher and student
    token_pos  the same between the CRF marginals (posteriors) of teacher and student
    exact_kl   the exact KL(P_teacher || P_student) over all tag sequences (crfkit's own)
    logit_mse  squared distance between teacher and student emissions (Tang et al.)
    hidden     the multi-stage paper's representation loss: MSE between GELU(W h_s + b), the
               student's word features projected to the teacher's width, and a hidden layer of
               the teacher (the projection is trained with the student)
Weighting: "uncertainty" (learned, Kendall et al.), "equal" (sum), or "adaptive": the adaptive
schedule theta_t of the adaptive-weight BERT NER distillation paper, theta_t times the sum of the
distillation losses plus (1 - theta_t) times the hard loss.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn

from .. import distill
from .._validation import check_choice, check_int, check_number
from ..distribution import LinearChainCRF

__all__ = ["EMBEDDINGS", "LOSSES", "WEIGHTINGS", "ObjectiveConfig", "TaggingObjective", "Variant", "VARIANTS"]

LOSSES = ("hard", "fuzzy", "kbest_ce", "token_em", "token_pos", "exact_kl", "logit_mse", "hidden")
WEIGHTINGS = ("uncertainty", "equal", "adaptive")
_NEEDS_KBEST = {"fuzzy", "kbest_ce"}
_NEEDS_TEACHER_CRF = {"token_em", "token_pos", "exact_kl", "logit_mse"}


@dataclass(frozen=True)
class ObjectiveConfig:
    """losses: names from LOSSES; weighting: one of WEIGHTINGS (ignored for a single loss);
    k: teacher paths for fuzzy / kbest_ce; temperature: of token_em / token_pos;
    adaptive_bias: b of theta_t = max(1 - exp(t / steps + b) / e, 0)."""

    losses: tuple[str, ...] = ("hard",)
    weighting: str = "uncertainty"
    k: int = 5
    temperature: float = 1.0
    adaptive_bias: float = 0.0

    def __post_init__(self):
        losses = tuple(self.losses)
        object.__setattr__(self, "losses", losses)
        if not losses or len(set(losses)) != len(losses):
            raise ValueError(f"losses must be distinct names from {LOSSES}, got {losses}")
        for name in losses:
            if name not in LOSSES:
                raise ValueError(f"unknown loss {name!r}; choose from {LOSSES}")
        check_choice("weighting", self.weighting, WEIGHTINGS)
        if self.weighting == "adaptive" and ("hard" not in losses or len(losses) < 2):
            raise ValueError("weighting='adaptive' mixes the hard loss with distillation losses: give 'hard' and at "
                             "least one other loss")
        check_int("k", self.k, minimum=1, type_error=ValueError)
        check_number("temperature", self.temperature, minimum=0, open_minimum=True)

    @property
    def needs_teacher(self) -> bool:
        return self.losses != ("hard",)

    @property
    def uses_kbest(self) -> bool:
        """Whether k (the teacher's K best) matters: the fuzzy or k-best CE loss is on."""
        return bool(_NEEDS_KBEST & set(self.losses))

    @property
    def needs_teacher_crf(self) -> bool:
        return bool(_NEEDS_TEACHER_CRF & set(self.losses))

    @property
    def needs_teacher_hidden(self) -> bool:
        return "hidden" in self.losses

    @property
    def trains_emissions(self) -> bool:
        """False for the representation loss alone, whose model is selected by validation loss
        (the emissions, and so F1, mean nothing yet)."""
        return self.losses != ("hidden",)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


EMBEDDINGS = ("random", "teacher", "glove", "pretrained")


@dataclass(frozen=True)
class Variant:
    """A row of the multi-grained distillation paper's tables: the student's word embeddings
    ("random": trained from scratch; "teacher": TE, the teacher's table, frozen; "glove": GloVe
    vectors, frozen, the baseline without a teacher), whether teacher-labelled unlabelled text is
    pooled in (da), and the objective. transformer_layers > 0 makes the student a
    TransformerCRFTagger of the pretrained encoder's first layers instead of a BiLSTM (the
    paper's appendix; embeddings is then "pretrained"). stages: objectives trained one after the
    other, each to its best validation score (the stage-wise schedule of the multi-stage
    distillation paper); when given, they replace objective. gradual_unfreezing: within each
    stage, train the top layer alone, then the top two, and so on down to the input (that
    paper's Algorithm 1), each round to its best validation score."""

    embeddings: str
    da: bool
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    transformer_layers: int = 0
    stages: tuple[ObjectiveConfig, ...] = ()
    gradual_unfreezing: bool = False

    @property
    def objectives(self) -> tuple[ObjectiveConfig, ...]:
        """The objectives in training order (one, unless stage-wise)."""
        return tuple(self.stages) or (self.objective,)

    def __post_init__(self):
        check_choice("embeddings", self.embeddings, EMBEDDINGS)
        if (self.embeddings == "pretrained") != (self.transformer_layers > 0):
            raise ValueError("embeddings='pretrained' goes with a transformer student (transformer_layers > 0)")


def _seq(*extra: str, drop: tuple[str, ...] = (), weighting: str = "uncertainty") -> ObjectiveConfig:
    losses = tuple(name for name in ("hard", "fuzzy", "kbest_ce") if name not in drop) + extra
    return ObjectiveConfig(losses=losses, weighting=weighting)


VARIANTS: dict[str, Variant] = {
    "vanilla": Variant("random", da=False),
    "glove": Variant("glove", da=False),
    # distillation into the GloVe student (the strongest student without a teacher)
    "glove_seq": Variant("glove", da=False, objective=_seq()),
    "glove_exact_kl": Variant("glove", da=False, objective=ObjectiveConfig(("hard", "exact_kl"))),
    "te": Variant("teacher", da=False),
    "te_token_em": Variant("teacher", da=False, objective=ObjectiveConfig(("hard", "token_em"))),
    "te_token_pos": Variant("teacher", da=False, objective=ObjectiveConfig(("hard", "token_pos"))),
    "te_seq": Variant("teacher", da=False, objective=_seq()),
    "te_seq_equal": Variant("teacher", da=False, objective=_seq(weighting="equal")),
    "te_exact_kl": Variant("teacher", da=False, objective=ObjectiveConfig(("hard", "exact_kl"))),
    "te_da": Variant("teacher", da=True),
    "te_da_token_em": Variant("teacher", da=True, objective=ObjectiveConfig(("hard", "token_em"))),
    "te_da_token_pos": Variant("teacher", da=True, objective=ObjectiveConfig(("hard", "token_pos"))),
    "te_da_seq": Variant("teacher", da=True, objective=_seq()),
    "te_da_seq_equal": Variant("teacher", da=True, objective=_seq(weighting="equal")),
    "te_da_exact_kl": Variant("teacher", da=True, objective=ObjectiveConfig(("hard", "exact_kl"))),
    # the loss combinations of the paper's Table 2 (with DA, as there)
    "te_da_seq_token_pos": Variant("teacher", da=True, objective=_seq("token_pos")),
    "te_da_seq_no_fuzzy": Variant("teacher", da=True, objective=_seq(drop=("fuzzy",))),
    "te_da_seq_no_kbest_ce": Variant("teacher", da=True, objective=_seq(drop=("kbest_ce",))),
    # the other papers' losses as options of the same trainer
    "te_da_logit_mse": Variant("teacher", da=True, objective=ObjectiveConfig(("hard", "logit_mse"), weighting="equal")),
    "te_da_seq_adaptive": Variant("teacher", da=True, objective=_seq(weighting="adaptive")),
    # stage-wise (multi-stage distillation): the teacher's hidden layer, then its logits, then the
    # hard loss, each stage with gradual unfreezing
    "te_da_stagewise": Variant("teacher", da=True, stages=(ObjectiveConfig(("hidden",)),
                                                           ObjectiveConfig(("logit_mse",)),
                                                           ObjectiveConfig()), gradual_unfreezing=True),
    # a small transformer student: the pretrained encoder's first 2 layers (of MiniLM's 6)
    "bp2": Variant("pretrained", da=False, transformer_layers=2),
    "bp2_seq": Variant("pretrained", da=False, objective=_seq(), transformer_layers=2),
    "bp2_da_seq": Variant("pretrained", da=True, objective=_seq(), transformer_layers=2),
}


class TaggingObjective(nn.Module):
    """The module transformers' Trainer optimises: the tagger plus the loss weights.

    tagger: a crfkit.taggers tagger (the student, or the model being trained on gold).
    config: ObjectiveConfig. teacher_crf: the teacher's (transitions, start, end), needed by
    token_em / token_pos / exact_kl / logit_mse (TeacherLabelCache.teacher_crf()).
    hidden_projection: a crfkit.distill.GeluProjectionLoss from the tagger's word_features width
    to the teacher's hidden width, needed by the hidden loss; trained with the tagger (pass the
    same module to every stage or round that shares it).
    forward(**batch) takes TaggingCollator's batch and returns {"loss", "loss_<name>" per loss}.
    progress (step, total_steps) is set by the trainer for weighting="adaptive".
    """

    def __init__(self, tagger: nn.Module, config: ObjectiveConfig = ObjectiveConfig(),
                 teacher_crf: Optional[tuple[Tensor, Tensor, Tensor]] = None,
                 hidden_projection: Optional[nn.Module] = None):
        super().__init__()
        self.tagger = tagger
        self.objective_config = config
        if config.needs_teacher_crf and teacher_crf is None:
            raise ValueError(f"losses {config.losses} need the teacher's CRF: pass teacher_crf=cache.teacher_crf() "
                             "(label the cache with with_emissions=True)")
        if config.needs_teacher_hidden and hidden_projection is None:
            raise ValueError("the hidden loss needs hidden_projection=crfkit.distill.GeluProjectionLoss(student "
                             "width, teacher width)")
        self.hidden_projection = hidden_projection
        if teacher_crf is not None:
            self.register_buffer("teacher_transitions", teacher_crf[0].float(), persistent=False)
            self.register_buffer("teacher_start", teacher_crf[1].float(), persistent=False)
            self.register_buffer("teacher_end", teacher_crf[2].float(), persistent=False)
        n = len(config.losses)
        self.weighting = distill.UncertaintyWeighting(n) if n > 1 and config.weighting == "uncertainty" else None
        self.progress = (0, 1)
        self.last_terms: dict[str, float] = {}

    def parameter_groups(self, learning_rate: float, **kwargs: Any) -> list[dict[str, Any]]:
        """The tagger's groups, plus the loss weights at the head's rate without weight decay."""
        groups = self.tagger.parameter_groups(learning_rate, **kwargs)
        rate = kwargs.get("head_learning_rate") or learning_rate
        if self.weighting is not None:
            groups.append({"params": list(self.weighting.parameters()), "lr": rate, "weight_decay": 0.0})
        if self.hidden_projection is not None:
            trainable = [p for p in self.hidden_projection.parameters() if p.requires_grad]
            if trainable:
                groups.append({"params": trainable, "lr": rate, "weight_decay": 0.0})
        return [group for group in groups if group["params"]]   # all of a layer may be frozen (gradual unfreezing)

    def forward(self, tags: Tensor, lengths: Tensor, teacher_paths: Optional[Tensor] = None,
                teacher_log_probs: Optional[Tensor] = None, teacher_emissions: Optional[Tensor] = None,
                teacher_hidden: Optional[Tensor] = None, **features: Tensor) -> dict[str, Tensor]:
        features["lengths"] = lengths
        word_features = self.tagger.word_features(features)
        emissions = self.tagger.emissions_from_features(word_features) if self.objective_config.trains_emissions \
            else None
        transitions, start, end = self.tagger.distribution_parameters()
        terms = {}
        for name in self.objective_config.losses:
            if name == "hidden":
                if teacher_hidden is None:
                    raise ValueError("loss 'hidden' needs the teacher's hidden states (a cache labelled with "
                                     "with_hidden=True and a TaggingCollator with teacher_hidden=True)")
                mask = torch.arange(word_features.shape[1], device=lengths.device) < lengths[:, None]
                terms[name] = self.hidden_projection(word_features, teacher_hidden.to(word_features.dtype), mask)
                continue
            if name == "hard":
                terms[name] = self.tagger.crf.nll(emissions, tags[:, :emissions.shape[1]], lengths=lengths)
                continue
            if name in _NEEDS_KBEST:
                if teacher_paths is None:
                    raise ValueError(f"loss {name!r} needs the teacher's k best (a TaggingCollator with a cache)")
                kb = (None, teacher_paths[:, :self.objective_config.k], teacher_log_probs[:, :self.objective_config.k])
                loss_fn = distill.fuzzy_loss if name == "fuzzy" else distill.kbest_cross_entropy
                terms[name] = loss_fn(emissions, transitions, kb, lengths, start, end)
                continue
            if teacher_emissions is None:
                raise ValueError(f"loss {name!r} needs the teacher's emissions (a cache labelled with_emissions=True "
                                 "and a TaggingCollator with teacher_emissions=True)")
            teacher = teacher_emissions.to(emissions.dtype)
            if name == "token_em":
                terms[name] = distill.token_kd(emissions, teacher, lengths, source="emissions",
                                               temperature=self.objective_config.temperature)
            elif name == "token_pos":
                terms[name] = distill.token_kd(emissions, teacher, lengths, source="marginals",
                                               student_transitions=transitions,
                                               teacher_transitions=self.teacher_transitions,
                                               student_start=start, student_end=end, teacher_start=self.teacher_start,
                                               teacher_end=self.teacher_end,
                                               temperature=self.objective_config.temperature)
            elif name == "exact_kl":
                teacher_dist = LinearChainCRF(teacher, self.teacher_transitions, lengths, self.teacher_start,
                                              self.teacher_end)
                student_dist = LinearChainCRF(emissions, transitions, lengths, start, end)
                terms[name] = distill.crf_kl_divergence(teacher_dist, student_dist)
            elif name == "logit_mse":
                mask = torch.arange(emissions.shape[1], device=lengths.device) < lengths[:, None]
                terms[name] = distill.logit_mse(emissions, teacher, mask)
        self.last_terms = {name: float(value.detach()) for name, value in terms.items()}
        values = list(terms.values())
        if len(values) == 1:
            loss = values[0]
        elif self.weighting is not None:
            loss = self.weighting(values)
        elif self.objective_config.weighting == "adaptive":
            step, total = self.progress
            theta = distill.adaptive_theta(min(step, total), max(total, 1), self.objective_config.adaptive_bias)
            soft = sum(value for name, value in terms.items() if name != "hard")
            loss = theta * soft + (1 - theta) * terms["hard"]
        else:
            loss = sum(values)
        return {"loss": loss, **{f"loss_{name}": value.detach() for name, value in terms.items()}}

