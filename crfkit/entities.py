"""Exact entity probabilities of a linear-chain CRF, and minimum-Bayes-risk entity decoding.

    types = entity_types(labels)                            # ["PER", "ORG", ...]
    found = entity_marginals(emissions, transitions, labels, lengths=lengths, start=start, end=end)
    found.spans          # (N, 4) int64 rows (sentence, first word, end word (exclusive), type index)
    found.probabilities  # (N,)  P(the decoded tags contain exactly that entity)
    best = mbr_decode(emissions, transitions, labels, lengths=lengths, start=start, end=end)
    best.paths, best.spans, best.probabilities

Shapes and conventions are crfkit.functional's: emissions (B, L, T), transitions (T, T) [from, to]
or per example ((B, T, T), (B, 1, T, T), or per position (B, L, T, T)), start / end (T,) or (B, T),
lengths (B,); labels are the T tag names. Type indices index entity_types(labels):
the entity types in the order in which they first appear in labels ("B-PER", "I-PER", "B-LOC" gives
["PER", "LOC"]).

How tags are read as entities (one reading, for every scheme, well-formed or not)
-------------------------------------------------------------------------------
Tags are read left to right, the way conlleval, seqeval's default (lenient) mode and
crfkit.tag.entities read them:

- O closes the open entity, if any;
- B-X and S-X always start a new entity of type X;
- I-X, M-X and E-X continue the open entity when it has type X and was opened or continued by a
  B-, I- or M- tag (the previous tag is B-X, I-X or M-X); otherwise they start a new entity of
  type X (so an I-X after O, after I-Y, or at the start of the sentence starts an entity);
- E-X and S-X close their entity after themselves.

For well-formed sequences of each scheme this is the scheme's own reading (BIO: B-X I-X* not
followed by I-X; IOB1: I-X where the previous tag is not B-X / I-X, or B-X, then I-X*; BIOES /
BMES: B-X (I|M)-X* E-X, or S-X). It also gives an entity to every ill-formed sequence: in BIO
"O I-X I-X" holds the entity I-X I-X, in BIOES "B-X O" holds B-X and "O E-X" holds E-X. The CRF is
NOT assumed to forbid such sequences: the probabilities below are exact for any scores, under
this reading; with the scheme's constraints (crfkit.constraints) ill-formed sequences have
probability 0 and any reading gives the same numbers (e.g. seqeval's strict mode, which the
training metrics use). The scheme only decides which labels are valid and how mbr_decode writes
its paths. (Bare BMES labels "B", "M", "E", "S" have the type "", which crfkit.tag.entities, reading
only PREFIX-TYPE labels, ignores.)

The algorithm
-------------
An entity [s, e) of type X is an event on the tags y_{s-1} .. y_e only: y_s starts an entity of
type X given y_{s-1} (a condition on the pair), each of y_{s+1} .. y_{e-1} continues the open
entity given its predecessor (a pair condition), and y_e does not continue it (a pair condition;
nothing when e is the sentence's length n). So with alpha and beta from ONE forward-backward
(crfkit.reference.forward_log_scores / backward_log_scores),

    P([s, e), X) = sum over y_{s-1} .. y_e satisfying the conditions of
                   alpha[s-1, y_{s-1}] * prod_{j=s}^{e} exp(trans[y_{j-1}, y_j] + em[j, y_j]) * beta[e, y_e] / Z

which is a product of (T, T) matrices over the window, masked by the pair conditions, in log
space (a -inf score anywhere is a forbidden tag, transition, first or last tag, as in every crfkit
op). The first and last factors (alpha into y_s, y_e into beta) are tables of one (B, L, T) pass
each, shared by all spans; inside the entity only the tags of its type X can occur, so each of
the e - s - 1 middle steps is an (M, M) product with M the number of tags of type X (2 for BIO):
O((e - s) * M^2) per span, O(T^2) per position once. The steps are vectorised over spans; the
only Python loop runs over the offset inside the window. The spans that share a first word and
type share their prefix of that product, so mbr_decode gets every candidate span of a sentence of
n words in O(n * max_span_length * M^2) after the forward-backward.

entity_marginals is differentiable in emissions, transitions, start and end (autograd through the
reference forward-backward and the window products); mbr_decode is not (a decoder: it runs
without gradient).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ._arguments import prepare, prepare_lengths
from ._validation import check_int, check_number
from .constraints import allowed_transitions
from .functional import viterbi
from .reference import backward_log_scores, forward_log_scores, safe_logsumexp

__all__ = ["EntityMarginals", "MBRDecode", "entity_marginals", "entity_spans", "entity_types", "mbr_decode"]

NEG_INF = float("-inf")
_STARTING = ("B", "S")   # prefixes that always start an entity
_CLOSING = ("E", "S")    # prefixes that close their entity after themselves


class EntityMarginals(NamedTuple):
    """spans (N, 4) int64 rows (sentence, first word, end word exclusive, type index into
    entity_types(labels)); probabilities (N,) in the emissions' compute dtype."""

    spans: Tensor
    probabilities: Tensor


