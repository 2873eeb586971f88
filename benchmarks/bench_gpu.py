"""crfkit's CUDA kernels against the peer libraries on the same GPU, and against the GPU's
memory bandwidth, in one run.

    python benchmarks/bench_gpu.py [--quick | --full | --shapes BxLxT,...] [--peers a,b] [--ops a,b]
                                   [--budget S] [--out PATH]

Needs a CUDA device and crfkit._C built with its CUDA kernels (crfkit.backend_info()
['cuda_kernels']); exits with status 2 otherwise.

Ops (benchmarks/cases.py, float32): log Z forward, log Z forward + backward, marginals,
Viterbi, k-best with K in {5, 15}. Grid (--full): B in {1, 32, 256, 1024}, L in {32, 128, 512},
T in {9, 37}; --quick (default): (B, L, T) in {(256, 128, 9), (1024, 128, 37), (32, 512, 9),
(1, 128, 9)}.

Per cell, on the same seeded inputs (cases.make_inputs, moved to the GPU):
  1. crfkit on the GPU is checked against crfkit's CPU kernels (cases.OPS[op].check); a cell
     that disagrees is WRONG and not timed.
  2. every peer (the adapters of benchmarks/peers, unchanged; this script only moves the state
     their _setup builds to the GPU) runs once on the GPU, its output is converted to crfkit's
     layout on the CPU and compared with crfkit (bench_peers.compare); a peer that disagrees is
     WRONG, one that raises is "failed: ..." (out of memory included), one whose call would take
     longer than --budget seconds (estimated from a call on the first 16 positions) is
     "skipped: too slow". Peers that cannot be imported are "not installed".
  3. timing: torch.cuda.Event around each call (host work included: crfkit's argument checks
     and its one synchronisation per op; the peers' Python loops), after warm-up calls; the
     median over at least --min-time seconds and 5 calls (3 calls for calls over a second).
  4. bandwidth: the least time the op's compulsory memory traffic takes (reading the emissions,
     writing the marginals / the emission gradients / the paths) at the device-to-device copy
     bandwidth measured at the start of the run (a 1 GiB copy_; read + write bytes / time).

Writes <out>.md and <out>.json (default runs/bench/gpu_<device>), rewritten after every
cell so that a run stopped by a time limit keeps the cells it finished: device, torch and
CUDA versions, the command, the bandwidth, every cell, the speed-up over the fastest correct
peer, and the issue's targets (log Z forward+backward at least 20x torch-struct at B = 256,
L = 128, T = 9; k-best at least 100x the fastest batched k-best peer; marginals at large B
within 3x of the bandwidth limit).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_peers  # noqa: E402  (benchmarks/ is not a package)
import cases  # noqa: E402
import peers  # noqa: E402
import run as core_run  # noqa: E402

import crfkit  # noqa: E402

OPS = ("log_partition", "log_partition_fwd_bwd", "marginals", "viterbi", "kbest")
KS = (5, 15)
FULL_SHAPES = [(B, L, T) for T in (9, 37) for L in (32, 128, 512) for B in (1, 32, 256, 1024)]
QUICK_SHAPES = [(256, 128, 9), (1024, 128, 37), (32, 512, 9), (1, 128, 9)]
PROBE = 16
TARGETS = [
    ("log_partition_fwd_bwd", (256, 128, 9), None, "torch-struct", 20.0),
    ("kbest", None, 5, "fastest", 100.0),
    ("kbest", None, 15, "fastest", 100.0),
]
MARGINALS_BANDWIDTH_TARGET = 3.0  # crfkit's marginals at most this many times the bandwidth limit (large B)


# ---- inputs and devices -----------------------------------------------------------------------------
def to_cpu(value):
    """Peer outputs (tensors, lists, tuples, nested) on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


@contextlib.contextmanager
def state_on(peer, device):
    """Within the block, the peer's _setup moves what it builds (its CRF module, masks, helper
    tensors) to `device`: the adapters build them on the CPU."""
    original = peer._setup

    def setup(x):
        state = original(x)
        for key, value in list(state.items()):
            if isinstance(value, torch.nn.Module):
                state[key] = value.to(device)
            elif isinstance(value, torch.Tensor) and value.device.type != torch.device(device).type:
                state[key] = value.to(device)
        return state

    peer._setup = setup
    try:
        yield
    finally:
        del peer._setup  # back to the class's method


