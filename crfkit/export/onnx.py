"""A saved tagger as one ONNX model with the Viterbi decode inside: any ONNX runtime tags with it,
without crfkit or PyTorch.

    export_onnx(load_tagger("runs/quick/students/vanilla-k5-seed0/model"), "tagger.onnx")
    session = onnxruntime.InferenceSession("tagger.onnx")
    paths, scores = session.run(None, {name: t.numpy() for name, t in tagger.featurize(sentences).items()})

The model's inputs are the tagger's featurize() tensors, by their names (BiLSTMCRFTagger: words,
casing (B, L) [, chars (B, L, C)], lengths (B,); TransformerCRFTagger: input_ids, attention_mask,
word_index (B, P), casing (B, L), lengths (B,)), all int64 with a dynamic batch and lengths. Its
outputs are "paths" (B, L) int64, -1 past each sentence's length, and "scores" (B,), exactly as
crfkit.viterbi gives them. The labels, the scheme and the inputs are in the model's metadata
("crfkit.labels" as JSON, ...), so a user maps paths to tag names without crfkit.

How it is built, and why this way:
- a BiLSTMCRFTagger's emissions are written directly as ONNX operators from its weights
  (_bilstm_graph): Gather for the embeddings, Conv for the character CNN, ONNX's LSTM with the
  sentence lengths as its sequence_lens (which is exactly the packed sequence the tagger runs:
  the backward direction starts at each sentence's last word), MatMul + Add. Tracing it does not
  work: torch.export fixes an nn.LSTM's length, or its width, to the example's (torch 2.13), and the
  tagger packs its batch, which no exporter follows;
- a TransformerCRFTagger's emissions come from torch.onnx.export (the dynamo exporter) of an
  export-friendly copy of its forward pass (TransformerEmissions: the same modules, with the
  word pooling written without the Python ints that align_to_words reads from tensors); a model
  whose inputs the exporter fixed to the example's sizes is refused;
- the decode is written with onnx.helper as standard operators (two Loops, ArgMax, GatherElements,
  Where), not traced: an exporter unrolls a Python loop over positions at the example's length,
  and writing the graph by hand pins down the order of every addition and the tie-breaking, which
  is what makes the paths exactly crfkit's (below). Its nodes are appended to the emissions' graph
  (one graph, the inputs shared).

The decode matches crfkit.reference.viterbi bit for bit in float32 and float64:
- alpha_0 = start + emissions[:, 0]; alpha_i = max_s (alpha_{i-1}[s] + transitions[s, t]) +
  emissions[:, i], the additions in that order; positions at or past a sentence's length leave its
  state unchanged; scores = max_t (alpha + end).
- Ties: crfkit orders equal-scoring sequences by their tags read from the last position backwards,
  smaller first, which is the first maximum at every step; ONNX ArgMax with select_last_index = 0
  picks the first maximum.
- A sentence whose every sequence scores -inf gets path -1 and score -inf; a length-0 sentence
  gets path -1 and score 0; positions past a length are -1.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Optional

import numpy as np
import torch
from torch import Tensor, nn

from .._optional import require
from ..taggers.transformer import pool_word_pieces

__all__ = ["DEFAULT_OPSET", "ONNX_INSTALL", "add_viterbi", "emission_module", "export_onnx", "viterbi_model"]

ONNX_INSTALL = "pip install onnx onnxruntime onnxscript"  # onnxscript: torch.onnx.export's exporter
DEFAULT_OPSET = 18     # the torch.onnx exporter's default; Loop, ArgMax and Where have not changed since 13
_MIN_OPSET = 13        # Squeeze / Unsqueeze take their axes as an input from 13 on
_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


def _onnx():
    return require("onnx", ONNX_INSTALL)


# ----------------------------------------------------------------------------- the decode
class _Builder:
    """Collects nodes and initializers under one name prefix, so that the decode's names cannot
    clash with those of the graph it is appended to."""

    def __init__(self, prefix: str):
        self.onnx = _onnx()
        self.prefix = prefix
        self.nodes: list = []
        self.initializers: list = []

    def name(self, name: str) -> str:
        return self.prefix + name

    def constant(self, name: str, value, dtype) -> str:
        from onnx import numpy_helper

        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), self.name(name)))
        return self.name(name)

    def used_initializers(self) -> list:
        """The initializers that some node (or a node of a subgraph) reads: constants made for an
        optional part that this model does not have are left out."""
        read = set()

        def visit(nodes):
            for node in nodes:
                read.update(node.input)
                for attribute in node.attribute:
                    for subgraph in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                        visit(subgraph.node)

        visit(self.nodes)
        return [t for t in self.initializers if t.name in read]

    def node(self, op: str, inputs: Sequence[str], output: str, nodes: Optional[list] = None, whole: bool = False,
             **attributes) -> str:
        """Append op(inputs) -> output to nodes (default: the graph's) and return the output's
        name: output under the prefix, or as it is with whole=True (the graph's outputs)."""
        target = self.nodes if nodes is None else nodes
        out = output if whole or output.startswith(self.prefix) else self.name(output)
        target.append(self.onnx.helper.make_node(op, list(inputs), [out], name=f"{out}/{op}", **attributes))
        return out


def add_viterbi(transitions: Tensor, start: Optional[Tensor], end: Optional[Tensor], emissions: str, lengths: str,
                paths: str = "paths", scores: str = "scores", dtype: torch.dtype = torch.float32,
                prefix: str = "crfkit_viterbi/") -> tuple[list, list]:
    """The ONNX nodes and initializers of the Viterbi decode of a CRF, reading the graph values
    named `emissions` (B, L, T) of `dtype` and `lengths` (B,) int64 and writing `paths` (B, L)
    int64 (-1 past each length) and `scores` (B,) of `dtype`.

    transitions (T, T) [from, to], start and end (T,) or None (zeros): the CRF's scores with its
    constraints applied (-inf forbids; crfkit.CRF.constrained_parameters()), stored in the graph
    as initializers. Returns (nodes, initializers) to add to a GraphProto."""
    onnx = _onnx()
    helper, TensorProto = onnx.helper, onnx.TensorProto
    if dtype not in _DTYPES:
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if not isinstance(transitions, Tensor) or transitions.dim() != 2 or transitions.shape[0] != transitions.shape[1]:
        given = tuple(transitions.shape) if isinstance(transitions, Tensor) else type(transitions).__name__
        raise ValueError(f"transitions must be a (T, T) tensor, got {given}")
    T = transitions.shape[0]
    np_dtype = _DTYPES[dtype]

    def scores_of(name, value):
        value = torch.zeros(T) if value is None else value
        if not isinstance(value, Tensor) or tuple(value.shape) != (T,):
            raise ValueError(f"{name} must be a ({T},) tensor or None, got "
                             f"{tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__}")
        return value.detach().to("cpu", dtype).numpy()

    for name, value in (("transitions", transitions), ("start", start), ("end", end)):
        if value is not None and bool((torch.isnan(value) | (value == float("inf"))).any()):
            raise ValueError(f"{name} contains NaN or +inf (use -inf to forbid)")
    b = _Builder(prefix)
    float_type = helper.np_dtype_to_tensor_dtype(np.dtype(np_dtype))
    transitions_name = b.constant("transitions", transitions.detach().to("cpu", dtype).numpy(), np_dtype)
    start_name = b.constant("start", scores_of("start", start), np_dtype)
    end_name = b.constant("end", scores_of("end", end), np_dtype)
    zero, one, minus_one = (b.constant(n, v, np.int64) for n, v in (("zero", 0), ("one", 1), ("minus_one", -1)))
    axis0, axis1, axis2 = (b.constant(f"axes{a}", [a], np.int64) for a in range(3))
    float_zero = b.constant("float_zero", 0, np_dtype)
    minus_inf = b.constant("minus_inf", -np.inf, np_dtype)

    # L may be 0 (a batch of empty sentences): pad the emissions to Lp = max(L, 1) positions so
    # that both Loops run at least once, and cut the paths back to L at the end.
    shape = b.node("Shape", [emissions], "shape")
    batch = b.node("Gather", [shape, zero], "batch", axis=0)
    length = b.node("Gather", [shape, one], "length", axis=0)
    padded_length = b.node("Max", [length, one], "padded_length")
    extra = b.node("Unsqueeze", [b.node("Sub", [padded_length, length], "extra_scalar"), axis0], "extra")
    pads = b.node("Concat", [b.constant("pads_before", [0, 0, 0, 0], np.int64), extra,
                             b.constant("pads_after", [0], np.int64)], "pads", axis=0)
    padded = b.node("Pad", [emissions, pads, float_zero], "padded_emissions", mode="constant")
    state_shape = b.node("Concat", [b.node("Unsqueeze", [batch, axis0], "batch_1d"),
                                    b.constant("num_tags", [T], np.int64)], "state_shape", axis=0)
    initial = b.node("ConstantOfShape", [state_shape], "alpha_init",
                     value=helper.make_tensor("zero", float_type, [1], [0]))

    # Forward recursion, one Loop iteration per position i (the body reads the outer values).
    # Iteration 0 gives start + emissions[:, 0]; its backpointers are never read.
    body: list = []
    i, cond, alpha = b.name("fw/i"), b.name("fw/cond"), b.name("fw/alpha")
    emit = b.node("Gather", [padded, i], "fw/emit", body, axis=1)                             # (B, T)
    candidates = b.node("Add", [b.node("Unsqueeze", [alpha, axis2], "fw/alpha_col", body), transitions_name],
                        "fw/candidates", body)                                              # (B, T_from, T_to)
    backpointer = b.node("ArgMax", [candidates], "fw/backpointer_keep", body, axis=1, keepdims=1,
                         select_last_index=0)                                               # (B, 1, T)
    best = b.node("Squeeze", [b.node("GatherElements", [candidates, backpointer], "fw/best_keep", body, axis=1),
                              axis1], "fw/best", body)
    step = b.node("Add", [best, emit], "fw/step", body)
    first = b.node("Add", [start_name, emit], "fw/first", body)
    updated = b.node("Where", [b.node("Equal", [i, zero], "fw/is_first", body), first, step], "fw/updated", body)
    active = b.node("Unsqueeze", [b.node("Less", [i, lengths], "fw/active_1d", body), axis1], "fw/active", body)
    b.node("Where", [active, updated, alpha], "fw/alpha_out", body)
    b.node("Identity", [cond], "fw/cond_out", body)
    b.node("Squeeze", [backpointer, axis1], "fw/backpointer_out", body)
    forward_body = helper.make_graph(
        body, "crfkit_viterbi_forward",
        [helper.make_tensor_value_info(i, TensorProto.INT64, []),
         helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
         helper.make_tensor_value_info(alpha, float_type, None)],
        [helper.make_tensor_value_info(b.name("fw/cond_out"), TensorProto.BOOL, []),
         helper.make_tensor_value_info(b.name("fw/alpha_out"), float_type, None),
         helper.make_tensor_value_info(b.name("fw/backpointer_out"), TensorProto.INT64, None)])
    b.nodes.append(helper.make_node("Loop", [padded_length, "", initial],
                                    [b.name("alpha_last"), b.name("backpointers")], name=b.name("forward/Loop"),
                                    body=forward_body))
    final = b.node("Add", [b.name("alpha_last"), end_name], "final")                            # (B, T)
    last_tag = b.node("ArgMax", [final], "last_tag_keep", axis=1, keepdims=1, select_last_index=0)
    best_score = b.node("Squeeze", [b.node("GatherElements", [final, last_tag], "best_keep", axis=1), axis1],
                        "best_score")

    # Backtrace, positions Lp-1 .. 0: write the current tag where the position is real, then
    # follow that position's backpointer; past a sentence's length its tag waits unchanged.
    body = []
    j, cond, tag = b.name("bt/j"), b.name("bt/cond"), b.name("bt/tag")
    position = b.node("Sub", [b.node("Sub", [padded_length, one], "bt/last_position", body), j], "bt/i", body)
    active = b.node("Less", [position, lengths], "bt/active", body)
    b.node("Where", [active, tag, minus_one], "bt/column", body)
    pointers = b.node("Gather", [b.name("backpointers"), position], "bt/pointers", body, axis=0)     # (B, T)
    previous = b.node("Squeeze", [b.node("GatherElements", [pointers, b.node("Unsqueeze", [tag, axis1], "bt/tag_col",
                                                                               body)], "bt/previous_col", body,
                                         axis=1), axis1], "bt/previous", body)
    b.node("Where", [active, previous, tag], "bt/tag_out", body)
    b.node("Identity", [cond], "bt/cond_out", body)
    backtrace_body = helper.make_graph(
        body, "crfkit_viterbi_backtrace",
        [helper.make_tensor_value_info(j, TensorProto.INT64, []),
         helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
         helper.make_tensor_value_info(tag, TensorProto.INT64, None)],
        [helper.make_tensor_value_info(b.name("bt/cond_out"), TensorProto.BOOL, []),
         helper.make_tensor_value_info(b.name("bt/tag_out"), TensorProto.INT64, None),
         helper.make_tensor_value_info(b.name("bt/column"), TensorProto.INT64, None)])
    b.nodes.append(helper.make_node("Loop", [padded_length, "", b.node("Squeeze", [last_tag, axis1], "last_tag")],
                                    [b.name("first_tag"), b.name("columns")], name=b.name("backtrace/Loop"),
                                    body=backtrace_body))
    # columns: (Lp, B), last position first -> (B, L) in position order
    reversed_columns = b.node("Slice", [b.name("columns"), b.constant("last", [-1], np.int64),
                                        b.constant("before_first", [np.iinfo(np.int64).min], np.int64), axis0,
                                        b.name("last")], "columns_in_order")
    all_paths = b.node("Slice", [b.node("Transpose", [reversed_columns], "padded_paths", perm=[1, 0]),
                                 b.constant("begin", [0], np.int64),
                                 b.node("Unsqueeze", [length, axis0], "length_1d"), axis1], "all_paths")
    missing = b.node("Unsqueeze", [b.node("Equal", [best_score, minus_inf], "missing_1d"), axis1], "missing")
    b.node("Where", [missing, minus_one, all_paths], paths, whole=True)
    b.node("Where", [b.node("Equal", [lengths, zero], "empty"), float_zero, best_score], scores, whole=True)
    return b.nodes, b.used_initializers()


def viterbi_model(transitions: Tensor, start: Optional[Tensor] = None, end: Optional[Tensor] = None,
                  dtype: torch.dtype = torch.float32, opset: int = DEFAULT_OPSET):
    """The decode alone as an ONNX model: inputs "emissions" (B, L, T) of dtype and "lengths" (B,)
    int64, outputs "paths" (B, L) int64 and "scores" (B,), crfkit.viterbi(emissions, transitions,
    lengths, start, end) exactly. Checked with onnx.checker."""
    onnx = _onnx()
    helper = onnx.helper
    if not isinstance(opset, int) or isinstance(opset, bool) or opset < _MIN_OPSET:
        raise ValueError(f"opset must be an int >= {_MIN_OPSET}, got {opset!r}")
    nodes, initializers = add_viterbi(transitions, start, end, "emissions", "lengths", dtype=dtype)
    float_type = helper.np_dtype_to_tensor_dtype(np.dtype(_DTYPES[dtype]))
    T = transitions.shape[0]
    graph = helper.make_graph(
        nodes, "crfkit_viterbi",
        [helper.make_tensor_value_info("emissions", float_type, ["batch", "length", T]),
         helper.make_tensor_value_info("lengths", onnx.TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("paths", onnx.TensorProto.INT64, ["batch", "length"]),
         helper.make_tensor_value_info("scores", float_type, ["batch"])],
        initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="crfkit")
    onnx.checker.check_model(model, full_check=True)
    return model


# ----------------------------------------------------------------------------- the emissions
def _float_constant(b: _Builder, name: str, tensor: Tensor, np_dtype) -> str:
    return b.constant(name, tensor.detach().to("cpu", torch.float64).numpy(), np_dtype)


def _lstm_gates(weight: Tensor, hidden: int) -> Tensor:
    """PyTorch's gate blocks (input, forget, cell, output) in ONNX's order (input, output, forget,
    cell), along dim 0."""
    i, f, g, o = weight.split(hidden, dim=0)
    return torch.cat([i, o, f, g], dim=0)


def _bilstm_graph(tagger, opset: int):
    """BiLSTMCRFTagger.emissions written as ONNX nodes (not traced): (nodes, initializers,
    inputs) of a graph from words, casing (B, L), lengths (B,) [, chars (B, L, C)] int64 to
    "emissions" (B, L, T).

    Why by hand: torch.export specialises an nn.LSTM's sequence length, or its width, to the
    example's (seen with torch 2.13, depending on the layer sizes), and the tagger packs its
    batch, which no exporter follows. ONNX's own LSTM operator takes per-sentence lengths
    (sequence_lens): its backward direction starts at each sentence's last word and its outputs
    are zero past it, which is exactly what pack_padded_sequence gives the tagger. Every other
    step is one operator (Gather for the embeddings, Conv for the character CNN, MatMul + Add for
    the linear layer)."""
    onnx = _onnx()
    helper, TensorProto = onnx.helper, onnx.TensorProto
    np_dtype = _DTYPES[next(tagger.parameters()).dtype]
    b = _Builder("crfkit_bilstm/")
    names = ["words", "casing", "lengths"] + (["chars"] if tagger.char_vocabulary is not None else [])
    inputs = [helper.make_tensor_value_info(name, TensorProto.INT64, list(_DIMENSIONS[name])) for name in names]
    axes = {a: b.constant(f"axes{a}", [a], np.int64) for a in range(3)}

    def reduce_max(x: str, axis: int, output: str) -> str:  # axes became an input in opset 18
        if opset >= 18:
            return b.node("ReduceMax", [x, axes[axis]], output, keepdims=0)
        return b.node("ReduceMax", [x], output, axes=[axis], keepdims=0)

    # onnxruntime's LSTM kernel aborts the process on a batch of 0 sentences and has no use for 0
    # positions: pad the batch and the length to at least 1 (an all-padding, length-0 sentence),
    # and cut the emissions back to (B, L) at the end. Rows never mix, so nothing real changes.
    shape = b.node("Shape", ["words"], "shape")                                                  # [B, L]
    at_least_one = b.node("Sub", [b.constant("ones", [1, 1], np.int64),
                                  b.node("Min", [shape, b.name("ones")], "at_most_one")], "extra")  # [B == 0, L == 0]
    extra_batch = b.node("Slice", [at_least_one, b.constant("first", [0], np.int64),
                                   b.constant("second", [1], np.int64), axes[0]], "extra_batch")
    extra_length = b.node("Slice", [at_least_one, b.name("second"), b.constant("third", [2], np.int64), axes[0]],
                          "extra_length")
    zeros = {n: b.constant(f"zeros{n}", [0] * n, np.int64) for n in (1, 2, 3)}
    padded = {}
    for name in names:
        ends = {1: [extra_batch], 2: [extra_batch, extra_length], 3: [extra_batch, extra_length, zeros[1]]}
        rank = len(_DIMENSIONS[name])
        pads = b.node("Concat", [zeros[rank], *ends[rank]], f"{name}_pads", axis=0)  # starts of each axis, then ends
        padded[name] = b.node("Pad", [name, pads], f"{name}_padded", mode="constant")

    features = [b.node("Gather", [_float_constant(b, "word_table", tagger.word_embedding.weight, np_dtype),
                                  padded["words"]], "word_vectors", axis=0)]
    if tagger.casing is not None:
        features.append(b.node("Gather", [_float_constant(b, "casing_table", tagger.casing.weight, np_dtype),
                                          padded["casing"]], "casing_vectors", axis=0))
    if tagger.char_vocabulary is not None:  # as BiLSTMCRFTagger.word_features
        chars = padded["chars"]
        char_shape = b.node("Shape", [chars], "char_shape")                                       # [B, L, C]
        flat = b.node("Reshape", [chars, b.node("Concat", [b.constant("minus_one", [-1], np.int64),
                                                           b.node("Slice", [char_shape, b.name("third"),
                                                                            b.constant("fourth", [3], np.int64),
                                                                            axes[0]], "width")],
                                                "flat_shape", axis=0)], "flat_chars")              # (B*L, C)
        embedded = b.node("Transpose", [b.node("Gather", [_float_constant(b, "char_table", tagger.char_embedding.weight,
                                                                          np_dtype), flat], "char_vectors", axis=0)],
                          "char_channels", perm=[0, 2, 1])                                        # (B*L, dim, C)
        conv = tagger.char_conv
        kernel, padding = conv.kernel_size[0], conv.padding[0]
        convolved = b.node("Conv", [embedded, _float_constant(b, "conv_weight", conv.weight, np_dtype),
                                    _float_constant(b, "conv_bias", conv.bias, np_dtype)], "convolved",
                           kernel_shape=[kernel], pads=[padding, padding])                        # (B*L, filters, C)
        padding_chars = b.node("Unsqueeze", [b.node("Equal", [flat, b.constant("pad_char", 0, np.int64)], "is_pad"),
                                             axes[1]], "is_pad_column")
        minus_inf = b.constant("minus_inf", -np.inf, np_dtype)
        pooled = reduce_max(b.node("Where", [padding_chars, minus_inf, convolved], "masked"), 2, "pooled")
        not_finite = b.node("Or", [b.node("IsInf", [pooled], "is_inf"), b.node("IsNaN", [pooled], "is_nan")],
                            "not_finite")
        finite = b.node("Where", [not_finite, b.constant("zero", 0, np_dtype), pooled], "finite")
        rows = b.node("Slice", [char_shape, b.name("first"), b.name("third"), axes[0]], "rows")    # [B, L]
        features.append(b.node("Reshape", [finite, b.node("Concat", [rows, b.constant(
            "filters", [conv.out_channels], np.int64)], "char_feature_shape", axis=0)], "char_features"))
    x = b.node("Concat", features, "features", axis=2)                                           # (B, L, D)
    lstm, hidden = tagger.lstm, tagger.lstm.hidden_size
    # pack_padded_sequence gets lengths.clamp(min=1) in the tagger: the same here
    sequence_lengths = b.node("Cast", [b.node("Max", [padded["lengths"], b.constant("one", 1, np.int64)],
                                              "clamped_lengths")], "sequence_lengths", to=TensorProto.INT32)
    x = b.node("Transpose", [x], "time_major_0", perm=[1, 0, 2])                                 # (L, B, D)
    for layer in range(lstm.num_layers):
        directions = ("", "_reverse")

        def stacked(kind):
            return torch.stack([_lstm_gates(getattr(lstm, f"{kind}_l{layer}{d}"), hidden) for d in directions])

        if lstm.bias:
            bias = torch.stack([torch.cat([_lstm_gates(getattr(lstm, f"bias_ih_l{layer}{d}"), hidden),
                                           _lstm_gates(getattr(lstm, f"bias_hh_l{layer}{d}"), hidden)])
                                for d in directions])
        else:
            bias = torch.zeros(2, 8 * hidden)
        y = b.node("LSTM", [x, _float_constant(b, f"W{layer}", stacked("weight_ih"), np_dtype),
                            _float_constant(b, f"R{layer}", stacked("weight_hh"), np_dtype),
                            _float_constant(b, f"B{layer}", bias, np_dtype), sequence_lengths],
                   f"lstm{layer}", direction="bidirectional", hidden_size=hidden)                 # (L, 2, B, H)
        # (L, B, 2, H) -> (L, B, 2H): the forward direction's features first, as in PyTorch
        directions_last = b.node("Transpose", [y], f"lstm{layer}_directions", perm=[0, 2, 1, 3])
        x = b.node("Reshape", [directions_last, b.constant(f"lstm{layer}_shape", [0, 0, 2 * hidden], np.int64)],
                   f"time_major_{layer + 1}")
    x = b.node("Transpose", [x], "lstm_features", perm=[1, 0, 2])                                # (B, L, 2H)
    head = tagger.head
    scores = b.node("Add", [b.node("MatMul", [x, _float_constant(b, "head_weight", head.weight.t(), np_dtype)],
                                   "head_product"), _float_constant(b, "head_bias", head.bias, np_dtype)],
                    "padded_emissions")
    b.node("Slice", [scores, zeros[2], shape, b.constant("batch_and_length", [0, 1], np.int64)], "emissions",
           whole=True)
    return b.nodes, b.used_initializers(), inputs


class TransformerEmissions(nn.Module):
    """TransformerCRFTagger.emissions for export: inputs input_ids, attention_mask, word_index
    (B, P), casing (B, L), lengths (B,) int64 -> emissions (B, L, T) (L from casing, which
    featurize makes max(lengths) wide; lengths is only the decode's)."""

    def __init__(self, tagger):
        super().__init__()
        self.tagger = tagger
        self.input_names = ["input_ids", "attention_mask", "word_index", "casing", "lengths"]

    def forward(self, input_ids: Tensor, attention_mask: Tensor, word_index: Tensor, casing: Tensor,
                lengths: Tensor) -> Tensor:
        tagger = self.tagger
        pieces = tagger.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        words = pool_word_pieces(pieces, word_index, casing.shape[1], tagger.word_pooling)
        return tagger.emissions_from_features(tagger._with_casing({"casing": casing}, words))


def emission_module(tagger) -> nn.Module:
    """An export-friendly nn.Module computing a TransformerCRFTagger's emissions (B, L, T) from
    its featurize() tensors, passed positionally in the order of its input_names attribute.
    (BiLSTMCRFTagger's graph is written directly in ONNX: see _bilstm_graph.)"""
    from ..taggers import TransformerCRFTagger

    if isinstance(tagger, TransformerCRFTagger):
        return TransformerEmissions(tagger).eval()
    raise TypeError(f"tagger must be a TransformerCRFTagger, got {type(tagger).__name__}")


# ----------------------------------------------------------------------------- the whole tagger
# Example sentences for tracing the transformer: a batch of 3, 6 words, more pieces, so that no
# dynamic size equals another or 1 (torch.export would specialise a size of 1 and may tie equal
# ones together).
_EXAMPLE = [["European", "Union", "rejects", "German", "call", "."], ["Peter", "Blackburn"],
            ["BRUSSELS", "1996-08-22", "rain", "."]]
_DIMENSIONS = {"words": ("batch", "length"), "casing": ("batch", "length"), "lengths": ("batch",),
               "chars": ("batch", "length", "characters"), "input_ids": ("batch", "pieces"),
               "attention_mask": ("batch", "pieces"), "word_index": ("batch", "pieces")}


def _dynamic_shapes(input_names: Sequence[str], max_pieces: Optional[int] = None) -> tuple:
    """torch.export's dynamic_shapes for the inputs: every axis dynamic; pieces at most max_pieces
    (an encoder's position embeddings bound it, and torch.export insists on that bound)."""
    dims = {name: torch.export.Dim(name) for name in ("batch", "length", "characters")}
    dims["pieces"] = torch.export.Dim("pieces", max=max_pieces) if max_pieces else torch.export.Dim("pieces")
    return tuple({axis: dims[dim] for axis, dim in enumerate(_DIMENSIONS[name])} for name in input_names)


def export_onnx(tagger, path: str, opset: int = DEFAULT_OPSET, check: bool = True) -> str:
    """Write tagger (a BiLSTMCRFTagger or TransformerCRFTagger) to path as one ONNX model: its
    emissions followed by the Viterbi decode (add_viterbi with the CRF's constrained parameters).
    Inputs: featurize()'s tensors by name, int64, dynamic batch and lengths; outputs "paths"
    (B, L) int64, "scores" (B,) and "emissions" (B, L, T), in the tagger's float dtype.
    The BiLSTM's graph is written directly (_bilstm_graph); the transformer's emissions come from
    torch.onnx.export of emission_module(tagger). check: run onnx.checker. Returns path."""
    from ..taggers import BiLSTMCRFTagger, TransformerCRFTagger

    onnx = _onnx()
    helper = onnx.helper
    if not isinstance(tagger, (BiLSTMCRFTagger, TransformerCRFTagger)):
        raise TypeError(f"tagger must be a BiLSTMCRFTagger or a TransformerCRFTagger, got {type(tagger).__name__}")
    if not isinstance(opset, int) or isinstance(opset, bool) or opset < _MIN_OPSET:
        raise ValueError(f"opset must be an int >= {_MIN_OPSET}, got {opset!r}")
    dtype = next(tagger.parameters()).dtype
    if dtype not in _DTYPES:
        raise TypeError(f"export_onnx exports float32 or float64 taggers, got a {dtype} one (call tagger.float())")
    if isinstance(tagger, BiLSTMCRFTagger):
        nodes, initializers, inputs = _bilstm_graph(tagger, opset)
        model = helper.make_model(helper.make_graph(nodes, "crfkit_tagger", inputs, [], initializer=initializers),
                                  opset_imports=[helper.make_opsetid("", opset)])
    else:
        model = _export_transformer(tagger, opset)
    graph = model.graph
    input_names = [i.name for i in graph.input]
    transitions, start, end = tagger.distribution_parameters()
    nodes, initializers = add_viterbi(transitions, start, end, "emissions", "lengths", dtype=dtype)
    graph.node.extend(nodes)
    graph.initializer.extend(initializers)
    float_type = helper.np_dtype_to_tensor_dtype(np.dtype(_DTYPES[dtype]))
    del graph.output[:]
    graph.output.extend([helper.make_tensor_value_info("paths", onnx.TensorProto.INT64, ["batch", "length"]),
                         helper.make_tensor_value_info("scores", float_type, ["batch"]),
                         helper.make_tensor_value_info("emissions", float_type, ["batch", "length", tagger.num_tags])])
    _set_metadata(model, tagger, input_names)
    if check:  # full_check: ONNX's shape inference runs over the graph too
        onnx.checker.check_model(model, full_check=True)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    onnx.save_model(model, path)
    return path


def _export_transformer(tagger, opset: int):
    """The emissions of a TransformerCRFTagger as an ONNX model (torch.onnx.export, dynamo),
    inputs input_ids, attention_mask, word_index, casing, lengths, output "emissions"."""
    onnx = _onnx()
    require("onnxscript", ONNX_INSTALL)  # the dynamo exporter of torch.onnx.export needs it
    module = emission_module(tagger)
    max_positions = getattr(tagger.encoder.config, "max_position_embeddings", None)
    was_training = tagger.training
    tagger.eval()
    try:
        batch = tagger.featurize(_EXAMPLE)
        example = tuple(batch[name].cpu() for name in module.input_names)
        with torch.no_grad(), _quiet_exporter():
            program = torch.onnx.export(module.cpu(), example, dynamo=True, opset_version=opset,
                                        input_names=list(module.input_names), output_names=["emissions"],
                                        dynamic_shapes=_dynamic_shapes(module.input_names, max_positions),
                                        verbose=False)
    finally:
        tagger.train(was_training)
    model = program.model_proto
    graph = model.graph
    # When torch.export cannot keep a size dynamic, torch.onnx.export retries with that size fixed
    # to the example's, and says so only in its log: refuse such a model rather than write one
    # that rejects (or mistags) other lengths.
    for value in graph.input:
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if not dim.dim_param:
                raise RuntimeError(f"torch.onnx.export fixed axis {axis} of input {value.name!r} to {dim.dim_value} "
                                   "(the example's size); crfkit exports only models with dynamic batch and lengths")
    # Shape annotations inside the graph may still carry sizes that tracing specialised; a runtime
    # that trusted them could fold a Shape into a constant. Drop them: the runtime infers shapes.
    del graph.value_info[:]
    if "lengths" not in [i.name for i in graph.input]:  # an exporter may drop an input the emissions do not read
        graph.input.append(onnx.helper.make_tensor_value_info("lengths", onnx.TensorProto.INT64, ["batch"]))
    _pad_empty_batch(graph, module.input_names, "emissions")
    return model


def _rename_inputs(graph, renamed: Mapping[str, str]) -> None:
    """Make every node of graph, and of its subgraphs, read renamed[name] instead of name."""
    for node in graph.node:
        for k, name in enumerate(node.input):
            if name in renamed:
                node.input[k] = renamed[name]
        for attribute in node.attribute:
            for subgraph in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                _rename_inputs(subgraph, renamed)


def _pad_empty_batch(graph, input_names: Sequence[str], output: str) -> None:
    """Give the exported emissions a batch of at least one sentence: some onnxruntime kernels
    abort the process on a batch of 0 (its LSTM calls std::terminate). Each input (B, ...) gets one all-zero
    row when B = 0 (a length-0 sentence), and the emissions are cut back to B rows. Rows never
    mix in the encoders, so the real rows' emissions are unchanged."""
    b = _Builder("crfkit_batch/")
    shape = b.node("Shape", [input_names[0]], "shape")
    batch = b.node("Gather", [shape, b.constant("zero", [0], np.int64)], "batch", axis=0)            # (1,)
    extra = b.node("Sub", [b.constant("one", [1], np.int64),
                           b.node("Min", [batch, b.name("one")], "at_most_one")], "extra")        # 1 iff B = 0
    renamed = {}
    for name in input_names:
        rank = len(_DIMENSIONS[name])
        after = [b.constant(f"{name}_after", [0] * (rank - 1), np.int64)] if rank > 1 else []
        # Pad's pads: the starts of every axis, then the ends; one row more at the end of axis 0
        pads = b.node("Concat", [b.constant(f"{name}_before", [0] * rank, np.int64), extra, *after], f"{name}_pads",
                      axis=0)
        renamed[name] = b.node("Pad", [name, pads], f"{name}_at_least_one", mode="constant")
    _rename_inputs(graph, renamed)
    for node in graph.node:
        node.output[:] = [b.name("emissions_rows") if o == output else o for o in node.output]
    b.node("Slice", [b.name("emissions_rows"), b.name("zero"), batch, b.name("zero")], output, whole=True)
    nodes = list(graph.node)  # ONNX wants topological order: the padding first, the cut last
    del graph.node[:]
    graph.node.extend(b.nodes[:-1] + nodes + b.nodes[-1:])
    graph.initializer.extend(b.used_initializers())


def _set_metadata(model, tagger, input_names: Sequence[str]) -> None:
    from .. import __version__

    entries = {"crfkit.tagger": type(tagger).__name__, "crfkit.labels": json.dumps(tagger.labels),
               "crfkit.scheme": json.dumps(tagger.scheme), "crfkit.inputs": json.dumps(list(input_names)),
               "crfkit.version": __version__,
               "crfkit.outputs": json.dumps({"paths": "(B, L) int64 tag indices into crfkit.labels, -1 past each "
                                                      "length", "scores": "(B,) Viterbi scores",
                                             "emissions": "(B, L, T) the CRF's emissions"})}
    del model.metadata_props[:]
    for key, value in entries.items():
        model.metadata_props.add(key=key, value=value)
    model.producer_name = "crfkit"


class _quiet_exporter:
    """torch.onnx.export prints its progress, logs the optional packages it does not find and warns
    about its own internals; a command that exports should print only its result."""

    def __enter__(self):
        import contextlib
        import io
        import logging
        import warnings

        self._stack = contextlib.ExitStack()
        self._stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        self._stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        for name in ("torch.onnx", "torch.export", "torch._export", "onnxscript"):
            logger = logging.getLogger(name)
            self._stack.callback(logger.setLevel, logger.level)
            logger.setLevel(logging.ERROR)
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)