class MBRDecode(NamedTuple):
    """paths (B, L) int64 tag indices written in the scheme (-1 at padding); spans (N, 4) the
    chosen entities as in EntityMarginals, sorted by sentence and first word; probabilities (N,)
    their probabilities."""

    paths: Tensor
    spans: Tensor
    probabilities: Tensor


@dataclass(frozen=True)
class _Reading:
    """The reading of one label set: tag -> (prefix, type index), and the pair tables."""

    labels: tuple[str, ...]
    scheme: str
    types: tuple[str, ...]
    prefixes: tuple[str, ...]
    type_of: tuple[int, ...]          # (T,) type index, -1 for O
    continues: tuple[tuple[bool, ...], ...]  # [u][t]: t continues the entity u opened / continued

    def tensors(self, device):
        """(type_of (T,) int64, continues (T, T) bool, starts (T, T) bool, first (T,) bool)."""
        type_of = torch.tensor(self.type_of, dtype=torch.long, device=device)
        continues = torch.tensor(self.continues, dtype=torch.bool, device=device).reshape(len(self.labels),
                                                                                          len(self.labels))
        entity = type_of >= 0
        return type_of, continues, entity.unsqueeze(0) & ~continues, entity

    def index(self, prefix: str, kind: int) -> int:
        """The tag index of prefix-type, or -1 when the labels lack it."""
        for t, (p, k) in enumerate(zip(self.prefixes, self.type_of)):
            if p == prefix and k == kind:
                return t
        return -1

    def label_name(self, prefix: str, kind: int) -> str:
        name = self.types[kind]
        return f"{prefix}-{name}" if name else prefix


def _split(label: str, scheme: str) -> tuple[str, str]:
    """(prefix, type) of a label that allowed_transitions has accepted for scheme."""
    if label == "O":
        return "O", ""
    if scheme == "BMES" and label in ("B", "M", "E", "S"):
        return label, ""
    prefix, _, kind = label.partition("-")
    return prefix, kind


def _reading(labels, scheme: str, num_tags: Optional[int] = None) -> _Reading:
    """Check labels and scheme (ValueError / TypeError naming them) and build their reading."""
    if scheme is None:
        raise TypeError("scheme must be a tagging scheme name ('BIO', 'IOB1', 'BIOES' or 'BMES'), got None")
    constraints = allowed_transitions(labels, scheme)  # checks the scheme, the labels and their prefixes
    labels, scheme = constraints.labels, constraints.scheme
    if num_tags is not None and len(labels) != num_tags:
        raise ValueError(f"labels has {len(labels)} tag names but emissions has num_tags = {num_tags} "
                         "(emissions.shape[2]); give one name per tag, in index order")
    parsed = [_split(label, scheme) for label in labels]
    types: list[str] = []
    for prefix, kind in parsed:
        if prefix != "O" and kind not in types:
            types.append(kind)
    type_of = tuple(-1 if prefix == "O" else types.index(kind) for prefix, kind in parsed)
    opens = [k >= 0 and p not in _CLOSING for (p, _), k in zip(parsed, type_of)]
    continues = tuple(tuple(opens[u] and type_of[u] == type_of[t] and parsed[t][0] not in _STARTING
                            for t in range(len(labels))) for u in range(len(labels)))
    return _Reading(labels, scheme, tuple(types), tuple(p for p, _ in parsed), type_of, continues)


def entity_types(labels: Sequence[str], scheme: str = "BIO") -> list[str]:
    """The entity types of labels, in order of first appearance: the meaning of the type index
    in entity_marginals' and mbr_decode's spans. ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"] ->
    ["PER", "LOC"]. Raises like crfkit.constraints.allowed_transitions on bad labels or scheme."""
    return list(_reading(labels, scheme).types)


