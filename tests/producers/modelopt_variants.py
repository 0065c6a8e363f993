"""NVIDIA ModelOpt's variants: FP8 (e4m3 per-tensor weights and static per-tensor input scales,
calibrated with max) exported by export_hf_checkpoint as a Hugging Face checkpoint with
hf_quant_config.json; one with an FP8 KV cache too; NVFP4 (NVFP4_DEFAULT_CFG: E2M1 weights and
activations in groups of 16) and W4A16_NVFP4 (W4A16_NVFP4_CFG: the same weights, activations left
alone), whose references are NVFP4QTensor.dequantize() of the export. (NVFP4_AWQ cannot be made
here: its AWQ search runs NVFP4's fake quantizer, which asserts a CUDA tensor.)

The reference holds the exported weights as ModelOpt's FP8QTensor.dequantize() gives them back
(fp8 x weight_scale), checked against ModelOpt's fake-quantized weights (each linear's
weight_quantizer applied to its weight) taken before the export. The two are not bit-equal: the
fake quantizer multiplies by 448 / amax where the export divides by amax / 448, and about 0.2-0.5%
of the weights round to the neighbouring fp8 value (and the fake-quantized ones are rounded to the
model's float16 besides). The reference follows the checkpoint, which is what a loader reads.

Usage (inside the ModelOpt venv): python modelopt_variants.py VARIANT BASE_ROOT OUT_FOLDER, or --list"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import base_models  # noqa: E402

# NVFP4's activations: E2M1 per group of 16 input channels, each group's e4m3 scale found at run
# time under the calibrated `input_scale` (the inverse of compressed-tensors' global scale).
NVFP4_ACTIVATIONS = "nvfp4 per-group-16, static input_scale"

# name: (base architecture, with the FP8 KV cache, ModelOpt config, scheme text, activation_quant)
VARIANTS = {
    "modelopt-fp8": ("llama", False, "FP8_DEFAULT_CFG", "fp8 e4m3 per-tensor weights (max calibration)",
                     "fp8 per-tensor static"),
    "modelopt-fp8-kv": ("llama", True, "FP8_DEFAULT_CFG", "fp8 e4m3 per-tensor weights (max calibration)",
                        "fp8 per-tensor static"),
    "modelopt-nvfp4": ("llama", False, "NVFP4_DEFAULT_CFG", "NVFP4 weights: E2M1 codes, an e4m3 scale per 16 times "
                       "weight_scale_2 (max calibration)", NVFP4_ACTIVATIONS),
    "modelopt-w4a16-nvfp4": ("llama", False, "W4A16_NVFP4_CFG", "NVFP4 weights: E2M1 codes, an e4m3 scale per 16 "
                             "times weight_scale_2 (max calibration)", None),
}


def main(variant: str, base_root: Path, out: Path) -> None:
    """Quantize VARIANTS[variant]'s base, export it into `out`, then write out/reference and kit.json."""
    import torch
    from transformers import AutoModelForCausalLM

    import modelopt
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    arch, fp8_kv, config_name, scheme, activation_quant = VARIANTS[variant]
    base = base_root / arch
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype="auto").eval()
    config = getattr(mtq, config_name)
    if fp8_kv:
        config = mtq.update_quant_cfg_with_kv_cache_quant(config, mtq.FP8_KV_CFG["quant_cfg"])
    ids = base_models.calibration_ids()

    def forward_loop(model):
        with torch.no_grad():
            for row in ids:
                model(row.unsqueeze(0))

    model = mtq.quantize(model, config, forward_loop)

    # The fake-quantized weights, before export_hf_checkpoint packs them (and frees the quantizers).
    # NVFP4's fake quantizer (a dynamic block quantizer) asserts a CUDA tensor, so there the weights
    # are kept as they are, to be quantized again with the exported scales.
    nvfp4 = "NVFP4" in config_name
    fake_quantized = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            quantizer = getattr(module, "weight_quantizer", None)
            if quantizer is not None and quantizer.is_enabled:
                fake_quantized[name] = module.weight.detach().clone() if nvfp4 else quantizer(module.weight).float()
    export_hf_checkpoint(model, export_dir=str(out))
    del model
    base_models.copy_tokenizer(base, out)

    saved = base_models.load_tensors(out)
    tensors, mismatch = (dequantize_nvfp4 if nvfp4 else dequantize)(saved, fake_quantized)
    base_models.write_reference(out, base, tensors)
    base_models.write_kit(
        out, producer="modelopt", version=modelopt.__version__, architecture=arch, scheme=scheme,
        activation_quant=activation_quant, kv_cache="fp8" if fp8_kv else None,
        quantized_modules=sorted(fake_quantized), fake_quant_mismatch=mismatch)


