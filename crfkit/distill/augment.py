"""Transfer-set augmentation for tagging (Tang et al. 2019, "Distilling Task-Specific Knowledge from BERT into
Simple Neural Networks"; docs/METHODS.md).

    from crfkit.data import load_conll2003
    from crfkit.distill.augment import augment_sentences
    train = load_conll2003("train")
    synthetic = augment_sentences(train, n_iter=20, seed=0)     # list[AugmentedSentence]
    synthetic[0].tokens, synthetic[0].pos, synthetic[0].source_index

For every source sentence, n_iter times: each word draws X ~ Uniform[0, 1); X < p_mask replaces it
by the mask token, p_mask <= X < p_mask + p_pos replaces it by another word of the same POS tag
(the two are mutually exclusive, as in the paper, so p_pos is an absolute rate, not a rate among
the unmasked words); then, with probability p_ng, only a random n-gram of the result is kept
(n uniform in 1..max_ngram). Duplicates are dropped.

The output carries words and POS tags only, never labels: an augmented sentence must be labelled
by the teacher (a masked or replaced word can change the entity, and an n-gram cuts entities),
so copying the source's tags would teach the student wrong labels.

Choices where the paper is silent (each can be changed by an argument where it matters):
- Replacement word: drawn from P(w | POS) = count(w, POS) / count(POS), counted over the
  (word, POS) pairs of the corpus, with the current word excluded (the paper replaces "a word with
  another of the same POS tag"), so a POS tag seen with one word type only is never replaced.
  Words are compared as written (CoNLL is cased).
- A masked word keeps its POS tag in the returned pos (its slot keeps its syntactic role).
- n-gram length: n drawn from 1..max_ngram, then capped at the sentence length (so for a sentence
  of at most n words, that step keeps the whole sentence); the start is uniform over the valid
  starts.
- Duplicates: a sample identical to its source sentence, or to an earlier sample, is dropped;
  ``deduplicate="corpus"`` (default) compares across the whole corpus (also against every source
  sentence), since identical inputs would get identical teacher labels and only reweight the
  transfer set; ``"sentence"`` compares only within the samples of one source sentence (the
  paper's wording).
- Randomness: sentence i uses its own random.Random seeded from (seed, i), so its samples do not
  depend on the other sentences (a corpus can be split across processes and give the same
  samples); the result is the same on every platform and Python hash seed.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple, Optional

from .._validation import check_choice, check_int, check_number

__all__ = [
    "AugmentedSentence",
    "PosUnigrams",
    "augment_sentence",
    "augment_sentences",
    "perturb_words",
    "sample_ngram",
    "sentence_rng",
]


def _tokens_and_pos(sentence, where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens, pos) of a crfkit.data.Sentence (or anything with .tokens and .pos) or of a
    (tokens, pos) pair."""
    if hasattr(sentence, "tokens") and hasattr(sentence, "pos"):
        tokens, pos = sentence.tokens, sentence.pos
    elif isinstance(sentence, Sequence) and len(sentence) == 2:
        tokens, pos = sentence
    else:
        raise TypeError(f"{where}: expected a Sentence (with .tokens and .pos) or a (tokens, pos) pair, "
                        f"got {type(sentence).__name__}")
    if pos is None:
        raise ValueError(f"{where}: the sentence has no POS tags (pos is None); augmentation needs them")
    tokens, pos = tuple(tokens), tuple(pos)
    if len(tokens) != len(pos):
        raise ValueError(f"{where}: {len(tokens)} tokens but {len(pos)} POS tags")
    return tokens, pos