def _path_spans(paths: Tensor, lengths: Tensor, reading: _Reading) -> Tensor:
    """The entities of tag paths (B, L) (-1 or anything past each length, -1 rows for sentences
    without a path): (N, 4) int64 rows sorted by sentence and first word. Vectorised."""
    B, L = paths.shape
    device = paths.device
    if B == 0 or L == 0:
        return torch.zeros(0, 4, dtype=torch.long, device=device)
    type_of, continues, _, _ = reading.tensors(device)
    positions = torch.arange(L, device=device)
    valid = (positions < lengths.unsqueeze(1)) & (paths >= 0)
    safe = paths.clamp(min=0)
    cont = torch.zeros_like(valid)
    cont[:, 1:] = valid[:, 1:] & valid[:, :-1] & continues[safe[:, :-1], safe[:, 1:]]
    starts = valid & (type_of[safe] >= 0) & ~cont
    # The entity starting at i ends at the first position j > i whose tag does not continue it
    # (padding and invalid positions never continue): a reverse running minimum of those j.
    boundary = torch.where(~cont, positions, L).flip(1).cummin(1).values.flip(1)
    next_boundary = torch.cat([boundary[:, 1:], torch.full((B, 1), L, dtype=torch.long, device=device)], 1)
    sentence, first = starts.nonzero(as_tuple=True)
    return torch.stack([sentence, first, next_boundary[sentence, first], type_of[safe[sentence, first]]], 1)


def entity_spans(paths: Tensor, labels: Sequence[str], lengths: Optional[Tensor] = None, *,
                 scheme: str = "BIO") -> Tensor:
    """The entities of tag sequences, read as the module docstring says: paths (B, L) integer tag
    indices (-1 at padding, as crfkit.viterbi gives; a row of -1 has no entity) -> (N, 4) int64 rows
    (sentence, first word, end word exclusive, type index into entity_types(labels)), sorted by
    sentence and first word. lengths (B,) defaults to all L."""
    if not isinstance(paths, Tensor) or paths.dim() != 2:
        raise TypeError(f"paths must be a (batch, seq_len) integer tensor, got "
                        f"{tuple(paths.shape) if isinstance(paths, Tensor) else type(paths).__name__}")
    if paths.dtype == torch.bool or paths.is_floating_point() or paths.is_complex():
        raise TypeError(f"paths must be an integer tensor, got {paths.dtype}")
    reading = _reading(labels, scheme)
    B, L = paths.shape
    if lengths is None:
        lengths = torch.full((B,), L, dtype=torch.long, device=paths.device)
    else:
        lengths = prepare_lengths(lengths, B, L, paths.device)
    T = len(reading.labels)
    real = paths[torch.arange(L, device=paths.device) < lengths.unsqueeze(1)]
    if real.numel() and (int(real.max()) >= T or int(real.min()) < -1):
        raise ValueError(f"paths within the lengths must lie in [0, {T}) (or be -1), got values in "
                         f"[{int(real.min())}, {int(real.max())}]")
    return _path_spans(paths.long(), lengths, reading)


class _Scores(NamedTuple):
    """One forward-backward and the per-position tables every window product reads."""

    emissions: Tensor   # (B, L, T), zero at padding
    lengths: Tensor     # (B,)
    opening: Tensor     # (B, L, T): log-mass of the prefixes up to y_s = t where t starts an entity
    closing: Tensor     # (B, L + 1, T): [b, p, u] log-mass of the suffixes from p given y_{p-1} = u,
    #                     with y_p not continuing u's entity (end[u] at p = n)
    log_z: Tensor       # (B,)
    type_tags: Tensor   # (K, M) the tag indices of each type (M: the most tags of one type), padded with 0
    type_pad: Tensor    # (K, M) additive: 0 for the tags of type k, -inf for the padding
    within: Tensor      # (B', L', T, T): the transition scores into positions 1 .. L-1 where the second tag
    #                     continues the first's entity, -inf elsewhere; B' = 1 / L' = 1 when shared
    blocks: Optional[Tensor]  # (K, M, M) within's blocks between the tags of each type, when within is shared


