"""bitsandbytes checkpoints, quantized and saved by transformers with `BitsAndBytesConfig` (the
real producer, not a writer of ours): 4-bit NF4 with double quantization, and 8-bit rows.

The tiny llama's down_proj has K = 160, which bitsandbytes' blocks of 64 do not divide: its blocks
cross rows, which the 4-bit loader turns into groups of 32."""

import shutil

import pytest
import torch

from helpers.checkpoints.tiny import make_checkpoint
from qrt.kernels.choices import choose
from qrt.kernels.lut4_reference import Lut4Weights

from . import INT_CUDA, FormatCase

NF4_DOUBLE_QUANT = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
INT8 = dict(load_in_8bit=True)


def write_bnb(folder, quantization: dict, arch: str = "llama", dtype=torch.float32, seed: int = 0, **overrides):
    """Save a tiny `arch` checkpoint quantized by transformers with BitsAndBytesConfig(**quantization)
    into `folder` (the unquantized one in `folder`.base); return the folder of the unquantized one."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes writes these checkpoints (pip install '.[test]')")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    base = folder.with_name(folder.name + ".base")
    make_checkpoint(base, arch, dtype=dtype, seed=seed, **overrides)
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=BitsAndBytesConfig(**quantization),
                                                 device_map="cpu")
    model.save_pretrained(folder)
    for name in ("generation_config.json",):  # nothing else of the base is needed
        if (base / name).exists() and not (folder / name).exists():
            shutil.copy(base / name, folder / name)
    return base


def lut4_kernels(device: str) -> frozenset:
    """The kernel the loader pass chooses for fp32-scaled table codes on `device`."""
    sample = Lut4Weights(torch.zeros(64, 64, dtype=torch.uint8), torch.linspace(-1, 1, 16), 64, torch.ones(64, 1))
    return frozenset({choose("qrt.lut4_linear", device, weights=sample, dtype=torch.float32).op})


CASES = {
    "stored:bitsandbytes": FormatCase(lambda folder: write_bnb(folder, NF4_DOUBLE_QUANT), None, lut4_kernels("cpu"),
                                      lut4_kernels("cuda")),
}