class PosUnigrams:
    """Word counts per POS tag, and sampling from P(word | POS) with one word excluded.

    counts: {pos: {word: count}} with positive integer counts. Words keep the order given
    (first appearance, with from_sentences), so sampling is deterministic for a given rng.
    """

    def __init__(self, counts: Mapping[str, Mapping[str, int]]) -> None:
        self._words: dict[str, tuple[str, ...]] = {}
        self._cumulative: dict[str, list[int]] = {}  # cumulative counts, for bisection
        self._position: dict[str, dict[str, int]] = {}
        for pos, word_counts in counts.items():
            words, cumulative, total = [], [], 0
            for word, count in word_counts.items():
                check_int(f"counts[{pos!r}][{word!r}]", count, minimum=1, type_error=ValueError)
                total += count
                words.append(word)
                cumulative.append(total)
            if words:
                self._words[pos] = tuple(words)
                self._cumulative[pos] = cumulative
                self._position[pos] = {word: index for index, word in enumerate(words)}

    @classmethod
    def from_sentences(cls, sentences: Iterable) -> "PosUnigrams":
        """Count (word, POS) pairs over crfkit.data.Sentence objects (or (tokens, pos) pairs)."""
        counts: dict[str, dict[str, int]] = {}
        for number, sentence in enumerate(sentences):
            tokens, pos = _tokens_and_pos(sentence, f"sentences[{number}]")
            for word, tag in zip(tokens, pos):
                per_tag = counts.setdefault(tag, {})
                per_tag[word] = per_tag.get(word, 0) + 1
        return cls(counts)

    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(self._words)

    def words(self, pos: str) -> tuple[str, ...]:
        """The words seen with tag ``pos`` (empty if none)."""
        return self._words.get(pos, ())

    def count(self, word: str, pos: str) -> int:
        index = self._position.get(pos, {}).get(word)
        if index is None:
            return 0
        cumulative = self._cumulative[pos]
        return cumulative[index] - (cumulative[index - 1] if index else 0)

    def total(self, pos: str) -> int:
        cumulative = self._cumulative.get(pos)
        return cumulative[-1] if cumulative else 0

    def probability(self, word: str, pos: str) -> float:
        """P(word | pos) under the counts (0 for an unseen pair)."""
        total = self.total(pos)
        return self.count(word, pos) / total if total else 0.0

    def sample(self, pos: str, rng: random.Random, exclude: Optional[str] = None) -> Optional[str]:
        """A word drawn from P(w | pos), renormalised without ``exclude``; None when no other word
        has that tag."""
        cumulative = self._cumulative.get(pos)
        if cumulative is None:
            return None
        excluded = self.count(exclude, pos) if exclude is not None else 0
        remaining = cumulative[-1] - excluded
        if remaining <= 0:
            return None
        # Exact sampling without the excluded word in one draw: pick a point in the total mass
        # minus the excluded word's, then step over the excluded word's interval.
        point = rng.randrange(remaining)
        if excluded:
            index = self._position[pos][exclude]
            excluded_start = cumulative[index] - excluded
            if point >= excluded_start:
                point += excluded
        return self._words[pos][bisect.bisect_right(cumulative, point)]

    def __repr__(self) -> str:
        return f"PosUnigrams(tags={len(self._words)}, pairs={sum(len(w) for w in self._words.values())})"


def _check_probability(name: str, value: float) -> None:
    check_number(name, value, minimum=0, maximum=1, type_error=ValueError)


def perturb_words(
    tokens: Sequence[str],
    pos: Sequence[str],
    unigrams: PosUnigrams,
    rng: random.Random,
    *,
    p_mask: float = 0.1,
    p_pos: float = 0.1,
    mask_token: str = "[MASK]",
) -> tuple[str, ...]:
    """One pass of masking and POS-guided replacement over a sentence: (n,) words -> (n,) words.

    Each word draws X ~ Uniform[0, 1): X < p_mask -> mask_token; p_mask <= X < p_mask + p_pos ->
    another word of the same POS tag (unchanged when there is none); otherwise unchanged.
    """
    _check_probability("p_mask", p_mask)
    _check_probability("p_pos", p_pos)
    if p_mask + p_pos > 1.0 + 1e-12:
        raise ValueError(f"p_mask + p_pos must be at most 1, got {p_mask} + {p_pos}")
    if len(tokens) != len(pos):
        raise ValueError(f"tokens and pos differ in length: {len(tokens)} vs {len(pos)}")
    perturbed = list(tokens)
    replace_below = p_mask + p_pos
    for position, draw in enumerate(rng.random() for _ in tokens):
        if draw < p_mask:
            perturbed[position] = mask_token
        elif draw < replace_below:
            replacement = unigrams.sample(pos[position], rng, exclude=tokens[position])
            if replacement is not None:
                perturbed[position] = replacement
    return tuple(perturbed)


def sample_ngram(length: int, rng: random.Random, max_ngram: int = 5) -> tuple[int, int]:
    """(start, stop) of a random n-gram of a sentence of ``length`` words: n uniform in
    1..max_ngram, capped at length; start uniform in 0..length-n."""
    n = min(rng.randint(1, max_ngram), length)
    start = rng.randint(0, length - n)
    return start, start + n


