"""A saved tagger as a torch.export / AOTInductor package with the Viterbi decode inside: a process
with torch and crfkit's op library alone tags with it, without crfkit's Python package.

    from crfkit.export.pt2 import export_pt2
    export_pt2(load_tagger("runs/quick/students/vanilla-seed0/model"), "tagger.pt2")
    # writes tagger.pt2 (the package) and tagger.pt2.json (its inputs, labels and op library)

and where it runs (load_pt2 below is a function to copy: it imports torch only):

    import torch
    torch.ops.load_library("/.../crfkit/_C.abi3.so")   # crfkit's op library
    model = torch._inductor.aoti_load_package("tagger.pt2")
    paths, scores = model(words, casing, lengths)      # the inputs listed in tagger.pt2.json

The package's graph is the tagger's own emissions() followed by torch.ops.crfkit.viterbi with the
CRF's constrained parameters (what tagger.decode computes), traced by torch.export.export with a
dynamic batch and dynamic lengths, then compiled to C++ by torch._inductor.aoti_compile_and_package.
While torch.export traces them (torch.compiler.is_exporting()) the taggers' forward passes take
an export-friendly form: BiLSTMCRFTagger runs its LSTM without packing (_bilstm_unpacked),
TransformerCRFTagger pools pieces onto words without align_to_words' value checks (pool_word_pieces);
the same weights and operations, the same paths (emissions equal to rounding).

Inputs: the tagger's featurize() tensors, positionally, in featurize's order, which "inputs" in
the JSON lists (BiLSTMCRFTagger: words, casing (B, L), lengths (B,) [, chars (B, L, C)];
TransformerCRFTagger: input_ids, attention_mask, word_index (B, P), casing (B, L), lengths (B,)),
all int64, any B, L, C >= 1 (P: 2 .. max_pieces). Outputs: paths (B, L) int64, -1 past each
sentence's length, and scores (B,) float32, as crfkit.viterbi and tagger.decode give them.

The op library: the compiled graph calls crfkit::viterbi through the dispatcher, so the process
that loads the package must first load the library that registers it: crfkit's compiled
extension, crfkit/_C.abi3.so, built on torch's stable ABI: it loads under any torch from its
target (2.10 for a release build) on, and the package itself needs the torch that compiled it
(AOTInductor's C++; the JSON's "op_library" records the file used at export and the torch). Where crfkit is installed,
`python -c "import crfkit; print(crfkit.backend_info()['extension'])"` prints its path; copy that
one file beside the package to deploy without crfkit.

Why the export and the compile run under torch.export._patches.register_lstm_while_loop_decomposition:
without it torch.export traces nn.LSTM as a Python loop over positions, which fixes the length to
the example's; with it each LSTM becomes a while_loop over a dynamic length, which AOTInductor
compiles. (A private torch module, in torch 2.13; without it an LSTM tagger's export fails with
torch's "specialized it to be a constant" error.)
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["PT2_FORMAT", "TaggerDecoder", "export_pt2", "exported_program", "load_pt2"]

PT2_FORMAT = "crfkit-pt2"
PT2_FORMAT_VERSION = 1

# Example sentences for tracing: 3 sentences of 2 .. 6 words of up to 10 characters, so that no
# dynamic size equals another or 1 (torch.export specialises a size of 1 and may tie equal ones).
_EXAMPLE = [["European", "Union", "rejects", "German", "call", "."], ["Peter", "Blackburn"],
            ["BRUSSELS", "1996-08-22", "rain", "."]]
# The named sizes of each featurize() tensor.
_DIMENSIONS = {"words": ("batch", "length"), "casing": ("batch", "length"), "lengths": ("batch",),
               "chars": ("batch", "length", "characters"), "input_ids": ("batch", "pieces"),
               "attention_mask": ("batch", "pieces"), "word_index": ("batch", "pieces")}


class TaggerDecoder(nn.Module):
    """tagger's featurize() tensors, positionally in input_names order -> (paths (B, L) int64,
    scores (B,)): tagger.emissions, then the compiled Viterbi op with the CRF's constrained
    parameters, as tagger.decode computes them (in eval mode)."""

    def __init__(self, tagger, input_names: list[str]):
        super().__init__()
        self.tagger = tagger
        self.input_names = list(input_names)

    def forward(self, *inputs: Tensor) -> tuple[Tensor, Tensor]:
        batch = dict(zip(self.input_names, inputs))
        emissions = self.tagger.emissions(batch)
        transitions, start, end = self.tagger.distribution_parameters()
        # The op takes every argument, in one dtype (crfkit._arguments.prepare's conventions).
        dtype = torch.float32 if emissions.dtype in (torch.float16, torch.bfloat16) else emissions.dtype
        zeros = emissions.new_zeros(emissions.shape[2], dtype=dtype)
        start = zeros if start is None else start.to(dtype)
        end = zeros if end is None else end.to(dtype)
        scores, paths = torch.ops.crfkit.viterbi(emissions.to(dtype).contiguous(), transitions.to(dtype).contiguous(),
                                                 batch["lengths"], start.contiguous(), end.contiguous())
        return paths, scores


def _lstm_as_while_loop():
    """The context under which torch.export keeps an LSTM's length dynamic (module docstring);
    a no-op on a torch without it (a transformer tagger does not need it)."""
    try:
        from torch.export._patches import register_lstm_while_loop_decomposition
    except ImportError:
        return contextlib.nullcontext()
    return register_lstm_while_loop_decomposition()


def _require_compiled_ops() -> None:
    from .. import backends

    backends.current()  # the first op call's build, where one is pending
    if "compiled" not in backends.available():
        why = backends.backend_info()["unavailable"].get("compiled", "not loaded")
        raise RuntimeError("a pt2 package calls crfkit's compiled Viterbi op (torch.ops.crfkit.viterbi), which is "
                           f"not available here ({why}); build it with `python -m crfkit.build`")


def _dynamic_shapes(tagger, input_names: list[str]) -> tuple:
    """One torch.export.Dim per named size, every one >= 1 (a batch of one sentence of one word
    is fine); pieces from 2 ([CLS] and [SEP]) to what featurize gives (max_pieces) and the
    encoder has position embeddings for."""
    bounds: dict[str, dict[str, int]] = {name: {"min": 1} for name in ("batch", "length", "characters")}
    encoder = getattr(tagger, "encoder", None)
    if encoder is not None:
        limit = getattr(encoder.config, "max_position_embeddings", None) or tagger.max_pieces
        bounds["pieces"] = {"min": 2, "max": min(limit, tagger.max_pieces)}
    dims = {name: torch.export.Dim(name, **bound) for name, bound in bounds.items()}
    # One entry: the decoder's forward takes its inputs as one *inputs argument.
    return (tuple({axis: dims[dim] for axis, dim in enumerate(_DIMENSIONS[name])} for name in input_names),)


@contextlib.contextmanager
def _in_eval_mode(tagger):
    was_training = tagger.training
    tagger.eval()
    try:
        yield
    finally:
        tagger.train(was_training)


def _export(tagger) -> tuple[torch.export.ExportedProgram, list[str]]:
    from ..taggers import BiLSTMCRFTagger, TransformerCRFTagger

    if not isinstance(tagger, (BiLSTMCRFTagger, TransformerCRFTagger)):
        raise TypeError(f"tagger must be a BiLSTMCRFTagger or a TransformerCRFTagger, got {type(tagger).__name__}")
    _require_compiled_ops()
    device = next(tagger.parameters()).device
    example = {name: t.to(device) for name, t in tagger.featurize(_EXAMPLE).items()}
    input_names = list(example)  # featurize's order
    with _in_eval_mode(tagger), _lstm_as_while_loop(), torch.no_grad():
        program = torch.export.export(TaggerDecoder(tagger, input_names), tuple(example.values()),
                                      dynamic_shapes=_dynamic_shapes(tagger, input_names))
    return program, input_names


def exported_program(tagger) -> torch.export.ExportedProgram:
    """torch.export.export of the tagger's decode (TaggerDecoder) with dynamic batch and lengths:
    the step of export_pt2 before AOTInductor. Its .module() runs in this process on the inputs
    of the module docstring; its graph keeps each LSTM direction as one aten.lstm op, which
    export_pt2's compile turns into a while_loop. The tagger is left in the mode it was in."""
    return _export(tagger)[0]


