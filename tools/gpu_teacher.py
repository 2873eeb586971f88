"""Fine-tune the MPNet-base teacher on a lent GPU machine (the device tool), and bring it back.

Issue 28 asks for the MPNet-base teacher where a session has a GPU. On this project's 2-core CPU
machine its 4 epochs take about 2 h 40 min (1756 steps of 32 sentences: longer than a working
session, so it runs across sessions from its checkpoints); on an H100 / H200 a few minutes.
What makes it awkward is the device tool's transfer limits: a call carries at most 64 MiB of
working tree, returns at most 8 files of 16 MiB (64 MiB in all), and the machine keeps what it
holds only while it is warm (30 s after a call). The weights (438 MB in float32) therefore
travel as float16 (219 MB, a rounding of about 1e-4 relative) in pieces, one per call, in calls
made back to back:

    python tools/gpu_teacher.py pack            # here: writes .gpu_payload/up1 .. up4, prints the calls
    # device calls, one right after the other (the machine must stay warm):
    #   carry [".gpu_payload/up1"]: python3 tools/gpu_teacher.py receive --build
    #   carry [".gpu_payload/up2"]: python3 tools/gpu_teacher.py receive     (likewise up3, up4)
    #   python3 tools/gpu_teacher.py train         -> $OUT: the record, the log, weights part 1
    #   python3 tools/gpu_teacher.py send 2        (likewise 3, 4)
    python tools/gpu_teacher.py unpack /work/.device/N ... --workdir runs/mpnet

`receive --build` also starts building crfkit's CUDA kernels in the background (setsid: the
build outlives the call); `train` waits for it (else runs on the reference backend, and says
so). `train` runs `python -m crfkit.pipeline --full --stages teacher` with the MPNet folder it
assembled; the record it writes names the GPU machine. `unpack` rebuilds the teacher's folder
(float32 again, from the float16 weights) in WORKDIR/teacher, where the `label` and `students`
stages on this machine find it; the record goes to WORKDIR/results.jsonl, with a note of the
rounding. Nothing here is committed: the payload folder is ignored, and the weights never leave
the run's workdir.

Estimated device time (measured parts: a start 30-90 s, a call's overhead 10-20 s, the CUDA
build 120 s): 4 uploads and 3 downloads of about 20 s each, the teacher's 4 epochs a few
minutes: about 8-10 of a session's 15 minutes.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAYLOAD = ROOT / ".gpu_payload"          # here: what the upload calls carry (ignored by git)
STORE = Path(os.environ.get("GPU_TEACHER_STORE", "/root/gpu_teacher"))  # there: kept between calls
CALL_LIMIT = 56 << 20                     # bytes of payload per call (64 MiB with the tree)
RETURN_PIECE = 14 << 20                   # bytes per returned file (16 MiB at most)
RETURN_PIECES_PER_CALL = 4                # 4 x 14 MiB, with room for the small files (64 MiB)


# ---- float16 weights in pieces ------------------------------------------------------------------
def to_half_bytes(path: Path) -> bytes:
    """A safetensors file with its floating tensors in float16, as bytes."""
    from safetensors.torch import load_file, save

    tensors = load_file(str(path))
    return save({k: v.half() if v.is_floating_point() else v for k, v in tensors.items()})


def from_half_bytes(blob: bytes, target: Path) -> None:
    """Write blob's tensors as float32 safetensors to target."""
    from safetensors.torch import load, save_file

    tensors = load(blob)
    save_file({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, str(target))


def split(blob: bytes, size: int) -> list[bytes]:
    return [blob[i:i + size] for i in range(0, len(blob), size)]


def write_pieces(pieces: list[bytes], folder: Path) -> None:
    """teacher.01-of-NN, ...: each piece names the count, so that a lost one is noticed."""
    for i, piece in enumerate(pieces, 1):
        (folder / f"teacher.{i:02d}-of-{len(pieces):02d}").write_bytes(piece)


def join_pieces(paths: list[Path]) -> bytes:
    """The blob of write_pieces' files (found in any order), checked complete."""
    by_number, counts = {}, set()
    for path in paths:
        number, count = path.name.split(".")[1].split("-of-")
        by_number[int(number)] = path
        counts.add(int(count))
    if len(counts) != 1 or sorted(by_number) != list(range(1, counts.pop() + 1)):
        raise SystemExit(f"missing weight pieces: have {sorted(p.name for p in paths)}")
    return b"".join(by_number[i].read_bytes() for i in sorted(by_number))


# ---- here: pack ---------------------------------------------------------------------------------
def site_file(package: str, *relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{package} is not installed here (see ../shared/DATA.md)")
    return Path(list(spec.submodule_search_locations)[0], *relative)


def pack(args) -> None:
    sys.path.insert(0, str(ROOT))
    from crfkit.taggers.encoders import encoder_path

    encoder = Path(encoder_path(args.encoder))
    shutil.rmtree(PAYLOAD, ignore_errors=True)
    pieces = split(to_half_bytes(encoder / "model.safetensors"), CALL_LIMIT)
    base = PAYLOAD / f"up{len(pieces)}"   # the small files ride with the last (smallest) piece
    for i, piece in enumerate(pieces, 1):
        (PAYLOAD / f"up{i}").mkdir(parents=True, exist_ok=True)
        (PAYLOAD / f"up{i}" / f"weights.{i:02d}").write_bytes(piece)
    (base / "encoder").mkdir()
    for f in encoder.iterdir():
        if f.is_file() and f.name != "model.safetensors" and f.stat().st_size < (4 << 20):
            shutil.copy(f, base / "encoder" / f.name)
    # The data the pipeline reads, laid out as the packages it finds them in (namespace packages).
    conll = base / "site" / "neuroner" / "data" / "conll2003" / "en"
    conll.mkdir(parents=True)
    for split_name in ("train", "valid", "test"):
        shutil.copy(site_file("neuroner", "data", "conll2003", "en", f"{split_name}.txt"), conll)
    news = base / "site" / "gensim" / "test" / "test_data"
    news.mkdir(parents=True)
    shutil.copy(site_file("gensim", "test", "test_data", "lee_background.cor"), news)
    shutil.copytree(site_file("seqeval"), base / "site" / "seqeval",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (base / "manifest.json").write_text(json.dumps({"pieces": len(pieces), "encoder": str(encoder)}))
    for i in range(1, len(pieces) + 1):
        size = sum(f.stat().st_size for f in (PAYLOAD / f"up{i}").rglob("*") if f.is_file())
        print(f"carry [\".gpu_payload/up{i}\"] ({size / 2**20:.1f} MiB): python3 tools/gpu_teacher.py receive"
              + (" --build" if i == 1 else ""))


# ---- there: receive, train, send ----------------------------------------------------------------
def receive(args) -> None:
    STORE.mkdir(parents=True, exist_ok=True)
    for folder in sorted(PAYLOAD.glob("up*")):
        shutil.copytree(folder, STORE / "in", dirs_exist_ok=True)
        print(f"received {folder.name}: {sorted(p.name for p in folder.iterdir())}")
    if args.build:
        # setsid: the build goes on after this call returns (the device tool ends the others).
        log = open(STORE / "build.log", "w")
        env = dict(os.environ, CRFKIT_ARCH="native", MAX_JOBS=str(os.cpu_count()))
        if os.access("/usr/bin/g++", os.X_OK):  # torch's shared libstdc++ (see tools/gpu_checks.sh)
            env.update(CC="/usr/bin/gcc", CXX="/usr/bin/g++")
        command = f"{sys.executable} setup.py build_ext --inplace && touch {STORE}/build.done"
        subprocess.Popen(["setsid", "bash", "-c", command], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        print("build started in the background")


def train(args) -> None:
    out = Path(os.environ.get("OUT", STORE / "out"))
    out.mkdir(parents=True, exist_ok=True)
    incoming = STORE / "in"
    manifest = json.loads((incoming / "manifest.json").read_text())
    blob = b"".join((incoming / f"weights.{i:02d}").read_bytes() for i in range(1, manifest["pieces"] + 1))
    encoder = STORE / "mpnet"
    shutil.copytree(incoming / "encoder", encoder, dirs_exist_ok=True)
    from_half_bytes(blob, encoder / "model.safetensors")
    deadline = time.time() + args.build_wait
    while not (STORE / "build.done").exists() and time.time() < deadline:
        time.sleep(2)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(incoming / "site"), str(ROOT)]),
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    workdir = STORE / "run"
    command = [sys.executable, "-m", "crfkit.pipeline", "--full", "--workdir", str(workdir), "--stages", "teacher",
               "--teacher-encoder", str(encoder), *args.pipeline_args]
    with open(out / "train.log", "w") as log:
        subprocess.run([sys.executable, "-c", "import crfkit; print(crfkit.backend_info())"], cwd=ROOT, env=env,
                       stdout=log, stderr=subprocess.STDOUT)
        log.flush()
        rc = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    text = (out / "train.log").read_text(errors="replace")
    (out / "train.log").write_text(text[-(2 << 20):])  # progress bars: keep the last 2 MB
    print(text[-3000:])
    if rc != 0:
        raise SystemExit(f"the pipeline failed (rc {rc}): see train.log")
    model = workdir / "teacher" / "model"
    back = STORE / "back"
    shutil.rmtree(back, ignore_errors=True)
    back.mkdir()
    write_pieces(split(to_half_bytes(model / "model.safetensors"), RETURN_PIECE), back)
    # The small files in one archive (a call returns 8 files at most): the model folder without its
    # weights, the run's result and record.
    staging = STORE / "small"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(model, staging / "model", ignore=shutil.ignore_patterns("model.safetensors"))
    shutil.copy(workdir / "teacher" / "result.json", staging / "result.json")
    shutil.make_archive(str(out / "teacher_files"), "gztar", root_dir=staging)
    send_pieces(1, out)


def send_pieces(call: int, out: Path) -> None:
    """Copy the call-th group of returned pieces to out."""
    pieces = sorted((STORE / "back").glob("teacher.*"))
    group = pieces[(call - 1) * RETURN_PIECES_PER_CALL:call * RETURN_PIECES_PER_CALL]
    for piece in group:
        shutil.copy(piece, out / piece.name)
    calls = -(-len(pieces) // RETURN_PIECES_PER_CALL)
    print(f"sent {[p.name for p in group]}; {len(pieces)} pieces in {calls} calls")


def send(args) -> None:
    send_pieces(args.call, Path(os.environ["OUT"]))


# ---- here: unpack -------------------------------------------------------------------------------
def unpack(args) -> None:
    folders = [Path(f) for f in args.folders]
    found = {f.name: f for folder in folders for f in folder.iterdir()}
    blob = join_pieces([path for name, path in found.items() if name.startswith("teacher.")])
    teacher = Path(args.workdir) / "teacher"
    teacher.mkdir(parents=True, exist_ok=True)
    shutil.unpack_archive(str(found["teacher_files.tar.gz"]), str(teacher))
    model = teacher / "model"
    from_half_bytes(blob, model / "model.safetensors")
    result = json.loads((teacher / "result.json").read_text())
    # The students' records name their teacher by the digest of the folder here.
    result["device_teacher_sha256"] = result["teacher_sha256"]
    result["teacher_sha256"] = hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()
    result["note"] = ("fine-tuned on the GPU machine named in 'machine'; its weights came back as float16 "
                      "(tools/gpu_teacher.py), so the folder here is that rounding (teacher_sha256), not the "
                      "exact weights the F1 above was measured with (device_teacher_sha256)")
    (teacher / "result.json").write_text(json.dumps(result, indent=1))
    with open(Path(args.workdir) / "results.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    print(f"teacher in {model}: dev {result['dev_f1']}, test {result['test_f1']} ({result['machine']})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="here: the upload payload")
    p.add_argument("--encoder", default="mpnet")
    p.set_defaults(run=pack)
    p = sub.add_parser("receive", help="there: keep what this call carried")
    p.add_argument("--build", action="store_true", help="also start building the CUDA kernels")
    p.set_defaults(run=receive)
    p = sub.add_parser("train", help="there: fine-tune the teacher, return the first weight pieces")
    p.add_argument("--build-wait", type=float, default=240.0, help="seconds to wait for the build")
    p.add_argument("pipeline_args", nargs="*", help="more arguments for crfkit.pipeline (after --)")
    p.set_defaults(run=train)
    p = sub.add_parser("send", help="there: return the call-th group of weight pieces")
    p.add_argument("call", type=int)
    p.set_defaults(run=send)
    p = sub.add_parser("unpack", help="here: rebuild the teacher from the fetched folders")
    p.add_argument("folders", nargs="+")
    p.add_argument("--workdir", required=True)
    p.set_defaults(run=unpack)
    args = parser.parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
