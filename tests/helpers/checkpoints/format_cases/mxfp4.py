"""Dense MXFP4 (`quant_method: "mxfp4"`): each decoder linear of the tiny llama as `weight_blocks`
[N, K / 32, 16] and `weight_scales` [N, K / 32], quantized by the writer gpt-oss's test checkpoint
uses (helpers/checkpoints/gpt_oss.py), from the format's definition."""

import json

import torch
from safetensors.torch import save_file

from helpers.checkpoints.gpt_oss import quantize_mxfp4
from helpers.checkpoints.tiny import make_checkpoint
from qrt.formats.mxfp4 import mxfp4_weights
from qrt.kernels.choices import choose

from . import FormatCase

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_mxfp4(folder, seed: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    hf = make_checkpoint(folder, seed=seed)
    tensors = {}
    for name, value in hf.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.endswith(LINEARS):
            tensors[f"{module}.weight_blocks"], tensors[f"{module}.weight_scales"] = quantize_mxfp4(value)
        else:
            tensors[name] = value.detach().clone()
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))


def mxfp4_kernels(device: str) -> frozenset:
    """The kernel the loader pass chooses for these layers' weights on `device`."""
    sample = mxfp4_weights(torch.zeros(64, 2, 16, dtype=torch.uint8), torch.full((64, 2), 127, dtype=torch.uint8))
    return frozenset({choose("qrt.lut4_linear", device, weights=sample, dtype=torch.float32).op})


CASES = {"stored:mxfp4": FormatCase(write_mxfp4, None, mxfp4_kernels("cpu"), mxfp4_kernels("cuda"))}
