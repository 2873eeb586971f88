"""A BiLSTM student on CoNLL-2003 test, four ways in one run: the PyTorch tagger, onnxruntime on its
ONNX export (Viterbi inside), the int8 student (torch.ao dynamic quantisation) and onnxruntime on
the int8 ONNX model (what `python -m crfkit.export --int8` writes).

    python benchmarks/export_speed.py --model runs/export/students/vanilla-k5-seed0/model [--threads 1]

Each way tags the whole test split in the same batches (--batch-size, same featurize()), and the
whole pass is timed: featurisation, the model, the decode and the tag names. The passes are
interleaved (a, b, c, d, a, b, ...) --repeats times so that a busy machine slows every way alike,
and the median pass is reported. Before timing, the ONNX paths are checked against PyTorch's.
Writes <out>.md (default benchmarks/results/export_speed.md) and <out>.json: entity F1 (seqeval,
strict), sentences per second, whether each way gives exactly PyTorch's entities, the command,
the commit, the machine and the thread count.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / "export_speed"


def tag_all(decode, tagger, token_lists, batch_size):
    """Tag names of every sentence: decode(batch) -> (B, L) paths (numpy or torch), batch_size
    sentences at a time."""
    tagged = []
    for begin in range(0, len(token_lists), batch_size):
        chunk = token_lists[begin:begin + batch_size]
        paths = np.asarray(decode(tagger.featurize(chunk)))
        tagged.extend([[tagger.labels[t] for t in row[:len(tokens)]] for tokens, row in zip(chunk, paths)])
    return tagged


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a saved BiLSTMCRFTagger (the student)")
    parser.add_argument("--threads", type=int, default=1, help="torch and onnxruntime intra-op threads (default 1)")
    parser.add_argument("--batch-size", type=int, default=32, help="sentences per batch (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over the test split per way (default 3)")
    parser.add_argument("--max-sentences", type=int, default=0, help="first N test sentences (0: all)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output path without extension")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)

    import onnx
    import onnxruntime as ort

    from crfkit.export import export_onnx, quantize_onnx, quantize_student
    from crfkit.packaged import load_conll2003
    from crfkit.tag import entities
    from crfkit.taggers import BiLSTMCRFTagger, load_tagger
    from crfkit.tool.records import git_commit, machine_description
    from crfkit.training.metrics import entity_scores

    command = shlex.join(["python", os.path.relpath(__file__, ROOT)] + [
        os.path.relpath(a, ROOT) if os.path.isabs(a) else a for a in (argv if argv is not None else sys.argv[1:])])
    commit = git_commit()
    tagger = load_tagger(args.model)
    if not isinstance(tagger, BiLSTMCRFTagger):
        parser.error(f"--model holds a {type(tagger).__name__}; this benchmark is for BiLSTM students")
    sentences = load_conll2003("test", max_sentences=args.max_sentences or None)
    token_lists, gold = [s.tokens for s in sentences], [s.tags for s in sentences]

    scratch = tempfile.mkdtemp(prefix="crfkit-export-speed-")
    float_path, int8_path = os.path.join(scratch, "student.onnx"), os.path.join(scratch, "student.int8.onnx")
    begin = time.perf_counter()
    export_onnx(tagger, float_path)
    export_seconds = time.perf_counter() - begin
    begin = time.perf_counter()
    quantize_onnx(float_path, int8_path)
    quantize_onnx_seconds = time.perf_counter() - begin
    begin = time.perf_counter()
    student_int8 = quantize_student(tagger)
    quantize_student_seconds = time.perf_counter() - begin

    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.inter_op_num_threads = 1
    sessions = {path: ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
                for path in (float_path, int8_path)}
    input_names = [i.name for i in sessions[float_path].get_inputs()]

    def onnx_decode(path):
        session = sessions[path]
        return lambda batch: session.run(["paths"], {name: batch[name].numpy() for name in input_names})[0]

    def torch_decode(model):
        def decode(batch):
            with torch.no_grad():
                return model.decode(batch).numpy()
        return decode

    ways = {
        "pytorch": ("PyTorch float32 (the tagger)", torch_decode(tagger)),
        "onnxruntime": ("onnxruntime float32 (ONNX export, Viterbi inside)", onnx_decode(float_path)),
        "torch_int8": ("PyTorch int8 (quantize_student: torch.ao dynamic, LSTM + linear)", torch_decode(student_int8)),
        "onnxruntime_int8": ("onnxruntime int8 (quantize_onnx / --int8: LSTM + linear)", onnx_decode(int8_path)),
    }
    tagger.eval()
    # correctness first: the tagger's own predict(), and the ONNX paths equal to PyTorch's
    predictions = {name: tag_all(decode, tagger, token_lists, args.batch_size) for name, (_, decode) in ways.items()}
    assert predictions["pytorch"] == tagger.predict(token_lists, batch_size=args.batch_size)
    seconds = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, (_, decode) in ways.items():
            begin = time.perf_counter()
            tag_all(decode, tagger, token_lists, args.batch_size)
            seconds[name].append(time.perf_counter() - begin)

    reference = predictions["pytorch"]
    reference_entities = [entities(t, p) for t, p in zip(token_lists, reference)]
    tokens = sum(len(t) for t in token_lists)
    rows = []
    for name, (description, _) in ways.items():
        predicted = predictions[name]
        scores = entity_scores(gold, predicted, tagger.scheme)
        median = statistics.median(seconds[name])
        differing_tokens = sum(a != b for p, q in zip(predicted, reference) for a, b in zip(p, q))
        same_entities = [entities(t, p) for t, p in zip(token_lists, predicted)] == reference_entities
        rows.append({"way": name, "description": description, "f1": round(100 * scores["f1"], 2),
                     "precision": round(100 * scores["precision"], 2), "recall": round(100 * scores["recall"], 2),
                     "sentences_per_s": round(len(token_lists) / median, 1),
                     "seconds": [round(s, 3) for s in seconds[name]], "same_entities_as_pytorch": same_entities,
                     "tokens_differing_from_pytorch": differing_tokens,
                     "sentences_differing_from_pytorch": sum(p != q for p, q in zip(predicted, reference))})
    record = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": command, "commit": commit,
        "machine": machine_description(), "threads": args.threads, "batch_size": args.batch_size,
        "repeats": args.repeats, "sentences": len(token_lists), "tokens": tokens, "gold_entities": None,
        "model": {"class": type(tagger).__name__, "config": tagger.config(), "parameters": tagger.num_parameters()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "onnx": onnx.__version__,
                     "onnxruntime": ort.__version__},
        "files": {"onnx_bytes": os.path.getsize(float_path), "onnx_int8_bytes": os.path.getsize(int8_path)},
        "preparation_seconds": {"export_onnx": round(export_seconds, 2),
                                "quantize_onnx": round(quantize_onnx_seconds, 2),
                                "quantize_student": round(quantize_student_seconds, 3)},
        "rows": rows,
    }
    record["gold_entities"] = entity_scores(gold, reference, tagger.scheme)["entities"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(record))
    print(markdown(record))
    for path in (float_path, int8_path):
        os.unlink(path)
    os.rmdir(scratch)
    return 0


def markdown(record: dict) -> str:
    base = next(r for r in record["rows"] if r["way"] == "pytorch")
    lines = [
        "# A BiLSTM student exported: PyTorch, onnxruntime and int8 on CoNLL-2003 test",
        "",
        f"Written by `benchmarks/export_speed.py` on {record['date'][:10]}: the whole test split "
        f"({record['sentences']} sentences, {record['tokens']} tokens, {record['gold_entities']} gold entities) "
        f"tagged {record['repeats']} times by each way, passes interleaved, batches of {record['batch_size']} "
        "sentences; a pass is featurize() + the model + the Viterbi decode + tag names, and sentences/s is "
        "from the median pass. Entity F1: seqeval, strict, BIO.",
        "",
        "| way | entity F1 | P / R | sentences/s | vs PyTorch | same entities as PyTorch | tokens differing |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        lines.append(f"| {row['description']} | {row['f1']:.2f} | {row['precision']:.2f} / {row['recall']:.2f} | "
                     f"{row['sentences_per_s']:.0f} | {row['sentences_per_s'] / base['sentences_per_s']:.2f}x | "
                     f"{'yes' if row['same_entities_as_pytorch'] else 'no'} | "
                     f"{row['tokens_differing_from_pytorch']} of {record['tokens']} |")
    files, prep = record["files"], record["preparation_seconds"]
    lines += [
        "",
        f"- Command: `{record['command']}`",
        f"- Commit: {record['commit']}; machine: {record['machine']}; threads: {record['threads']} (torch "
        f"intra-op and onnxruntime intra-op, onnxruntime inter-op 1); versions: "
        + ", ".join(f"{k} {v}" for k, v in record["versions"].items()),
        f"- Model: {record['model']['class']} {json.dumps(record['model']['config'])}, "
        f"{record['model']['parameters']:,} parameters",
        f"- ONNX model {files['onnx_bytes'] / 1e6:.1f} MB, int8 ONNX model {files['onnx_int8_bytes'] / 1e6:.1f} MB "
        "(the word table stays float); export_onnx took "
        f"{prep['export_onnx']:.1f} s, quantize_onnx {prep['quantize_onnx']:.1f} s, quantize_student "
        f"{prep['quantize_student']:.2f} s",
        "- Seconds per pass: " + "; ".join(f"{r['way']} {', '.join(f'{s:.2f}' for s in r['seconds'])}"
                                            for r in record["rows"]),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
