"""Smoke test of benchmarks/bench_new_ops.py on small shapes: every contender's correctness check
runs (crfkit must pass its own; a peer agrees with crfkit, or is not installed, or fails in the
ways bench_new_ops.py documents), crfkit's call is timed with pytest-benchmark, and the report
is written end to end.

    python -m pytest -q benchmarks/test_bench_new_ops.py
    python -m pytest benchmarks/test_bench_new_ops.py --benchmark-only -k sample

Not part of the main test suite (testpaths = ["tests"]). The before / after part (5) is tested
through its worker on this checkout only: the git worktree of HEAD is made by the benchmark
itself, not here. CRFKIT_BENCH_THREADS=N sets torch's number of threads.
"""
from __future__ import annotations

import json
import os
import types

import pytest
import torch

import bench_new_ops as bench

if os.environ.get("CRFKIT_BENCH_THREADS"):
    torch.set_num_threads(int(os.environ["CRFKIT_BENCH_THREADS"]))

# the peers' own notices (torch.distributions validation of torch-struct, uint8 masks in torch.where)
pytestmark = [pytest.mark.filterwarnings("ignore:.*does not define `arg_constraints`"),
              pytest.mark.filterwarnings("ignore:where received a uint8 condition tensor"),
              pytest.mark.filterwarnings("ignore:indexing with dtype torch.uint8 is now deprecated")]

SHAPES = [(4, 12, 5), (1, 12, 5)]
ARGS = types.SimpleNamespace(rounds=1, min_run_time=0.01, budget=10.0, isolate_mb=bench.ISOLATE_MB,
                             mem_cap_gb=bench.MEM_CAP_GB)
SPECS = [spec for part in ("sample", "marginals", "partial_nll", "per_example")
         for spec in bench.cells(part, False, ARGS.budget, SHAPES)]
# Documented peer failures (bench_new_ops.PEER_CONVENTIONS): pytorch-partial-crf at B = 1 writes into
# the caller's emissions (forward: WRONG) or raises on a leaf that requires grad (forward + backward).
KNOWN = {("partial_nll", 1, "fwd"): "WRONG", ("partial_nll", 1, "fwd_bwd"): "failed: RuntimeError"}


def _id(spec: dict) -> str:
    return bench.cell_name(spec).replace(" ", "-").replace(",", "").replace("(", "").replace(")", "")


@pytest.mark.parametrize("spec", SPECS, ids=[_id(s) for s in SPECS])
def test_cell(benchmark, spec: dict):
    contenders = bench.CONTENDERS[spec["part"]](spec)
    assert "crfkit" in contenders
    benchmark.group = _id(spec)
    timed = None
    for name, contender in contenders.items():
        entry, fn = bench.check_contender(contender)
        status = entry["status"]
        if name == "crfkit" or contender.role == "crfkit-other":
            assert status == "ok", f"{name}: {status}"
            if name == "crfkit":
                timed = fn
            continue
        known = KNOWN.get((spec["part"], spec["B"], spec.get("op")))
        if known and name == "pytorch-partial-crf" and status.startswith(known):
            continue
        assert status == "ok" or status.startswith("skipped: not installed"), f"{name}: {status}"
    benchmark.extra_info.update(part=spec["part"], B=spec["B"], L=spec["L"], T=spec["T"])
    benchmark.pedantic(timed, rounds=3, iterations=1)


def test_report(tmp_path):
    out = tmp_path / "new_ops"
    code = bench.main(["bench_new_ops.py", "--parts", "sample,partial_nll", "--shapes", "4x12x5", "--rounds", "1",
                       "--min-run-time", "0.01", "--out", str(out)])
    assert code == 0
    text = (tmp_path / "new_ops.md").read_text()
    for needle in ("## 1. Sampling", "## 3. Partial log-likelihood", "## Checks", "load average", "cpu_isa"):
        assert needle in text
    report = json.loads((tmp_path / "new_ops.json").read_text())
    rows = report["parts"]["sample"]
    assert len(rows) == len(bench.SAMPLE_DRAWS)
    assert all(r["entries"]["crfkit"]["status"] == "ok" and r["entries"]["crfkit"]["ms"] > 0 for r in rows)


def test_overhead_worker():
    worker = bench.Worker(bench.ROOT, 1)
    try:
        assert os.path.realpath(worker.hello["crfkit_file"]) == str((bench.ROOT / "crfkit" / "__init__.py").resolve())
        request = {"op": "kbest", "B": 2, "L": 6, "T": 3}
        first = worker.ask(cmd="result", **request)["result"]
        assert bench._same(first, worker.ask(cmd="result", **request)["result"]) is None
        assert worker.ask(cmd="time", min_run_time=0.01, **request)["ms"] > 0
    finally:
        worker.close()
    assert worker.proc.returncode == 0
