"""Our safetensors reader: same tensors as the safetensors library, clear errors on damage."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from qrt.errors import CheckpointError
from qrt.checkpoint.safetensors_files import iter_tensors, read_header


@pytest.fixture
def weights_file(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "b": torch.randn(7, generator=gen),
        "c": torch.randint(-100, 100, (2, 2, 2), dtype=torch.int8, generator=gen),
        "d": torch.randn(4, 4, generator=gen).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 3),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path


def test_reads_every_tensor_exactly(weights_file):
    expected = load_file(str(weights_file))
    got = {name: tensor for _, name, tensor in iter_tensors([weights_file])}
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_truncated_file_names_the_tensor_cut_off(weights_file):
    data = weights_file.read_bytes()
    weights_file.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor '.*'.*past the end of the file.*truncated"):
        read_header(weights_file)


def test_not_a_safetensors_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"PK\x03\x04 this is a zip, not safetensors" * 4)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        read_header(path)


def test_header_that_is_not_json(tmp_path):
    path = tmp_path / "model.safetensors"
    header = b"{this is not json}"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_header(path)


def _write(path, header: dict, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_overlapping_tensors_are_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    _write(path, {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                  "y": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, b"\0" * 16)
    with pytest.raises(CheckpointError, match="overlaps tensor 'x'"):
        read_header(path)


def test_size_that_does_not_match_the_shape(tmp_path):
    path = tmp_path / "model.safetensors"
    _write(path, {"x": {"dtype": "F16", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"tensor 'x'.*16 bytes for shape \[4\] F16, which needs 8"):
        read_header(path)


def test_unknown_dtype(tmp_path):
    path = tmp_path / "model.safetensors"
    _write(path, {"x": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(CheckpointError, match="unknown dtype 'F4'"):
        read_header(path)
