"""crfkit.export: trained taggers out of Python.

    python -m crfkit.export --model DIR --onnx tagger.onnx [--int8] [--export-pt2 tagger.pt2]

    export_onnx(tagger, "tagger.onnx")      one ONNX model: the emissions and the Viterbi decode, so
                                            any ONNX runtime tags without crfkit (crfkit.export.onnx)
    viterbi_model(transitions, start, end)  the decode alone, as an ONNX model
    quantize_student(tagger)                an int8 BiLSTM student (torch.ao dynamic quantisation)
    quantize_onnx(src, dst)                 an int8 ONNX model (onnxruntime.quantization)
    export_pt2(tagger, "tagger.pt2")        a torch.export / AOTInductor package that a process runs with
                                            torch and crfkit's op library alone (crfkit.export.pt2;
                                            load_pt2 loads it there)

onnx, onnxruntime and onnxscript (the exporter of torch.onnx) are optional: pip install onnx onnxruntime
onnxscript (the "export" extra). They are imported when an export runs, not here.
"""
from .onnx import ONNX_INSTALL, emission_module, export_onnx, viterbi_model
from .pt2 import export_pt2, load_pt2
from .quantize import quantize_onnx, quantize_student

__all__ = ["ONNX_INSTALL", "emission_module", "export_onnx", "export_pt2", "load_pt2", "quantize_onnx",
           "quantize_student", "viterbi_model"]
