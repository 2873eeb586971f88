"""The training objective of a tagger: the CRF loss on gold tags, or a distillation loss built from
crfkit.distill and named by configuration (docs/METHODS.md states each loss).

    config = VARIANTS["te_seq"].objective          # hard + fuzzy + k-best CE, uncertainty-weighted
    objective = TaggingObjective(student, config, teacher_crf=cache.teacher_crf())
    out = objective(**collated_batch)             # {"loss": ..., "loss_hard": ..., ...}

Each loss is an entry of the registry LOSS_TERMS (a LossTerm: its name, the teacher fields of
TaggingCollator's batch it reads, whether it needs the teacher's CRF, the docs/METHODS.md equation
it implements, and the function computing it from the student's outputs and the batch); the
ObjectiveConfig properties that say what a run needs (a cache, the teacher's emissions, its
hidden states) are read from it. The losses (each a mean over the batch's sentences):
    hard       -log P_s(y | x) for the gold tags (the teacher's best path on unlabelled text)
    fuzzy      coarse-grained: binary cross entropy on the mass of the teacher's K best
    kbest_ce   fine-grained: cross entropy over the K best, with the residual mass
    token_em   token-level cross entropy between softmax(emissions) of teacher and student
    token_pos  the same between the CRF marginals (posteriors) of teacher and student
    exact_kl   the exact KL(P_teacher || P_student) over all tag sequences (crfkit's own)
    logit_mse  squared distance between teacher and student emissions (Tang et al.)
    hidden     a hidden layer of the teacher against the student's word features projected to
               the teacher's width (the projection is trained with the student): the multi-stage
               paper's L_RL, a distance (MSE, or the KL of softmaxes) to GELU(W h_s + b), or
               the adaptive-weight paper's L_hidn = MSE(h_s W_h, H_t) (ObjectiveConfig's
               hidden_projection and hidden_distance; hidden_projection_for builds the module)
Weighting: "uncertainty" (learned, Kendall et al.), "equal" (sum), or "adaptive": the adaptive
schedule theta_t of the adaptive-weight BERT NER distillation paper, theta_t times the sum of the
distillation losses plus (1 - theta_t) times the hard loss (crfkit.distill.adaptive_theta and
adaptive_kd_loss).
An ObjectiveConfig is also one stage of a stage-wise Variant: which teacher it reads (the
fine-tuned one, or the general encoder that was never fine-tuned, the adaptive-weight paper's first
stage), whether it trains the frozen word table too (the multi-stage paper's last unfreezing
round), and whether it trains on the gold-labelled sentences only (that paper's L_CE stage).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from .. import distill
from .._validation import check_bool, check_choice, check_int, check_number
from ..distribution import LinearChainCRF

__all__ = ["EMBEDDINGS", "HIDDEN_DISTANCES", "HIDDEN_PROJECTIONS", "LOSSES", "LOSS_TERMS", "LossTerm",
           "ObjectiveConfig", "StudentOutputs", "TEACHERS", "TaggingObjective", "Variant", "VARIANTS", "WEIGHTINGS",
           "hidden_projection_for"]

WEIGHTINGS = ("uncertainty", "equal", "adaptive")
# the hidden loss's projection: the multi-stage paper's GELU(W h + b) (crfkit.distill.GeluProjectionLoss)
# or the adaptive-weight paper's linear h W_h (crfkit.distill.HiddenStateMSE)
HIDDEN_PROJECTIONS = ("gelu", "linear")
HIDDEN_DISTANCES = ("mse", "cosine", "softmax_kl", "keras_kld")   # GeluProjectionLoss's distances
# whose labels a stage reads: the fine-tuned teacher's, or the general (pretrained, never
# fine-tuned) encoder's hidden layer (the adaptive-weight paper's first distillation stage)
TEACHERS = ("fine-tuned", "general")


@dataclass(frozen=True)
class StudentOutputs:
    """What the loss terms read from the student for one batch (B sentences padded to L words, T
    tags, D features).

    word_features: (B, L, D), what the tagger's linear layer reads. emissions: (B, L, T), or None
    when no configured term reads them (the representation loss alone). transitions: (T, T);
    start, end: (T,) or None. lengths: (B,)."""

    word_features: Tensor
    emissions: Optional[Tensor]
    transitions: Tensor
    start: Optional[Tensor]
    end: Optional[Tensor]
    lengths: Tensor


@dataclass(frozen=True)
class LossTerm:
    """One loss of the registry LOSS_TERMS.

    name: its name in ObjectiveConfig.losses. equation: where docs/METHODS.md states it, as
    "<section> <symbol>": the section's number, then the left-hand side of the equation there
    (e.g. "2.2 L_seq_ce"). compute(student, batch, objective) -> a scalar tensor: student is the
    StudentOutputs, batch TaggingCollator's batch, objective the TaggingObjective (its
    objective_config, tagger, teacher_crf and hidden_projection). teacher_fields: the batch fields
    holding the teacher's labels that it reads (checked before any term is computed).
    needs_teacher_crf: it reads the teacher's transitions, start and end (TaggingObjective's
    teacher_crf). uses_emissions: it reads the student's emissions (every loss but the
    representation loss, which reads the word features)."""

    name: str
    equation: str
    compute: Callable[[StudentOutputs, Mapping[str, Tensor], "TaggingObjective"], Tensor]
    teacher_fields: tuple[str, ...] = ()
    needs_teacher_crf: bool = False
    uses_emissions: bool = True


# The teacher fields of TaggingCollator's batch: what each holds and what puts it in the batch
# (the error when a loss finds it missing).
_TEACHER_FIELDS = {
    "teacher_paths": "the teacher's k best (a TaggingCollator with a cache)",
    "teacher_log_probs": "the teacher's k best (a TaggingCollator with a cache)",
    "teacher_emissions": "the teacher's emissions (a cache labelled with_emissions=True and a TaggingCollator with "
                         "teacher_emissions=True)",
    "teacher_hidden": "the teacher's hidden states (a cache labelled with with_hidden=True and a TaggingCollator "
                      "with teacher_hidden=True)",
    "teacher_transitions": "each sentence's teacher CRF (a CacheUnion of teachers with different CRFs)",
    "teacher_start": "each sentence's teacher CRF (a CacheUnion of teachers with different CRFs)",
    "teacher_end": "each sentence's teacher CRF (a CacheUnion of teachers with different CRFs)",
}


def _real_positions(lengths: Tensor, length: int) -> Tensor:
    """(B, length) bool: True at each sentence's real positions."""
    return torch.arange(length, device=lengths.device) < lengths[:, None]


