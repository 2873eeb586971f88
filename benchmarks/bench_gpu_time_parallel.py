"""The parallel-in-time path of log Z / marginals against the sequential kernels, on a GPU.

    python benchmarks/bench_gpu_time_parallel.py [--shapes 1x512x9,32x512x9] [--chunks 0,16,32]
                                                 [--min-time 0.3] [--out PATH]

Per shape and op (log Z forward; log Z forward + backward to emissions and transitions, as
bench_gpu.py's log_partition_fwd_bwd; marginals; Viterbi), the median ms of one whole call (torch.cuda.Event
around it, host work included, as bench_gpu.py) with CRFKIT_CUDA_TIME_PARALLEL=never (the
sequential kernels), =always for each chunk length of --chunks (0: the default, ceil(sqrt(2 L))),
and =auto (what users get), and torch-struct's LinearChainCRF where it is installed (its
forward + backward: the partition's gradient; its marginals). Each crfkit mode is checked
against the sequential kernels first. Prints a Markdown table; --out writes <out>.md / .json.

--graphs adds a second table: the same calls captured in a CUDA graph and replayed (median ms of
one replay), i.e. the device time without the host's per-call cost (launches, allocations,
the autograd engine), as a user of CUDA graphs or torch.compile(mode="reduce-overhead") sees it.
crfkit's ops capture (deferred error mode is automatic during a capture); a peer that does not
capture is reported as failed.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import median_ms  # noqa: E402

import crfkit  # noqa: E402


def inputs(B, L, T):
    g = torch.Generator().manual_seed(B * 7919 + L * 31 + T)
    em = torch.randn(B, L, T, generator=g).cuda()
    tr = torch.randn(T, T, generator=g).cuda()
    ln = torch.full((B,), L, dtype=torch.long).cuda()
    return em, tr, ln


def crfkit_calls(em, tr, ln):
    def fwd():
        return crfkit.log_partition(em, tr, ln)

    def fwd_bwd():
        e, t = em.detach().requires_grad_(), tr.detach().requires_grad_()
        log_z = crfkit.log_partition(e, t, ln)
        return (log_z.detach(), *torch.autograd.grad(log_z.sum(), (e, t)))

    def marginals():
        return crfkit.marginals(em, tr, ln)

    def viterbi():
        return crfkit.viterbi(em, tr, ln)

    return {"log_partition": fwd, "log_partition_fwd_bwd": fwd_bwd, "marginals": marginals, "viterbi": viterbi}


def torch_struct_calls(em, tr, ln):
    try:
        from torch_struct import LinearChainCRF
    except ImportError:
        return {}
    B, L, T = em.shape
    # torch-struct's potentials (B, L-1, T, T): log phi[b, i, t, s] for the edge i -> i + 1, with
    # position 0's emission folded into the first edge.
    def potentials(e, t):
        phi = e[:, 1:, :, None] + t.t()[None, None]
        return torch.cat([phi[:, :1] + e[:, :1, None, :], phi[:, 1:]], 1)

    lengths = ln

    def fwd():
        return LinearChainCRF(potentials(em, tr), lengths=lengths).partition

    def fwd_bwd():
        e, t = em.detach().requires_grad_(), tr.detach().requires_grad_()
        log_z = LinearChainCRF(potentials(e, t), lengths=lengths).partition
        return (log_z.detach(), *torch.autograd.grad(log_z.sum(), (e, t)))

    def marginals():
        return LinearChainCRF(potentials(em, tr), lengths=lengths).marginals

    def viterbi():
        return LinearChainCRF(potentials(em, tr), lengths=lengths).argmax

    return {"log_partition": fwd, "log_partition_fwd_bwd": fwd_bwd, "marginals": marginals, "viterbi": viterbi}


def with_mode(mode, chunk, fn):
    def call():
        os.environ["CRFKIT_CUDA_TIME_PARALLEL"] = mode
        if chunk:
            os.environ["CRFKIT_CUDA_TIME_CHUNK"] = str(chunk)
        else:
            os.environ.pop("CRFKIT_CUDA_TIME_CHUNK", None)
        return fn()
    return call


def graphed(fn):
    """fn captured in a CUDA graph (after warm-up on a side stream); returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def graph_table(shapes, min_time):
    lines = ["", "## Replayed CUDA graphs (device time)", "",
             "| op | B | L | T | sequential | chunked (auto) | torch-struct | chunked vs torch-struct |",
             "|---|---|---|---|---|---|---|---|"]
    records = []
    for shape in shapes:
        B, L, T = (int(v) for v in shape.split("x"))
        em, tr, ln = inputs(B, L, T)
        ours, theirs = crfkit_calls(em, tr, ln), torch_struct_calls(em, tr, ln)
        for op, fn in ours.items():
            row = {"op": op, "B": B, "L": L, "T": T, "graph_ms": {}}
            for mode in ("never", "auto"):
                os.environ["CRFKIT_CUDA_TIME_PARALLEL"] = mode  # read while capturing
                row["graph_ms"][mode] = median_ms(graphed(fn), min_time)
                # Each graph's private memory pool and the cached blocks of the warm-up go back
                # before the next capture, so that one capture's memory cannot starve the next.
                gc.collect()
                torch.cuda.empty_cache()
            os.environ.pop("CRFKIT_CUDA_TIME_PARALLEL", None)
            try:
                row["graph_ms"]["torch-struct"] = median_ms(graphed(theirs[op]), min_time) if op in theirs else None
            except Exception as error:  # noqa: BLE001 (a peer's failure is a result)
                row["graph_ms"]["torch-struct"] = None
                row["torch_struct_error"] = repr(error)[:200]
            gc.collect()
            torch.cuda.empty_cache()
            g = row["graph_ms"]
            ratio = f"{g['torch-struct'] / g['auto']:.1f}x" if g["torch-struct"] else "-"
            ts = f"{g['torch-struct']:.3f}" if g["torch-struct"] else "failed"
            lines.append(f"| {op} | {B} | {L} | {T} | {g['never']:.3f} | {g['auto']:.3f} | {ts} | {ratio} |")
            print(lines[-1], flush=True)
            records.append(row)
    return lines, records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1x512x9,32x512x9,1x128x9,32x128x9,256x128x9,1024x128x9,"
                                            "8x1024x9,1x2048x9,32x512x32")
    parser.add_argument("--chunks", default="0,16,32")
    parser.add_argument("--min-time", type=float, default=0.3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--graphs", default="", help="shapes for the CUDA-graph table (e.g. 1x512x9,32x512x9)")
    args = parser.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    command = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    modes = [("never", 0)] + [("always", c) for c in chunks] + [("auto", 0)]
    header = ["op", "B", "L", "T"] + [f"{m}{'' if not c else f' S={c}'}" for m, c in modes] + \
        ["torch-struct", "best chunked vs sequential", "auto vs torch-struct"]
    lines = [f"# Parallel in time on {torch.cuda.get_device_name()}", "",
             f"- command: `{command}`", f"- torch {torch.__version__}, CUDA {torch.version.cuda}, crfkit {git}",
             "- median ms of one whole call (torch.cuda.Event, host included), float32, full-length sentences", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    records = []
    for shape in [s for s in args.shapes.split(",") if s]:
        B, L, T = (int(v) for v in shape.split("x"))
        em, tr, ln = inputs(B, L, T)
        ours, theirs = crfkit_calls(em, tr, ln), torch_struct_calls(em, tr, ln)
        for op, fn in ours.items():
            want = with_mode("never", 0, fn)()
            row = {"op": op, "B": B, "L": L, "T": T, "ms": {}}
            for mode, chunk in modes:
                call = with_mode(mode, chunk, fn)
                got = call()
                pairs = zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,))
                for a, b in pairs:
                    if op == "viterbi":  # equal but for near-ties within rounding: counted, not raised
                        row["differing"] = row.get("differing", 0) + int((a != b).sum())
                        continue
                    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * max(1.0, float(b.abs().max())) ** 0.5)
                row["ms"][f"{mode}{'' if not chunk else f'_{chunk}'}"] = median_ms(call, args.min_time)
            if op in theirs:
                try:
                    row["ms"]["torch-struct"] = median_ms(theirs[op], args.min_time)
                except Exception as error:  # noqa: BLE001 (a peer's failure is a result)
                    row["ms"]["torch-struct"] = None
                    row["torch_struct_error"] = repr(error)[:200]
            os.environ.pop("CRFKIT_CUDA_TIME_PARALLEL", None)
            os.environ.pop("CRFKIT_CUDA_TIME_CHUNK", None)
            ms = row["ms"]
            chunked = min(v for k, v in ms.items() if k.startswith("always"))
            ts = ms.get("torch-struct")
            cells = [f"{v:.3f}" if v is not None else "-" for v in ms.values()]
            if "torch-struct" not in ms:
                cells.append("-")
            vs_peer = f"{ts / ms['auto']:.1f}x" if ts else "-"
            lines.append(f"| {op} | {B} | {L} | {T} | " + " | ".join(cells) +
                         f" | {ms['never'] / chunked:.2f}x | {vs_peer} |")
            print(lines[-1], flush=True)
            records.append(row)
    graph_records = []
    if args.graphs:
        try:
            graph_lines, graph_records = graph_table(args.graphs.split(","), args.min_time)
            lines += graph_lines
        except Exception as error:  # noqa: BLE001 (keep the first table)
            lines += ["", f"CUDA-graph table failed: {error!r}"[:400]]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out + ".md").write_text(text)
        Path(args.out + ".json").write_text(json.dumps({"command": command, "git": git,
                                                        "device": torch.cuda.get_device_name(),
                                                        "records": records, "graph_records": graph_records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
