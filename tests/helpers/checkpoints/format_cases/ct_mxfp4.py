"""compressed-tensors `mxfp4-pack-quantized` (MXFP4A16): each decoder linear of the tiny llama as
`weight_packed` [N, K / 2] and `weight_scale` [N, K / 32], quantized from the OCP definition by the
writer the gpt-oss checkpoints use, in compressed-tensors' names and config. Loaded in bf16, so that
the compiled contract test runs qrt's CPU kernel for 4-bit table codes."""

import json

import torch
from safetensors.torch import save_file

from helpers.checkpoints.gpt_oss import quantize_mxfp4
from helpers.checkpoints.tiny import make_checkpoint
from qrt.formats.mxfp4 import mxfp4_weights
from qrt.kernels.choices import choose
from qrt.kernels.onednn_cpu import onednn_prepack_supported

from . import FormatCase

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMAT = "mxfp4-pack-quantized"
WEIGHTS = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
           "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": None}


def write_ct_mxfp4(folder, seed: int = 0) -> dict:
    """Write the checkpoint; return the dequantized weight of every quantized linear by name."""
    folder.mkdir(parents=True, exist_ok=True)
    hf = make_checkpoint(folder, seed=seed)
    tensors, dequantized = {}, {}
    for name, value in hf.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.endswith(LINEARS):
            blocks, scales = quantize_mxfp4(value)  # [N, K / 32, 16], [N, K / 32]
            tensors[f"{module}.weight_packed"] = blocks.reshape(blocks.shape[0], -1)  # [N, K / 2]
            tensors[f"{module}.weight_scale"] = scales
            dequantized[name] = mxfp4_weights(blocks, scales).dequantize()
        else:
            tensors[name] = value.detach().clone()
    for path in folder.glob("*.safetensors"):
        path.unlink()
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": FORMAT, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": WEIGHTS, "input_activations": None,
                                      "format": FORMAT}},
        "ignore": ["lm_head"], "kv_cache_scheme": None}
    (folder / "config.json").write_text(json.dumps(config))
    return dequantized


def kernels(device: str) -> frozenset:
    """The kernel the loader pass chooses for these layers' weights on `device`, in bf16."""
    sample = mxfp4_weights(torch.zeros(64, 2, 16, dtype=torch.uint8), torch.full((64, 2), 127, dtype=torch.uint8))
    return frozenset({choose("qrt.lut4_linear", device, weights=sample, dtype=torch.bfloat16).op})


# A compiled bf16 CPU model prepacks its dense lm_head for oneDNN (layers/prepack.py) where oneDNN
# has bf16 kernels (not on an AVX2 CPU: there the lm_head stays ATen's linear, which no pass swaps).
PREPACKED_LM_HEAD = frozenset({"qrt.onednn_linear"}) if onednn_prepack_supported(torch.bfloat16) else frozenset()
CASES = {f"compressed-tensors:{FORMAT}": FormatCase(write_ct_mxfp4, None, kernels("cpu") | PREPACKED_LM_HEAD,
                                                    kernels("cuda"), dtype="bfloat16")}