def _teacher_kbest(batch: Mapping[str, Tensor], objective: "TaggingObjective") -> tuple:
    k = objective.objective_config.k
    return None, batch["teacher_paths"][:, :k], batch["teacher_log_probs"][:, :k]


def _teacher_emissions(student: StudentOutputs, batch: Mapping[str, Tensor]) -> Tensor:
    return batch["teacher_emissions"].to(student.emissions.dtype)


def _hard(student, batch, objective):
    emissions = student.emissions
    return objective.tagger.crf.nll(emissions, batch["tags"][:, :emissions.shape[1]], lengths=student.lengths)


def _fuzzy(student, batch, objective):
    return distill.fuzzy_loss(student.emissions, student.transitions, _teacher_kbest(batch, objective),
                              student.lengths, student.start, student.end)


def _kbest_ce(student, batch, objective):
    return distill.kbest_cross_entropy(student.emissions, student.transitions, _teacher_kbest(batch, objective),
                                       student.lengths, student.start, student.end)


def _token_em(student, batch, objective):
    return distill.token_kd(student.emissions, _teacher_emissions(student, batch), student.lengths,
                            source="emissions", temperature=objective.objective_config.temperature)


def _teacher_crf(batch, objective):
    """The teacher's (transitions, start, end): each sentence's (B, T, T), (B, T) from the batch
    when its sentences come from different teachers (cross-fitting), else the one CRF."""
    if batch.get("teacher_transitions") is not None:
        return batch["teacher_transitions"], batch["teacher_start"], batch["teacher_end"]
    if objective.teacher_crf is None:
        raise ValueError("the teacher's CRF is missing: TaggingObjective got no teacher_crf and the batch holds no "
                         "per-sentence teacher_transitions")
    return objective.teacher_crf


def _token_pos(student, batch, objective):
    transitions, start, end = _teacher_crf(batch, objective)
    return distill.token_kd(student.emissions, _teacher_emissions(student, batch), student.lengths,
                            source="marginals", student_transitions=student.transitions,
                            teacher_transitions=transitions, student_start=student.start, student_end=student.end,
                            teacher_start=start, teacher_end=end, temperature=objective.objective_config.temperature)