def dequantize(saved: dict, fake_quantized: dict) -> tuple[dict, dict]:
    """The exported tensors with each fp8 weight dequantized by ModelOpt's FP8QTensor, less the
    scales (weight, input, k/v cache); and how far the fake-quantized weights are from them: the
    largest fraction of a module's weights more than float16 rounding apart, and the largest gap in fp8 steps at the
    top of the range (32 x weight_scale), which must stay at most one (plus float16 rounding)."""
    import torch
    from modelopt.torch.quantization.qtensor import FP8QTensor

    tensors, fraction, steps = {}, 0.0, 0.0
    for name, tensor in saved.items():
        module = name.rpartition(".")[0]
        if module in fake_quantized and name.endswith(".weight"):
            assert tensor.dtype == torch.float8_e4m3fn, f"{name}: exported as {tensor.dtype}"
            scale = saved[module + ".weight_scale"].float()
            weight = FP8QTensor(tensor.shape, torch.float32, tensor).dequantize(dtype=torch.float32, scale=scale)
            fake = fake_quantized[module]
            apart = (weight - fake).abs()
            flipped = apart > fake.abs() * 2.0 ** -10  # more than the float16 rounding of `fake`
            fraction = max(fraction, flipped.float().mean().item())
            steps = max(steps, apart.max().item() / (32 * scale.item()))
            tensors[name] = weight
        elif name.endswith((".weight", ".bias")) and module not in fake_quantized:
            tensors[name] = tensor.float()
    assert steps <= 1.01 and fraction < 0.01, f"export and fake quantization disagree: {fraction:.2%} of weights, {steps:.2f} steps"
    print(f"fake-quantized weights: up to {fraction:.2%} of a module's weights one fp8 value off the export")
    return tensors, {"fraction_of_weights_max": fraction, "fp8_top_steps_max": steps}


def dequantize_nvfp4(saved: dict, originals: dict) -> tuple[dict, dict]:
    """The exported tensors with each NVFP4 weight (uint8 codes, e4m3 weight_scale per 16,
    weight_scale_2) dequantized in float32 by ModelOpt's NVFP4QTensor, less the scales. Checked on
    a second path of ModelOpt's: NVFP4QTensor.quantize of the weight as it was before the export,
    given the exported scales, must give the exported codes (the fraction that differs is recorded
    and must be 0)."""
    import torch
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    tensors, differing = {}, 0.0
    for name, tensor in saved.items():
        module = name.rpartition(".")[0]
        if module in originals and name.endswith(".weight"):
            assert tensor.dtype == torch.uint8, f"{name}: exported as {tensor.dtype}"
            block, double = saved[module + ".weight_scale"], saved[module + ".weight_scale_2"]
            n, k = tensor.shape[0], tensor.shape[1] * 2
            weight = NVFP4QTensor((n, k), torch.float32, tensor).dequantize(
                dtype=torch.float32, scale=block, double_scale=double, block_sizes={-1: 16})
            again, _, _ = NVFP4QTensor.quantize(originals[module], 16, block, double)
            differing = max(differing, (again._quantized_data != tensor).float().mean().item())
            tensors[name] = weight
        elif name.endswith((".weight", ".bias")) and module not in originals:
            tensors[name] = tensor.float()
    assert differing == 0, f"quantizing the weights again with the exported scales changed {differing:.2%} of the bytes"
    return tensors, {"requantized_bytes_differing": differing}


if __name__ == "__main__":
    base_models.cli(VARIANTS, main)
