"""Export a saved crfkit tagger so that it tags outside Python's crfkit.

    python -m crfkit.export --model DIR --onnx tagger.onnx                  # emissions + Viterbi, float
    python -m crfkit.export --model DIR --onnx tagger.int8.onnx --int8      # BiLSTM student, int8
    python -m crfkit.export --model DIR --export-pt2 tagger.pt2             # torch.export / AOTInductor

DIR is a folder written by a tagger's save_pretrained (a BiLSTM+CRF student or a transformer+CRF
teacher). The ONNX model's inputs are the tagger's featurize() tensors by name, its outputs "paths"
(B, L) int64 (-1 past each length), "scores" (B,) and "emissions" (B, L, T); its metadata holds the
labels (crfkit.export.onnx says more). After writing it, the command tags a few sentences with
onnxruntime and with the PyTorch tagger and says whether the paths agree (--no-verify skips that).

--int8 applies to the ONNX model: its LSTM and linear layers are dynamically quantised
(onnxruntime.quantization; the decode and the CRF stay float), the route that makes a smaller,
faster file which any onnxruntime loads. A pt2 package stays float (the exact one): a torch.ao
int8 tagger lives only in memory (crfkit.export.quantize_student), and whether torch.export keeps
its int8 kernels has not been checked.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

__all__ = ["main", "verify_onnx"]

# Sentences to compare onnxruntime with PyTorch on: other lengths than the tracing example's,
# a one-word sentence, and a batch with padding.
_CHECK_SENTENCES = [["EU", "rejects", "German", "call", "to", "boycott", "British", "lamb", "."], ["Japan"],
                    ["Peter", "Blackburn", "reports", "from", "BRUSSELS", "on", "1996-08-22", "."],
                    ["The", "European", "Commission", "said", "on", "Thursday", "it", "disagreed", "with",
                     "German", "advice", "to", "consumers", "to", "shun", "British", "lamb", "until",
                     "scientists", "determine", "whether", "mad", "cow", "disease", "can", "be", "transmitted",
                     "to", "sheep", "."], ["Nadim", "Ladki"]]


def verify_onnx(tagger, path: str, sentences=_CHECK_SENTENCES) -> dict:
    """Tag sentences (word lists) with onnxruntime on the model at path and with the PyTorch
    tagger, in one padded batch. Returns {"sentences", "tokens", "same_paths" (bool),
    "tokens_agreeing", "max_score_difference"}."""
    import numpy as np
    import torch

    from .._optional import require
    from .onnx import ONNX_INSTALL

    ort = require("onnxruntime", ONNX_INSTALL)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    tagger.eval()
    batch = tagger.featurize(sentences)
    names = [i.name for i in session.get_inputs()]
    paths, scores = session.run(["paths", "scores"], {name: batch[name].numpy() for name in names})
    with torch.no_grad():
        expected = tagger.crf.decode(tagger.emissions(batch), lengths=batch["lengths"])
    real = (torch.arange(paths.shape[1]) < batch["lengths"][:, None]).numpy()
    agreeing = int(((paths == expected.paths.numpy()) & real).sum())
    return {"sentences": len(sentences), "tokens": int(real.sum()),
            "same_paths": bool(np.array_equal(paths, expected.paths.numpy())), "tokens_agreeing": agreeing,
            "max_score_difference": float(np.abs(scores - expected.scores.numpy()).max())}


def _size(path: str) -> str:
    return f"{os.path.getsize(path) / 1e6:.1f} MB"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m crfkit.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, metavar="DIR", help="a folder written by a tagger's save_pretrained")
    parser.add_argument("--onnx", metavar="OUT.onnx", help="write the tagger, Viterbi decode included, as ONNX")
    parser.add_argument("--export-pt2", metavar="OUT.pt2", help="write a torch.export / AOTInductor package")
    parser.add_argument("--int8", action="store_true",
                        help="quantise the ONNX model's LSTM and linear layers to int8 (BiLSTM students)")
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset (default 18; at least 13)")
    parser.add_argument("--no-verify", action="store_true",
                        help="do not compare onnxruntime's paths with PyTorch's on a few sentences")
    args = parser.parse_args(argv)
    if args.onnx is None and args.export_pt2 is None:
        parser.error("nothing to write: give --onnx OUT.onnx and / or --export-pt2 OUT.pt2")
    if args.int8 and args.onnx is None:
        parser.error("--int8 quantises the ONNX model: give --onnx OUT.onnx (a pt2 package stays float)")
    if args.opset is not None and args.opset < 13:
        parser.error(f"argument --opset: expected an int >= 13, got {args.opset}")
    if not os.path.isdir(args.model):
        parser.error(f"--model {args.model!r} is not a folder (a saved tagger is the folder that save_pretrained "
                     "wrote: config.json, model.safetensors, ...)")
    if args.onnx is not None:
        from .._optional import require
        from .onnx import ONNX_INSTALL

        try:  # before loading the model: a missing package should not cost that wait (onnxscript,
            # which only the transformer's export needs, is asked for by export_onnx)
            for module in ("onnx", "onnxruntime"):
                require(module, ONNX_INSTALL)
        except ImportError as error:
            parser.exit(1, f"{parser.prog}: error: {error}\n")

    from ..taggers import BiLSTMCRFTagger, load_tagger

    try:
        tagger = load_tagger(args.model)
    except (FileNotFoundError, ValueError) as error:
        parser.error(f"--model {args.model!r}: {error}")
    if args.int8 and not isinstance(tagger, BiLSTMCRFTagger):
        parser.error(f"--int8 quantises BiLSTM students; {args.model!r} holds a {type(tagger).__name__}")

    if args.onnx is not None:
        from .onnx import DEFAULT_OPSET, export_onnx
        from .quantize import quantize_onnx

        opset = args.opset or DEFAULT_OPSET
        with tempfile.TemporaryDirectory() as scratch:
            float_path = os.path.join(scratch, "float.onnx") if args.int8 else args.onnx
            export_onnx(tagger, float_path, opset=opset)
            what = "float32"
            if not args.no_verify:
                check = verify_onnx(tagger, float_path)
                verdict = "the same" if check["same_paths"] else "DIFFERENT"
                print(f"{parser.prog}: onnxruntime and PyTorch give {verdict} paths on {check['sentences']} check "
                      f"sentences (scores within {check['max_score_difference']:.1e})", file=sys.stderr)
                if not check["same_paths"]:
                    return 1
            if args.int8:
                quantize_onnx(float_path, args.onnx)
                what = "int8 (LSTM and linear layers), float decode"
                if not args.no_verify:
                    check = verify_onnx(tagger, args.onnx)
                    print(f"{parser.prog}: the int8 model and the float tagger agree on {check['tokens_agreeing']} of "
                          f"{check['tokens']} check tokens", file=sys.stderr)
        print(f"{args.onnx}: {type(tagger).__name__}, {what}, {_size(args.onnx)}")

    if args.export_pt2 is not None:
        try:
            from .pt2 import export_pt2
        except ModuleNotFoundError as error:
            if error.name != f"{__package__}.pt2":
                raise
            parser.exit(1, f"{parser.prog}: error: this crfkit has no pt2 exporter (crfkit/export/pt2.py)\n")
        written = export_pt2(tagger, args.export_pt2)
        print(f"{written}: {type(tagger).__name__}, torch.export package, {_size(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