def _description(tagger, input_names: list[str]) -> dict[str, Any]:
    from .. import __version__, backends

    library = backends.backend_info()["extension"]
    return {
        "format": PT2_FORMAT, "format_version": PT2_FORMAT_VERSION,
        "tagger": type(tagger).__name__, "labels": list(tagger.labels), "scheme": tagger.scheme,
        "inputs": [{"name": name, "dtype": "int64", "shape": list(_DIMENSIONS[name])} for name in input_names],
        "outputs": [{"name": "paths", "dtype": "int64", "shape": ["batch", "length"],
                     "note": "indices into labels, -1 past each sentence's length"},
                    {"name": "scores", "dtype": "float32", "shape": ["batch"], "note": "the best path's score"}],
        "op_library": {
            "file": os.path.basename(library), "path_at_export": library,
            "torch_version": torch.__version__, "crfkit_version": __version__,
            "how_to_find": ("crfkit's compiled extension (torch's stable ABI: any torch from its target on). "
                            "Where crfkit "
                            "is installed, python -c \"import crfkit; print(crfkit.backend_info()['extension'])\" "
                            "prints its path (the installed package's crfkit/_C*.so, or a first-use build under "
                            "~/.cache/crfkit/extensions); copy that file beside the package. Load it with "
                            "torch.ops.load_library(path) before torch._inductor.aoti_load_package(package)."),
        },
    }


