"""The records of finished runs: each run's result.json (written atomically) and the work folder's
results.jsonl (one line per finished run), plus what a record says of its code and machine.

A kill between writing a run's result.json and appending its line to results.jsonl would lose
that line for good (the run is skipped from then on): finished_record() puts it back.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from typing import Optional

import torch

from .._distributed import is_main_process
from .._files import atomic_write

__all__ = ["RESULT", "RESULTS", "append_to_results", "command_line", "file_sha256", "finished_record",
           "git_commit", "log", "machine_description", "read_results", "relative_command", "write_result"]

RESULT = "result.json"      # in a run's folder: its record, written (atomically) when it finishes
RESULTS = "results.jsonl"   # in the work folder: every finished run's record, one per line


def log(message: str, prefix: str = "crfkit.distill") -> None:
    """A timestamped progress line, from the main process only."""
    import datetime

    if is_main_process():
        print(f"[{prefix} {datetime.datetime.now():%H:%M:%S}] {message}", flush=True)


@functools.lru_cache(maxsize=None)
def git_commit() -> Optional[str]:
    """The checkout's commit (+dirty) when first asked: the tool asks at start, so a record names
    the code its process ran, not a commit made while it trained."""
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def command_line(module: str, workdir: Optional[str] = None) -> str:
    """This process's command, as `python -m module ARGS` (the interpreter by its name only). With
    workdir, the command as run from inside the work folder: every argument that names an existing
    file or folder, or is an absolute path, is written relative to it (the work folder itself is
    "."), so a record carries no path of the machine it ran on (see relative_command)."""
    command = [os.path.basename(sys.executable), "-m", module, *sys.argv[1:]]
    return relative_command(command, workdir) if workdir is not None else shlex.join(command)


def relative_command(command, workdir: str, base: Optional[str] = None) -> str:
    """command (a list of arguments, or a shell string) with its paths relative to workdir: an
    absolute argument, or one naming a file or folder that exists relative to base (default: the
    current folder), becomes os.path.relpath(its absolute form, workdir)."""
    arguments = shlex.split(command) if isinstance(command, str) else list(command)
    base = os.getcwd() if base is None else base
    target = os.path.abspath(os.path.join(base, workdir))
    out = arguments[:3]
    for argument in arguments[3:]:
        path = argument if os.path.isabs(argument) else os.path.join(base, argument)
        if os.path.isabs(argument) or (not argument.startswith("-") and os.path.exists(path)):
            argument = os.path.relpath(os.path.abspath(path), target)
        out.append(argument)
    return shlex.join(out)


def write_result(workdir: str, out: str, record: dict) -> None:
    """Mark the run in folder out finished: its result.json, whole or not at all, then its line in
    workdir/results.jsonl."""
    atomic_write(os.path.join(out, RESULT), (json.dumps(record, indent=2) + "\n").encode("utf-8"))
    append_to_results(workdir, record)


def finished_record(workdir: str, out: str) -> Optional[dict]:
    """The record of a finished run in folder out (its result.json), or None when it has not
    finished. Makes sure the record is in results.jsonl too. A result.json that is not JSON (an
    older crfkit wrote it in place and was killed) is treated as absent: the run resumes from its
    last checkpoint and is scored again."""
    path = os.path.join(out, RESULT)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError):
        record = None
    if not isinstance(record, dict):
        log(f"warning: {path} is damaged (not a JSON record); scoring the run again")
        if is_main_process():
            os.unlink(path)
        return None
    if is_main_process():
        append_to_results(workdir, record)
    return record


def append_to_results(workdir: str, record: dict) -> None:
    """Append record to workdir/results.jsonl unless it is there already. A line cut short by a
    kill during an earlier append is left as it is (readers skip it); the record goes on a line
    of its own after it."""
    path = os.path.join(workdir, RESULTS)
    text = ""
    if os.path.isfile(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    for line in text.splitlines():
        try:
            if json.loads(line) == record:
                return
        except json.JSONDecodeError:
            continue
    with open(path, "a", encoding="utf-8") as f:
        f.write(("\n" if text and not text.endswith("\n") else "") + json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_results(workdir: str) -> list[dict]:
    """Every record of workdir/results.jsonl, in order (a line cut short by a kill is skipped)."""
    path = os.path.join(workdir, RESULTS)
    records = []
    if os.path.isfile(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return records
