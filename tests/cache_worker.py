"""A deterministic toy teacher and corpus for tests/test_distill_cache.py, and a command line that
labels the toy corpus with crfkit.distill.cache.label_corpus: run directly (the kill test), or
under torchrun (the two-rank test), which label_corpus detects from RANK / WORLD_SIZE.

    python tests/cache_worker.py DIR --num-sentences 60 --k 5 --shard-size 8 [--sleep 0.05]
    python -m torch.distributed.run --nproc_per_node=2 --standalone tests/cache_worker.py DIR ...
"""
import argparse
import os
import sys
import time
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from crfkit.distill.cache import TeacherOutput, label_corpus  # noqa: E402

FORBID = "<forbid>"  # a token whose every tag is forbidden: the sentence has no allowed sequence
TEACHER_INFO = {"model": "toy-teacher", "version": 1}


def toy_corpus(num_sentences, max_len=12, seed=0):
    """num_sentences token lists with lengths in [0, max_len]; sentence 0 is empty, 1 has one token,
    2 has two, 3 contains FORBID."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (num_sentences,), generator=g).tolist()
    words = torch.randint(0, 40, (sum(lengths),), generator=g).tolist()
    corpus, at = [], 0
    for n in lengths:
        corpus.append([f"w{w}" for w in words[at:at + n]])
        at += n
    for i, n in zip(range(3), (0, 1, 2)):
        if i < num_sentences:
            corpus[i] = [f"w{j}" for j in range(n)]
    if num_sentences > 3:
        corpus[3] = ["w1", FORBID, "w2"]
    return corpus


class ToyTeacher:
    """Hashed tokens -> seeded embeddings -> a linear map to emissions (B, L, T); fixed transitions
    with -inf constraints (tag T-1 never follows tag 0, tag 0 never repeats) and start[T-1] = -inf."""

    def __init__(self, num_tags=4, dim=8, vocab=101, seed=0, sleep=0.0):
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.sleep, self.calls = vocab, sleep, 0
        self.table = torch.randn(vocab, dim, generator=g)
        self.projection = torch.randn(dim, num_tags, generator=g)
        self.transitions = torch.randn(num_tags, num_tags, generator=g)
        self.start = torch.randn(num_tags, generator=g)
        self.end = torch.randn(num_tags, generator=g)
        if num_tags > 1:
            self.transitions[0, num_tags - 1] = float("-inf")
            self.transitions[0, 0] = float("-inf")
            self.start[num_tags - 1] = float("-inf")

    def token_id(self, token):
        return zlib.crc32(token.encode()) % self.vocab

    def __call__(self, batch):
        self.calls += 1
        if self.sleep:
            time.sleep(self.sleep)
        B, L = len(batch), max((len(s) for s in batch), default=0)
        ids = torch.zeros(B, L, dtype=torch.long)
        forbid = torch.zeros(B, L, dtype=torch.bool)
        for b, sentence in enumerate(batch):
            for i, token in enumerate(sentence):
                ids[b, i] = self.token_id(token)
                forbid[b, i] = token == FORBID
        emissions = self.table[ids] @ self.projection
        emissions[forbid] = float("-inf")
        lengths = torch.tensor([len(s) for s in batch], dtype=torch.long)
        return TeacherOutput(emissions, self.transitions, lengths, self.start, self.end)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--num-sentences", type=int, default=60)
    parser.add_argument("--max-len", type=int, default=12)
    parser.add_argument("--num-tags", type=int, default=4)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=5)
    parser.add_argument("--shard-size", type=int, default=8)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per teacher call")
    parser.add_argument("--marginals", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    corpus = toy_corpus(args.num_sentences, args.max_len)
    teacher = ToyTeacher(args.num_tags, sleep=args.sleep)
    cache = label_corpus(teacher, corpus, args.directory, args.k, batch_size=args.batch_size,
                         shard_size=args.shard_size, teacher_info=TEACHER_INFO, with_marginals=args.marginals,
                         marginals_dtype=torch.float32, progress=False)
    print(f"rank {os.environ.get('RANK', '0')}: {len(cache)} sentences, {teacher.calls} teacher calls", flush=True)


if __name__ == "__main__":
    main()
