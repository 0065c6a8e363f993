"""Pre-quantized FP8 checkpoints (HF fp8, ModelOpt, compressed-tensors): detection, logits
against the dequantized transformers model, kernels after the swap pass, clear errors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.checkpoints.fp8 import FAMILIES, make_fp8_checkpoint
from helpers.checkpoints.tiny import random_ids
from helpers.compare import relative_l2
from helpers.kernel_checks import fp8_cpu_kernel
from qrt import runtime
from qrt.errors import CheckpointError, UnsupportedError

EXPECTED = {  # family -> (words inspect/describe must show, logical op, CPU kernel op)
    "hf-fp8-dynamic": ("HF fp8: tensor weight scales, dynamic per token", "qrt.fp8_linear", fp8_cpu_kernel("qrt.fp8_linear")),
    "hf-fp8-static": ("HF fp8: tensor weight scales, static per tensor", "qrt.fp8_static_linear", fp8_cpu_kernel("qrt.fp8_static_linear")),
    "hf-fp8-block": ("HF fp8: block 32x32 weight scales, dynamic per token-group", "qrt.fp8_block_linear", fp8_cpu_kernel("qrt.fp8_block_linear")),
    "modelopt-fp8": ("ModelOpt: tensor weight scales, static per tensor", "qrt.fp8_static_linear", fp8_cpu_kernel("qrt.fp8_static_linear")),
    "modelopt-fp8-side-file": ("ModelOpt: tensor weight scales, static per tensor", "qrt.fp8_static_linear", fp8_cpu_kernel("qrt.fp8_static_linear")),
    "modelopt-fp8-kv-cache": ("static per tensor activations, fp8 KV cache", "qrt.fp8_static_linear", fp8_cpu_kernel("qrt.fp8_static_linear")),
    "ct-fp8-tensor-static": ("compressed-tensors: tensor weight scales, static per tensor", "qrt.fp8_static_linear", fp8_cpu_kernel("qrt.fp8_static_linear")),
    "ct-fp8-channel-dynamic": ("compressed-tensors: channel weight scales, dynamic per token", "qrt.fp8_linear", fp8_cpu_kernel("qrt.fp8_linear")),
    "ct-fp8-block": ("compressed-tensors: block 32x32 weight scales, dynamic per token-group", "qrt.fp8_block_linear", fp8_cpu_kernel("qrt.fp8_block_linear")),
}
assert set(EXPECTED) == set(FAMILIES)
LINEARS = 2 * 4  # tiny model: 2 layers x (qkv, o, gate_up, down)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    made = {}

    def get(family):
        if family not in made:
            made[family] = (root / family, make_fp8_checkpoint(root / family, family))
        return made[family]

    return get


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_detected_and_matches_the_dequantized_model(family, checkpoints):
    folder, reference = checkpoints(family)
    described, _, kernel = EXPECTED[family]
    eager = runtime.compile_model(folder, compile=False, progress=False, max_seq_len=128)
    assert described in eager.scheme.describe()
    ids = random_ids()
    with torch.no_grad():
        expected = reference(ids).logits
    # Weights are exactly the checkpoint's dequantized values (block weights up to one fp32
    # rounding); what remains is the fp8 rounding of activations: 2**-4 relative per element at
    # most, compounded over 2 layers of 4 matmuls.
    error = relative_l2(eager(ids), expected)
    assert error < 0.06, error
    # The loader pass chose the family's CPU kernel for every quantized layer; the format contract
    # test (test_format_contract.py) compiles one family per registered format with it.
    kernels = {m.weight.kernel for m in eager.model.model.layers.modules() if hasattr(m, "quant_method")}
    assert kernels == {kernel}, kernels


@pytest.mark.parametrize("equal", [False, True], ids=["shard-scales-differ", "shard-scales-equal"])
def test_fused_shards_keep_their_own_per_tensor_scales(equal, tmp_path):
    """q/k/v (and gate/up) carry one scale each; the fused layer's per-row scales reproduce
    every shard's dequantized weight exactly, whether or not the scales differ."""
    folder = tmp_path / "ckpt"
    make_fp8_checkpoint(folder, "hf-fp8-dynamic", equal_shard_scales=equal)
    stored = load_file(str(folder / "model.safetensors"))
    model = runtime.compile_model(folder, compile=False, progress=False, max_seq_len=32).model
    layer = model.model.layers[0].self_attn.qkv_proj
    shards = [stored[f"model.layers.0.self_attn.{p}_proj.weight"].float() * stored[f"model.layers.0.self_attn.{p}_proj.weight_scale"]
              for p in "qkv"]
    scales = {float(stored[f"model.layers.0.self_attn.{p}_proj.weight_scale"]) for p in "qkv"}
    assert (len(scales) == 1) == equal
    assert torch.equal(layer.weight.float() * layer.weight_scale[:, None], torch.cat(shards))


