"""int8 students: dynamic quantisation of a BiLSTM+CRF tagger, in PyTorch and in ONNX.

    student = load_tagger("runs/quick/students/vanilla-k5-seed0/model")
    small = quantize_student(student)            # torch.ao: int8 LSTM and linear layer
    small.predict([["EU", "rejects", "German", "call"]])
    quantize_onnx("tagger.onnx", "tagger.int8.onnx")   # onnxruntime.quantization, the decode untouched

Dynamic quantisation stores the weights of the LSTM and the linear layer in int8 and quantises
their inputs per batch at run time; the embeddings, the character CNN and the CRF (transitions,
start, end, and so the Viterbi decode) stay float, so every output is still a valid path under the
CRF's constraints. Neither is exact: the emissions move by the quantisation error, so a few tokens
can get other tags (benchmarks/results/export_speed.md measures the F1 and speed on CoNLL-2003).
The two routes quantise differently (torch.ao's fbgemm / x86 kernels, onnxruntime's
DynamicQuantizeLSTM and MatMulInteger), so their int8 tags differ from each other too.
torch 2.13 warns that torch.ao's quantised tensors are deprecated (torchao is their successor);
quantize_student uses them as torch 2.13 has them.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .._optional import require
from .onnx import ONNX_INSTALL

__all__ = ["quantize_onnx", "quantize_student"]


def _refuse_save(*args, **kwargs):
    raise TypeError("a quantised tagger cannot be saved (its int8 weights are packed for one CPU kernel): save the "
                    "float tagger, and quantise it again after loading (quantize_student takes well under a second)")


def quantize_student(tagger, dtype: torch.dtype = torch.qint8):
    """A quantised copy of a BiLSTMCRFTagger: nn.LSTM and nn.Linear dynamically quantised
    (torch.ao.quantization.quantize_dynamic, weights of `dtype`, torch.qint8 or torch.float16);
    embeddings, character CNN and CRF float. The copy is a BiLSTMCRFTagger with the same tagging
    API (featurize, emissions (B, L, T), decode, kbest, predict), in eval mode, on the CPU (the
    quantised kernels are CPU-only), and cannot be trained or saved. tagger itself is unchanged."""
    from ..taggers import BiLSTMCRFTagger

    if not isinstance(tagger, BiLSTMCRFTagger):
        raise TypeError(f"tagger must be a BiLSTMCRFTagger (the BiLSTM student), got {type(tagger).__name__}")
    if dtype not in (torch.qint8, torch.float16):
        raise ValueError(f"dtype must be torch.qint8 or torch.float16, got {dtype}")
    if next(tagger.parameters()).dtype != torch.float32:
        raise TypeError("quantize_student takes a float32 tagger (call tagger.float() first)")
    from torch.ao.quantization import quantize_dynamic

    source = copy.deepcopy(tagger).cpu().eval()
    quantized = quantize_dynamic(source, {nn.LSTM, nn.Linear}, dtype=dtype)
    quantized.save_pretrained = _refuse_save
    for parameter in quantized.parameters():
        parameter.requires_grad_(False)
    return quantized.eval()


def quantize_onnx(source: str, target: str) -> str:
    """Dynamically quantise the ONNX model at source (from crfkit.export.export_onnx) into
    target: MatMul, Gemm and LSTM nodes get int8 weights (onnxruntime.quantization.
    quantize_dynamic); the embeddings (Gather), the CRF's scores and the decode's Loops stay float,
    as in quantize_student. The quantised LSTM is onnxruntime's com.microsoft.DynamicQuantizeLSTM,
    so the int8 model runs in onnxruntime (the float one in any ONNX runtime). The metadata
    (labels, inputs) is kept. Returns target."""
    import os
    import tempfile

    onnx = require("onnx", ONNX_INSTALL)
    require("onnxruntime", ONNX_INSTALL)
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory() as scratch:
        # The exporter reorders the LSTM's gates with Slice / Concat nodes over the weights;
        # quantize_dynamic quantises only weights that are initializers, so fold those first.
        folded = os.path.join(scratch, "folded.onnx")
        quant_pre_process(source, folded, skip_symbolic_shape=True)
        quantize_dynamic(folded, target, op_types_to_quantize=["MatMul", "Gemm", "LSTM"],
                         weight_type=QuantType.QInt8, extra_options={"EnableSubgraph": False})
    model = onnx.load(target)
    del model.metadata_props[:]
    model.metadata_props.extend(onnx.load(source, load_external_data=False).metadata_props)
    model.metadata_props.add(key="crfkit.quantized", value="int8 (onnxruntime.quantization.quantize_dynamic)")
    onnx.save_model(model, target)
    return target
