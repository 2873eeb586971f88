"""Datasets and the collator that feeds a tagger (and, when distilling, the teacher's labels).

    items = tagging_items(train_sentences)                   # gold sentences, ids 0 .. n-1
    items += tagging_items(unlabelled_token_lists, first_id=len(items))   # no gold (DA)
    collate = TaggingCollator(student, cache=TeacherLabelCache(dir), k=5)
    batch = collate(items[:32])

An item is a dict {"tokens": tuple of words, "tags": tuple of tag names or None, "id": int or
None}; "id" indexes the teacher-label cache (the corpus the teacher labelled), so a training set
and its cache must list the same sentences in the same order.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from .._validation import check_int

__all__ = ["TaggingCollator", "check_gold_tags", "tagging_items"]

IGNORE_INDEX = -100  # padding of tags and of decoded paths, as transformers pads predictions


def tagging_items(sentences: Iterable, first_id: Optional[int] = 0, with_tags: bool = True) -> list[dict[str, Any]]:
    """crfkit.data.Sentence objects (or plain word lists) -> items. first_id: the cache id of the
    first sentence (None: no cache ids). with_tags=False drops gold tags (unlabelled text)."""
    items = []
    for i, sentence in enumerate(sentences):
        tokens = tuple(getattr(sentence, "tokens", sentence))
        tags = getattr(sentence, "tags", None) if with_tags else None
        items.append({"tokens": tokens, "tags": None if tags is None else tuple(tags),
                      "id": None if first_id is None else first_id + i})
    return items


def check_gold_tags(items: Sequence[dict[str, Any]], tagger, name: str = "items") -> None:
    """Check that every item with gold tags has one per word, each a label of tagger, in a
    sequence its scheme allows (crfkit.constraints: first tag, transitions, last tag). A
    forbidden sequence would train with a loss of +inf (no gradient, and the Trainer's logs skip
    it), so it is a ValueError naming the item (name[i]), its first words and the offending tags.
    Items without gold tags (None) are skipped."""
    from ..constraints import allowed_transitions
    from ..taggers.base import sentence_preview

    index = {label: i for i, label in enumerate(tagger.labels)}
    scheme = getattr(tagger, "scheme", None)
    rules = allowed_transitions(tagger.labels, scheme) if scheme is not None else None
    for position, item in enumerate(items):
        tags, tokens = item["tags"], item["tokens"]
        if tags is None:
            continue
        if len(tags) != len(tokens):
            problem = f"{len(tokens)} words but {len(tags)} tags"
        else:
            unknown = [tag for tag in tags if tag not in index]
            problem = f"tag {unknown[0]!r} is not one of the tagger's labels {tagger.labels}" if unknown else None
            if problem is None and rules is not None:
                problem = rules.violation([index[tag] for tag in tags])
                if problem is not None:
                    problem += (f" under the tagger's {scheme} scheme; if the data is IOB1 (an entity may start "
                                "with I-), convert it with crfkit.data.iob1_to_bio, or build the tagger with the "
                                "data's scheme")
        if problem is not None:
            raise ValueError(f"{name}[{position}] ({sentence_preview(list(tokens))}): {problem}")


class TaggingCollator:
    """items -> one batch dict of tensors for a tagger (B sentences, L = the longest):

    the tagger's featurize() tensors (lengths (B,) among them), tags (B, L) int64 (-100 past each
    length), has_gold (B,) bool. With a teacher-label cache, also teacher_paths (B, K, L) and
    teacher_log_probs (B, K) (the first k of the cache's K best, -1 / -inf for missing rows), and
    teacher_emissions (B, L, T) when asked for (a cache that stores emissions; with a cache whose
    sentences come from teachers with different CRFs, a CacheUnion, also each sentence's
    teacher_transitions (B, T, T), teacher_start and teacher_end (B, T)), and teacher_hidden
    (B, L, H) float32 likewise (a cache labelled with_hidden). A sentence without gold tags is
    given the teacher's best path as its tags (the hard loss on unlabelled text).
    """

    def __init__(self, tagger, cache=None, k: Optional[int] = None, teacher_emissions: bool = False,
                 teacher_hidden: bool = False):
        self.tagger = tagger
        self.cache = cache
        self.label_index = {label: i for i, label in enumerate(tagger.labels)}
        if cache is not None:
            k = cache.k if k is None else k
            check_int("k", k, minimum=1, maximum=cache.k, type_error=ValueError)  # at most the cache's K
            if cache.label_names is not None and list(cache.label_names) != list(tagger.labels):
                raise ValueError(f"the cache's labels {cache.label_names} differ from the tagger's {tagger.labels}")
            if teacher_emissions and not cache.manifest.get("with_emissions"):
                raise ValueError("teacher_emissions=True needs a cache labelled with with_emissions=True")
            if teacher_hidden and not cache.manifest.get("with_hidden"):
                raise ValueError("teacher_hidden=True needs a cache labelled with with_hidden=True")
        elif teacher_emissions or teacher_hidden:
            raise ValueError("teacher_emissions / teacher_hidden need a teacher-label cache (cache=...)")
        self.k = k
        self.teacher_emissions = teacher_emissions
        self.teacher_hidden = teacher_hidden

    def _tag_indices(self, tags: Sequence[str], position: int) -> list[int]:
        try:
            return [self.label_index[t] for t in tags]
        except KeyError as error:
            raise ValueError(f"item {position} has tag {error.args[0]!r}, not one of the tagger's labels "
                             f"{self.tagger.labels}") from None

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, Tensor]:
        batch = self.tagger.featurize([item["tokens"] for item in items])
        lengths = batch["lengths"]
        B, L = len(items), int(lengths.max()) if len(items) else 0
        tags = torch.full((B, L), IGNORE_INDEX, dtype=torch.long)
        has_gold = torch.zeros(B, dtype=torch.bool)
        for b, item in enumerate(items):
            if item["tags"] is not None:
                if len(item["tags"]) != len(item["tokens"]):
                    raise ValueError(f"item {b} has {len(item['tokens'])} tokens but {len(item['tags'])} tags")
                tags[b, :len(item["tags"])] = torch.tensor(self._tag_indices(item["tags"], b), dtype=torch.long)
                has_gold[b] = True
        if self.cache is not None and all(item["id"] is not None for item in items):
            cached = self.cache.batch([item["id"] for item in items], pad_to=L)
            if not torch.equal(cached.lengths, lengths):
                raise ValueError("the teacher-label cache's sentence lengths differ from the batch's: the items' "
                                 "ids do not index the corpus the cache was labelled on")
            batch["teacher_paths"] = cached.kbest.paths[:, :self.k]
            batch["teacher_log_probs"] = cached.kbest.log_probs[:, :self.k]
            if self.teacher_emissions:
                batch["teacher_emissions"] = cached.emissions
                if getattr(self.cache, "per_sentence_crf", False):   # a CacheUnion of cross-fitted teachers
                    crfs = self.cache.teacher_crfs(cached.ids)
                    batch["teacher_transitions"], batch["teacher_start"], batch["teacher_end"] = crfs
            if self.teacher_hidden:
                batch["teacher_hidden"] = cached.hidden.float()
            best = cached.kbest.paths[:, 0]
            tags = torch.where(has_gold[:, None], tags, torch.where(best >= 0, best, IGNORE_INDEX))
        elif not bool(has_gold.all()):
            raise ValueError("items without gold tags need a teacher-label cache (and cache ids)")
        batch["tags"] = tags
        batch["has_gold"] = has_gold
        return batch