def _scores(emissions, transitions, lengths, start, end, reading: _Reading) -> _Scores:
    B, L, T = emissions.shape
    dtype, device = emissions.dtype, emissions.device
    valid = torch.arange(L, device=device) < lengths.unsqueeze(1)
    emissions = emissions.masked_fill(~valid.unsqueeze(-1), 0)
    alpha = forward_log_scores(emissions, transitions, lengths, start)
    beta = backward_log_scores(emissions, transitions, lengths, end)
    type_of, continues, starts, first = reading.tensors(device)

    def additive(mask):
        return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, NEG_INF)

    K = len(reading.types)
    members = [[t for t, k in enumerate(reading.type_of) if k == kind] for kind in range(K)]
    M = max((len(m) for m in members), default=1)
    type_tags = torch.tensor([m + [0] * (M - len(m)) for m in members], dtype=torch.long,
                             device=device).reshape(K, M)
    type_pad = additive(torch.tensor([[i < len(m) for i in range(M)] for m in members], dtype=torch.bool,
                                     device=device).reshape(K, M))
    # The transition scores into positions 1 .. L-1, broadcastable to (B, L-1, T, T): shared (T, T), or
    # per example (B, Lt, T, T) as crfkit._arguments.prepare gives them (Lt = 1, or L: [:, 0] unread).
    if transitions.dim() == 2:
        into = transitions
    else:
        into = transitions if transitions.shape[1] == 1 else transitions[:, 1:]
    within = into + additive(continues)
    within = within.reshape(1, 1, T, T) if within.dim() == 2 else within
    blocks = None
    if within.shape[0] == 1 and within.shape[1] == 1:
        blocks = within[0, 0][type_tags.unsqueeze(2), type_tags.unsqueeze(1)] + type_pad.unsqueeze(2) + \
            type_pad.unsqueeze(1)  # (K, M, M)
    opening = emissions.new_full((B, L, T), NEG_INF)
    if L > 0:
        opening[:, 0] = start + additive(first)
        if L > 1:
            opening[:, 1:] = safe_logsumexp(alpha[:, :-1].unsqueeze(3) + (into + additive(starts)), dim=2)
        opening = opening + emissions
    # closing[b, p, u] for 1 <= p < n: logsumexp_w trans[u, w] + em[p, w] + beta[p, w] over the w
    # that do not continue u; p = n: end[u]; elsewhere -inf (no span ends there).
    closing = emissions.new_full((B, L + 1, T), NEG_INF)
    if L > 1:
        ahead = (emissions[:, 1:] + beta[:, 1:]).unsqueeze(2)  # (B, L-1, 1, to)
        closing[:, 1:L] = safe_logsumexp(ahead + (into + additive(~continues)), dim=3)
    at_end = torch.arange(L + 1, device=device) == lengths.unsqueeze(1)  # (B, L + 1)
    closing = torch.where(at_end.unsqueeze(2), end.unsqueeze(-2).expand(B, L + 1, T), closing)
    last = (lengths - 1).clamp(min=0)
    if L > 0:
        final = alpha[torch.arange(B, device=device), last] + end
        log_z = torch.where(lengths > 0, safe_logsumexp(final, dim=1), torch.zeros_like(final[:, 0]))
    else:
        log_z = emissions.new_zeros(B)
    return _Scores(emissions, lengths, opening, closing, log_z, type_tags, type_pad, within, blocks)


