"""Entity confidences in the taggers and the tag command: predict(confidence=True) against brute-force
enumeration, the temperature (set, fitted by calibrate, saved and loaded), `python -m crfkit.tag
--confidence` in each format, and examples/entity_calibration.py end to end on a tiny saved tagger
and a tiny CoNLL file."""
import importlib.util
import io
import json
import math
from pathlib import Path

import pytest
import torch

from crfkit import data, tag
from crfkit.calibration import fit_temperature
from crfkit.entities import entity_marginals

from brute_force import all_sequences

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent.parent
LABELS = list(data.CONLL2003_TAGS)
WORDS = ["<pad>", "<unk>", "eu", "rejects", "german", "call", "to", "boycott", "british", "lamb", "peter", "blackburn"]
SENTENCES = [["EU", "rejects", "German", "call"], ["Peter", "Blackburn"], ["boycott", "British", "lamb", "."], [],
             ["EU"]]


def tiny_tagger(scheme="BIO", seed=0):
    from crfkit.taggers import BiLSTMCRFTagger

    torch.manual_seed(seed)
    tagger = BiLSTMCRFTagger(LABELS, WORDS, scheme=scheme, embedding_dim=8, hidden_size=8, casing_dim=4)
    with torch.no_grad():  # sharper emissions than an untrained tagger's, so that entities appear
        tagger.head.weight.mul_(12)
        tagger.head.bias.copy_(torch.tensor([-1.0, 1, 0, 1, 0, 1, 0, 1, 0]))
    return tagger.eval()


def brute_force_probability(tagger, tokens, entity, temperature):
    """P(entity) from every tag sequence of the tagger's CRF (scores / temperature)."""
    batch = tagger.featurize([tokens])
    emissions = tagger.emissions(batch)[0].double() / temperature
    transitions, start, end = (x.double() / temperature for x in tagger.distribution_parameters())
    seqs = all_sequences(emissions, transitions, start, end, len(tokens))
    top = max(s for s, _ in seqs)
    log_z = top + math.log(sum(math.exp(s - top) for s, _ in seqs))
    total = 0.0
    for score, seq in seqs:
        found = tag.entities(tokens, [LABELS[t] for t in seq])
        if (entity["text"], entity["type"], entity["start"], entity["end"]) in found:
            total += math.exp(score - log_z)
    return total


@pytest.mark.parametrize("scheme", ["BIO", None])
def test_predict_with_confidence_gives_the_tags_and_exact_entity_probabilities(scheme):
    tagger = tiny_tagger(scheme)
    plain = tagger.predict(SENTENCES, batch_size=2)
    rich = tagger.predict(SENTENCES, batch_size=2, confidence=True)
    assert [r["tags"] for r in rich] == plain
    assert sum(len(r["entities"]) for r in rich) >= 3
    for tokens, r in zip(SENTENCES, rich):
        expected = tag.entities(tokens, r["tags"])
        assert [(e["text"], e["type"], e["start"], e["end"]) for e in r["entities"]] == expected
        for entity in r["entities"]:
            assert isinstance(entity["probability"], float) and 0 < entity["probability"] <= 1
            if len(tokens) <= 4:
                assert entity["probability"] == pytest.approx(brute_force_probability(tagger, tokens, entity, 1.0),
                                                              abs=2e-5)


def test_the_temperature_changes_the_probabilities_not_the_tags():
    tagger = tiny_tagger()
    assert tagger.temperature == 1.0
    cold = tagger.predict(SENTENCES, confidence=True)
    tagger.temperature = 3.0
    hot = tagger.predict(SENTENCES, confidence=True)
    assert [r["tags"] for r in hot] == [r["tags"] for r in cold] == tagger.predict(SENTENCES)
    pairs = [(a["probability"], b["probability"]) for r, s in zip(cold, hot) for a, b in zip(r["entities"],
                                                                                           s["entities"])]
    assert pairs and any(abs(a - b) > 1e-3 for a, b in pairs)
    tokens = SENTENCES[0]
    for entity in hot[0]["entities"]:
        assert entity["probability"] == pytest.approx(brute_force_probability(tagger, tokens, entity, 3.0), abs=2e-5)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite positive number"):
            tagger.temperature = bad
    with pytest.raises(TypeError, match="temperature must be a real number"):
        tagger.temperature = "2"
    with pytest.raises(TypeError, match="confidence must be a bool"):
        tagger.predict(SENTENCES, confidence=1)


