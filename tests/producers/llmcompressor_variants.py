"""llm-compressor's variants: oneshot() recipes saved with save_pretrained(save_compressed=True)
in the compressed-tensors format, each with the dense reference that compressed-tensors' own
model-free dequantizer (CompressedTensorsDequantizer) makes of the saved folder.

Usage (inside the llm-compressor venv): python llmcompressor_variants.py VARIANT BASE_ROOT OUT_FOLDER, or --list"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import base_models  # noqa: E402

# Never quantized: the lm_head (as llm-compressor's examples do) and MoE routers (a quantized router
# would pick other experts).
IGNORE = ["lm_head", "re:.*mlp.gate$"]
# SparseGPT matches its ignore list against names with a trailing dot ("model.layers.0.mlp.up_proj."),
# so only patterns find them. Its `targets` must stay the default ["Linear"]: the string "Linear",
# which the quantization modifiers accept, silently matches no layer and prunes nothing.
SPARSEGPT_IGNORE = ["re:.*lm_head", r"re:.*mlp\.gate\.?$"]


def _gptq(scheme):
    from llmcompressor.modifiers.gptq import GPTQModifier

    return [GPTQModifier(targets="Linear", scheme=scheme, ignore=IGNORE)]


def _rtn(scheme):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return [QuantizationModifier(targets="Linear", scheme=scheme, ignore=IGNORE)]


def _smoothquant_gptq(scheme):
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

    return [SmoothQuantModifier(smoothing_strength=0.8), *_gptq(scheme)]


def _sparsegpt_rtn(scheme):
    # Round-to-nearest after SparseGPT, not GPTQ: GPTQ's error feedback would write into the pruned
    # positions (0.14's GPTQModifier keeps no sparsity mask): tried, 13% of the groups of 4 lost
    # their pair of zeros. Symmetric round-to-nearest maps 0 to 0 and keeps the 2:4 pattern whole.
    from llmcompressor.modifiers.pruning import SparseGPTModifier

    return [SparseGPTModifier(sparsity=0.5, mask_structure="2:4", ignore=SPARSEGPT_IGNORE), *_rtn(scheme)]


# NVFP4's activations: E2M1 per group of 16 input channels, each group's e4m3 scale found at run
# time under the calibrated `input_global_scale`.
NVFP4_ACTIVATIONS = "nvfp4 per-group-16, static global scale"

# name: (base architecture, recipe builder, preset scheme, scheme text, activation_quant)
VARIANTS = {
    "llmc-w4a16-sym": ("llama", _gptq, "W4A16", "GPTQ int4 group-128 symmetric (pack-quantized)", None),
    "llmc-w4a16-asym": ("llama", _gptq, "W4A16_ASYM", "GPTQ int4 group-128 asymmetric (pack-quantized)", None),
    "llmc-w8a16": ("llama", _gptq, "W8A16", "GPTQ int8 group-128 symmetric (pack-quantized; the W8A16 preset is grouped)", None),
    "llmc-fp8-static": ("llama", _rtn, "FP8", "fp8 e4m3 per-tensor weights (float-quantized)", "fp8 per-tensor static"),
    "llmc-fp8-dynamic": ("llama", _rtn, "FP8_DYNAMIC", "fp8 e4m3 per-channel weights (float-quantized)", "fp8 per-token dynamic"),
    "llmc-fp8-block": ("llama", _rtn, "FP8_BLOCK", "fp8 e4m3 weights in 128x128 blocks (float-quantized)", "fp8 per-group-128 dynamic"),
    "llmc-w8a8-int8": ("llama", _smoothquant_gptq, "W8A8", "SmoothQuant + GPTQ int8 per-channel symmetric weights (int-quantized)", "int8 per-token dynamic"),
    "llmc-2of4-w4a16": ("llama", _sparsegpt_rtn, "W4A16",
                        "SparseGPT 2:4 sparse + int4 group-128 symmetric; compressed-tensors 0.19 has no marlin-24 "
                        "writer, so it is saved as plain pack-quantized (zeros in the packed weights, no sparsity_config)", None),
    "llmc-w4a16-sym-qwen2": ("qwen2", _gptq, "W4A16", "GPTQ int4 group-128 symmetric (pack-quantized)", None),
    "llmc-w4a16-sym-moe": ("qwen3_moe", _gptq, "W4A16", "GPTQ int4 group-128 symmetric (pack-quantized)", None),
    "llmc-fp8-dynamic-moe": ("qwen3_moe", _rtn, "FP8_DYNAMIC", "fp8 e4m3 per-channel weights (float-quantized)", "fp8 per-token dynamic"),
    "llmc-nvfp4a16": ("llama", _rtn, "NVFP4A16", "NVFP4 weights: E2M1 codes, an e4m3 scale per 16, an fp32 global "
                      "scale (nvfp4-pack-quantized)", None),
    "llmc-nvfp4": ("llama", _rtn, "NVFP4", "NVFP4 weights and FP4 activations (nvfp4-pack-quantized)",
                   NVFP4_ACTIVATIONS),
    "llmc-nvfp4a16-moe": ("qwen3_moe", _rtn, "NVFP4A16", "NVFP4 weights: E2M1 codes, an e4m3 scale per 16, an fp32 "
                          "global scale (nvfp4-pack-quantized)", None),
    "llmc-mxfp4a16": ("llama", _rtn, "MXFP4A16", "MXFP4 weights: E2M1 codes, an e8m0 exponent per 32 "
                      "(mxfp4-pack-quantized)", None),
}


def main(variant: str, base_root: Path, out: Path) -> None:
    """Quantize VARIANTS[variant]'s base into `out`, then write out/reference and out/kit.json."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    import llmcompressor
    from llmcompressor import oneshot

    arch, recipe, scheme, description, activation_quant = VARIANTS[variant]
    base = base_root / arch
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype="auto")
    ids = base_models.calibration_ids()
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    torch.manual_seed(0)
    # Unshuffled, so that two builds of a kit give the same bytes.
    oneshot(model=model, dataset=dataset, recipe=recipe(scheme), max_seq_length=ids.shape[1],
            num_calibration_samples=ids.shape[0], shuffle_calibration_samples=False)
    model.save_pretrained(str(out), save_compressed=True)
    del model
    base_models.copy_tokenizer(base, out)

    tensors, quantized = dequantize(out)
    base_models.write_reference(out, base, tensors)
    base_models.write_kit(
        out, producer="llmcompressor", version=llmcompressor.__version__, architecture=arch, scheme=description,
        activation_quant=activation_quant, kv_cache=None, quantized_modules=quantized)