def test_fp8_quant_on_an_fp8_checkpoint_uses_the_stored_one_and_other_formats_are_refused(checkpoints):
    folder, _ = checkpoints("hf-fp8-dynamic")
    m = runtime.compile_model(folder, quant="fp8", compile=False, progress=False, max_seq_len=32)
    assert "HF fp8" in m.scheme.describe()
    with pytest.raises(UnsupportedError, match=r"quant='gptq' was asked for.*pre-quantized fp8 \(HF fp8"):
        runtime.compile_model(folder, quant="gptq", compile=False, progress=False)


def _corrupt(src, dst, mutate):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_weight_scale_is_named(checkpoints, tmp_path):
    folder, _ = checkpoints("hf-fp8-dynamic")
    broken = _corrupt(folder, tmp_path / "x", lambda t: t.pop("model.layers.1.mlp.down_proj.weight_scale"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) for model.layers.1.mlp.down_proj.weight_scale"):
        runtime.compile_model(broken, compile=False, progress=False)


def test_wrong_block_scale_shape_is_named(checkpoints, tmp_path):
    folder, _ = checkpoints("hf-fp8-block")
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    broken = _corrupt(folder, tmp_path / "x", lambda t: t.update({name: t[name][:, :-1].contiguous()}))
    with pytest.raises(CheckpointError, match=rf"{name}.*shape \[2, 4\], expected \[2, 5\]"):
        runtime.compile_model(broken, compile=False, progress=False)


def test_bf16_weight_where_fp8_is_required(checkpoints, tmp_path):
    folder, _ = checkpoints("hf-fp8-dynamic")
    name = "model.layers.0.self_attn.o_proj.weight"
    broken = _corrupt(folder, tmp_path / "x", lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=rf"{name}.*bfloat16, expected float8_e4m3fn"):
        runtime.compile_model(broken, compile=False, progress=False)


@pytest.mark.parametrize("bad", [float("nan"), 0.0])
def test_nan_or_zero_scales_are_refused(checkpoints, tmp_path, bad):
    folder, _ = checkpoints("hf-fp8-static")
    name = "model.layers.1.self_attn.k_proj.input_scale"
    broken = _corrupt(folder, tmp_path / "x", lambda t: t.update({name: torch.tensor(bad)}))
    with pytest.raises(CheckpointError, match=rf"{name}.*positive finite"):
        runtime.compile_model(broken, compile=False, progress=False)


def test_ignore_lists_keep_layers_dense(tmp_path):
    folder = tmp_path / "ckpt"
    make_fp8_checkpoint(folder, "ct-fp8-channel-dynamic")
    tensors = load_file(str(folder / "model.safetensors"))
    dense = torch.randn(64, 64) * 0.05  # o_proj of layer 1 stays bf16, as an ignore entry says
    tensors["model.layers.1.self_attn.o_proj.weight"] = dense
    tensors.pop("model.layers.1.self_attn.o_proj.weight_scale")
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*layers\\.1\\.self_attn\\.o_proj$"]
    (folder / "config.json").write_text(json.dumps(config))
    model = runtime.compile_model(folder, compile=False, progress=False, max_seq_len=32).model
    assert torch.equal(model.model.layers[1].self_attn.o_proj.weight, dense)
    assert model.model.layers[0].self_attn.o_proj.quant_method.name == "fp8"


def test_modelopt_fp8_kv_cache_stores_e4m3_with_the_stored_scales(checkpoints, compiled):
    folder, _ = checkpoints("modelopt-fp8-kv-cache")
    model = compiled(folder)
    layers = model.model.model.layers
    assert layers[0].self_attn.k_cache.dtype == torch.float8_e4m3fn
    # As stored (amax / 448, below 1.0): a floor at 1.0 would round small keys to a few e4m3 codes.
    assert float(layers[0].self_attn.k_scale) == torch.tensor(0.0125).item()
    assert float(layers[1].self_attn.v_scale) == torch.tensor(0.02).item()
    # Decoding through the fp8 cache stays close to the full forward, which keeps K/V unrounded:
    # e4m3 keeps 3 mantissa bits, so K and V carry up to 2**-4 relative error each.
    ids = random_ids(5)[:1, :12]
    full = model(ids)[0]
    model.prefill(ids[:, :8])
    for pos in range(8, 12):
        step = model.decode(ids[:, pos:pos + 1], pos)
        assert relative_l2(step[0, -1], full[pos]) < 0.05