def convert_on_cpu(peer, op: str, x_cpu: cases.Inputs, out, k: Optional[int]) -> tuple:
    """The peer's GPU output in crfkit's layout, converted on the CPU with a CPU twin of the
    peer's state (the same conversions as peers.base.Peer.bind)."""
    out = to_cpu(out)
    state = peer._setup(x_cpu)
    if op == "log_partition":
        return (out,)
    if op == "log_partition_fwd_bwd":
        return out[0], out[1], peer._transitions_grad(state, out[2])
    if op == "marginals":
        valid = peers.base.mask_from_lengths(x_cpu.lengths, x_cpu.emissions.shape[1]).unsqueeze(-1)
        mu = peer._marginals_convert(state, out) if "marginals" in peer.native else out
        return (mu.masked_fill(~valid, 0),)
    if op == "viterbi":
        return tuple(peer._viterbi_convert(state, out))
    return tuple(peer._kbest_convert(state, out, k))


# ---- timing -----------------------------------------------------------------------------------------
def call_ms(fn) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop)


def median_ms(fn, min_time_s: float, single_ms: Optional[float] = None) -> float:
    slow = single_ms is not None and single_ms > 1000.0
    for _ in range(1 if slow else 3):  # warm-up: caching allocator, lazy initialisation
        fn()
    torch.cuda.synchronize()
    times: List[float] = []
    begin = time.perf_counter()
    while len(times) < (3 if slow else 5) or (not slow and time.perf_counter() - begin < min_time_s
                                               and len(times) < 1000):
        times.append(call_ms(fn))
    return statistics.median(times)


