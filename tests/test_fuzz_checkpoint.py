"""Mutated tiny checkpoints either load into the reference model or fail with a qrt error:
never another exception type, a hang or a crash."""

import json
import shutil
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import load_file, save_file

from qrt import runtime
from qrt.errors import QrtError

CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "vocab_size", "rms_norm_eps", "rope_theta", "architectures",
               "tie_word_embeddings", "torch_dtype", "max_position_embeddings")
ODD_VALUES = st.one_of(st.integers(-3, 400), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
                       st.none(), st.booleans(), st.lists(st.integers(0, 3), max_size=2))
IDS = torch.tensor([[1, 5, 9, 200, 17, 3]])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, llama_dir):
    """The tiny checkpoint's files and the logits it must give when it loads."""
    reference = runtime.compile_model(llama_dir, compile=False, progress=False, max_seq_len=32)(IDS)
    return llama_dir, reference


def _load_or_qrt_error(folder, reference):
    try:
        model = runtime.compile_model(folder, compile=False, progress=False, max_seq_len=32)
    except QrtError:
        return "refused"
    torch.testing.assert_close(model(IDS), reference)  # a load that succeeds must be the same model
    return "loaded"


def _copy(src, dst):
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


fuzz_settings = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@fuzz_settings
@given(data=st.data())
def test_mutated_header_bytes(pristine, tmp_path, data):
    src, reference = pristine
    folder = _copy(src, tmp_path / "ckpt")
    path = folder / "model.safetensors"
    raw = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, 8 + header_len - 1))
        raw[at] = data.draw(st.integers(0, 255))
    path.write_bytes(bytes(raw))
    _load_or_qrt_error(folder, reference)


@fuzz_settings
@given(cut=st.floats(0.0, 0.999))
def test_truncated_weights(pristine, tmp_path, cut):
    src, reference = pristine
    folder = _copy(src, tmp_path / "ckpt")
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * cut)])
    assert _load_or_qrt_error(folder, reference) == "refused"


@fuzz_settings
@given(key=st.sampled_from(CONFIG_KEYS), value=ODD_VALUES)
def test_mutated_config_values(pristine, tmp_path, key, value):
    src, reference = pristine
    folder = _copy(src, tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    try:
        model = runtime.compile_model(folder, compile=False, progress=False, max_seq_len=32)
    except QrtError:
        return
    # A value that changes the model (eps, theta) may load and give other logits: fine, as long
    # as it runs.
    logits = model(IDS[:, : model.max_seq_len])
    assert logits.shape[-1] == model.vocab_size


@fuzz_settings
@given(data=st.data())
def test_mutated_tensor_shapes_and_dtypes(pristine, tmp_path, data):
    src, reference = pristine
    folder = _copy(src, tmp_path / "ckpt")
    tensors = load_file(str(folder / "model.safetensors"))
    name = data.draw(st.sampled_from(sorted(tensors)))
    tensor = tensors[name]
    change = data.draw(st.sampled_from(["dtype", "drop_row", "transpose", "flatten"]))
    if change == "dtype":
        tensor = tensor.to(data.draw(st.sampled_from([torch.int8, torch.float8_e4m3fn, torch.bool])))
    elif change == "drop_row":
        tensor = tensor[:-1]
    elif change == "transpose" and tensor.dim() == 2 and tensor.shape[0] != tensor.shape[1]:
        tensor = tensor.t()
    else:
        tensor = tensor.reshape(-1)[:-1] if tensor.dim() == 1 else tensor.reshape(-1)
    tensors[name] = tensor.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    assert _load_or_qrt_error(folder, reference) == "refused"


def test_pickle_only_checkpoints_are_refused(llama_dir, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(llama_dir / "config.json", folder / "config.json")
    (folder / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(QrtError, match="pytorch_model.bin.*unpickling can run code"):
        runtime.compile_model(folder, compile=False, progress=False)


def test_index_entry_missing_from_its_shard_and_duplicates_across_shards(llama_dir, tmp_path):
    tensors = load_file(str(llama_dir / "model.safetensors"))
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(llama_dir / "config.json", folder / "config.json")
    save_file({n: tensors[n] for n in first}, str(folder / "a.safetensors"))
    save_file({n: tensors[n] for n in second[1:]}, str(folder / "b.safetensors"))
    weight_map = {**{n: "a.safetensors" for n in first}, **{n: "b.safetensors" for n in second}}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(QrtError, match=rf"b.safetensors: tensor '{second[0]}': listed in .* but no shard has it"):
        runtime.compile_model(folder, compile=False, progress=False)
    save_file({n: tensors[n] for n in second + first[:1]}, str(folder / "b.safetensors"))
    with pytest.raises(QrtError, match=rf"tensor '{first[0]}': is also in a.safetensors"):
        runtime.compile_model(folder, compile=False, progress=False)


def test_index_naming_a_missing_shard(llama_dir, tmp_path):
    folder = _copy(llama_dir, tmp_path / "ckpt")
    names = load_file(str(folder / "model.safetensors"))
    weight_map = {name: "model.safetensors" for name in names}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(QrtError, match=r"index.json: names shard\(s\) \['model-00002-of-00002.safetensors'\]"):
        runtime.compile_model(folder, compile=False, progress=False)