def _exact_kl(student, batch, objective):
    transitions, start, end = _teacher_crf(batch, objective)
    teacher = LinearChainCRF(_teacher_emissions(student, batch), transitions, student.lengths, start, end)
    return distill.crf_kl_divergence(teacher, LinearChainCRF(student.emissions, student.transitions,
                                                             student.lengths, student.start, student.end))


def _logit_mse(student, batch, objective):
    emissions = student.emissions
    return distill.logit_mse(emissions, _teacher_emissions(student, batch),
                             _real_positions(student.lengths, emissions.shape[1]))


def _hidden(student, batch, objective):
    features = student.word_features
    return objective.hidden_projection(features, batch["teacher_hidden"].to(features.dtype),
                                       _real_positions(student.lengths, features.shape[1]))


_KBEST = ("teacher_paths", "teacher_log_probs")
_EMISSIONS = ("teacher_emissions",)

LOSS_TERMS: dict[str, LossTerm] = {term.name: term for term in (
    LossTerm("hard", "2.2 L_hard", _hard),
    LossTerm("fuzzy", "2.2 L_seq_fuzzy", _fuzzy, teacher_fields=_KBEST),
    LossTerm("kbest_ce", "2.2 L_seq_ce", _kbest_ce, teacher_fields=_KBEST),
    LossTerm("token_em", "2.4 L_token", _token_em, teacher_fields=_EMISSIONS),
    LossTerm("token_pos", "2.4 L_token", _token_pos, teacher_fields=_EMISSIONS, needs_teacher_crf=True),
    LossTerm("exact_kl", "3 KL(p_t || p_s)", _exact_kl, teacher_fields=_EMISSIONS, needs_teacher_crf=True),
    LossTerm("logit_mse", "5.2 L_logit", _logit_mse, teacher_fields=_EMISSIONS),
    LossTerm("hidden", "5.2 L_RL", _hidden, teacher_fields=("teacher_hidden",), uses_emissions=False),
)}
LOSSES = tuple(LOSS_TERMS)


@dataclass(frozen=True)
class ObjectiveConfig:
    """losses: names from LOSSES; weighting: one of WEIGHTINGS (ignored for a single loss);
    k: teacher paths for fuzzy / kbest_ce; temperature: of token_em / token_pos;
    adaptive_bias: b of theta_t = max(1 - exp(t / steps + b) / e, 0).

    The hidden loss: hidden_projection, one of HIDDEN_PROJECTIONS ("gelu": GeluProjectionLoss,
    "linear": HiddenStateMSE, whose distance is MSE); hidden_distance, GeluProjectionLoss's
    distance (HIDDEN_DISTANCES). hidden_projection_for builds the module.

    As a stage of a Variant: teacher, one of TEACHERS ("general": the hidden layer of the
    encoder before fine-tuning, labelled into a cache of its own by the tool; only for the hidden
    loss alone, the one thing an encoder without a trained head can teach); unfreeze_embeddings:
    the stage trains the word table even when it is frozen by design (TE, GloVe): with gradual
    unfreezing as the bottom layer, in the stage's last round, else for the whole stage, frozen
    again afterwards (fit_tagger, fit_tagger_gradually); labelled_only: the stage trains on the
    gold-labelled sentences alone, leaving out the DA pool's (fit_tagger)."""

    losses: tuple[str, ...] = ("hard",)
    weighting: str = "uncertainty"
    k: int = 5
    temperature: float = 1.0
    adaptive_bias: float = 0.0
    hidden_projection: str = "gelu"
    hidden_distance: str = "mse"
    teacher: str = "fine-tuned"
    unfreeze_embeddings: bool = False
    labelled_only: bool = False

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
        check_choice("hidden_projection", self.hidden_projection, HIDDEN_PROJECTIONS)
        check_choice("hidden_distance", self.hidden_distance, HIDDEN_DISTANCES)
        if self.hidden_projection == "linear" and self.hidden_distance != "mse":
            raise ValueError("hidden_projection='linear' (the adaptive-weight paper's MSE(h W_h, H_t)) has the MSE "
                             f"distance only, got hidden_distance={self.hidden_distance!r}")
        check_choice("teacher", self.teacher, TEACHERS)
        if self.teacher == "general" and losses != ("hidden",):
            raise ValueError("teacher='general' (the encoder before fine-tuning, whose head is untrained) teaches "
                             f"its hidden layer only: give losses=('hidden',), got {losses}")
        check_bool("unfreeze_embeddings", self.unfreeze_embeddings)
        check_bool("labelled_only", self.labelled_only)

    @property
    def terms(self) -> tuple[LossTerm, ...]:
        """The registry's entries (LOSS_TERMS) for losses, in order."""
        return tuple(LOSS_TERMS[name] for name in self.losses)

    @property
    def teacher_fields(self) -> tuple[str, ...]:
        """The teacher fields of TaggingCollator's batch that the losses read, in order."""
        return tuple(dict.fromkeys(name for term in self.terms for name in term.teacher_fields))

    @property
    def needs_teacher(self) -> bool:
        """Whether a loss reads the teacher's labels (a teacher-label cache)."""
        return bool(self.teacher_fields)

    @property
    def uses_kbest(self) -> bool:
        """Whether k (the teacher's K best) matters: the fuzzy or k-best CE loss is on."""
        return "teacher_paths" in self.teacher_fields

    @property
    def needs_teacher_crf(self) -> bool:
        """Whether a loss reads the CRF side of the teacher's labels, its emissions or its
        transitions: both come from a cache labelled with_emissions=True, and TaggingObjective
        takes that cache's teacher_crf()."""
        return "teacher_emissions" in self.teacher_fields or any(term.needs_teacher_crf for term in self.terms)

    @property
    def needs_teacher_hidden(self) -> bool:
        return "teacher_hidden" in self.teacher_fields

    @property
    def trains_emissions(self) -> bool:
        """False for the representation loss alone, whose model is selected by validation loss
        (the emissions, and so F1, mean nothing yet)."""
        return any(term.uses_emissions for term in self.terms)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


