"""Tiny pre-quantized FP8 checkpoints in the exact on-disk layouts of HF fp8, ModelOpt and
compressed-tensors, plus the dequantized transformers model they should reproduce."""

import json
import math

import torch
from safetensors.torch import save_file

from helpers.checkpoints.tiny import make_checkpoint

FP8 = torch.float8_e4m3fn
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = 32  # the tiny model's dims are multiples of 32; real checkpoints use 128 with the same layout


def quantize_tensor(w):
    scale = w.abs().amax().float() / 448.0  # []
    return (w / scale).clamp(-448, 448).to(FP8), scale


def quantize_channel(w):
    scale = w.abs().amax(dim=1, keepdim=True).float() / 448.0  # [N, 1]
    return (w / scale).clamp(-448, 448).to(FP8), scale


def quantize_block(w, block=BLOCK):
    n, k = w.shape
    rows, cols = math.ceil(n / block), math.ceil(k / block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:n, :k] = w
    tiles = padded.view(rows, block, cols, block)
    scale = tiles.abs().amax(dim=(1, 3)) / 448.0  # [ceil(N/b), ceil(K/b)]
    q = (tiles / scale[:, None, :, None]).clamp(-448, 448).view(rows * block, cols * block)[:n, :k]
    return q.to(FP8), scale


def dequantize_block(q, scale, block=BLOCK):
    expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * expanded


FAMILIES = {
    # name: (weight strategy, static input scale?, how the config says it)
    "hf-fp8-dynamic": ("tensor", False),
    "hf-fp8-static": ("tensor", True),
    "hf-fp8-block": ("block", False),
    "modelopt-fp8": ("tensor", True),
    "modelopt-fp8-side-file": ("tensor", True),
    "modelopt-fp8-kv-cache": ("tensor", True),
    "ct-fp8-tensor-static": ("tensor", True),
    "ct-fp8-channel-dynamic": ("channel", False),
    "ct-fp8-block": ("block", False),
}


def make_fp8_checkpoint(folder, family: str, arch: str = "llama", seed: int = 0, equal_shard_scales=False):
    """Write `family`'s layout into `folder`; return the transformers model holding the
    dequantized weights (the reference)."""
    strategy, static = FAMILIES[family]
    folder.mkdir(parents=True, exist_ok=True)
    hf = make_checkpoint(folder, arch, seed=seed)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    tensors, gen = {}, torch.Generator().manual_seed(seed + 1)
    for name, value in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or not module.endswith(LINEARS):
            tensors[name] = value
            continue
        if equal_shard_scales and strategy == "tensor":
            value = value / value.abs().amax()  # every shard then has the same scale, 1/448
        stored_dtype = torch.bfloat16 if family.startswith("ct-") else torch.float32
        if strategy == "tensor":
            q, scale = quantize_tensor(value)
            dequant = q.float() * scale
        elif strategy == "channel":
            q, scale = quantize_channel(value)
            dequant = q.float() * scale
        else:
            q, scale = quantize_block(value)
            dequant = dequantize_block(q, scale)
        if stored_dtype != torch.float32:  # the reference must use the scales as stored
            scale = scale.to(stored_dtype).float()
            dequant = q.float() * scale if strategy != "block" else dequantize_block(q, scale)
        state[name] = dequant
        tensors[name] = q
        tensors[f"{module}.{_scale_name(family)}"] = _stored_scale(family, scale)
        if static:
            input_scale = torch.rand((), generator=gen) * 0.02 + 0.01  # amax of activations / 448
            tensors[f"{module}.input_scale"] = _stored_scale(family, input_scale)
        if family == "modelopt-fp8-kv-cache" and module.endswith(("k_proj", "v_proj")):
            # amax / 448 of keys and values, unclamped, as ModelOpt's Hugging Face export writes them.
            leaf_name = "k_scale" if module.endswith("k_proj") else "v_scale"
            tensors[f"{module}.{leaf_name}"] = torch.tensor(0.0125 if "layers.0" in module else 0.02)
    for path in folder.glob("*.safetensors"):
        path.unlink()
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    _write_quant_config(folder, config, family)
    hf.load_state_dict(state)
    return hf


def _scale_name(family: str) -> str:
    return "weight_scale_inv" if family == "hf-fp8-block" else "weight_scale"


def _stored_scale(family: str, scale: torch.Tensor) -> torch.Tensor:
    if family.startswith("ct-"):
        # compressed-tensors keeps scales in the calibration dtype (bf16), per-tensor as [1].
        return (scale.reshape(1) if scale.dim() == 0 else scale).to(torch.bfloat16).contiguous()
    return scale.float().contiguous()  # HF fp8 and ModelOpt: fp32 scalars []


def _write_quant_config(folder, config: dict, family: str) -> None:
    if family in ("modelopt-fp8-side-file", "modelopt-fp8-kv-cache"):
        kv = "FP8" if family == "modelopt-fp8-kv-cache" else None
        side = {"producer": {"name": "modelopt", "version": "0.19.0"},
                "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": kv, "exclude_modules": ["lm_head"]}}
        (folder / "hf_quant_config.json").write_text(json.dumps(side))
    else:
        config["quantization_config"] = _quant_config(family)
    (folder / "config.json").write_text(json.dumps(config))


def _quant_config(family: str) -> dict:
    if family.startswith("hf-fp8"):
        quant = {"quant_method": "fp8", "fmt": "e4m3",
                 "activation_scheme": "static" if family == "hf-fp8-static" else "dynamic"}
        if family == "hf-fp8-block":
            quant["weight_block_size"] = [BLOCK, BLOCK]
        return quant
    if family == "modelopt-fp8":
        return {"quant_method": "modelopt", "quant_algo": "FP8", "producer": {"name": "modelopt"},
                "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "dynamic": False}}}}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    if family == "ct-fp8-tensor-static":
        weights["strategy"] = "tensor"
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}
    elif family == "ct-fp8-channel-dynamic":
        weights["strategy"] = "channel"
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    else:
        weights.update(strategy="block", block_structure=[BLOCK, BLOCK])
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "group",
                  "group_size": BLOCK}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}
