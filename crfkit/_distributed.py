"""Which process of a torchrun job writes shared files and prints: one answer for the pipeline,
the trainer's callbacks and fit_tagger."""
import os


def is_main_process() -> bool:
    """True on rank 0 of the default process group when one is initialised; before that (a
    torchrun process starts without a group), whether torchrun's RANK is 0 or unset."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0") or 0) == 0