EMBEDDINGS = ("random", "teacher", "glove", "glove100", "glove100_te", "pretrained")


@dataclass(frozen=True)
class Variant:
    """A row of the multi-grained distillation paper's tables: the student's word embeddings
    ("random": trained from scratch; "teacher": TE, the teacher's table, frozen; "glove": GloVe
    vectors, frozen, the baseline without a teacher; "glove100": NeuroNER's cased 100-d GloVe
    table beside GloVe 50d, frozen, crfkit.tool.job.DistillationJob.build_student; "glove100_te":
    that table with the teacher's beside it, reduced by SVD), whether
    teacher-labelled unlabelled text is pooled in (da), and the objective. transformer_layers > 0 makes the student a
    TransformerCRFTagger of the pretrained encoder's first layers instead of a BiLSTM (the
    paper's appendix; embeddings is then "pretrained"). stages: objectives trained one after the
    other, each to its best validation score (the stage-wise schedule of the multi-stage
    distillation paper); when given, they replace objective. gradual_unfreezing: within each
    stage, train the top layer alone, then the top two, and so on down to the input (that
    paper's Algorithm 1), each round to its best validation score. teacher_hidden_layer: the
    teacher layer the hidden loss distils, None for the tool's --teacher_hidden_layer, -1 for
    the teacher's last layer (the adaptive-weight paper's uniform layer mapping of a one-layer
    student, crfkit.distill.uniform_layer_map(1, N) == [N])."""

    embeddings: str
    da: bool
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    transformer_layers: int = 0
    stages: tuple[ObjectiveConfig, ...] = ()
    gradual_unfreezing: bool = False
    teacher_hidden_layer: Optional[int] = None

    @property
    def objectives(self) -> tuple[ObjectiveConfig, ...]:
        """The objectives in training order (one, unless stage-wise)."""
        return tuple(self.stages) or (self.objective,)

    @property
    def distilled(self) -> bool:
        """Whether the run uses anything of a teacher: its embedding table, its labels of the DA
        pool, or any loss on its outputs. False for the baselines trained on gold labels alone."""
        return self.embeddings in ("teacher", "glove100_te") or self.da or any(o.needs_teacher for o in self.objectives)

    def __post_init__(self):
        check_choice("embeddings", self.embeddings, EMBEDDINGS)
        if (self.embeddings == "pretrained") != (self.transformer_layers > 0):
            raise ValueError("embeddings='pretrained' goes with a transformer student (transformer_layers > 0)")
        if self.teacher_hidden_layer is not None:
            check_int("teacher_hidden_layer", self.teacher_hidden_layer, minimum=-1, type_error=ValueError)
        if self.objectives[-1].teacher != "fine-tuned":
            raise ValueError("the last stage must read the fine-tuned teacher: the general encoder only initialises "
                             "the student")


