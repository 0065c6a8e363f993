"""ModelOpt NVFP4 checkpoints (as `export_hf_checkpoint` writes them in config.json's
`quantization_config` with `quant_method: "modelopt"`, and in hf_quant_config.json): E2M1 weights
with an e4m3 scale per 16 input channels times the fp32 `weight_scale_2`; with `quant_algo:
"NVFP4"` FP4 activations rounded per group of 16 under the static `input_scale`, with
`"W4A16_NVFP4"` activations left as they are (docs/formats.md §15).

ModelOpt's config is read by fp8_checkpoint.py, which owns its FP8 algorithms and hands every
other `quant_algo` to the stored format registered as "modelopt-<algo>": this one. The tensors are
compressed-tensors' NVFP4 under other names, so the linear method is the one of
compressed_tensors/nvfp4.py.
"""

from dataclasses import replace

from qrt.errors import UnsupportedError
from qrt.formats.compressed_tensors.nvfp4 import Nvfp4LinearMethod, Nvfp4Tensors
from qrt.formats.registry import stored_format
from qrt.formats.scheme import QuantScheme

_TENSORS = Nvfp4Tensors("ModelOpt", "weight", "weight_scale", "weight_scale_2", global_divides=False,
                        input_global="input_scale", input_global_inverted=True)
_WEIGHT_ONLY_TENSORS = replace(_TENSORS, input_global=None, input_global_inverted=False)


@stored_format("modelopt-nvfp4", computes=("qrt.lut4_linear",),
               summary="ModelOpt NVFP4: FP4 E2M1 weights, an E4M3 scale per 16 input channels "
               "times an fp32 weight_scale_2, FP4 activations per group of 16 under a static input_scale; optional "
               "FP8 KV cache",
               detected_from="ModelOpt `quant_algo: \"NVFP4\"` (config.json's `quantization_config` or "
                             "`hf_quant_config.json`)")
def modelopt_nvfp4_scheme(config: dict, source) -> QuantScheme:
    return _scheme(config, source, "NVFP4", _TENSORS)


@stored_format("modelopt-w4a16_nvfp4", computes=("qrt.lut4_linear",),
               summary="ModelOpt W4A16_NVFP4: FP4 E2M1 weights, an E4M3 scale per 16 input channels "
               "times an fp32 weight_scale_2; activations unquantized; optional FP8 KV cache",
               detected_from="ModelOpt `quant_algo: \"W4A16_NVFP4\"` (config.json's `quantization_config` or "
                             "`hf_quant_config.json`)")
def modelopt_w4a16_nvfp4_scheme(config: dict, source) -> QuantScheme:
    return _scheme(config, source, "W4A16_NVFP4", _WEIGHT_ONLY_TENSORS)


def _scheme(config: dict, source, expected_algo: str, tensors: Nvfp4Tensors) -> QuantScheme:
    algo = str(config.get("quant_algo")).upper()
    if algo != expected_algo:
        raise UnsupportedError(f"{source}: ModelOpt quant_algo={algo!r} read as {expected_algo}; "
                               f"supported: {expected_algo!r}")
    kv_algo = config.get("kv_cache_quant_algo")
    if kv_algo is not None and str(kv_algo).upper() != "FP8":
        raise UnsupportedError(f"{source}: ModelOpt kv_cache_quant_algo={kv_algo!r} is not supported; only FP8")
    kv = "modelopt" if kv_algo is not None else None
    description = tensors.describe() + (", fp8 KV cache" if kv else "")
    return QuantScheme("nvfp4", lambda names: Nvfp4LinearMethod(tensors, names), config.get("ignore") or (),
                       description, kv)
