"""crfkit side by side with the peer CRF libraries for PyTorch, on CPU.

    python benchmarks/bench_peers.py [--quick | --full] [--threads N] [--peers a,b] [--out PATH]

Peers (adapters in benchmarks/peers/, installed by benchmarks/peers/install.sh): torch-struct,
pytorch-crf, allencrf, TorchCRF, pytorchcrf, pyt-crf, transformers-crf, pytorch-crf-compiled
(pytorch-crf's log Z and decode under torch.compile, timed after warm-up, so without compilation;
sentences over 256 positions skipped), hmmlearn (its C++ forward-backward and Viterbi, one
sentence per call) and torbi (Viterbi only). A peer that cannot be imported is reported as
"not installed: <reason>"; a cell an adapter declines (Peer.skip_reason) as "skipped: <reason>".

Ops (the same as benchmarks/cases.py): log Z forward (no grad), log Z forward + backward
(d log Z.sum() / d emissions and transitions), marginals, Viterbi (paths and scores), k-best
with K in {1, 5, 15}. Grid: B in {1, 32, 256}, L in {32, 128, 512}, T in {9, 37}, float32;
--quick (default) keeps (B, L, T) in {(32, 128, 9), (256, 128, 37), (1, 512, 9)}.

For every cell, in ONE process on the SAME inputs (benchmarks/cases.py's seeded inputs):
  1. crfkit's result (compiled backend) is computed; each peer's result, converted to crfkit's
     layout, is compared with it (log Z, gradients, marginals, best path and score, k-best scores
     and paths, with the tolerances of benchmarks/cases.py). A peer that disagrees is WRONG
     (with the reason) and is not timed; one that raises is "failed: ..."; one whose single call
     would exceed --budget seconds (estimated from a call on the first 16 positions, scaled
     by L / 16) is "skipped: too slow".
  2. crfkit and every correct peer are timed like benchmarks/run.py: median of
     torch.utils.benchmark blocked_autorange (run.median_ms), --rounds interleaved rounds, the
     smallest round median reported (a peer whose single call takes over a second gets one round).
torch-struct cells whose intermediates are expected to be large (its scan broadcasts to
B * L/2 * T^3 floats, times K^2 for k-best) run in a subprocess under an address-space cap
(--mem-cap-gb), so that running out of memory is reported ("failed: out of memory") instead of
taking the machine down; they use the same seeded inputs.
Peak memory (quick cells): each (library, op, cell) in a fresh subprocess: one warm-up call,
crfkit's kept buffers freed (crfkit.release_cached_memory), malloc_trim, the peak-RSS counter reset
(/proc/self/clear_refs), one call; the increase of
VmHWM over VmRSS before the call is reported.

Writes <out>.md, <out>.json and <out>_speedup.png (default runs/bench/cpu, or cpu_full
with --full). speed-up = fastest correct peer's ms / crfkit's ms.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cases  # noqa: E402  (benchmarks/ is not a package)
import run as core_run  # noqa: E402  (timing and machine helpers of benchmarks/run.py)
import peers  # noqa: E402

import crfkit  # noqa: E402

TAGS, LENGTHS, BATCHES, KS = cases.TAGS, cases.LENGTHS, cases.BATCHES, cases.KS
QUICK_SHAPES = ((32, 128, 9), (256, 128, 37), (1, 512, 9))  # (B, L, T)
OP_ORDER = ("log_partition", "log_partition_fwd_bwd", "marginals", "viterbi", "kbest")
OP_LABEL = {"log_partition": "log Z fwd", "log_partition_fwd_bwd": "log Z fwd+bwd", "marginals": "marginals",
            "viterbi": "Viterbi", "kbest": "k-best"}
# The project's targets: speed-up over the fastest correct peer, float32, at the quick shapes.
TARGETS = {("log_partition_fwd_bwd", None): 10.0, ("viterbi", None): 10.0, ("kbest", 5): 30.0,
           ("kbest", 15): 30.0}

BUDGET_S = 10.0
PROBE = 16  # positions of the probe call that estimates a peer's single-call time
ISOLATE_BYTES = 256 << 20  # peer cells expected to need more run in a capped subprocess
MEM_CAP_GB = 12.0
CHILD_BASE_GB = 3.0  # address space of a bare torch + crfkit process, added to the cap
RESULT_TAG = "@@bench_peers_result "


# ---- grid ---------------------------------------------------------------------------------------
def shapes(full: bool) -> List[Tuple[int, int, int]]:
    if full:
        return [(B, L, T) for T in TAGS for L in LENGTHS for B in BATCHES]
    return list(QUICK_SHAPES)


def grid(full: bool, ops: Optional[List[str]] = None, limit: Optional[int] = None,
         only_shapes: Optional[List[Tuple[int, int, int]]] = None) -> List[cases.Case]:
    out = []
    for B, L, T in only_shapes or shapes(full):
        for op in OP_ORDER:
            if ops and op not in ops:
                continue
            for k in (KS if op == "kbest" else (None,)):
                out.append(cases.Case(op, B, L, T, k))
    return out[:limit] if limit is not None else out


def peer_inputs(peer, x: cases.Inputs) -> cases.Inputs:
    """A peer without start / end scores is compared on inputs whose start / end are zero."""
    if peer is None or peer.has_start_end:
        return x
    zero = torch.zeros_like(x.start)
    return cases.Inputs(x.emissions, x.transitions, x.lengths, zero, zero, x.k)


# ---- correctness ----------------------------------------------------------------------------------
def crfkit_result(case: cases.Case, x: cases.Inputs) -> tuple:
    return cases.OPS[case.op].run(x, "compiled")


def _float64_note(case: cases.Case, got: tuple, want: tuple, x: cases.Inputs) -> str:
    """Who is closer to the truth: the errors of the peer and of crfkit against crfkit's plain
    PyTorch reference run in float64 on the same inputs."""
    d = [t.double() for t in (x.emissions, x.transitions, x.start, x.end)]
    if case.op == "marginals":
        truth, peer_v, crfkit_v, what = crfkit.reference.marginals(d[0], d[1], x.lengths, d[2], d[3]), got[0], \
            want[0], "marginals"
    else:
        truth, peer_v, crfkit_v, what = crfkit.reference.log_partition(d[0], d[1], x.lengths, d[2], d[3]), got[0], \
            want[0], "log Z"
        if case.op == "log_partition_fwd_bwd" and torch.allclose(peer_v, crfkit_v, **cases.SCORE_TOL):
            truth, peer_v, crfkit_v, what = crfkit.reference.marginals(d[0], d[1], x.lengths, d[2], d[3]), got[1], \
                want[1], "d logZ/d emissions"
    peer_err = (peer_v.double() - truth).abs().max().item()
    crfkit_err = (crfkit_v.double() - truth).abs().max().item()
    return f" (against a float64 reference, max |error| of {what}: peer {peer_err:.2g}, crfkit {crfkit_err:.2g})"


def compare(case: cases.Case, got: tuple, want: tuple, x: cases.Inputs) -> Optional[str]:
    """None if the peer's result (in crfkit's layout) agrees with crfkit's, else what differs.
    Uses the checks and tolerances of benchmarks/cases.py; for k-best the peer's log-probs are
    its scores minus crfkit's log Z (peers return no log-probs), so only scores and paths count."""
    if case.op == "kbest":
        log_z = (want[1] - want[2])[:, :1]
        got = (got[0], got[1], got[1] - log_z)
    error = cases.OPS[case.op].check(got, want, x)
    if error is None:
        return None
    error = error.replace("compiled", "peer").replace("reference", "crfkit")
    if case.op in ("log_partition", "log_partition_fwd_bwd", "marginals"):
        error += _float64_note(case, got, want, x)
    if case.op == "kbest":
        dup = cases.repeated_paths(got[0], got[1], x.lengths)
        if dup and dup not in error:  # why the scores differ, if that is what the check reported
            error += f"; {dup}"
    return error