def hidden_projection_for(objectives: Sequence[ObjectiveConfig], student_width: int,
                          teacher_width: int) -> Optional[nn.Module]:
    """The module of the hidden loss for a run's objectives (one module, shared by every stage and
    round that has the hidden loss, so that what one stage learns the next starts from):
    crfkit.distill.GeluProjectionLoss(student_width, teacher_width, distance=hidden_distance) for
    hidden_projection="gelu", crfkit.distill.HiddenStateMSE(student_width, teacher_width) (no bias:
    the adaptive-weight paper's formula (18) has none) for "linear". None when no objective has the
    hidden loss. The objectives with it must agree on hidden_projection and hidden_distance."""
    kinds = {(o.hidden_projection, o.hidden_distance) for o in objectives if o.needs_teacher_hidden}
    if not kinds:
        return None
    if len(kinds) > 1:
        raise ValueError(f"the stages with the hidden loss share one projection: they must agree on "
                         f"(hidden_projection, hidden_distance), got {sorted(kinds)}")
    (projection, distance), = kinds
    if projection == "linear":
        return distill.HiddenStateMSE(student_width, teacher_width)
    return distill.GeluProjectionLoss(student_width, teacher_width, distance=distance)


def _seq(*extra: str, drop: tuple[str, ...] = (), weighting: str = "uncertainty") -> ObjectiveConfig:
    losses = tuple(name for name in ("hard", "fuzzy", "kbest_ce") if name not in drop) + extra
    return ObjectiveConfig(losses=losses, weighting=weighting)


# the adaptive-weight paper's two-stage scheme (its Fig. 6): the general encoder's last layer, then formula (15)
_ADAPTIVE_PAPER = (ObjectiveConfig(("hidden",), hidden_projection="linear", teacher="general"),
                   ObjectiveConfig(("hard", "token_em", "hidden"), weighting="adaptive", hidden_projection="linear"))
# the multi-stage paper's Algorithm 1 (D4.2): L_RL, L_LL, L_CE, the word table in each stage's last round
_MULTISTAGE_PAPER = (ObjectiveConfig(("hidden",), hidden_distance="softmax_kl", unfreeze_embeddings=True),
                     ObjectiveConfig(("logit_mse",), unfreeze_embeddings=True),
                     ObjectiveConfig(("hard",), unfreeze_embeddings=True, labelled_only=True))

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
    # the students issue's student: NeuroNER's cased 100-d GloVe beside GloVe 50d (give it
    # --student_hidden 600 --student_char_cnn); "g100" is its baseline on gold labels alone
    "g100": Variant("glove100", da=False),
    "g100_token_pos": Variant("glove100", da=False, objective=ObjectiveConfig(("hard", "token_pos"))),
    "g100_seq": Variant("glove100", da=False, objective=_seq()),
    "g100_exact_kl": Variant("glove100", da=False, objective=ObjectiveConfig(("hard", "exact_kl"))),
    "g100_da": Variant("glove100", da=True),
    "g100_da_token_pos": Variant("glove100", da=True, objective=ObjectiveConfig(("hard", "token_pos"))),
    "g100_da_seq": Variant("glove100", da=True, objective=_seq()),
    "g100_da_exact_kl": Variant("glove100", da=True, objective=ObjectiveConfig(("hard", "exact_kl"))),
    # the same student with the teacher's table beside its GloVe columns (TE beside, not alone)
    "g100te": Variant("glove100_te", da=False),
    "g100te_seq": Variant("glove100_te", da=False, objective=_seq()),
    "g100te_da_seq": Variant("glove100_te", da=True, objective=_seq()),
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
    # the adaptive-weight paper run faithfully (docs/METHODS.md 5.1; needs no --teacher_hidden_layer):
    # stage 1 distils the general encoder (never fine-tuned) alone, L_hidn = MSE(h W_h, H_t) between the
    # BiLSTM's outputs and its last layer (the uniform layer map of a one-layer student); stage 2 the
    # fine-tuned teacher by formula (15), theta_t (L_soft + L_hidn) + (1 - theta_t) L_hard, L_soft the
    # cross entropy to softmax(teacher emissions), theta_t over the stage's steps (b = 0)
    "g100_da_adaptive_paper": Variant("glove100", da=True, stages=_ADAPTIVE_PAPER, teacher_hidden_layer=-1),
    "te_da_adaptive_paper": Variant("teacher", da=True, stages=_ADAPTIVE_PAPER, teacher_hidden_layer=-1),
    # the multi-stage paper's best schedule (D4.2) run faithfully (docs/METHODS.md 5.2): L_RL (the KL
    # between softmaxes of GELU(W h + b) and the teacher's layer --teacher_hidden_layer, 6 or 7 of 12
    # in the paper), then L_LL (logit MSE), then L_CE on the gold sentences alone; in every stage
    # gradual unfreezing whose last round unfreezes the (frozen) word table
    "g100_da_multistage_paper": Variant("glove100", da=True, stages=_MULTISTAGE_PAPER, gradual_unfreezing=True),
    "te_da_multistage_paper": Variant("teacher", da=True, stages=_MULTISTAGE_PAPER, gradual_unfreezing=True),
    # a small transformer student: the pretrained encoder's first 2 layers (of MiniLM's 6)
    "bp2": Variant("pretrained", da=False, transformer_layers=2),
    "bp2_seq": Variant("pretrained", da=False, objective=_seq(), transformer_layers=2),
    "bp2_da_seq": Variant("pretrained", da=True, objective=_seq(), transformer_layers=2),
}


