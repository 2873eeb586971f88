"""Transition constraints for tagging schemes.

A linear-chain CRF over ``T`` labels scores a tag sequence with
``start[t]`` (first tag), ``transitions[from, to]`` (every pair of
neighbouring tags) and ``end[t]`` (last tag).  A tagging scheme makes some of
these impossible; :func:`allowed_transitions` works out which, and the CRF
gives the forbidden ones a score of ``-inf`` so that they can never be
predicted.

Labels
------
A label is either ``"O"`` (outside any chunk) or ``PREFIX-TYPE``, split on the
*first* ``"-"``: ``"B-PER"`` has prefix ``B`` and type ``PER``; ``"B-PER-X"``
has prefix ``B`` and type ``PER-X``.  Prefixes are case-sensitive upper-case
letters and the type must not be empty.  Under ``BMES`` the bare labels
``"B"``, ``"M"``, ``"E"`` and ``"S"`` are also accepted (e.g. Chinese word
segmentation); they all share the empty type ``""``.  Only the labels that are
present are used: a scheme does not require every prefix of every type, nor
``"O"``.

Schemes
-------
Scheme names are case-insensitive; ``IOB2`` is an alias of ``BIO`` and
``IOBES`` of ``BIOES``.  ``BILOU`` is not supported.  Below, ``X`` and ``Y``
are entity types, ``*`` is any type, and "first"/"last" are the tags that may
begin / end a sentence.

``BIO`` (IOB2) -- every chunk starts with ``B``::

    first: O, B-*                  last: any tag
    O   -> O, B-*
    B-X -> O, B-*, I-X
    I-X -> O, B-*, I-X

    so I-X only ever follows B-X or I-X of the same type.

``IOB1`` -- chunks start with ``I``; ``B-X`` only starts a chunk that directly
follows another chunk of the same type X::

    first: O, I-*                  last: any tag
    O   -> O, I-*
    I-X -> O, I-*, B-X
    B-X -> O, I-*, B-X

    I-X -> I-Y (Y != X) is allowed: it starts a new chunk of type Y.

``BIOES`` (IOBES) -- Begin, Inside, End of a multi-tag chunk; Single-tag
chunk::

    first: O, B-*, S-*             last: O, E-*, S-*
    O   -> O, B-*, S-*
    B-X -> I-X, E-X
    I-X -> I-X, E-X
    E-X -> O, B-*, S-*
    S-X -> O, B-*, S-*

``BMES`` -- the same as ``BIOES`` with ``M`` (middle) in place of ``I``;
``O`` may be used if it is among the labels.  For the untyped labels
``B``/``M``/``E``/``S`` the "same type" rule compares the empty type, so
``B -> M``, ``B -> E``, ``M -> E`` are allowed but ``B -> M-NR`` is not.

Example
-------
>>> c = allowed_transitions(["O", "B-PER", "I-PER"], scheme="BIO")
>>> bool(c.transitions[0, 2]), bool(c.transitions[1, 2])   # O->I-PER, B-PER->I-PER
(False, True)
>>> c.is_allowed([1, 2, 0])
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
import operator
from typing import Optional

import torch

__all__ = ["SCHEMES", "Constraints", "allowed_transitions"]

SCHEMES = ("BIO", "IOB1", "BIOES", "BMES")

_ALIASES = {"IOB2": "BIO", "IOBES": "BIOES"}

# Chunk prefixes valid in each scheme ("O" is valid in every scheme).
_PREFIXES = {
    "BIO": ("B", "I"),
    "IOB1": ("I", "B"),
    "BIOES": ("B", "I", "E", "S"),
    "BMES": ("B", "M", "E", "S"),
}


def _canonical_scheme(scheme: str) -> str:
    if not isinstance(scheme, str):
        raise TypeError(f"scheme must be a str, got {type(scheme).__name__}")
    name = scheme.upper()
    name = _ALIASES.get(name, name)
    if name not in SCHEMES:
        raise ValueError(
            f"scheme: unknown tagging scheme {scheme!r}; expected one of "
            f"{', '.join(SCHEMES)} (case-insensitive; aliases: "
            f"{', '.join(f'{a} = {c}' for a, c in _ALIASES.items())})"
        )
    return name


def _parse(label: str, scheme: str) -> tuple[str, str]:
    """Split ``label`` into ``(prefix, type)``; ``("O", "")`` for outside."""
    if label == "O":
        return "O", ""
    prefixes = _PREFIXES[scheme]
    if scheme == "BMES" and label in prefixes:
        return label, ""
    prefix, sep, typ = label.partition("-")
    if sep and typ and prefix in prefixes:
        return prefix, typ
    untyped = " or bare B, M, E, S" if scheme == "BMES" else ""
    raise ValueError(
        f"labels: invalid label {label!r} for scheme {scheme}; expected 'O' or "
        f"PREFIX-TYPE with PREFIX one of {', '.join(prefixes)}{untyped}"
    )


def _rules(scheme: str):
    """Return ``(start, end, step)`` predicates over parsed ``(prefix, type)`` tags."""
    if scheme == "BIO":

        def start(p, t):
            return p in ("O", "B")

        def end(p, t):
            return True

        def step(fp, ft, tp, tt):
            # Only I-X is restricted: it continues a chunk of type X.
            if tp == "I":
                return fp in ("B", "I") and ft == tt
            return True

    elif scheme == "IOB1":

        def start(p, t):
            return p in ("O", "I")

        def end(p, t):
            return True

        def step(fp, ft, tp, tt):
            # Only B-X is restricted: it splits two adjacent chunks of type X.
            if tp == "B":
                return fp in ("B", "I") and ft == tt
            return True

    else:  # BIOES / BMES
        inside = "I" if scheme == "BIOES" else "M"

        def start(p, t):
            return p in ("O", "B", "S")

        def end(p, t):
            return p in ("O", "E", "S")

        def step(fp, ft, tp, tt):
            open_chunk = fp in ("B", inside)
            continues = tp in (inside, "E")
            if open_chunk or continues:
                return open_chunk and continues and ft == tt
            return True

    return start, end, step


@dataclass(frozen=True, eq=False)
class Constraints:
    """Which tags may start / follow / end a sentence under a tagging scheme.

    Attributes:
        labels: the ``T`` label strings, in model order.
        scheme: canonical scheme name, one of :data:`SCHEMES`.
        transitions: ``(T, T)`` bool tensor indexed ``[from, to]``;
            True where tag ``to`` may directly follow tag ``from``.
        start: ``(T,)`` bool tensor; True where the tag may begin a sentence.
        end: ``(T,)`` bool tensor; True where the tag may end a sentence.

    The tensors live on the CPU and should be treated as read-only.  Two
    instances compare equal when all five fields are equal.
    """

    labels: tuple[str, ...]
    scheme: str
    transitions: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor

    def __post_init__(self) -> None:
        n = len(self.labels)
        for name, shape in (("transitions", (n, n)), ("start", (n,)), ("end", (n,))):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.dtype != torch.bool:
                raise TypeError(f"{name} must be a bool tensor")
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"{name} must have shape {shape} for {n} labels, "
                    f"got {tuple(value.shape)}"
                )

    @property
    def num_tags(self) -> int:
        """``T``, the number of labels."""
        return len(self.labels)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Constraints):
            return NotImplemented
        return (
            self.labels == other.labels
            and self.scheme == other.scheme
            and torch.equal(self.transitions.cpu(), other.transitions.cpu())
            and torch.equal(self.start.cpu(), other.start.cpu())
            and torch.equal(self.end.cpu(), other.end.cpu())
        )

    def __hash__(self) -> int:
        return hash((self.labels, self.scheme))

    def as_scores(
        self,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Additive score masks: ``0.0`` where allowed, ``-inf`` where forbidden.

        Args:
            dtype: a floating-point dtype (``-inf`` must be representable).
            device: where to put the result (default: CPU).

        Returns:
            ``(transitions, start, end)`` of shapes ``(T, T)`` (``[from, to]``),
            ``(T,)`` and ``(T,)``; fresh tensors, safe to modify.
        """
        if not dtype.is_floating_point:
            raise ValueError(
                f"dtype must be a floating-point dtype to hold -inf, got {dtype}"
            )

        def convert(mask: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(mask.shape, dtype=dtype, device=device)
            return out.masked_fill_(~mask.to(out.device), float("-inf"))

        return convert(self.transitions), convert(self.start), convert(self.end)

    def is_allowed(self, tags: Sequence[int]) -> bool:
        """Whether a whole tag sequence is allowed.

        Args:
            tags: ``(L,)`` indices into :attr:`labels` (a sequence of ints or a
                1-D integer tensor).

        Returns:
            True iff the first tag may start a sentence, every neighbouring
            pair is an allowed transition and the last tag may end a sentence.
            The empty sequence is allowed.

        Raises:
            ValueError: a tag index is outside ``[0, T)``.
        """
        return self.violation(tags) is None

    def violation(self, tags: Sequence[int]) -> Optional[str]:
        """Why a tag sequence is not allowed, or None when it is.

        Args:
            tags: ``(L,)`` indices into :attr:`labels` (a sequence of ints or a
                1-D integer tensor).

        Returns:
            The first rule the sequence breaks, in words and 0-based word
            positions, e.g. ``"tag 'I-ORG' of word 1 may not follow 'O'"`` or
            ``"its first tag 'I-ORG' may not start a sentence"``; None for an
            allowed sequence (the empty one included).

        Raises:
            ValueError: a tag index is outside ``[0, T)``.
        """
        if isinstance(tags, torch.Tensor):
            tags = tags.reshape(-1).tolist()
        idx = [operator.index(t) for t in tags]
        n = self.num_tags
        for t in idx:
            if not 0 <= t < n:
                raise ValueError(f"tags: index {t} out of range for {n} labels")
        if not idx:
            return None
        names = self.labels
        if not bool(self.start[idx[0]]):
            return f"its first tag {names[idx[0]]!r} may not start a sentence"
        allowed = self.transitions.tolist()
        for i in range(1, len(idx)):
            if not allowed[idx[i - 1]][idx[i]]:
                return f"tag {names[idx[i]]!r} of word {i} may not follow {names[idx[i - 1]]!r}"
        if not bool(self.end[idx[-1]]):
            return f"its last tag {names[idx[-1]]!r} may not end a sentence"
        return None


def allowed_transitions(labels: Sequence[str], scheme: str = "BIO") -> Constraints:
    """Compute the constraints of ``scheme`` over ``labels``.

    Args:
        labels: the ``T`` label strings of the model, in index order
            (``"O"`` or ``PREFIX-TYPE``; see the module docstring).
        scheme: one of :data:`SCHEMES` or an alias (``IOB2``, ``IOBES``),
            case-insensitive.

    Returns:
        A :class:`Constraints` with ``transitions`` ``(T, T)`` (``[from, to]``),
        ``start`` ``(T,)`` and ``end`` ``(T,)`` bool tensors on the CPU.

    Raises:
        TypeError: ``labels`` is not a sequence of str (a bare str is rejected).
        ValueError: unknown scheme, empty or duplicate labels, or a label
            whose prefix is not valid for the scheme.
    """
    name = _canonical_scheme(scheme)
    if isinstance(labels, (str, bytes)) or not isinstance(labels, Sequence):
        raise TypeError(
            f"labels must be a sequence of str, got {type(labels).__name__}"
        )
    labels = tuple(labels)
    for label in labels:
        if not isinstance(label, str):
            raise TypeError(
                f"labels must be a sequence of str, found {label!r} "
                f"of type {type(label).__name__}"
            )
    if not labels:
        raise ValueError("labels must be non-empty")
    seen: set[str] = set()
    for label in labels:
        if label in seen:
            raise ValueError(f"labels must be unique; duplicate label {label!r}")
        seen.add(label)

    parsed = [_parse(label, name) for label in labels]
    start_ok, end_ok, step_ok = _rules(name)
    transitions = torch.tensor(
        [[step_ok(fp, ft, tp, tt) for tp, tt in parsed] for fp, ft in parsed],
        dtype=torch.bool,
    ).reshape(len(labels), len(labels))
    start = torch.tensor([start_ok(p, t) for p, t in parsed], dtype=torch.bool)
    end = torch.tensor([end_ok(p, t) for p, t in parsed], dtype=torch.bool)
    return Constraints(labels, name, transitions, start, end)
