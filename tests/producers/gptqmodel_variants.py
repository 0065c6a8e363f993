"""GPTQModel's variants: GPTQ checkpoints in GPTQModel's default format (gptq, v1 zero points),
quantized on the CPU, each with the dense reference GPTQModel's own dequantizer makes of it.

Usage (inside the GPTQModel venv): python gptqmodel_variants.py VARIANT BASE_ROOT OUT_FOLDER, or --list"""

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import base_models  # noqa: E402

# name: (base architecture, QuantizeConfig arguments, scheme text)
VARIANTS = {
    "gptqmodel-w4g128-sym": ("llama", dict(bits=4, group_size=128, sym=True, desc_act=False), "int4 group-128 symmetric"),
    "gptqmodel-w4g128-asym": ("llama", dict(bits=4, group_size=128, sym=False, desc_act=False), "int4 group-128 asymmetric"),
    "gptqmodel-w4g128-actorder": ("llama", dict(bits=4, group_size=128, sym=True, desc_act=True), "int4 group-128 symmetric, act-order (desc_act)"),
    "gptqmodel-w8g128-sym": ("llama", dict(bits=8, group_size=128, sym=True, desc_act=False), "int8 group-128 symmetric"),
    "gptqmodel-w4g128-sym-qwen2": ("qwen2", dict(bits=4, group_size=128, sym=True, desc_act=False), "int4 group-128 symmetric"),
    "gptqmodel-w4g128-sym-moe": ("qwen3_moe", dict(bits=4, group_size=128, sym=True, desc_act=False), "int4 group-128 symmetric"),
}


def main(variant: str, base_root: Path, out: Path) -> None:
    """Quantize VARIANTS[variant]'s base into `out`, then write out/reference and out/kit.json."""
    # GPTQModel gives the CPU (cores + 1) // 2 workers but asks for 2 of them for its model loader:
    # on a 2-core machine load() then fails ("requests 2 workers but parent 'cpu' only has 1").
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    import torch
    import gptqmodel
    from gptqmodel import GPTQModel, QuantizeConfig

    arch, arguments, scheme = VARIANTS[variant]
    base = base_root / arch
    # offload_to_disk only saves memory on big models; off, nothing is written outside `out`.
    config = QuantizeConfig(**arguments, offload_to_disk=False)
    dtype = base_models.BASES[arch][3]  # the base's own: casting would change the unquantized tensors
    model = GPTQModel.load(str(base), config, device="cpu", dtype=dtype)
    calibration = [{"input_ids": row.tolist(), "attention_mask": [1] * row.numel()}
                   for row in base_models.calibration_ids()]
    model.quantize(calibration, batch_size=1)
    model.save(str(out))
    del model
    base_models.copy_tokenizer(base, out)

    # GPTQModel's own safetensors-level dequantizer (utils/model_dequant.py), in float32.
    from gptqmodel.utils.model_dequant import dequantize_model

    with tempfile.TemporaryDirectory() as scratch:
        dense = Path(scratch) / "dense"
        dequantize_model(out, dense, target_dtype=torch.float32)
        tensors = base_models.load_tensors(dense)
    check_runtime_dequant(out, tensors, dtype)
    saved = base_models.load_tensors(out)
    quantized = sorted(name.removesuffix(".qweight") for name in saved if name.endswith(".qweight"))
    base_models.write_reference(out, base, tensors)
    base_models.write_kit(
        out, producer="gptqmodel", version=gptqmodel.__version__, architecture=arch, scheme=scheme,
        activation_quant=None, kv_cache=None, quantized_modules=quantized)


def check_runtime_dequant(folder: Path, reference: dict, dtype) -> None:
    """Cross-check the safetensors-level dequantizer against GPTQModel's runtime: the checkpoint
    loaded back with the torch kernel, each QuantLinear's dequantize_weight() (which applies the v1
    zero-point offset on load) must match the float32 reference up to the rounding of computing in
    the checkpoint's dtype (in bfloat16 the runtime rounds an intermediate product too)."""
    import torch
    from gptqmodel import BACKEND, GPTQModel

    model = GPTQModel.load(str(folder), device="cpu", backend=BACKEND.GPTQ_TORCH, dtype=dtype)
    checked = 0
    for name, module in model.model.named_modules():
        if hasattr(module, "qweight") and hasattr(module, "dequantize_weight"):
            runtime = module.dequantize_weight().t().float()  # QuantLinear keeps [in, out]
            expected = reference[name + ".weight"]
            difference = (runtime - expected).abs().max().item()
            tolerance = 2 * torch.finfo(dtype).eps * expected.abs().max().item()
            assert difference <= tolerance, f"{name}: runtime dequant differs by {difference} (tolerance {tolerance})"
            checked += 1
    assert checked, "no QuantLinear found in the loaded checkpoint"
    print(f"runtime dequantize_weight() matches the reference on {checked} modules")


if __name__ == "__main__":
    base_models.cli(VARIANTS, main)