def _is_oom(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, MemoryError) or "can't allocate memory" in text or "out of memory" in text or (
        "alloc" in text and "bytes" in text)


def _failure(error: BaseException) -> str:
    if _is_oom(error):
        text = str(error)
        tried = ""
        if "allocate" in text and "bytes" in text:
            try:
                n = int(text.split("allocate")[1].split("bytes")[0].strip(" :"))
                tried = f": it asked for {n / 2**30:.1f} GiB more"
            except (ValueError, IndexError):
                pass
        return f"failed: out of memory{tried}"
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"failed: {type(error).__name__}: {first[:200]}"


def _timed(fn):
    begin = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - begin


def estimate_seconds(peer, case: cases.Case, x: cases.Inputs, budget_s: float) -> float:
    """Seconds one call of the peer on the whole cell should take: a call on the first PROBE
    positions scaled by L / PROBE; when that is over budget, a second call on 2 * PROBE positions
    separates the per-position cost from a fixed one (peers that decode sentence by sentence
    have a large fixed cost per sentence) and the line through both is used."""
    def probe(n: int) -> float:
        fn = peer.bind(case.op, x.truncated(n), case.K)[0]
        return min(_timed(fn)[1] for _ in range(2))

    short = probe(PROBE)
    estimate = short * case.L / PROBE
    if estimate > budget_s and 2 * PROBE < case.L:
        long = probe(2 * PROBE)
        per_position = max(0.0, (long - short) / PROBE)
        estimate = max(long, long + per_position * (case.L - 2 * PROBE))
    return estimate


