"""Tag text with a saved crfkit tagger and print the entities.

    python -m crfkit.tag --model runs/quick/students/te_seq-k5-seed0/model < sentences.txt
    echo "EU rejects German call to boycott British lamb ." | python -m crfkit.tag --model DIR --format conll

Input: one sentence per line, words separated by whitespace (empty lines are skipped); with
--tokenize, plain text instead, split into sentences and words the way CoNLL-2003 is
(crfkit.data.tokenize_text: "didn't" -> "did n't", punctuation apart). Output,
one line per sentence: the entities as "text<TAB>TYPE" pairs separated by " | " (--format
entities, the default), or one "word<TAB>tag" line per word with a blank line between sentences
(--format conll), or one JSON object per sentence (--format json).

--confidence adds each entity's probability (crfkit.entities: the exact probability under the
tagger's CRF, at the temperature saved with the tagger, that its tag sequence holds that entity
with exactly those words and that type): "text<TAB>TYPE<TAB>0.973" pairs (--format entities), a
"probability" field on each entity (--format json), and a third column "word<TAB>tag<TAB>p" (--format
conll) where p is the probability of the entity the word belongs to (the same on each of its
words) and "-" for a word outside every entity. The tags themselves do not change.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from ._validation import cli_int  # noqa: E402

__all__ = ["entities", "main"]


def entities(tokens, tags) -> list[tuple[str, str, int, int]]:
    """(text, type, first word, end word) of each entity in BIO / IOB1 / BIOES tags."""
    found, begin, kind = [], None, None

    def close(end):
        if begin is not None:
            found.append((" ".join(tokens[begin:end]), kind, begin, end))

    for i, tag in enumerate(tags):
        prefix, _, label = tag.partition("-")
        if tag == "O" or not label:
            close(i)
            begin, kind = None, None
        elif prefix in ("B", "S") or begin is None or label != kind:
            close(i)
            begin, kind = i, label
        if prefix in ("E", "S"):
            close(i + 1)
            begin, kind = None, None
    close(len(tags))
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m crfkit.tag", description=__doc__.split("\n\n")[0],
                                     epilog="Input is read as UTF-8 whatever the locale; a byte that is not UTF-8 "
                                     "becomes U+FFFD (the replacement character) instead of stopping the run.")
    parser.add_argument("--model", required=True, help="a folder written by a tagger's save_pretrained")
    parser.add_argument("--format", choices=("entities", "conll", "json"), default="entities")
    parser.add_argument("--tokenize", action="store_true",
                        help="plain text in: split it into sentences and CoNLL-style words first")
    parser.add_argument("--batch-size", type=cli_int(minimum=1), default=32, help="sentences per batch (default 32)")
    parser.add_argument("--confidence", action="store_true",
                        help="print each entity's probability (at the tagger's saved temperature) with it")
    args = parser.parse_args(argv)

    from .taggers import load_tagger

    try:
        tagger = load_tagger(args.model)
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    text = _read_stdin()
    if args.tokenize:
        from .data import tokenize_text

        sentences = [list(words) for words in tokenize_text(text)]
    else:
        sentences = [line.split() for line in text.split("\n") if line.strip()]
    try:
        tagged = tagger.predict(sentences, batch_size=args.batch_size, confidence=args.confidence)
    except ValueError as error:  # e.g. a sentence that the CRF allows no tag sequence for
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    try:
        for tokens, result in zip(sentences, tagged):
            if args.confidence:
                print(_with_confidence(tokens, result, args.format))
            elif args.format == "conll":
                print("\n".join(f"{w}\t{t}" for w, t in zip(tokens, result)) + "\n")
            elif args.format == "json":
                print(json.dumps({"tokens": tokens, "tags": result,
                                  "entities": [{"text": e[0], "type": e[1], "start": e[2], "end": e[3]}
                                               for e in entities(tokens, result)]}, ensure_ascii=False))
            else:
                print(" | ".join(f"{text}\t{kind}" for text, kind, _, _ in entities(tokens, result)))
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped early (`| head -n 1`): stop quietly, as command-line tools do, with the
        # shell's status for a SIGPIPE; stdout goes to /dev/null so that Python's own flush at exit
        # does not raise again (the recipe of Python's signal module documentation).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13
    return 0


def _with_confidence(tokens, result: dict, output_format: str) -> str:
    """One sentence's output with --confidence: result is tagger.predict(..., confidence=True)'s dict."""
    tags, found = result["tags"], result["entities"]
    if output_format == "json":
        return json.dumps({"tokens": tokens, "tags": tags, "entities": found}, ensure_ascii=False)
    if output_format == "conll":
        shown = ["-"] * len(tokens)
        for entity in found:
            for i in range(entity["start"], entity["end"]):
                shown[i] = f"{entity['probability']:.3f}"
        return "\n".join(f"{w}\t{t}\t{p}" for w, t, p in zip(tokens, tags, shown)) + "\n"
    return " | ".join(f"{e['text']}\t{e['type']}\t{e['probability']:.3f}" for e in found)


def _read_stdin() -> str:
    """All of stdin as text: its bytes decoded as UTF-8 with replacement, so neither the locale
    (C, C.UTF-8: surrogate escapes; en_US.UTF-8: strict) nor one bad byte decides the outcome."""
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # a text stream without bytes underneath (io.StringIO in tests, IDEs)
        return sys.stdin.read()
    return stream.read().decode("utf-8", errors="replace")


if __name__ == "__main__":
    sys.exit(main())