def export_pt2(tagger, path: str) -> str:
    """Write tagger (a BiLSTMCRFTagger or TransformerCRFTagger, e.g. from load_tagger) to path as
    an AOTInductor package (module docstring), and path + ".json" beside it: the inputs in call
    order, the outputs, the labels and where the op library comes from. path must end with
    ".pt2". Compiles C++: about 30 to 60 s on 2 cores for a small tagger. Returns path."""
    path = os.fspath(path)
    if not isinstance(path, str) or not path.endswith(".pt2"):
        raise ValueError(f"path must be a file name ending with .pt2 (AOTInductor's package format), got {path!r}")
    program, input_names = _export(tagger)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with _lstm_as_while_loop():
        written = torch._inductor.aoti_compile_and_package(program, package_path=path)
    with open(written + ".json", "w") as f:
        json.dump(_description(tagger, input_names), f, indent=2)
        f.write("\n")
    return written


def load_pt2(path: str, op_library: "str | None" = None):  # (a string: the copy needs no typing import)
    """Load a package written by export_pt2 with torch alone: load crfkit's op library (its path,
    or by default the one recorded in path + ".json" at export), then the package. Returns the
    callable model: model(*inputs) -> (paths, scores). Imports nothing from crfkit, so it can be
    copied into a program that does not have crfkit installed."""
    import json
    import os

    import torch

    if op_library is None:
        with open(path + ".json") as f:
            op_library = json.load(f)["op_library"]["path_at_export"]
    if not os.path.isfile(op_library):
        raise FileNotFoundError(f"op_library {op_library!r} does not exist: give the path of crfkit's compiled "
                                "extension (crfkit/_C*.so, see the package's .json 'op_library')")
    torch.ops.load_library(op_library)
    return torch._inductor.aoti_load_package(path)
