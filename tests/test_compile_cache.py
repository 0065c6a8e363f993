"""qrt's compile cache: a second start loads the graphs the first compiled, a broken entry is
reported in one line and rebuilt, the key follows what the graphs depend on, and the CLI lists and
clears entries."""

import json

import pytest
import torch

from helpers.checkpoints.tiny import edited_copy
from helpers.graph_checks import assert_one_graph_per_role, decode_without_recompiles
from qrt import runtime
from qrt import cli
from qrt.runtime.compile_cache import MAGIC, CompileCache, checkpoint_identity, entry_key, list_entries
from qrt.runtime.direct_graph import DirectGraph

PROMPT = [5, 9, 2, 7, 11]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "qrt-cache"
    monkeypatch.setenv("QRT_CACHE_DIR", str(folder))
    return folder


def start(folder, **kwargs):
    return runtime.compile_model(folder, max_seq_len=64, **kwargs)


def only_entry(cache_dir):
    (entry,) = (cache_dir / "compiled").glob("*.qrtc")
    return entry


def test_second_start_loads_the_graphs_and_decodes_the_same(llama_dir, cache_dir, capfd):
    first = start(llama_dir)
    assert first.cache_hit is False
    assert "compiling (first run for this model, about" in capfd.readouterr().err
    expected = first.generate(PROMPT, max_new_tokens=8, stop_at_eos=False)
    entry = only_entry(cache_dir)
    second = start(llama_dir)
    assert second.cache_hit is True
    assert "loaded compiled graphs from cache" in capfd.readouterr().err
    # The graphs themselves came from the entry: called without tracing the model at all.
    assert second.loaded_roles == {"prefill", "decode"}
    assert second.generate(PROMPT, max_new_tokens=8, stop_at_eos=False) == expected
    assert all(backend.last_compiled is None for backend in second.backends.values())
    assert_one_graph_per_role(second, forward=False)
    # Through Dynamo (traced on entering `guarded`), with every step under its recompile check.
    assert decode_without_recompiles(second, PROMPT, 8) == expected
    assert second.loaded_roles == set()
    assert_one_graph_per_role(second, forward=False)
    assert list(cache_dir.joinpath("compiled").glob("*.qrtc")) == [entry]  # a hit writes nothing new


@pytest.mark.slow  # two more starts of the tiny model (about 15 s); the test above covers the warm path
def test_a_loaded_graph_refuses_weights_it_was_not_compiled_for(llama_dir, cache_dir):
    start(llama_dir, progress=False)
    loaded = start(llama_dir, progress=False)
    decode = loaded.direct["decode"]
    state = {**dict(loaded.model.named_parameters()), **dict(loaded.model.named_buffers())}
    name = next(i.name for i in decode.spec.inputs if i.kind == "state" and "norm" in i.name)
    with pytest.raises(ValueError, match=rf"decode graph: '{name}' is torch.float64 .* compiled for torch.float32"):
        DirectGraph(decode.fn, decode.spec, {**state, name: state[name].double()}, "decode")
    with pytest.raises(ValueError, match=rf"decode graph: the model has no weight or buffer '{name}'"):
        DirectGraph(decode.fn, decode.spec, {k: v for k, v in state.items() if k != name}, "decode")


# Two kinds of damage by default (a short file, a checksum mismatch); the other two in `make test-slow`.
@pytest.mark.parametrize("damage", ["truncate", "flip_payload_byte", pytest.param("garbage_header", marks=pytest.mark.slow),
                                    pytest.param("valid_checksum_bad_payload", marks=pytest.mark.slow)])
def test_a_broken_entry_is_reported_in_one_line_and_rebuilt(llama_dir, cache_dir, capfd, damage):
    expected = start(llama_dir).generate(PROMPT, max_new_tokens=6, stop_at_eos=False)
    entry = only_entry(cache_dir)
    data = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "flip_payload_byte":
        entry.write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
    elif damage == "garbage_header":
        entry.write_bytes(b"\x00garbage" + data[20:])
    else:  # passes every check of the file itself; torch cannot deserialize it
        meta = json.loads(data[len(MAGIC):].partition(b"\n")[0])
        CompileCache(meta["key"], meta["parts"], directory=entry.parent).store(b"not artifacts" * 10, meta)
    capfd.readouterr()
    rebuilt = start(llama_dir)
    err = capfd.readouterr().err
    complaints = [line for line in err.splitlines() if str(entry) in line]
    assert len(complaints) == 1 and "deleting it and compiling anew" in complaints[0]
    assert rebuilt.cache_hit is False
    assert rebuilt.generate(PROMPT, max_new_tokens=6, stop_at_eos=False) == expected
    # The rebuilt entry is whole again, and serves the next start.
    assert start(llama_dir).cache_hit is True