def _window_log_probs(scores: _Scores, sentence: Tensor, first: Tensor, kind: Tensor, width: int) -> Tensor:
    """(N, width): [i, d] = log P(an entity of type kind[i] spans exactly words first[i] ..
    first[i] + d of sentence[i]), -inf where that passes the sentence's end. One step of the
    window product per offset d, vectorised over the N rows."""
    N = sentence.shape[0]
    L = scores.emissions.shape[1]
    n = scores.lengths[sentence]
    # The open entity's mass as a function of its last tag, over the M tags of its type: (N, M).
    tags = scores.type_tags[kind]
    v = scores.opening[sentence, first].gather(1, tags) + scores.type_pad[kind]
    shared = scores.blocks is not None
    if shared:
        blocks = scores.blocks[kind]  # (N, M, M)
    else:
        rows = torch.arange(N, device=sentence.device).view(N, 1, 1)
        pad = scores.type_pad[kind]
        pad = pad.unsqueeze(2) + pad.unsqueeze(1)
        batch = sentence if scores.within.shape[0] > 1 else torch.zeros_like(sentence)
    out = []
    for d in range(width):
        position = first + d  # the entity's last word
        closing = scores.closing[sentence, (position + 1).clamp(max=L)].gather(1, tags)
        mass = safe_logsumexp(v + closing, dim=1)
        out.append(torch.where(position < n, mass, torch.full_like(mass, NEG_INF)))
        if d + 1 < width:
            if not shared:  # the transitions into position + 1 of each row's sentence, between its type's tags
                at = position.clamp(max=scores.within.shape[1] - 1) if scores.within.shape[1] > 1 else 0 * position
                full = scores.within[batch, at]  # (N, T, T)
                blocks = full[rows, tags.unsqueeze(2), tags.unsqueeze(1)] + pad
            step = safe_logsumexp(v.unsqueeze(2) + blocks, dim=1)
            v = step + scores.emissions[sentence, (position + 1).clamp(max=L - 1)].gather(1, tags)
    if not out:
        return scores.emissions.new_zeros(N, 0)
    log_z = scores.log_z[sentence].unsqueeze(1)
    mass = torch.stack(out, 1)
    # A sentence with log Z = -inf (every sequence forbidden) has no entity: probability 0.
    return torch.where(torch.isfinite(log_z), mass - log_z.clamp(min=torch.finfo(mass.dtype).min), NEG_INF)


def _check_spans(spans, lengths: Tensor, num_types: int) -> Tensor:
    if not isinstance(spans, Tensor):
        raise TypeError(f"spans must be a torch.Tensor (N, 4) of int64 rows (sentence, first, end, type), "
                        f"got {type(spans).__name__}")
    if spans.dtype == torch.bool or spans.is_floating_point() or spans.is_complex():
        raise TypeError(f"spans must be an integer tensor (N, 4), got {spans.dtype}")
    if spans.dim() != 2 or spans.shape[1] != 4:
        raise ValueError(f"spans must have shape (N, 4): rows (sentence, first, end, type), got {tuple(spans.shape)}")
    if spans.device != lengths.device:
        raise ValueError(f"spans is on {spans.device} but emissions is on {lengths.device}; put them on one device")
    spans = spans.long()
    if spans.shape[0] == 0:
        return spans
    B = lengths.shape[0]
    sentence, first, stop, kind = spans.unbind(1)
    bad = (sentence < 0) | (sentence >= B)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise ValueError(f"spans[{row}]: sentence {int(sentence[row])} is not in [0, batch = {B})")
    bad = (first < 0) | (stop <= first) | (stop > lengths[sentence])
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise ValueError(f"spans[{row}] = {spans[row].tolist()}: need 0 <= first < end <= lengths[sentence] = "
                         f"{int(lengths[sentence[row]])}")
    bad = (kind < 0) | (kind >= num_types)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise ValueError(f"spans[{row}]: type index {int(kind[row])} is not in [0, {num_types}) "
                         "(the types of entity_types(labels))")
    return spans


def entity_marginals(emissions: Tensor, transitions: Tensor, labels: Sequence[str], spans: Optional[Tensor] = None,
                     lengths: Optional[Tensor] = None, start: Optional[Tensor] = None, end: Optional[Tensor] = None,
                     *, scheme: str = "BIO") -> EntityMarginals:
    """The exact probability of each entity: P(the CRF's tag sequence, read as the module docstring
    says, holds an entity of that type with exactly those boundaries).

    emissions, transitions, lengths, start, end: as in crfkit.functional (any scores; -inf forbids).
    labels: the T tag names, in index order; scheme: "BIO" (IOB2), "IOB1", "BIOES" (IOBES) or "BMES".
    spans: (N, 4) integer rows (sentence, first word, end word exclusive, type index into
    entity_types(labels)); None: the entities of the Viterbi paths (crfkit.viterbi), sorted by
    sentence and first word (none for a sentence whose every sequence is forbidden).

    Returns EntityMarginals(spans (N, 4) int64, probabilities (N,) in the compute dtype): the spans
    given (or found) and their probabilities. One forward-backward, then a window product per span
    (module docstring). Differentiable in the scores.
    """
    emissions, transitions, lengths, start, end = prepare(emissions, transitions, lengths, start, end)
    B, L, T = emissions.shape
    reading = _reading(labels, scheme, T)
    if spans is None:
        with torch.no_grad():
            paths = viterbi(emissions, transitions, lengths, start, end).paths
        spans = _path_spans(paths, lengths, reading)
    else:
        spans = _check_spans(spans, lengths, len(reading.types))
    if spans.shape[0] == 0:
        return EntityMarginals(spans, emissions.new_zeros(0))
    scores = _scores(emissions, transitions, lengths, start, end, reading)
    sentence, first, stop, kind = spans.unbind(1)
    width = stop - first
    log_probs = _window_log_probs(scores, sentence, first, kind, int(width.max()))
    log_probs = log_probs.gather(1, (width - 1).unsqueeze(1)).squeeze(1)
    return EntityMarginals(spans, log_probs.exp().clamp(max=1))