def augment_sentence(
    tokens: Sequence[str],
    pos: Sequence[str],
    unigrams: PosUnigrams,
    rng: random.Random,
    *,
    n_iter: int = 20,
    p_mask: float = 0.1,
    p_pos: float = 0.1,
    p_ng: float = 0.25,
    max_ngram: int = 5,
    mask_token: str = "[MASK]",
) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """Up to n_iter distinct synthetic (tokens, pos) versions of one sentence, none equal to it,
    in the order drawn."""
    _check_arguments(n_iter, p_mask, p_pos, p_ng, max_ngram, mask_token)
    tokens, pos = tuple(tokens), tuple(pos)
    if len(tokens) != len(pos):
        raise ValueError(f"tokens and pos differ in length: {len(tokens)} vs {len(pos)}")
    if not tokens:
        return []
    seen = {tokens}
    samples = []
    for _ in range(n_iter):
        words = perturb_words(tokens, pos, unigrams, rng, p_mask=p_mask, p_pos=p_pos, mask_token=mask_token)
        tags = pos
        if rng.random() < p_ng:
            start, stop = sample_ngram(len(words), rng, max_ngram)
            words, tags = words[start:stop], tags[start:stop]
        if words not in seen:
            seen.add(words)
            samples.append((words, tags))
    return samples


class AugmentedSentence(NamedTuple):
    """A synthetic, unlabelled sentence: tokens (n,), pos (n,), and the index of its source
    sentence in the input (for bookkeeping only; its labels must come from the teacher)."""

    tokens: tuple[str, ...]
    pos: tuple[str, ...]
    source_index: int


def augment_sentences(
    sentences: Iterable,
    unigrams: Optional[PosUnigrams] = None,
    *,
    n_iter: int = 20,
    p_mask: float = 0.1,
    p_pos: float = 0.1,
    p_ng: float = 0.25,
    max_ngram: int = 5,
    mask_token: str = "[MASK]",
    seed: int = 0,
    deduplicate: str = "corpus",
) -> list[AugmentedSentence]:
    """Tang et al.'s augmentation over a corpus.

    sentences: crfkit.data.Sentence objects (or (tokens, pos) pairs) with POS tags; their labels,
        if any, are ignored.
    unigrams: the per-POS word counts to draw replacements from; default counted over
        ``sentences`` themselves.
    n_iter: samples drawn per sentence (the paper uses 10-20); fewer come back after duplicates
        are dropped.
    deduplicate: "corpus" drops a sample equal to any source sentence or any earlier sample;
        "sentence" only to its own source sentence or that sentence's earlier samples.
    seed: non-negative int; sentence i draws from sentence_rng(seed, i).

    Returns the samples in source order: list[AugmentedSentence(tokens, pos, source_index)].
    """
    _check_arguments(n_iter, p_mask, p_pos, p_ng, max_ngram, mask_token)
    sentences = list(sentences)  # read twice below (counts, then samples): a generator would run dry
    check_choice("deduplicate", deduplicate, ("corpus", "sentence"))
    check_int("seed", seed, minimum=0, type_error=ValueError)
    if unigrams is None:
        unigrams = PosUnigrams.from_sentences(sentences)
    elif not isinstance(unigrams, PosUnigrams):
        raise TypeError(f"unigrams must be a PosUnigrams or None, got {type(unigrams).__name__}")
    sources = [_tokens_and_pos(sentence, f"sentences[{index}]") for index, sentence in enumerate(sentences)]
    seen = {tokens for tokens, _ in sources}
    result = []
    for index, (tokens, pos) in enumerate(sources):
        rng = sentence_rng(seed, index)
        samples = augment_sentence(tokens, pos, unigrams, rng, n_iter=n_iter, p_mask=p_mask, p_pos=p_pos,
                                   p_ng=p_ng, max_ngram=max_ngram, mask_token=mask_token)
        for words, tags in samples:
            if deduplicate == "corpus":
                if words in seen:
                    continue
                seen.add(words)
            result.append(AugmentedSentence(words, tags, index))
    return result


def sentence_rng(seed: int, index: int) -> random.Random:
    """The generator augment_sentences uses for sentence ``index`` under ``seed``."""
    # A string seed goes through SHA-512 in random.seed: neighbouring (seed, index) pairs give
    # unrelated streams, the same on every platform and Python hash seed.
    return random.Random(f"crfkit.distill.augment:{seed}:{index}")


def _check_arguments(n_iter, p_mask, p_pos, p_ng, max_ngram, mask_token) -> None:
    check_int("n_iter", n_iter, minimum=0, type_error=ValueError)
    _check_probability("p_mask", p_mask)
    _check_probability("p_pos", p_pos)
    _check_probability("p_ng", p_ng)
    if p_mask + p_pos > 1.0 + 1e-12:
        raise ValueError(f"p_mask + p_pos must be at most 1, got {p_mask} + {p_pos}")
    check_int("max_ngram", max_ngram, minimum=1, type_error=ValueError)
    if not isinstance(mask_token, str) or not mask_token:
        raise TypeError(f"mask_token must be a non-empty str, got {mask_token!r}")