def test_the_temperature_is_saved_and_old_folders_load_with_1(tmp_path):
    from crfkit.taggers import load_tagger

    tagger = tiny_tagger()
    tagger.temperature = 1.7
    tagger.save_pretrained(str(tmp_path))
    record = json.loads((tmp_path / "config.json").read_text())
    assert record["temperature"] == 1.7
    loaded = load_tagger(str(tmp_path))
    assert loaded.temperature == 1.7
    assert loaded.predict(SENTENCES, confidence=True) == tagger.predict(SENTENCES, confidence=True)
    del record["temperature"]  # a folder saved before the temperature existed
    (tmp_path / "config.json").write_text(json.dumps(record))
    assert load_tagger(str(tmp_path)).temperature == 1.0
    for bad in (0, -2, "1", None, True):
        record["temperature"] = bad
        (tmp_path / "config.json").write_text(json.dumps(record))
        with pytest.raises(ValueError, match="'temperature' must be a positive number"):
            load_tagger(str(tmp_path))


def test_calibrate_fits_the_validation_temperature():
    tagger = tiny_tagger()
    # gold tags: the tagger's own Viterbi tags on some sentences, another labelling on others
    sentences = SENTENCES * 3
    gold = tagger.predict(sentences)
    gold[1] = ["B-PER", "I-PER"]
    gold[5] = ["O", "O", "O", "O"]
    fitted = tagger.calibrate(sentences, gold, batch_size=4)
    assert tagger.temperature == fitted and fitted > 0
    # the same as fit_temperature on the tagger's scores
    batch = tagger.featurize(sentences)
    emissions = tagger.emissions(batch).detach()
    index = {label: i for i, label in enumerate(LABELS)}
    tags = torch.zeros(emissions.shape[:2], dtype=torch.long)
    for b, row in enumerate(gold):
        tags[b, :len(row)] = torch.tensor([index[t] for t in row], dtype=torch.long)
    transitions, start, end = (None if x is None else x.detach() for x in tagger.distribution_parameters())
    assert fitted == pytest.approx(fit_temperature(emissions, transitions, tags, batch["lengths"], start, end),
                                   rel=1e-3)
    with pytest.raises(ValueError, match="one list of tag names per sentence"):
        tagger.calibrate(sentences, gold[:-1])
    with pytest.raises(ValueError, match=r"tag_lists\[0\] must be a list of 4 tag names"):
        tagger.calibrate(sentences, [["O"]] + gold[1:])
    with pytest.raises(ValueError, match=r"tag_lists\[0\] holds 'B-XYZ'"):
        tagger.calibrate(sentences, [["B-XYZ", "O", "O", "O"]] + gold[1:])
    with pytest.raises(ValueError, match="forbidden by the CRF"):  # I-PER after O is not BIO
        tagger.calibrate(sentences, [["O", "I-PER", "O", "O"]] + gold[1:])


def test_entity_probabilities_match_entity_marginals_on_the_scaled_scores():
    tagger = tiny_tagger()
    tagger.temperature = 0.6
    rich = tagger.predict(SENTENCES[:3], confidence=True)
    batch = tagger.featurize(SENTENCES[:3])
    emissions = tagger.emissions(batch).detach() / 0.6
    transitions, start, end = (x.detach() / 0.6 for x in tagger.distribution_parameters())
    found = entity_marginals(emissions, transitions, LABELS, None, batch["lengths"], start, end)
    assert [p for r in rich for p in (e["probability"] for e in r["entities"])] == pytest.approx(
        found.probabilities.tolist(), abs=1e-6)


# ------------------------------------------------------------------------------ the tag command
def run_tag(argv, text, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert tag.main(argv) == 0
    return capsys.readouterr().out


def test_tag_command_with_confidence(tmp_path, monkeypatch, capsys):
    tagger = tiny_tagger()
    tagger.save_pretrained(str(tmp_path))
    text = "EU rejects German call\n\nPeter Blackburn\n"
    expected = tagger.predict([s.split() for s in text.split("\n") if s], confidence=True)
    out = run_tag(["--model", str(tmp_path), "--confidence"], text, monkeypatch, capsys)
    lines = out.rstrip("\n").split("\n")
    assert len(lines) == 2
    for line, r in zip(lines, expected):
        assert line == " | ".join(f"{e['text']}\t{e['type']}\t{e['probability']:.3f}" for e in r["entities"])
        for item in filter(None, line.split(" | ")):
            assert len(item.split("\t")) == 3 and 0 <= float(item.split("\t")[2]) <= 1
    plain = run_tag(["--model", str(tmp_path)], text, monkeypatch, capsys)
    assert plain.rstrip("\n").split("\n") == [" | ".join("\t".join(item.split("\t")[:2]) for item in
                                                         filter(None, line.split(" | "))) for line in lines]

    out = run_tag(["--model", str(tmp_path), "--confidence", "--format", "json"], text, monkeypatch, capsys)
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["tags"] for r in records] == [r["tags"] for r in expected]
    assert [r["entities"] for r in records] == [r["entities"] for r in expected]
    assert all("probability" in e for r in records for e in r["entities"])

    out = run_tag(["--model", str(tmp_path), "--confidence", "--format", "conll"], text, monkeypatch, capsys)
    blocks = out.strip("\n").split("\n\n")
    assert len(blocks) == 2
    for block, tokens, r in zip(blocks, (text.split("\n")[0].split(), text.split("\n")[2].split()), expected):
        rows = [line.split("\t") for line in block.split("\n")]
        assert [w for w, _, _ in rows] == tokens and [t for _, t, _ in rows] == r["tags"]
        shown = ["-"] * len(tokens)
        for e in r["entities"]:
            shown[e["start"]:e["end"]] = [f"{e['probability']:.3f}"] * (e["end"] - e["start"])
        assert [p for _, _, p in rows] == shown