def _span_table(scores: _Scores, num_types: int, width: int) -> Tensor:
    """(B, L, width, K) probabilities: [b, s, d, k] of the entity [s, s + d + 1) of type k (0 past
    the sentence's end), from one window product per (sentence, first word, type)."""
    B, L = scores.emissions.shape[:2]
    device = scores.emissions.device
    sentence, first = (torch.arange(L, device=device) < scores.lengths.unsqueeze(1)).nonzero(as_tuple=True)
    table = scores.emissions.new_zeros(B, L, width, num_types)
    if sentence.numel() == 0 or width == 0:
        return table
    rows = sentence.numel()
    kind = torch.arange(num_types, device=device).repeat(rows)
    sentence, first = sentence.repeat_interleave(num_types), first.repeat_interleave(num_types)
    probabilities = _window_log_probs(scores, sentence, first, kind, width).exp().clamp(max=1)  # (rows * K, width)
    table[sentence, first, :, kind] = probabilities
    return table


def _write_paths(spans: Tensor, B: int, L: int, lengths: Tensor, reading: _Reading) -> Tensor:
    """Tag paths (B, L) that hold exactly the given non-overlapping entities, O elsewhere."""
    device = spans.device
    outside = reading.labels.index("O")
    paths = torch.full((B, L), -1, dtype=torch.long, device=device)
    paths[torch.arange(L, device=device) < lengths.unsqueeze(1)] = outside
    if spans.shape[0] == 0:
        return paths
    # role: 0 the only word, 1 the first of several, 2 a middle word, 3 the last of several;
    # IOB1 writes an entity that directly follows one of its type with B- first (roles 4, 5).
    prefixes = {"BIO": ("B", "B", "I", "I", "B", "B"), "IOB1": ("I", "I", "I", "I", "B", "B"),
                "BIOES": ("S", "B", "I", "E", "S", "B"), "BMES": ("S", "B", "M", "E", "S", "B")}[reading.scheme]
    K = len(reading.types)
    table = torch.tensor([[reading.index(p, k) for p in prefixes] for k in range(K)], dtype=torch.long,
                         device=device)
    sentence, first, stop, kind = spans.unbind(1)
    width = stop - first
    follows_same = torch.zeros_like(first, dtype=torch.bool)
    if reading.scheme == "IOB1" and spans.shape[0] > 1:
        follows_same[1:] = (sentence[1:] == sentence[:-1]) & (first[1:] == stop[:-1]) & (kind[1:] == kind[:-1])
    row = torch.arange(spans.shape[0], device=device).repeat_interleave(width)
    offset = torch.arange(row.shape[0], device=device) - (width.cumsum(0) - width)[row]
    last = offset == width[row] - 1
    role = torch.where(offset == 0, torch.where(last, 0, 1), torch.where(last, 3, 2))
    role = torch.where((offset == 0) & follows_same[row], role + 4, role)
    tags = table[kind[row], role]
    missing = (tags < 0).nonzero()
    if missing.numel():
        i = int(missing[0])
        r, k = int(role[i]), int(kind[row[i]])
        what = {0: "a one-word", 1: "a multi-word", 2: "a multi-word", 3: "a multi-word", 4: "a one-word",
                5: "a multi-word"}[r]
        raise ValueError(f"mbr_decode: labels lack {reading.label_name(prefixes[r], k)!r}, which {reading.scheme} "
                         f"needs to write {what} {reading.types[k] or 'untyped'} entity")
    paths[sentence[row], first[row] + offset] = tags
    return paths