def copy_bandwidth(gib: float = 1.0) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written per second)."""
    free, _total = torch.cuda.mem_get_info()
    n = int(min(gib * 2**30, free / 4) // 4)
    buffers = [torch.empty(n, dtype=torch.float32, device="cuda").uniform_(), torch.empty(n, device="cuda")]
    ms = median_ms(lambda: buffers[1].copy_(buffers[0]), 0.5)
    buffers.clear()
    torch.cuda.empty_cache()
    return 2 * n * 4 / (ms / 1e3)


def compulsory_bytes(op: str, B: int, L: int, T: int, k: Optional[int]) -> int:
    """Bytes an op must move at least: the emissions read once (float32), plus what it writes
    that scales with the input: marginals or emission gradients (B L T float32), paths
    (B [K] L int64)."""
    emissions = 4 * B * L * T
    if op in ("marginals", "log_partition_fwd_bwd"):
        return 2 * emissions
    if op == "viterbi":
        return emissions + 8 * B * L
    if op == "kbest":
        return emissions + 8 * B * k * L
    return emissions


# ---- one cell ----------------------------------------------------------------------------------------
def failure(error: BaseException) -> str:
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return "failed: out of memory"
    return bench_peers._failure(error)


def run_peer(peer, case: cases.Case, x_cpu: cases.Inputs, wants: Dict[bool, tuple], args) -> dict:
    """Check one peer on the GPU against crfkit (wants: crfkit's CPU results, by whether the
    inputs keep their start / end scores), then time it."""
    entry = {"status": None, "how": peer.how(case.op), "ms": None, "single_ms": None}
    if case.op not in peer.supports:
        entry["status"] = "unsupported"
        return entry
    xp_cpu = bench_peers.peer_inputs(peer, x_cpu)
    xp = xp_cpu.to("cuda")
    try:
        if peer.has_start_end not in wants:
            wants[peer.has_start_end] = bench_peers.crfkit_result(case, xp_cpu)
        want = wants[peer.has_start_end]
        with state_on(peer, "cuda"):
            if case.L > PROBE:  # the cost of a call, from one on the first PROBE positions
                probe_fn = peer.bind(case.op, xp.truncated(PROBE), case.K)[0]
                probe_fn()
                estimate_s = call_ms(probe_fn) / 1e3 * case.L / PROBE
                if estimate_s > args.budget:
                    entry["status"] = f"skipped: too slow (one call ~{estimate_s:.3g} s)"
                    return entry
            fn = peer.bind(case.op, xp, case.K)[0]
        out = fn()
        entry["single_ms"] = call_ms(fn)
        error = bench_peers.compare(case, convert_on_cpu(peer, case.op, xp_cpu, out, case.K), want, xp_cpu)
        del out
        if error:
            entry["status"] = f"WRONG: {error}"
            return entry
        entry["ms"] = median_ms(fn, args.min_time, entry["single_ms"])
        entry["status"] = "ok"
    except Exception as error:  # out of memory, a peer that does not run on CUDA, ...
        entry["status"] = failure(error)
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    return entry


def run_cell(case: cases.Case, loaded, bandwidth: float, args) -> dict:
    x_cpu = cases.inputs_for(case)
    x = x_cpu.to("cuda")
    row = {"op": case.op, "B": case.B, "L": case.L, "T": case.T, "K": case.K,
           "crfkit": {"status": None, "ms": None}, "peers": {}, "fastest_peer": None, "fastest_peer_ms": None,
           "speedup": None}
    bound_ms = compulsory_bytes(case.op, case.B, case.L, case.T, case.K) / bandwidth * 1e3
    row["bandwidth_bound_ms"] = bound_ms
    op = cases.OPS[case.op]
    wants: Dict[bool, tuple] = {}  # crfkit's CPU kernels: True with start / end, False with zeros
    try:
        wants[True] = op.run(x_cpu, "compiled")
        got = to_cpu(op.run(x, "compiled"))
        error = op.check(got, wants[True], x_cpu)
        row["crfkit"]["status"] = f"WRONG: {error}" if error else "ok"
        if not error:
            row["crfkit"]["ms"] = median_ms(lambda: op.run(x, "compiled"), args.min_time)
            row["crfkit"]["x_bandwidth_bound"] = row["crfkit"]["ms"] / bound_ms
    except Exception as error:
        row["crfkit"]["status"] = failure(error)
    for name, peer, reason in loaded:
        row["peers"][name] = {"status": reason, "how": None, "ms": None} if peer is None else run_peer(
            peer, case, x_cpu, wants, args)
    correct = [(e["ms"], n) for n, e in row["peers"].items() if e["status"] == "ok" and e["ms"] is not None]
    if correct:
        row["fastest_peer_ms"], row["fastest_peer"] = min(correct)
        if row["crfkit"]["ms"]:
            row["speedup"] = row["fastest_peer_ms"] / row["crfkit"]["ms"]
    return row


# ---- report -----------------------------------------------------------------------------------------
def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def environment(argv: List[str], bandwidth: float) -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", *argv]),
        "device": torch.cuda.get_device_name(0),
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "crfkit": crfkit.__version__,
        "git": core_run.git_commit(),
        "backend_info": {k: v for k, v in crfkit.backend_info().items() if k != "unavailable"},
    }


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else (f"{x:.3g}" if x < 100 else f"{x:.0f}")


def _status(entry: dict) -> str:
    if entry["status"] == "ok":
        return _ms(entry["ms"])
    return bench_peers._short(entry["status"])


def targets(rows: List[dict]) -> List[str]:
    lines = []
    for op, shape, k, against, goal in TARGETS:
        for row in rows:
            if row["op"] != op or (shape and (row["B"], row["L"], row["T"]) != shape) or (k and row["K"] != k):
                continue
            if against == "fastest":
                peer_ms, who = row["fastest_peer_ms"], row["fastest_peer"]
            else:
                entry = row["peers"].get(against, {})
                peer_ms, who = (entry.get("ms"), against) if entry.get("status") == "ok" else (None, against)
            crfkit_ms = row["crfkit"]["ms"]
            cell = f"{op} B={row['B']} L={row['L']} T={row['T']}" + (f" K={row['K']}" if row["K"] else "")
            if peer_ms is None or crfkit_ms is None:
                lines.append(f"- {cell}: no correct {who or 'peer'} timing: target ({goal:g}x) not measurable")
                continue
            ratio = peer_ms / crfkit_ms
            lines.append(f"- {cell}: {ratio:.1f}x {who} (target {goal:g}x): {'met' if ratio >= goal else 'NOT met'}")
    big = [r for r in rows if r["op"] == "marginals" and r["B"] >= 256 and r["crfkit"].get("x_bandwidth_bound")]
    for row in big:
        x = row["crfkit"]["x_bandwidth_bound"]
        lines.append(f"- marginals B={row['B']} L={row['L']} T={row['T']}: {x:.2f}x the bandwidth limit "
                     f"(target at most {MARGINALS_BANDWIDTH_TARGET:g}x): "
                     f"{'met' if x <= MARGINALS_BANDWIDTH_TARGET else 'NOT met'}")
    return lines


def markdown(env: dict, rows: List[dict], loaded) -> str:
    names = [name for name, _, _ in loaded]
    out = [f"# crfkit on {env['device']}", "",
           f"- date: {env['date']}", f"- command: `{env['command']}`",
           f"- device: {env['device']} (compute capability {env['capability']}, {env['multiprocessors']} SMs, "
           f"{env['memory_gib']} GiB)",
           f"- torch {env['torch']}, CUDA {env['cuda']}, crfkit {env['crfkit']} ({env['git']})",
           f"- device-to-device copy bandwidth: {env['copy_bandwidth_gb_s']} GB/s (read + write)",
           "- times: median ms of one call (torch.cuda.Event), float32; bound = compulsory bytes / bandwidth;",
           "  speed-up = fastest correct peer / crfkit", ""]
    for name, peer, reason in loaded:
        out.append(f"- {name}: {peer.version if peer else reason}")
    out += ["", "## Targets", "", *targets(rows), "", "## Cells", ""]
    header = ["op", "B", "L", "T", "K", "crfkit ms", "bound ms", "x bound", *names, "speed-up"]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "---|" * len(header))
    for row in rows:
        c = row["crfkit"]
        cells = [row["op"], str(row["B"]), str(row["L"]),
                 str(row["T"]), str(row["K"] or ""), _status(c), _ms(row["bandwidth_bound_ms"]),
                 f"{c['x_bandwidth_bound']:.2f}" if c.get("x_bandwidth_bound") else "-",
                 *[_status(row["peers"][n]) for n in names],
                 f"{row['speedup']:.1f}x ({row['fastest_peer']})" if row["speedup"] else "-"]
        out.append("| " + " | ".join(cells) + " |")
    wrong = [(row, n, e["status"]) for row in rows for n, e in row["peers"].items()
             if e["status"] and e["status"].startswith(("WRONG", "failed"))]
    if wrong:
        out += ["", "## Peers that were wrong or failed", ""]
        out += [f"- {n}, {r['op']} B={r['B']} L={r['L']} T={r['T']} K={r['K']}: {s}" for r, n, s in wrong]
    return "\n".join(out) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the quick shapes (default)")
    size.add_argument("--full", action="store_true", help="B 1..1024 x L 32..512 x T 9, 37")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    parser.add_argument("--peers", default=None, help="comma-separated peer names (default: all)")
    parser.add_argument("--budget", type=float, default=10.0, help="skip a peer call estimated above this (s)")
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds of timed calls per library and cell")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated BxLxT cells instead of --quick / --full, e.g. 256x128x9,1x128x9")
    parser.add_argument("--out", default=None, help="output path without extension")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available() or not crfkit.backend_info()["cuda_kernels"]:
        print("bench_gpu: needs a CUDA device and crfkit._C built with its CUDA kernels "
              f"(torch.cuda.is_available() = {torch.cuda.is_available()}, "
              f"cuda_kernels = {crfkit.backend_info()['cuda_kernels']})", file=sys.stderr)
        return 2
    ops = [o for o in args.ops.split(",") if o]
    unknown = set(ops) - set(OPS)
    if unknown:
        parser.error(f"unknown ops {sorted(unknown)}")
    loaded = peers.load_peers(args.peers.split(",") if args.peers else None)
    bandwidth = copy_bandwidth()
    env = environment(["benchmarks/bench_gpu.py", *argv], bandwidth)
    print(f"{env['device']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s", file=sys.stderr, flush=True)
    shapes = FULL_SHAPES if args.full else QUICK_SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in cell.split("x")) for cell in args.shapes.split(",") if cell]
    out = Path(args.out) if args.out else HERE.parent / "runs" / "bench" / f"gpu_{device_slug(env['device'])}"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, report = [], ""
    for B, L, T in shapes:
        for op in ops:
            for k in (KS if op == "kbest" else (None,)):
                case = cases.Case(op, B, L, T, k)
                begin = time.perf_counter()
                rows.append(run_cell(case, loaded, bandwidth, args))
                r = rows[-1]
                print(f"{case.id}: crfkit {_status(r['crfkit'])} ms, "
                      + ", ".join(f"{n} {_status(e)}" for n, e in r["peers"].items())
                      + f" ({time.perf_counter() - begin:.0f} s)", file=sys.stderr, flush=True)
                # after every cell, so that a run stopped by a time limit keeps what it measured
                report = write_results(out, env, rows, loaded)
    print(report)
    return 0


def write_results(out: Path, env: dict, rows: List[dict], loaded) -> str:
    """<out>.md and <out>.json from the cells so far; returns the markdown."""
    report = markdown(env, rows, loaded)
    out.with_suffix(".md").write_text(report)
    out.with_suffix(".json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1, default=str))
    return report


if __name__ == "__main__":
    sys.exit(main())
