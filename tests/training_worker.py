"""A small real training run for the resume and torchrun tests (run as a script).

    python tests/training_worker.py OUTPUT_DIR [--variant te_seq] [--steps 24] [--sleep 0.0]

A BiLSTM+CRF student on the first 96 CoNLL-2003 train sentences, distilled from a teacher-label
cache that a tiny 1-layer MiniLM teacher (untrained head) writes into OUTPUT_DIR/labels, with
checkpoints every 4 steps, and its RunClock. --sleep slows each step so a test can kill the run
mid-way.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402

from crfkit import data, distill  # noqa: E402
from crfkit.taggers import BiLSTMCRFTagger, TransformerCRFTagger  # noqa: E402
from crfkit.training import (VARIANTS, RunClock, TaggerTrainingArguments, fit_tagger, init_distributed,  # noqa: E402
                             tagging_items)


class _Slow(transformers.TrainerCallback):
    def __init__(self, seconds):
        self.seconds = seconds

    def on_step_end(self, *args, **kwargs):
        time.sleep(self.seconds)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--variant", default="te_seq")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_distributed()
    labels = list(data.CONLL2003_TAGS)
    train = data.load_conll2003("train", max_sentences=96)
    dev = data.load_conll2003("valid", max_sentences=32)

    transformers.set_seed(0)
    teacher = TransformerCRFTagger(labels, num_layers=1).eval()

    variant = VARIANTS[args.variant]
    cache = distill.label_corpus(teacher.teacher_output, [s.tokens for s in train],
                                 os.path.join(args.output_dir, "labels"), k=5, with_emissions=True, label_names=labels,
                                 progress=False)
    transformers.set_seed(0)
    student = BiLSTMCRFTagger(labels, BiLSTMCRFTagger.build_vocabulary(train), embedding_dim=32, hidden_size=32)
    items = tagging_items(train)
    if variant.da:
        items = items[:48] + tagging_items(train[48:], first_id=48, with_tags=False)
    training = TaggerTrainingArguments(
        os.path.join(args.output_dir, "run"), max_steps=args.steps, per_device_train_batch_size=8,
        learning_rate=1e-2, eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=4,
        save_total_limit=2, logging_steps=4, report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
        patience=100)
    clock = RunClock(training.output_dir)
    fit_tagger(student, items, tagging_items(dev), training, objective=variant.objective, cache=cache,
               callbacks=[clock] + ([_Slow(args.sleep)] if args.sleep else []))
    clock.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
