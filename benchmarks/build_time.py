"""Time a clean build of crfkit._C: what `pip install` of the sdist and a first `make setup` compile.

    python benchmarks/build_time.py [--source DIR] [--label NAME] [--env VAR=VALUE ...] [--out PATH]

Builds the extension of the checkout at --source (default: this one) from nothing, in a
temporary folder (the checkout's crfkit/_C*.so and build/ are left alone), with
`python setup.py build_ext` under the given environment (e.g. --env CRFKIT_ARCH=native), and
records the wall and CPU seconds, the library's size, whether it carries debug info, and each
object's compile seconds (from ninja's logs). Appends the run to <out>.json (default
benchmarks/results/build_time) and rewrites <out>.md from every run there, so that two commits
can be set side by side: run it once more with --source on a worktree of the other commit
(`git worktree add /tmp/old <commit>`). Run it on an otherwise idle machine: the build uses
every core (MAX_JOBS, default the CPU count).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run as core_run  # noqa: E402  (machine and commit helpers of benchmarks/run.py)

DEFAULT_OUT = HERE / "results" / "build_time"


def object_seconds(build_temp: Path) -> Dict[str, float]:
    """{object path relative to build_temp: compile seconds} from every .ninja_log below it."""
    seconds = {}
    for log in build_temp.rglob(".ninja_log"):
        for line in log.read_text().splitlines()[1:]:
            start, end, _, output, _ = line.split("\t")
            seconds[str(Path(output).relative_to(build_temp))] = (int(end) - int(start)) / 1000
    return dict(sorted(seconds.items(), key=lambda item: -item[1]))


def has_debug_info(library: Path) -> Optional[bool]:
    if shutil.which("objdump") is None:
        return None
    sections = subprocess.run(["objdump", "-h", str(library)], capture_output=True, text=True, check=True).stdout
    return ".debug_info" in sections


def build(source: Path, env_overrides: Dict[str, str]) -> dict:
    env = dict(os.environ, **env_overrides)
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(prefix="crfkit_build_time_") as tmp:
        build_temp, build_lib = Path(tmp) / "temp", Path(tmp) / "lib"
        command = [sys.executable, "setup.py", "-q", "build_ext", "--build-temp", str(build_temp),
                   "--build-lib", str(build_lib)]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        begin = time.perf_counter()
        result = subprocess.run(command, cwd=source, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - begin
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if result.returncode != 0:
            raise SystemExit(f"the build failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        (library,) = build_lib.glob("crfkit/_C*.so")
        return {
            "wall_s": round(wall, 1),
            "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 1),
            "library_bytes": library.stat().st_size,
            "debug_info": has_debug_info(library),
            "objects_s": object_seconds(build_temp),
        }


def write_markdown(runs: List[dict], out: Path) -> str:
    lines = ["# Build time of crfkit._C", "",
             "Written by `benchmarks/build_time.py` (a clean `python setup.py build_ext` in a temporary folder;",
             "wall and CPU seconds of the whole build, the library's size, the slowest objects from ninja's",
             "logs). One row per run, oldest first.", "",
             "| date | label | commit | environment | machine | wall | CPU | library | debug info | slowest objects |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        slowest = ", ".join(f"{name.replace('csrc/', '')} {s:.0f} s" for name, s in list(run["objects_s"].items())[:3])
        environment = " ".join(f"{k}={v}" for k, v in run["env"].items()) or "(defaults)"
        machine = f"{run['machine']['cpu']}, {run['machine']['nproc']} CPUs"
        lines.append(f"| {run['date'][:10]} | {run['label']} | {run['commit']} | {environment} | {machine} | "
                     f"{run['wall_s'] / 60:.1f} min | {run['cpu_s'] / 60:.1f} min | "
                     f"{run['library_bytes'] / 2**20:.1f} MiB | {run['debug_info']} | {slowest} |")
    lines += ["", "Commands:", ""] + [f"- {run['label']}: `{run['command']}` (torch {run['torch']}, "
                                      f"Python {run['python']})" for run in runs]
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    return text


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, default=HERE.parent, help="the checkout to build (default: this one)")
    parser.add_argument("--label", default="", help="a name for the run in the table (default: the commit)")
    parser.add_argument("--env", action="append", default=[], metavar="VAR=VALUE",
                        help="build environment, e.g. CRFKIT_ARCH=native (repeatable)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results without suffix")
    args = parser.parse_args(argv)
    source = args.source.resolve()
    if not (source / "setup.py").exists():
        parser.error(f"--source {source} holds no setup.py")
    env = {}
    for item in args.env:
        if "=" not in item:
            parser.error(f"--env expects VAR=VALUE, got {item!r}")
        name, value = item.split("=", 1)
        env[name] = value
    commit = core_run.git_commit(source) or "unknown"
    run = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "label": args.label or commit, "commit": commit, "env": env,
        "command": shlex.join(["python", "benchmarks/build_time.py", *argv]),
        "machine": {"cpu": core_run.cpu_model(), "nproc": os.cpu_count(),
                    "load_average_at_start": list(os.getloadavg())},
        "python": platform.python_version(), "torch": torch.__version__,
    }
    run.update(build(source, env))
    out_json = args.out.with_suffix(".json")
    runs = json.loads(out_json.read_text()) if out_json.exists() else []
    runs.append(run)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(runs, indent=1) + "\n")
    print(write_markdown(runs, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