def dequantize(folder: Path) -> tuple[dict, list[str]]:
    """The saved folder's tensors with every quantized weight decompressed to float32 by
    compressed-tensors' CompressedTensorsDequantizer (its validate() also fails on any quantization
    parameter left over), less the static activation scales, which a dense checkpoint has no place
    for; and the names of the quantized modules (those with a weight_scale)."""
    import torch
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    saved = base_models.load_tensors(folder)
    quantized = sorted(name.removesuffix(".weight_scale") for name in saved if name.endswith(".weight_scale"))
    # The model-free dequantizer cannot tell a Linear from other modules by tensor names: for
    # float-quantized (fp8) weights, stored as plain ".weight", it would take the embeddings and
    # norms for quantized linears too. So every module that is not quantized is named as ignored.
    unquantized = sorted({name.rpartition(".")[0] for name in saved} - set(quantized))
    converter = CompressedTensorsDequantizer(folder, ignore=unquantized, dtype=torch.float32)
    # The dequantizer computes in the scales' dtype and casts after: with the float16/bfloat16
    # scales as saved, q x scale (up to 4 + 11 significant bits) is rounded to that dtype, which
    # is not the weight the checkpoint defines. Given float32 scales, every product is exact.
    tensors = converter.validate({name: tensor.float() if name.endswith(".weight_scale") else tensor
                                  for name, tensor in saved.items() if not name.endswith(ACTIVATION_SCALES)})
    if any(name.endswith(".weight_global_scale") for name in saved):
        tensors.update(nvfp4_weights_in_float32(folder, saved, quantized, tensors))
    return tensors, quantized


# Static activation scales: fp8's input_scale, NVFP4's input_global_scale.
ACTIVATION_SCALES = (".input_scale", ".input_global_scale")


def nvfp4_weights_in_float32(folder: Path, saved: dict, quantized: list[str], decompressed: dict) -> dict:
    """NVFP4 weights dequantized by compressed-tensors' own functions in float32. Its NVFP4
    decompressor unpacks the codes to bfloat16 and returns the weight in that dtype, rounding each
    e2m1 x (e4m3 / global) product (2 + 24 significant bits) to 8 bits; the same unpacking and
    `dequantize` asked for float32 keep the product the checkpoint defines. Each weight is checked
    against the decompressor's: equal once rounded to bfloat16."""
    import json

    import torch
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

    config = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    (scheme,) = config.config_groups.values()
    weights = {}
    for module in quantized:
        packed = saved[f"{module}.weight_packed"]
        codes = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
        weight = ct_dequantize(codes, scale=saved[f"{module}.weight_scale"].float(), args=scheme.weights,
                               dtype=torch.float32, global_scale=saved[f"{module}.weight_global_scale"])
        if not torch.equal(weight.to(torch.bfloat16), decompressed[f"{module}.weight"].to(torch.bfloat16)):
            raise AssertionError(f"{module}: the float32 NVFP4 weight does not round to the decompressor's")
        weights[f"{module}.weight"] = weight
    return weights

if __name__ == "__main__":
    base_models.cli(VARIANTS, main)
