"""tools/gpu_teacher.py: the teacher's weights travel as float16 pieces and come back whole."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

_SPEC = importlib.util.spec_from_file_location(
    "gpu_teacher", Path(__file__).resolve().parents[1] / "tools" / "gpu_teacher.py")
gpu_teacher = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu_teacher)


def _weights(path):
    g = torch.Generator().manual_seed(0)
    tensors = {"encoder.weight": torch.randn(300, 40, generator=g) * 3, "crf.transitions": torch.randn(9, 9),
               "casing.index": torch.arange(5)}
    save_file(tensors, str(path))
    return tensors


def _device_output(tmp_path, pieces_per_folder=2, piece_bytes=10_000):
    """What the device calls would return: weight pieces over two folders and the small files."""
    model = tmp_path / "device" / "model"
    model.mkdir(parents=True)
    tensors = _weights(model / "model.safetensors")
    (model / "config.json").write_text(json.dumps({"tagger": "TransformerCRFTagger"}))
    (model / "encoder").mkdir()
    (model / "encoder" / "config.json").write_text("{}")
    staging = tmp_path / "staging"
    shutil.copytree(model, staging / "model", ignore=shutil.ignore_patterns("model.safetensors"))
    (staging / "result.json").write_text(json.dumps({"variant": "teacher", "teacher_sha256": "device", "dev_f1": 90.0,
                                                     "test_f1": 88.0, "machine": "NVIDIA H200"}))
    pieces = gpu_teacher.split(gpu_teacher.to_half_bytes(model / "model.safetensors"), piece_bytes)
    assert len(pieces) > pieces_per_folder  # the test spans several calls
    everything = tmp_path / "pieces"
    everything.mkdir()
    gpu_teacher.write_pieces(pieces, everything)
    written, folders = sorted(everything.iterdir()), []
    for start in range(0, len(pieces), pieces_per_folder):
        folder = tmp_path / f"call{len(folders)}"
        folder.mkdir()
        for path in written[start:start + pieces_per_folder]:
            shutil.move(str(path), str(folder / path.name))
        folders.append(folder)
    shutil.make_archive(str(folders[0] / "teacher_files"), "gztar", root_dir=staging)
    return tensors, folders


def test_unpack_rebuilds_the_teacher_from_float16_pieces(tmp_path):
    tensors, folders = _device_output(tmp_path)
    workdir = tmp_path / "run"
    gpu_teacher.main(["unpack", *map(str, folders), "--workdir", str(workdir)])
    got = load_file(str(workdir / "teacher" / "model" / "model.safetensors"))
    assert got.keys() == tensors.keys()
    for name, want in tensors.items():
        if want.is_floating_point():
            assert got[name].dtype == torch.float32
            torch.testing.assert_close(got[name], want, rtol=1e-3, atol=1e-4)  # float16's rounding
            assert not torch.equal(got[name], want)
        else:
            assert torch.equal(got[name], want)
    assert (workdir / "teacher" / "model" / "encoder" / "config.json").is_file()
    record = json.loads((workdir / "results.jsonl").read_text().splitlines()[-1])
    assert record["device_teacher_sha256"] == "device"
    assert record["teacher_sha256"] == gpu_teacher.hashlib.sha256(
        (workdir / "teacher" / "model" / "model.safetensors").read_bytes()).hexdigest()
    assert record == json.loads((workdir / "teacher" / "result.json").read_text())


@pytest.mark.parametrize("lost", ["first", "last"])
def test_unpack_refuses_a_missing_piece(tmp_path, lost):
    _, folders = _device_output(tmp_path)
    pieces = sorted(p for folder in folders for p in folder.iterdir() if p.name.startswith("teacher."))
    (pieces[0] if lost == "first" else pieces[-1]).unlink()
    with pytest.raises(SystemExit, match="missing weight pieces"):
        gpu_teacher.main(["unpack", *map(str, folders), "--workdir", str(tmp_path / "run")])


def test_pieces_fit_the_device_tools_limits():
    assert gpu_teacher.CALL_LIMIT <= 58 << 20  # with the working tree, under the 64 MiB a call carries
    assert gpu_teacher.RETURN_PIECE <= 16 << 20  # a returned file's limit
    assert gpu_teacher.RETURN_PIECES_PER_CALL * gpu_teacher.RETURN_PIECE + (4 << 20) <= 64 << 20
