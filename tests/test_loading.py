"""The loader: plain Parameters, fused shards, ties, and clear errors for broken checkpoints."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from helpers.kernel_checks import fp8_cpu_kernel
from qrt import runtime
from qrt.errors import CheckpointError, ConfigError, UnsupportedError


def load_eager(folder, quant=None, **kwargs):
    return runtime.compile_model(folder, quant=quant, compile=False, progress=False, **kwargs).model


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_every_parameter_is_a_plain_parameter(llama_dir, quant):
    model = load_eager(llama_dir, quant)
    params = list(model.parameters())
    assert params, "model has no parameters"
    for name, param in model.named_parameters():
        assert type(param) is nn.Parameter, f"{name} is a {type(param).__name__}"
        assert not param.requires_grad, name
        assert param.device.type == "cpu" and not param.is_meta, name


def test_fused_shards_land_in_their_rows(llama_dir):
    model = load_eager(llama_dir)
    stored = load_file(str(llama_dir / "model.safetensors"))
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    expected = torch.cat([stored[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, expected)
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    expected = torch.cat([stored[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(gate_up, expected)


def test_qwen2_loads_qkv_bias(qwen2_dir):
    model = load_eager(qwen2_dir)
    stored = load_file(str(qwen2_dir / "model.safetensors"))
    bias = model.model.layers[0].self_attn.qkv_proj.bias
    expected = torch.cat([stored[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(bias, expected)


def test_tied_embeddings_share_one_tensor(tied_llama_dir):
    model = load_eager(tied_llama_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_online_fp8_quantizes_each_shard_per_row(llama_dir):
    model = load_eager(llama_dir, "fp8")
    layer = model.model.layers[0].self_attn.qkv_proj
    stored = load_file(str(llama_dir / "model.safetensors"))
    original = torch.cat([stored[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    # On the CPU the weights stay fp8 for qrt's own kernel; where it cannot build, the loader pass
    # widens the codes to exact values in the model dtype.
    assert layer.weight.kernel == fp8_cpu_kernel("qrt.fp8_linear")
    if layer.weight.kernel == "qrt.fp8_linear_native_cpu":
        assert layer.weight.dtype == torch.float8_e4m3fn
    else:
        assert layer.weight.dtype == torch.float32
        assert torch.equal(layer.weight, layer.weight.to(torch.float8_e4m3fn).float()), "not exact fp8 values"
    assert layer.weight_scale.shape == (original.shape[0],)
    dequant = layer.weight.float() * layer.weight_scale[:, None]
    # e4m3 keeps 3 mantissa bits: each weight within half a step (2**-4 relative) of the original.
    assert torch.all((dequant - original).abs() <= original.abs() * 2**-4 + layer.weight_scale[:, None] * 2**-9)
    assert model.lm_head.weight.dtype == torch.int8, "lm_head: int8 per channel"
    assert model.model.embed_tokens.weight.dtype == torch.float32, "the embeddings stay as stored"


def test_sharded_checkpoint_loads_like_the_single_file(llama_dir, tmp_path):
    tensors = load_file(str(llama_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
        weight_map.update({n: file for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(llama_dir / "config.json", tmp_path / "config.json")
    sharded, single = load_eager(tmp_path), load_eager(llama_dir)
    for (name, a), (_, b) in zip(sharded.named_parameters(), single.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_dummy_load_format_gives_random_weights_of_the_right_shapes(llama_dir):
    model = runtime.compile_model(llama_dir, compile=False, progress=False,
                                  load_config=runtime.LoadConfig(load_format="dummy")).model
    stored = load_file(str(llama_dir / "model.safetensors"))
    embed = model.model.embed_tokens.weight
    assert embed.shape == stored["model.embed_tokens.weight"].shape
    assert not torch.equal(embed, stored["model.embed_tokens.weight"])
    assert 0.01 < float(embed.std()) < 0.03


def _broken_copy(src, dst, mutate):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_tensor_is_named(llama_dir, tmp_path):
    folder = _broken_copy(llama_dir, tmp_path / "ckpt", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight \(shard 'k'\)"):
        load_eager(folder)


def test_wrong_shape_names_file_tensor_and_shapes(llama_dir, tmp_path):
    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]

    folder = _broken_copy(llama_dir, tmp_path / "ckpt", shrink)
    with pytest.raises(CheckpointError) as info:
        load_eager(folder)
    message = str(info.value)
    assert "model.safetensors" in message and "model.layers.0.mlp.up_proj.weight" in message
    assert "[159, 64]" in message and "[160, 64]" in message


def test_unexpected_tensor_is_an_error(llama_dir, tmp_path):
    folder = _broken_copy(llama_dir, tmp_path / "ckpt", lambda t: t.update({"model.extra.weight": torch.ones(3)}))
    with pytest.raises(CheckpointError, match="model.extra.weight.*unexpected"):
        load_eager(folder)


def test_unknown_architecture_lists_the_supported_ones(llama_dir, tmp_path):
    shutil.copytree(llama_dir, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt/config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (tmp_path / "ckpt/config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match="FancyNewForCausalLM.*LlamaForCausalLM, Qwen2ForCausalLM"):
        load_eager(tmp_path / "ckpt")


def test_missing_config_and_bad_json_are_config_errors(llama_dir, tmp_path):
    with pytest.raises(ConfigError, match="config.json: not found"):
        load_eager(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_eager(tmp_path)


def test_prequantized_checkpoints_and_unknown_quant_are_refused(llama_dir, tmp_path):
    with pytest.raises(UnsupportedError, match="quant='int3'.*fp8"):
        load_eager(llama_dir, "int3")
    shutil.copytree(llama_dir, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt/config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq", "nbits": 4}
    (tmp_path / "ckpt/config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match="quant_method='hqq'.*'gptq'"):
        load_eager(tmp_path / "ckpt")
    # A config that claims GPTQ over plain weights: the first dense weight is named as unexpected.
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (tmp_path / "ckpt/config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"down_proj\.weight'.*unexpected tensor.*'gptq'-format layer, which loads \['qweight'"):
        load_eager(tmp_path / "ckpt")