@torch.no_grad()
def mbr_decode(emissions: Tensor, transitions: Tensor, labels: Sequence[str], lengths: Optional[Tensor] = None,
               start: Optional[Tensor] = None, end: Optional[Tensor] = None, *, scheme: str = "BIO",
               threshold: float = 0.5, max_span_length: Optional[int] = None) -> MBRDecode:
    """Minimum-Bayes-risk entity decoding: per sentence, the set of non-overlapping entities that
    maximises the sum over its entities of (P(entity) - threshold).

    Every candidate span (any first word, up to max_span_length words, default the sentence's
    length; every type) gets its exact probability (entity_marginals' window product, shared by the
    spans of one first word), then a weighted-interval dynamic programme over the end words picks
    the set. threshold 0 maximises the expected number of correct entities (an entity is correct
    when the CRF's sequence holds it); threshold 0.5 maximises expected correct minus expected
    wrong ones. Two overlapping entities exclude each other (a tag sequence holds non-overlapping
    entities), so their probabilities add up to at most 1: with threshold >= 0.5 the entities with
    P > threshold never overlap and the decoding is simply those. Only entities with
    P > threshold are chosen (one at exactly the threshold adds nothing and is left out).

    Returns MBRDecode(paths (B, L) int64, spans (N, 4), probabilities (N,)): the paths write the
    chosen entities in the scheme (BIO: B-X I-X..., IOB1: I-X I-X... and B-X first where an entity
    directly follows one of its type, BIOES: S-X, or B-X I-X... E-X; BMES with M-X) and O elsewhere,
    -1 at padding; they need not score well under the CRF (or be allowed by it). Raises ValueError
    when labels lack O or a tag the chosen entities need. Not differentiable.
    """
    emissions, transitions, lengths, start, end = prepare(emissions, transitions, lengths, start, end)
    B, L, T = emissions.shape
    reading = _reading(labels, scheme, T)
    threshold = check_number("threshold", threshold, minimum=0, maximum=1)
    check_int("max_span_length", max_span_length, minimum=1, optional=True)
    if "O" not in reading.labels:
        raise ValueError(f"mbr_decode: labels must hold 'O' to write the words outside entities, got "
                         f"{list(reading.labels)}")
    K = len(reading.types)
    width = min(L, max_span_length) if max_span_length is not None else L
    device = emissions.device
    if K == 0 or width == 0 or B == 0:
        spans = torch.zeros(0, 4, dtype=torch.long, device=device)
        return MBRDecode(_write_paths(spans, B, L, lengths, reading), spans, emissions.new_zeros(0))
    scores = _scores(emissions, transitions, lengths, start, end, reading)
    table = _span_table(scores, K, width)  # (B, L, width, K)
    gain = table - threshold
    gain = torch.where(gain > 0, gain, NEG_INF)
    # best[b, j]: the best total over entities within words 0 .. j-1; choice[b, j]: d * K + k of the
    # entity [j - d - 1, j) of type k that ends the best set there, -1 when word j-1 is outside.
    best = emissions.new_zeros(B, L + 1)
    choice = torch.full((B, L + 1), -1, dtype=torch.long, device=device)
    for j in range(1, L + 1):
        m = min(j, width)
        first = torch.arange(j - 1, j - 1 - m, -1, device=device)  # d = 0 .. m-1
        candidates = best[:, first].unsqueeze(2) + gain[:, first, torch.arange(m, device=device)]  # (B, m, K)
        value, code = candidates.reshape(B, m * K).max(1)
        take = value > best[:, j - 1]
        best[:, j] = torch.where(take, value, best[:, j - 1])
        choice[:, j] = torch.where(take, code, -1)
    # Back from each sentence's end.
    at = lengths.clone()
    batch = torch.arange(B, device=device)
    found = []
    for _ in range(L):
        active = at > 0
        if not bool(active.any()):
            break
        code = choice[batch, at]
        take = active & (code >= 0)
        d, k = code // K, code % K
        if bool(take.any()):
            found.append(torch.stack([batch, at - d - 1, at, k], 1)[take])
        at = torch.where(take, at - d - 1, torch.where(active, at - 1, at))
    spans = torch.cat(found) if found else torch.zeros(0, 4, dtype=torch.long, device=device)
    if spans.shape[0]:
        spans = spans[torch.argsort(spans[:, 0] * (L + 1) + spans[:, 1])]
    probabilities = table[spans[:, 0], spans[:, 1], spans[:, 2] - spans[:, 1] - 1, spans[:, 3]]
    return MBRDecode(_write_paths(spans, B, L, lengths, reading), spans, probabilities)