# ---------------------------------------------------------------------- the calibration script
def _load_example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_conll(path, sentences):
    with open(path, "w") as f:
        for tokens, tags in sentences:
            f.write("".join(f"{w} {t}\n" for w, t in zip(tokens, tags)) + "\n")


@pytest.mark.filterwarnings("ignore:fit_temperature. the NLL is smallest at the edge")  # random taggers
def test_the_entity_calibration_script_on_a_tiny_tagger(tmp_path):
    pytest.importorskip("seqeval")
    script = _load_example("entity_calibration")
    teacher, student = tiny_tagger(seed=0), tiny_tagger(seed=1)
    teacher.save_pretrained(str(tmp_path / "teacher"))
    student.save_pretrained(str(tmp_path / "student"))
    sentences = [s for s in SENTENCES if s] * 2
    tags = teacher.predict(sentences)
    tags[0] = ["B-ORG", "O", "B-MISC", "O"]
    tags[1] = ["O", "O"]
    write_conll(tmp_path / "valid.txt", list(zip(sentences, tags)))
    write_conll(tmp_path / "test.txt", list(zip(sentences[::-1], tags[::-1])))
    docs = tmp_path / "calibration.md"
    docs.write_text(f"# Title\n\nintro\n\n{script.BEGIN}\nOLD SECTION\n{script.END}\n\nafter\n")
    out = tmp_path / "result.json"
    assert script.main(["--teacher", str(tmp_path / "teacher"), "--student", str(tmp_path / "student"),
                        "--validation", str(tmp_path / "valid.txt"), "--test", str(tmp_path / "test.txt"),
                        "--batch-size", "3", "--docs", str(docs), "--json", str(out)]) == 0
    run = json.loads(out.read_text())
    assert set(run["taggers"]) == {"teacher", "student"}
    assert run["command"].startswith("python examples/entity_calibration.py --teacher ")
    assert {"git", "machine", "seed", "date"} <= set(run)
    for name, tagger in (("teacher", teacher), ("student", student)):
        r = run["taggers"][name]
        assert r["temperature"] > 0 and r["test_sentences"] == len(sentences)
        # the Viterbi entities of the test file, their correctness and probabilities, recomputed here
        test_tags = tags[::-1]
        predicted = tagger.predict(sentences[::-1], confidence=True)
        entities = [(b, e) for b, p in enumerate(predicted) for e in p["entities"]]
        assert r["test_entities_predicted"] == len(entities)
        correct = [(e["text"], e["type"], e["start"], e["end"]) in tag.entities(sentences[::-1][b], test_tags[b])
                   for b, e in entities]
        assert r["accuracy"] == pytest.approx(sum(correct) / len(correct))
        mean = sum(e["probability"] for _, e in entities) / len(entities)
        assert r["calibration"]["1"]["mean_probability"] == pytest.approx(mean, abs=1e-6)
        ece = sum(abs(sum(c) / len(c) - sum(p) / len(p)) * len(c) / len(entities)
                  for i in range(10)
                  for c, p in [[[c for c, (_, e) in zip(correct, entities) if min(int(e["probability"] * 10), 9) == i],
                                [e["probability"] for _, e in entities if min(int(e["probability"] * 10), 9) == i]]]
                  if c)
        assert r["calibration"]["1"]["ece"] == pytest.approx(ece, abs=1e-6)
        viterbi = r["decoding"]["viterbi"]
        assert viterbi["f1"] == pytest.approx(viterbi["seqeval_f1"])
        assert set(r["decoding"]) == {"viterbi", "mbr_T_1", "mbr_T_fitted"}
    text = docs.read_text()
    assert text.startswith("# Title\n\nintro\n\n") and text.endswith("\n\nafter\n") and "OLD SECTION" not in text
    assert "| teacher |" in text and "| student |" in text
    # a second run replaces the section again
    assert script.main(["--student", str(tmp_path / "student"), "--validation", str(tmp_path / "valid.txt"),
                        "--test", str(tmp_path / "test.txt"), "--docs", str(docs), "--json", str(out)]) == 0
    assert docs.read_text().count(script.BEGIN) == 1 and "| teacher |" not in docs.read_text()


def test_the_script_needs_a_tagger(capsys):
    script = _load_example("entity_calibration")
    with pytest.raises(SystemExit):
        script.main([])
    assert "give --teacher and / or --student" in capsys.readouterr().err