def test_the_key_follows_config_weights_headers_format_and_shapes(llama_dir, tmp_path):
    def key(folder=llama_dir, **parts):
        files = [folder / "config.json", folder / "model.safetensors"]
        return entry_key({"checkpoint": checkpoint_identity(files), "quant": None, "max_seq_len": 64, **parts})[0]

    base = key()
    assert key() == base
    assert key(quant="fp8") != base
    assert key(max_seq_len=128) != base
    config_edit = edited_copy(llama_dir, tmp_path / "eps")
    config = json.loads((config_edit / "config.json").read_text())
    (config_edit / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    assert key(config_edit) != base
    # The same config, one tensor renamed: the safetensors header tells them apart.
    renamed = edited_copy(llama_dir, tmp_path / "renamed",
                          tensors=lambda state: state.__setitem__("model.norm.weigh_", state.pop("model.norm.weight")))
    assert key(renamed) != base


def test_cli_lists_and_clears_entries(llama_dir, cache_dir, capsys):
    start(llama_dir, progress=False)
    assert cli.main(["cache", "list"]) == 0
    listing = capsys.readouterr().out
    assert "1 entries" in listing and str(llama_dir) in listing and "max_seq_len=64" in listing
    assert "  graphs  " in listing  # the step graphs themselves, not torch's caches
    only_entry(cache_dir).write_bytes(b"broken")
    assert cli.main(["cache", "list"]) == 0
    assert "UNUSABLE" in capsys.readouterr().out
    assert cli.main(["cache", "clear"]) == 0
    assert list_entries() == []
    assert not (cache_dir / "inductor").exists()


@pytest.mark.slow  # the frozen build's whole-model compile: 15 s; the frozen build's other tests are slow too
def test_no_cache_and_frozen_builds_write_no_entry(llama_dir, cache_dir):
    assert start(llama_dir, cache=False, progress=False).cache_hit is False
    assert start(llama_dir, build="frozen", progress=False).compile_cache is None
    assert not (cache_dir / "compiled").exists()


@pytest.mark.slow  # three starts of the tiny model (about 20 s); `qrt generate` runs this path in test_cli
def test_lazy_prefill_compiles_decode_alone_and_the_entry_gains_prefill_later(llama_dir, cache_dir, capfd):
    long_prompt = PROMPT * 3  # 15 tokens
    lazy = start(llama_dir, lazy_prefill=len(PROMPT))
    assert set(lazy.compile_seconds) == {"decode"} and lazy.compile_report()["prefill"] == 0
    short_by_decode = lazy.prefill_chunk(PROMPT, 0, 0)
    assert lazy.compile_report()["prefill"] == 0  # the short prompt ran through the decode graph
    long_by_prefill = lazy.prefill_chunk(long_prompt, 0, 0)
    assert "compiling prefill (the first prompt longer than 5 tokens)" in capfd.readouterr().err
    assert lazy.compile_report()["prefill"] == 1
    assert lazy.prefill_chunk(long_prompt[:9], 0, 0).shape == long_by_prefill.shape  # no recompile: still 1
    assert lazy.compile_report()["prefill"] == 1

    # A start without lazy_prefill finds both graphs in the entry, which gained prefill later.
    full = start(llama_dir)
    assert full.cache_hit is True and full.loaded_roles == {"prefill", "decode"} and full.compile_seconds == {}
    assert torch.equal(full.prefill_chunk(long_prompt, 0, 0), long_by_prefill)
    # The decode graph's logits for a prompt fed a token a step are the prefill graph's within
    # float32 rounding (the tiny model's dtype): the attention and the matmuls sum in other
    # orders. The same prompt one position on differs by 0.25.
    by_prefill = full.prefill_chunk(PROMPT, 0, 0)
    assert (short_by_decode - by_prefill).norm() / by_prefill.norm() < 1e-5


@pytest.mark.slow  # two compiles of the tiny model, one uncached: `make test-slow`
def test_a_cache_folder_that_cannot_be_written_warns_and_runs_uncached(llama_dir, tmp_path, monkeypatch, capfd):
    # Not a folder at all: mkdir under a regular file fails for every user, root included (the
    # mode bits of a read-only folder would not stop root).
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("QRT_CACHE_DIR", str(blocker / "qrt-cache"))
    # Inductor's folder left to qrt, as a user who never set it has it (the suite shares one). qrt
    # then points the variable at a folder of its own; monkeypatch restores the suite's afterwards.
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    model = start(llama_dir)
    err = capfd.readouterr().err
    assert "cannot be written; compiling without a cache" in err
    assert "could not write the compile cache entry" in err
    assert model.cache_hit is False
    eager = start(llama_dir, compile=False)
    assert (model.generate(PROMPT, max_new_tokens=8, stop_at_eos=False)
            == eager.generate(PROMPT, max_new_tokens=8, stop_at_eos=False))
