"""bitsandbytes' variants: the base loaded by transformers with a BitsAndBytesConfig (the weights are
quantized as they load, on the CPU here) and saved with save_pretrained, as users make the `-bnb-4bit`
checkpoints they publish. No calibration: bitsandbytes rounds each weight to the nearest code.

The reference holds bitsandbytes' own dequantization of the saved tensors: `dequantize_4bit` of each
4-bit weight with its QuantState rebuilt from the file (`QuantState.from_dict`), in float32, and
`int8_vectorwise_dequant` (q · SCB · 1/127) of each int8 weight. It is checked against a second path
of bitsandbytes' code: the checkpoint loaded back by transformers, each `Linear4bit` dequantized
from the quant_state its `Params4bit` holds and each `Linear8bitLt` from its `Int8Params`, which
must agree bit for bit.

Usage (inside the bitsandbytes venv): python bitsandbytes_variants.py VARIANT BASE_ROOT OUT_FOLDER, or --list"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import base_models  # noqa: E402

# name: (base architecture, BitsAndBytesConfig arguments, scheme text)
VARIANTS = {
    "bnb-nf4": ("llama", dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
                "NF4 blocks of 64, double quantization (absmax as 8-bit codes, nested fp32 absmax per 256)"),
    "bnb-nf4-single": ("llama", dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"), "NF4 blocks of 64, fp32 absmax"),
    "bnb-fp4": ("llama", dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"), "FP4 blocks of 64, fp32 absmax"),
    "bnb-int8": ("llama", dict(load_in_8bit=True), "LLM.int8() int8 rows with SCB (per-row absmax)"),
    "bnb-nf4-moe": ("qwen3_moe", dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
                    "NF4 blocks of 64, double quantization (the modules transformers converts)"),
}
# The quant_state tensors a 4-bit weight `P.weight` carries beside it (P.weight.<part>).
STATE_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


def main(variant: str, base_root: Path, out: Path) -> None:
    """Quantize VARIANTS[variant]'s base while transformers loads it, save it into `out`, then write
    out/reference and kit.json."""
    import bitsandbytes
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    arch, arguments, scheme = VARIANTS[variant]
    base = base_root / arch
    model = AutoModelForCausalLM.from_pretrained(str(base), quantization_config=BitsAndBytesConfig(**arguments),
                                                 device_map="cpu")
    model.save_pretrained(str(out))
    del model
    base_models.copy_tokenizer(base, out)

    saved = base_models.load_tensors(out)
    tensors, quantized = dequantize(saved)
    assert quantized, "transformers converted no module"
    check_against_loaded_back(out, tensors, quantized)
    base_models.write_reference(out, base, tensors)
    base_models.write_kit(
        out, producer="bitsandbytes", version=bitsandbytes.__version__, transformers=transformers.__version__,
        architecture=arch, scheme=scheme, activation_quant=None, kv_cache=None, quantized_modules=quantized)
    print(f"{len(quantized)} modules quantized, torch {torch.__version__}")


def dequantize(saved: dict) -> tuple[dict, list[str]]:
    """The saved tensors with each quantized weight dequantized by bitsandbytes in float32 and its
    quantization state left out; the quantized modules' names."""
    import torch
    from bitsandbytes.functional import QuantState, dequantize_4bit, int8_vectorwise_dequant

    tensors, quantized = {}, []
    for name, tensor in saved.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight":
            continue
        if f"{name}.absmax" in saved:  # 4-bit
            state = {k[len(name) + 1:]: v for k, v in saved.items() if k.startswith(name + ".")}
            quant_state = QuantState.from_dict(state, torch.device("cpu"))
            quant_state.dtype = torch.float32
            tensors[name] = dequantize_4bit(tensor, quant_state)
            quantized.append(module)
        elif f"{module}.SCB" in saved:  # 8-bit
            tensors[name] = int8_vectorwise_dequant(tensor, saved[f"{module}.SCB"])
            quantized.append(module)
        else:
            tensors[name] = tensor.float()
    for name, tensor in saved.items():  # biases, and any other float tensor (routers keep .weight above)
        if name not in tensors and name.endswith(".bias"):
            tensors[name] = tensor.float()
    return tensors, sorted(quantized)


def check_against_loaded_back(folder: Path, tensors: dict, quantized: list[str]) -> None:
    """The checkpoint loaded back by transformers, each quantized module dequantized from its own
    bitsandbytes parameter, must equal the reference bit for bit."""
    import bitsandbytes as bnb
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), device_map="cpu")
    for module in quantized:
        layer = model.get_submodule(module)
        if isinstance(layer, bnb.nn.Linear4bit):
            state = layer.weight.quant_state
            state.dtype = torch.float32
            again = bnb.functional.dequantize_4bit(layer.weight.data, state)
        else:
            again = bnb.functional.int8_vectorwise_dequant(layer.weight.data, layer.weight.SCB)
        assert torch.equal(again, tensors[f"{module}.weight"]), f"{module}: loaded back, dequantizes otherwise"


if __name__ == "__main__":
    base_models.cli(VARIANTS, main)