def check_peer(peer, case: cases.Case, x: cases.Inputs, want: tuple, budget_s: float) -> dict:
    """Run a peer once on the cell and compare with crfkit. Returns {"status", "single_s",
    "estimate_s", "fn"} where fn is the bound timed callable when the status is "ok"."""
    if case.op not in peer.supports:
        return {"status": "unsupported", "single_s": None, "estimate_s": None, "fn": None}
    declined = peer.skip_reason(case.op, x, case.K)
    if declined:
        return {"status": f"skipped: {declined}", "single_s": None, "estimate_s": None, "fn": None}
    estimate = None
    try:
        if PROBE < case.L:
            estimate = estimate_seconds(peer, case, x, budget_s)
            if estimate > budget_s:
                return {"status": f"skipped: too slow (one call ~{estimate:.3g} s)", "single_s": None,
                        "estimate_s": estimate, "fn": None}
        fn, convert = peer.bind(case.op, x, case.K)
        out, seconds = _timed(fn)
        error = compare(case, convert(out), want, x)
        del out
    except Exception as error:  # MemoryError, RuntimeError (out of memory, a peer's crash), ...
        gc.collect()
        return {"status": _failure(error), "single_s": None, "estimate_s": estimate, "fn": None}
    if error:
        return {"status": f"WRONG: {error}", "single_s": seconds, "estimate_s": estimate, "fn": None}
    return {"status": "ok", "single_s": seconds, "estimate_s": estimate, "fn": fn}


# ---- subprocesses (capped torch-struct cells, memory) ------------------------------------------
def _cap_address_space(cap_gb: float):
    limit = int((cap_gb + CHILD_BASE_GB) * 2**30)

    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return apply