class TaggingObjective(nn.Module):
    """The module transformers' Trainer optimises: the tagger plus the loss weights (and the hidden
    projection), so that one model holds every trainable parameter.

    tagger: a crfkit.taggers tagger (the student, or the model being trained on gold).
    config: ObjectiveConfig. teacher_crf: the teacher's (transitions, start, end), needed by
    token_em / token_pos / exact_kl / logit_mse (TeacherLabelCache.teacher_crf()), or
    per_sentence_teacher_crf=True when each batch brings its sentences' own (a CacheUnion's).
    hidden_projection: a crfkit.distill.GeluProjectionLoss from the tagger's word_features width
    to the teacher's hidden width, needed by the hidden loss; trained with the tagger (pass the
    same module to every stage or round that shares it).
    forward(**batch) takes TaggingCollator's batch and returns {"loss", "loss_<name>" per loss}:
    each term computed by its LOSS_TERMS entry, then combined by the configured weighting.
    progress (step, total_steps) is set by DistillationTrainer for weighting="adaptive".
    """

    def __init__(self, tagger: nn.Module, config: ObjectiveConfig = ObjectiveConfig(),
                 teacher_crf: Optional[tuple[Tensor, Tensor, Tensor]] = None,
                 hidden_projection: Optional[nn.Module] = None, per_sentence_teacher_crf: bool = False):
        super().__init__()
        self.tagger = tagger
        self.objective_config = config
        if config.needs_teacher_crf and teacher_crf is None and not per_sentence_teacher_crf:
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

    @property
    def teacher_crf(self) -> Optional[tuple[Tensor, Tensor, Tensor]]:
        """The teacher's (transitions (T, T), start (T,), end (T,)) in float32, on the module's
        device; None when not given."""
        if not hasattr(self, "teacher_transitions"):
            return None
        return self.teacher_transitions, self.teacher_start, self.teacher_end

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

    def student_outputs(self, batch: Mapping[str, Tensor]) -> StudentOutputs:
        """The tagger's outputs on TaggingCollator's batch (its features; tags and teacher fields
        are not the tagger's)."""
        features = {name: value for name, value in batch.items() if name != "tags" and name not in _TEACHER_FIELDS}
        word_features = self.tagger.word_features(features)
        emissions = self.tagger.emissions_from_features(word_features) if self.objective_config.trains_emissions \
            else None
        transitions, start, end = self.tagger.distribution_parameters()
        return StudentOutputs(word_features, emissions, transitions, start, end, batch["lengths"])

    def forward(self, **batch: Tensor) -> dict[str, Tensor]:
        terms = self.objective_config.terms
        for term in terms:
            for name in term.teacher_fields:
                if batch.get(name) is None:
                    raise ValueError(f"loss {term.name!r} needs {_TEACHER_FIELDS[name]}")
        student = self.student_outputs(batch)
        values = {term.name: term.compute(student, batch, self) for term in terms}
        return {"loss": self.combine(values), **{f"loss_{name}": value.detach() for name, value in values.items()}}

    def combine(self, terms: dict[str, Tensor]) -> Tensor:
        """The configured weighting of the terms {name: scalar}: the term itself when it is
        alone, else uncertainty weighting, the adaptive mix at progress, or their sum."""
        values = list(terms.values())
        if len(values) == 1:
            return values[0]
        if self.weighting is not None:
            return self.weighting(values)
        if self.objective_config.weighting == "adaptive":
            step, total = self.progress
            theta = distill.adaptive_theta(min(step, total), max(total, 1), self.objective_config.adaptive_bias)
            distillation = sum(value for name, value in terms.items() if name != "hard")
            return distill.adaptive_kd_loss(distillation, terms["hard"], None, theta)
        return sum(values)
