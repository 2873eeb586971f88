"""crfkit's distillation tool: a transformer + CRF teacher fine-tuned on your tagging data, its k
best labels cached, and small BiLSTM + CRF students distilled from them, in one command.

    python -m crfkit.distill --train_file train.conll --validation_file dev.conll --test_file test.conll \\
        --output_dir runs/mydata                                 # MiniLM teacher; vanilla and TE+SEQ students
    python -m crfkit.distill runs/mydata/config.json             # the same run from its JSON file
    python -m crfkit.tag --model runs/mydata/students/te_seq-k5-seed0/model < sentences.txt

The arguments (crfkit.tool.arguments; `--help` lists them): the data (CoNLL columns or JSON lines,
the label list and scheme inferred and checked, an optional unlabelled text file for the DA pool),
the teacher (a packaged encoder, any local encoder folder, or a trained crfkit teacher), the
students, the distillation runs (variants of crfkit.training.VARIANTS or an explicit list of
losses), and transformers' training arguments (output_dir is the work folder). With no data
files, the data is CoNLL-2003 English (`python -m crfkit.pipeline` is that configuration, with
its own quick / full defaults). Every stage resumes after a kill; torchrun runs it over several
processes. The stages: crfkit.tool.job.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

__all__ = ["execute", "main", "prepare", "run"]


def prepare(arguments, command=None, workdir_option: str = "--output_dir"):
    """The job of parsed arguments (crfkit.tool.arguments.parse_arguments), checked: an unwritable
    work folder, a bad data file or inconsistent arguments raise ValueError / OSError here, before
    any stage runs."""
    from .._files import ensure_writable_directory
    from .datasets import load_data
    from .job import DistillationJob

    ensure_writable_directory(arguments[4].output_dir, workdir_option)
    return DistillationJob(arguments, load_data(arguments[0]), command=command)


def run(arguments, command=None) -> list[dict]:
    """Run the job of parsed arguments; returns the student runs' records."""
    from ..training import init_distributed

    job = prepare(arguments, command)
    init_distributed()
    return job.run()


def execute(arguments, prog: str = "python -m crfkit.distill", command=None,
            workdir_option: str = "--output_dir") -> int:
    """Check (a usage error, exit status 2, before any stage) and run the job; the exit status."""
    from ..training import init_distributed
    from .arguments import ConfigurationError

    try:
        job = prepare(arguments, command, workdir_option)
    except (ValueError, OSError) as error:
        print(f"{prog}: error: {error.strerror if isinstance(error, OSError) and error.strerror else error}",
              file=sys.stderr)
        return 2
    init_distributed()
    try:
        job.run()
    except ConfigurationError as error:  # found when a stage starts (a failure inside one keeps its traceback)
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    """python -m crfkit.distill / crfkit-distill."""
    from .arguments import parse_arguments

    return execute(parse_arguments(argv))