def _run_child(task: dict, cap_gb: Optional[float], timeout_s: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", json.dumps(task)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              preexec_fn=_cap_address_space(cap_gb) if cap_gb else None)
    except subprocess.TimeoutExpired:
        return {"status": f"failed: subprocess timed out after {timeout_s:.0f} s"}
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    if proc.returncode < 0:
        return {"status": f"failed: subprocess killed by signal {-proc.returncode}"
                          + (" (out of memory?)" if -proc.returncode == 9 else "")}
    tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
    if "memory" in tail.lower() or "alloc" in tail.lower():
        return {"status": "failed: out of memory"}
    return {"status": f"failed: subprocess exited {proc.returncode}: {tail[:200]}"}


def _read_status_kb() -> Dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def _child(task: dict) -> dict:
    """Body of a subprocess: "cell" (check + time one peer on one cell) or "memory"."""
    torch.set_num_threads(task["threads"])
    case = cases.Case(task["op"], task["B"], task["L"], task["T"], task["K"])
    x = cases.inputs_for(case)
    lib = task["lib"]
    peer = None if lib == "crfkit" else peers.load(lib)
    x = peer_inputs(peer, x)
    if task["kind"] == "cell":
        want = crfkit_result(case, x)
        result = check_peer(peer, case, x, want, task["budget"])
        fn = result.pop("fn")
        result["rounds_ms"], result["other_load"] = [], None
        if fn is not None and task["rounds"]:
            medians, result["other_load"] = time_rounds({"peer": (fn, result["single_s"])}, task["rounds"],
                                                        task["min_run_time"])
            result["rounds_ms"] = medians["peer"]
        return result
    # memory: peak RSS increase of one call after a warm-up call
    try:
        fn = cases.callable_for(case, "compiled") if peer is None else peer.bind(case.op, x, case.K)[0]
        out = fn()
        del out
        gc.collect()
        # crfkit keeps freed buffers for the next call (crfkit.release_cached_memory): freed
        # here, so that the measured call's buffers count in its peak like any allocation.
        crfkit.release_cached_memory()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = _read_status_kb()
        out = fn()
        after = _read_status_kb()
        del out
    except Exception as error:
        return {"status": _failure(error)}
    return {"status": "ok", "peak_mib": (after["VmHWM"] - before["VmRSS"]) / 1024,
            "rss_before_mib": before["VmRSS"] / 1024}


# ---- one cell ---------------------------------------------------------------------------------------
def wait_for_quiet(max_wait_s: float, window_s: float = 2.0) -> float:
    """Wait until other processes use at most run.BUSY of the CPUs over a window (at most
    max_wait_s); returns the seconds waited. On this small shared machine a competing build or
    test run makes multi-threaded timings meaningless (a torch thread that loses its core stalls
    every parallel region)."""
    begin = time.perf_counter()
    while True:
        load = core_run.OtherLoad().start()
        time.sleep(window_s)
        share = load.stop()
        waited = time.perf_counter() - begin
        if share is None or share <= core_run.BUSY or waited >= max_wait_s:
            return waited
        print(f"    waiting for a quiet machine (others use {100 * share:.0f}% of the CPUs)", file=sys.stderr,
              flush=True)
        time.sleep(5.0)


def time_rounds(timers: Dict[str, tuple], rounds: int,
                min_run_time: float) -> Tuple[Dict[str, List[float]], Optional[float]]:
    """Interleaved rounds: {library: [round medians]}, and the other processes' CPU share meanwhile."""
    out: Dict[str, List[float]] = {name: [] for name in timers}
    load = core_run.OtherLoad().start()
    for r in range(rounds):
        for name, (fn, single_s) in timers.items():
            if r == 0 or single_s < 1.0:
                out[name].append(core_run.median_ms(fn, min_run_time))
    return out, load.stop()


def run_cell(case: cases.Case, loaded, args) -> dict:
    x = cases.inputs_for(case)
    want = crfkit_result(case, x)
    row = {"op": case.op, "B": case.B, "L": case.L, "T": case.T, "K": case.K, "tokens": case.B * case.L,
           "crfkit": {"status": "ok", "ms": None, "tokens_per_s": None, "rounds_ms": []}, "peers": {},
           "fastest_peer": None, "fastest_peer_ms": None, "speedup": None, "other_load": None}
    timers = {"crfkit": (cases.callable_for(case, "compiled"), 0.0)}
    row["quiet_wait_s"] = 0.0 if args.no_wait else wait_for_quiet(args.max_wait)
    for name, peer, reason in loaded:
        entry = {"status": reason, "how": None, "ms": None, "tokens_per_s": None, "rounds_ms": [],
                 "single_s": None, "isolated": False}
        row["peers"][name] = entry
        if peer is None:
            continue
        entry["how"] = peer.how(case.op)
        if case.op not in peer.supports:
            entry["status"] = "unsupported"
            continue
        xp = peer_inputs(peer, x)
        want_p = want if xp is x else crfkit_result(case, xp)
        if peer.memory_estimate(case.op, xp, case.K) > args.isolate_mb * 2**20:
            entry["isolated"] = True
            task = {"kind": "cell", "lib": name, "op": case.op, "B": case.B, "L": case.L, "T": case.T,
                    "K": case.K, "threads": torch.get_num_threads(), "budget": args.budget,
                    "rounds": 0 if args.check_only else args.rounds, "min_run_time": args.min_run_time}
            for attempt in range(1 + (0 if args.check_only else args.retries)):
                if attempt:
                    row["quiet_wait_s"] += wait_for_quiet(args.max_wait)
                result = _run_child(task, args.mem_cap_gb, timeout_s=max(120.0, 30 * args.budget))
                if (result.get("other_load") or 0) <= core_run.BUSY or args.no_wait:
                    break
            entry["other_load"] = result.get("other_load")
            entry["status"] = result["status"]
            entry["single_s"] = result.get("single_s")
            entry["rounds_ms"] = result.get("rounds_ms", [])
            continue
        load = core_run.OtherLoad().start()
        result = check_peer(peer, case, xp, want_p, args.budget)
        if (result["status"].startswith("skipped: too slow") and not args.no_wait
                and (load.stop() or 0) > core_run.BUSY):
            row["quiet_wait_s"] += wait_for_quiet(args.max_wait)  # the estimate was taken on a busy machine
            result = check_peer(peer, case, xp, want_p, args.budget)
        entry["status"], entry["single_s"] = result["status"], result["single_s"]
        if result["fn"] is not None:
            timers[name] = (result["fn"], result["single_s"])
    if not args.check_only:
        best = None
        row["attempts"] = 0
        for attempt in range(1 + args.retries):
            if attempt:
                row["quiet_wait_s"] += wait_for_quiet(args.max_wait)
            medians, other = time_rounds(timers, args.rounds, args.min_run_time)
            row["attempts"] += 1
            if best is None or (other or 0) < (best[1] or 0):
                best = (medians, other)
            if (other or 0) <= core_run.BUSY or args.no_wait:
                break
            print(f"    others used {100 * other:.0f}% of the CPUs while timing: again", file=sys.stderr, flush=True)
        medians, row["other_load"] = best
        for name, values in medians.items():
            (row["crfkit"] if name == "crfkit" else row["peers"][name])["rounds_ms"] = values
    for bucket in [row["crfkit"], *row["peers"].values()]:
        if bucket["rounds_ms"]:
            bucket["ms"] = min(bucket["rounds_ms"])
            bucket["tokens_per_s"] = case.B * case.L / (bucket["ms"] / 1e3)
    correct = [(e["ms"], n) for n, e in row["peers"].items() if e["status"] == "ok" and e["ms"] is not None]
    if correct:
        row["fastest_peer_ms"], row["fastest_peer"] = min(correct)
        if row["crfkit"]["ms"]:
            row["speedup"] = row["fastest_peer_ms"] / row["crfkit"]["ms"]
    timers.clear()
    gc.collect()
    return row


def measure_memory(rows: List[dict], args, memory_shapes) -> List[dict]:
    """Peak RSS increase per (library, op, cell) for the cells of memory_shapes (the quick ones):
    crfkit and every peer that was correct there (each in a fresh subprocess)."""
    out = []
    quick = set(memory_shapes)
    for row in rows:
        if (row["B"], row["L"], row["T"]) not in quick:
            continue
        libs = ["crfkit"] + [n for n, e in row["peers"].items() if e["status"] == "ok"]
        for lib in libs:
            task = {"kind": "memory", "lib": lib, "op": row["op"], "B": row["B"], "L": row["L"], "T": row["T"],
                    "K": row["K"], "threads": torch.get_num_threads()}
            capped = lib != "crfkit" and row["peers"][lib]["isolated"]
            result = _run_child(task, args.mem_cap_gb if capped else None, timeout_s=max(120.0, 30 * args.budget))
            out.append({"lib": lib, "op": row["op"], "B": row["B"], "L": row["L"], "T": row["T"], "K": row["K"],
                        **result})
            print(f"  memory {lib} {_cell_name(row)}: {_mib(result)}", file=sys.stderr, flush=True)
    return out


# ---- report -------------------------------------------------------------------------------------
def _cell_name(row: dict) -> str:
    k = f" K={row['K']}" if row["K"] is not None else ""
    return f"{OP_LABEL[row['op']]}{k} ({row['B']}, {row['L']}, {row['T']})"


def _ms(x: Optional[float]) -> str:
    return core_run._ms(x)


def _rate(x: Optional[float]) -> str:
    if x is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _short(status: Optional[str]) -> str:
    if status is None:
        return "-"
    if status == "unsupported":
        return "n/a"
    if status.startswith("WRONG"):
        return "WRONG"
    if status.startswith("skipped: too slow"):
        return "too slow"
    if status.startswith("skipped"):
        return "skipped"
    if "out of memory" in status:
        return "OOM"
    if status.startswith("not installed"):
        return "not installed"
    if status.startswith("failed"):
        return "failed"
    return status


def _peer_cell(entry: dict) -> str:
    if entry["status"] == "ok" and entry["ms"] is not None:
        return f"{_ms(entry['ms'])} ({_rate(entry['tokens_per_s'])}/s)"
    if entry["status"] == "ok":
        return "ok (untimed)"
    return _short(entry["status"])


def _mib(result: Optional[dict]) -> str:
    if result is None:
        return "-"
    if result.get("status") != "ok":
        return _short(result.get("status"))
    peak = result["peak_mib"]
    return "<0.1" if peak < 0.1 else f"{peak:.2g}" if peak < 10 else f"{peak:.0f}"


def summary(rows: List[dict]) -> List[dict]:
    out = []
    for (op, k), target in TARGETS.items():
        for B, L, T in QUICK_SHAPES:
            row = next((r for r in rows if (r["op"], r["K"], r["B"], r["L"], r["T"]) == (op, k, B, L, T)), None)
            if row is None:
                continue
            if row["crfkit"]["ms"] is None:
                verdict = "not timed"
            elif row["speedup"] is None:
                verdict = "no correct peer"
            else:
                verdict = "meets target" if row["speedup"] >= target else "BELOW target"
                if (row["other_load"] or 0) > core_run.BUSY:
                    verdict += " (machine busy: unreliable)"
            out.append({"cell": _cell_name(row), "target": target, "row": row, "verdict": verdict})
    return out


def markdown(env: dict, rows: List[dict], loaded, memory: List[dict], heads: List[dict], args,
             plot_name: Optional[str]) -> str:
    m = env["machine"]
    names = [n for n, _, _ in loaded]
    table = core_run._table
    lines = [f"# crfkit vs the peer CRF libraries on CPU ({'full' if args.full else 'quick'} grid)", ""]
    lines += ["## Summary against the targets", "",
              "speed-up = the fastest CORRECT peer's median ms / crfkit's median ms (float32). Targets: "
              "log Z fwd+bwd >= 10x, Viterbi >= 10x, k-best K=5 and K=15 >= 30x, at (B, L, T) = "
              "(32, 128, 9), (256, 128, 37), (1, 512, 9).", ""]
    lines += table(["cell (B, L, T)", "crfkit ms", "fastest correct peer", "its ms", "speed-up", "target", "verdict"], [
        [h["cell"], _ms(h["row"]["crfkit"]["ms"]), h["row"]["fastest_peer"] or "-", _ms(h["row"]["fastest_peer_ms"]),
         f"{h['row']['speedup']:.1f}x" if h["row"]["speedup"] else "-", f">= {h['target']:g}x", h["verdict"]]
        for h in heads])
    met = sum(h["verdict"].startswith("meets") for h in heads)
    lines += ["", f"{met} of {len(heads)} target cells met.", ""]
    busy = [r for r in rows if (r["other_load"] or 0) > core_run.BUSY]
    if busy:
        lines += [f"**Warning: other processes used more than {core_run.BUSY:.0%} of the CPUs during {len(busy)} "
                  f"of {len(rows)} cells: those timings are unreliable.**", ""]
    if plot_name:
        lines += [f"![crfkit speed-up over the fastest correct peer]({plot_name})", ""]

    lines += ["## Setup", "",
              f"- command: `{env['command']}`",
              f"- date: {env['date']}",
              f"- machine: {m['cpu']}, {m['nproc']} CPUs ({m['nproc_available']} available), torch threads: "
              f"{m['torch_num_threads']}; {m['platform']}; load average {core_run._load(m['load_average_at_start'])} "
              f"at start, {core_run._load(m['load_average_at_end'])} at end",
              f"- torch {env['torch']}, python {env['python']}, crfkit {env['crfkit']} (git {env['crfkit_git']})",
              f"- crfkit backend_info: `{env['backend_info']}`",
              "- inputs: benchmarks/cases.py's seeded inputs (emissions randn*3, transitions / start / end randn, "
              "ragged lengths in [L/2, L] with sentence 0 of length L), float32, the same tensors for crfkit "
              "and every peer.",
              f"- timing: torch.utils.benchmark blocked_autorange median (min_run_time {args.min_run_time} s) of one "
              f"call, the smallest of {args.rounds} interleaved rounds (crfkit and the peers in turn; a peer whose "
              "single call takes over 1 s gets one round). "
              + ("With --no-wait the benchmark neither waited for a quiet machine nor re-timed a disturbed cell: "
                 "each cell was timed once, whatever the other processes did (column others' CPU). "
                 if args.no_wait else
                 "Before each cell the benchmark waits for a quiet machine "
                 f"(other processes under {core_run.BUSY:.0%} of the CPUs, at most {args.max_wait:g} s), and a cell "
                 f"whose timing saw more is re-timed up to {args.retries} times, the quietest attempt kept (column "
                 "others' CPU). ")
              + "crfkit: one call of the public function "
              "(benchmarks/cases.py's op, compiled backend). A peer: its own call on inputs already in its "
              "layout (module built and parameters set beforehand; see 'How each peer is called'). "
              "tokens/s = B*L / time (padded positions count).",
              f"- correctness first: every peer result is compared with crfkit's on the cell's inputs (tolerances of "
              f"benchmarks/cases.py); WRONG / failed peers are not timed; a peer whose single call would exceed "
              f"{args.budget:g} s is skipped (estimated from calls on the first {PROBE} and {2 * PROBE} positions).",
              f"- torch-struct cells whose scan is expected to need over {args.isolate_mb} MiB run in a subprocess "
              f"with an address-space cap of {args.mem_cap_gb:g} GiB (+{CHILD_BASE_GB:g} GiB for the process "
              "itself): an allocation beyond it is reported as 'failed: out of memory'.",
              f"- peers: {', '.join(n for n, _, _ in loaded)}"
              + ("" if not args.peers else f" (chosen with --peers; also known: "
                 f"{', '.join(n for n in peers.NAMES if n not in [m for m, _, _ in loaded]) or 'none'})") + ".",
              "- peers installed by `bash benchmarks/peers/install.sh` (pip --no-deps, never touching torch); "
              "`pip install -e '.[bench]'` installs the ones that resolve cleanly (see install.sh).",
              ""]

    lines += ["## Peers", ""]
    peer_rows = []
    for name, peer, reason in loaded:
        if peer is None:
            peer_rows.append([name, "-", reason or "-", "-"])
            continue
        ops = ", ".join(f"{OP_LABEL[o]}" + (f" ({peer.how(o)})" if peer.how(o) != "native" else "")
                        for o in OP_ORDER if o in peer.supports)
        peer_rows.append([name, peer.version, f"import {peer.module}", ops])
    lines += table(["peer", "version", "import (or why it is missing)", "ops (how, where not its own op)"],
                   peer_rows) + [""]

    lines += ["## All cells", "",
              "ms = median ms of one call (tokens/s in parentheses). n/a: the peer has no such op; WRONG: "
              "disagrees with crfkit (not timed); OOM: out of memory; too slow: one call over the budget; "
              "details under 'Correctness and failures'.", ""]
    header = ["op", "B", "L", "T", "K", "crfkit ms", "crfkit tokens/s"] + names + ["fastest correct peer", "speed-up",
                                                                                  "others' CPU"]
    body = []
    for r in rows:
        body.append([OP_LABEL[r["op"]], str(r["B"]), str(r["L"]), str(r["T"]), "-" if r["K"] is None else str(r["K"]),
                     _ms(r["crfkit"]["ms"]), _rate(r["crfkit"]["tokens_per_s"])]
                    + [_peer_cell(r["peers"][n]) for n in names]
                    + [r["fastest_peer"] or "-", f"{r['speedup']:.1f}x" if r["speedup"] else "-",
                       "-" if r["other_load"] is None else f"{100 * r['other_load']:.0f}%"])
    lines += table(header, body) + [""]

    if memory:
        lines += ["## Peak memory", "",
                  "MiB: increase of the peak resident set size (VmHWM) over the RSS before the call, for one call in "
                  "a fresh subprocess after one warm-up call and malloc_trim (the peak counter reset through "
                  "/proc/self/clear_refs); it includes the outputs. Measured for crfkit and for each peer that was "
                  "correct on the cell.", ""]
        by = {(e["lib"], e["op"], e["K"], e["B"], e["L"], e["T"]): e for e in memory}
        mem_body = []
        for r in rows:
            key = (r["op"], r["K"], r["B"], r["L"], r["T"])
            if ("crfkit",) + key not in by:
                continue
            mem_body.append([_cell_name(r), _mib(by[("crfkit",) + key])]
                            + [_mib(by.get((n,) + key)) if (n,) + key in by else _short(r["peers"][n]["status"])
                               if r["peers"][n]["status"] != "ok" else "-" for n in names])
        lines += table(["cell (B, L, T)", "crfkit MiB"] + [f"{n} MiB" for n in names], mem_body) + [""]

    lines += ["## Correctness and failures", ""]
    problems = []
    for r in rows:
        for n in names:
            status = r["peers"][n]["status"]
            if status and status not in ("ok", "unsupported") and not status.startswith("not installed"):
                problems.append(f"- {n}, {_cell_name(r)}: {status}")
    lines += problems or ["- every peer agreed with crfkit wherever it ran."]
    lines += [""]

    lines += ["## How each peer is called", ""]
    for name, peer, reason in loaded:
        if peer is None:
            lines += [f"### {name}", "", reason or "", ""]
            continue
        doc = sys.modules[type(peer).__module__].__doc__ or ""
        lines += [f"### {name} {peer.version}", "", doc.strip(), ""]
    return "\n".join(lines) + "\n"


def plot(rows: List[dict], path: Path, full: bool) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    groups = []
    for op in OP_ORDER:
        for k in (KS if op == "kbest" else (None,)):
            cell_rows = [r for r in rows if r["op"] == op and r["K"] == k]
            if cell_rows:
                groups.append((op, k, cell_rows))
    if not groups:
        return False
    fig, axes = plt.subplots(1, len(groups), figsize=(max(12, 2.2 * len(groups) * (3 if full else 1)), 4.8),
                             sharey=True, squeeze=False)
    for ax, (op, k, cell_rows) in zip(axes[0], groups):
        labels = [f"{r['B']},{r['L']},{r['T']}" for r in cell_rows]
        values = [r["speedup"] or 0.0 for r in cell_rows]
        colors = ["tab:blue" if r["speedup"] else "lightgray" for r in cell_rows]
        ax.bar(range(len(values)), [max(v, 1e-2) for v in values], color=colors)
        for i, (v, r) in enumerate(zip(values, cell_rows)):
            ax.text(i, max(v, 1e-2) * 1.05, f"{v:.1f}x\n{r['fastest_peer']}" if v else "no peer",
                    ha="center", va="bottom", fontsize=6)
        target = TARGETS.get((op, k))
        if target:
            ax.axhline(target, color="tab:red", linestyle="--", linewidth=1)
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_yscale("log")
        ax.set_xticks(range(len(values)), labels, rotation=90 if full else 30, fontsize=7)
        ax.set_title(OP_LABEL[op] + (f" K={k}" if k is not None else ""), fontsize=9)
    top = max([r["speedup"] or 1.0 for _, _, rs in groups for r in rs] + list(TARGETS.values()))
    axes[0][0].set_ylim(top=top * 4)
    axes[0][0].set_ylabel("crfkit speed-up over the fastest correct peer (log)")
    fig.suptitle("crfkit vs the fastest correct peer, float32, CPU (B, L, T); red dashed: target", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the three quick shapes (default)")
    mode.add_argument("--full", action="store_true", help="the full grid (long)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads(N) first")
    parser.add_argument("--peers", help="comma-separated peers to run (default: all): " + ", ".join(peers.NAMES))
    parser.add_argument("--ops", help="comma-separated ops to keep: " + ", ".join(OP_ORDER))
    parser.add_argument("--limit", type=int, help="keep the first N cells")
    parser.add_argument("--shapes", help="run these shapes instead of the grid's, e.g. 256x128x37,1x512x9 (B x L x T)")
    parser.add_argument("--out", help="output path without extension (default runs/bench/cpu, "
                        "or cpu_full with --full; --out benchmarks/results/NAME updates the committed results)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (default %(default)s)")
    parser.add_argument("--min-run-time", type=float, default=0.5, help="blocked_autorange min_run_time (s)")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help="skip a peer whose single call would exceed this many seconds (default %(default)s)")
    parser.add_argument("--mem-cap-gb", type=float, default=MEM_CAP_GB,
                        help="address-space cap of the subprocess of a memory-heavy peer cell (default %(default)s)")
    parser.add_argument("--isolate-mb", type=int, default=ISOLATE_BYTES >> 20,
                        help="run peer cells expected to need more than this in a capped subprocess")
    parser.add_argument("--retries", type=int, default=2,
                        help="re-time a cell (after waiting for a quiet machine) when other processes used over "
                        "10%% of the CPUs meanwhile; the quietest attempt is kept (default %(default)s)")
    parser.add_argument("--max-wait", type=float, default=600.0,
                        help="longest wait for a quiet machine before a cell, in seconds (default %(default)s)")
    parser.add_argument("--no-wait", action="store_true", help="never wait for a quiet machine nor re-time")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    parser.add_argument("--check-only", action="store_true", help="correctness only, no timing (no files written)")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv[1:])

    if args._child:
        task = json.loads(args._child)
        try:
            result = _child(task)
        except Exception as error:
            result = {"status": _failure(error)}
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else HERE.parent / "runs" / "bench" / ("cpu_full" if args.full else "cpu")
    loaded = peers.load_peers(args.peers.split(",") if args.peers else None)
    for name, peer, reason in loaded:
        print(f"{name}: {peer.version if peer else reason}", file=sys.stderr)
    env = core_run.environment(argv)
    only = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else None
    cells = grid(args.full, args.ops.split(",") if args.ops else None, args.limit, only)

    rows = []
    for i, case in enumerate(cells, 1):
        row = run_cell(case, loaded, args)
        rows.append(row)
        peers_text = ", ".join(f"{n} {_peer_cell(e)}" for n, e in row["peers"].items() if e["status"] != "unsupported")
        print(f"[{i}/{len(cells)}] {_cell_name(row)}: crfkit {_ms(row['crfkit']['ms'])} ms | {peers_text} | "
              f"speed-up {row['speedup'] and round(row['speedup'], 1)}", file=sys.stderr, flush=True)
        for n, e in row["peers"].items():
            if e["status"] and e["status"].startswith(("WRONG", "failed")):
                print(f"    {n}: {e['status']}", file=sys.stderr, flush=True)
    if args.check_only:
        return 0
    memory = [] if args.no_memory else measure_memory(rows, args, only or QUICK_SHAPES)
    env["machine"]["load_average_at_end"] = list(os.getloadavg())
    env.update(min_run_time=args.min_run_time, rounds=args.rounds, budget_s=args.budget, mem_cap_gb=args.mem_cap_gb,
               grid="full" if args.full else "quick")
    heads = summary(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_path = Path(f"{out}_speedup.png")
    plotted = plot(rows, plot_path, args.full)
    text = markdown(env, rows, loaded, memory, heads, args, plot_path.name if plotted else None)
    Path(f"{out}.md").write_text(text)
    report = {**env,
              "peers": [{"name": n, "version": p.version if p else None, "module": p.module if p else None,
                         "status": "installed" if p else r,
                         "ops": {o: p.how(o) for o in OP_ORDER if p and o in p.supports}} for n, p, r in loaded],
              "targets": [{"op": op, "K": k, "speedup_at_least": t} for (op, k), t in TARGETS.items()],
              "summary": [{"cell": h["cell"], "target": h["target"], "verdict": h["verdict"],
                           "speedup": h["row"]["speedup"], "fastest_peer": h["row"]["fastest_peer"]} for h in heads],
              "cells": rows, "memory": memory}
    Path(f"{out}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(text)
    print(f"wrote {out}.md, {out}.json" + (f", {plot_path}" if plotted else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
