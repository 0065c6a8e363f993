"""Hugging Face Hub ids (checkpoint/hub.py), offline against a hub cache laid out as
huggingface_hub lays it out: models--ORG--NAME/{refs,blobs,snapshots/<commit>/}, each snapshot
file a link to its blob. Nothing is downloaded."""

import hashlib
import os
from pathlib import Path

import pytest
import torch

from qrt.checkpoint.hub import is_hub_id, locate
from qrt.cli import main
from qrt.errors import CheckpointError
from qrt.runtime import compile_model


def add_snapshot(cache: Path, repo: str, commit: str, files: dict[str, bytes], refs=("main",)) -> Path:
    """One commit of `repo` in the cache: its files as blobs, linked from snapshots/<commit>/."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_a_hub_id_loads_the_cached_snapshot_like_its_folder(hub, llama_dir):
    snapshot = add_snapshot(hub, "tiny-org/tiny-llama", "a" * 40, folder_files(llama_dir))
    assert locate("tiny-org/tiny-llama") == snapshot
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    from_hub = compile_model("tiny-org/tiny-llama", compile=False, progress=False)
    from_folder = compile_model(llama_dir, compile=False, progress=False)
    assert from_hub.source == snapshot
    assert torch.equal(from_hub(ids), from_folder(ids))


def test_a_revision_picks_its_own_snapshot(hub, llama_dir):
    files = folder_files(llama_dir)
    add_snapshot(hub, "tiny-org/tiny-llama", "a" * 40, files)
    older = add_snapshot(hub, "tiny-org/tiny-llama", "b" * 40, files, refs=("v1",))
    assert locate("tiny-org/tiny-llama", revision="v1") == older
    assert locate("tiny-org/tiny-llama", revision="b" * 40) == older


def test_a_gguf_repository_names_its_file_by_name_or_by_quantization_tag(hub):
    snapshot = add_snapshot(hub, "tiny-org/tiny-GGUF", "c" * 40,
                            {"tiny-Q4_0.gguf": b"GGUF0", "tiny-Q4_K_M.gguf": b"GGUF1", "README.md": b"#"})
    assert locate("tiny-org/tiny-GGUF:Q4_K_M") == snapshot / "tiny-Q4_K_M.gguf"
    assert locate("tiny-org/tiny-GGUF:q4_0") == snapshot / "tiny-Q4_0.gguf"  # tags match in any case
    assert locate("tiny-org/tiny-GGUF:tiny-Q4_0.gguf") == snapshot / "tiny-Q4_0.gguf"
    with pytest.raises(CheckpointError, match=r"0 \.gguf files match the tag 'Q8_0'.*tiny-Q4_0\.gguf, tiny-Q4_K_M\.gguf"):
        locate("tiny-org/tiny-GGUF:Q8_0")
    with pytest.raises(CheckpointError, match=r"2 \.gguf files match the tag 'Q4'"):
        locate("tiny-org/tiny-GGUF:Q4")
    with pytest.raises(CheckpointError, match=r"holds GGUF files, so name one: tiny-org/tiny-GGUF:tiny-Q4_0\.gguf"):
        locate("tiny-org/tiny-GGUF")


def test_offline_and_not_cached_says_what_to_do(hub):
    with pytest.raises(CheckpointError) as err:
        locate("tiny-org/absent-model")
    message = str(err.value)
    assert "tiny-org/absent-model" in message and "HF_HUB_OFFLINE" in message and str(hub) in message
    assert "hf download tiny-org/absent-model" in message


def test_a_local_path_always_wins(hub, tmp_path, monkeypatch, llama_dir):
    add_snapshot(hub, "tiny-org/tiny-llama", "a" * 40, folder_files(llama_dir))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-org" / "tiny-llama").mkdir(parents=True)
    assert not is_hub_id("tiny-org/tiny-llama")
    assert locate("tiny-org/tiny-llama") == Path("tiny-org/tiny-llama")
    with pytest.raises(ValueError, match="revision='v1' applies to hub ids"):
        locate("tiny-org/tiny-llama", revision="v1")
    assert not is_hub_id("./not-there") and not is_hub_id("a/b/c") and is_hub_id("org/name:Q4_K_M")


def test_the_command_line_takes_a_hub_id_and_a_revision(hub, llama_dir, capsys):
    files = folder_files(llama_dir)
    add_snapshot(hub, "tiny-org/tiny-llama", "a" * 40, files)
    older = add_snapshot(hub, "tiny-org/tiny-llama", "b" * 40, files, refs=("v1",))
    assert main(["inspect", "tiny-org/tiny-llama", "--revision", "v1", "--tensors", "0"]) == 0
    assert f"checkpoint:    {older}" in capsys.readouterr().out
    assert main(["inspect", "tiny-org/absent-model"]) == 2
    assert "HF_HUB_OFFLINE" in capsys.readouterr().err


def test_a_lora_adapter_by_hub_id_is_its_cached_snapshot(hub, llama_dir, tmp_path):
    from helpers.lora_adapters import make_peft_adapter

    adapter = make_peft_adapter(llama_dir, tmp_path / "adapter", seed=5)
    add_snapshot(hub, "tiny-org/tiny-lora", "c" * 40, folder_files(adapter))
    from_hub = compile_model(llama_dir, compile=False, progress=False, lora={"a": "tiny-org/tiny-lora"})
    from_folder = compile_model(llama_dir, compile=False, progress=False, lora={"a": adapter})
    assert from_hub.lora.residents["a"].path == hub / "models--tiny-org--tiny-lora" / "snapshots" / ("c" * 40)
    prompt = [1, 5, 9, 3, 7]
    assert from_hub.generate(prompt, 8, lora="a") == from_folder.generate(prompt, 8, lora="a")
    with pytest.raises(CheckpointError, match="tiny-org/no-lora"):
        compile_model(llama_dir, compile=False, progress=False, lora={"a": "tiny-org/no-lora"})
