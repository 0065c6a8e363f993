"""ModelOpt NVFP4 checkpoints (`quant_algo: "NVFP4"`, as `export_hf_checkpoint` writes them in
config.json's `quantization_config` with `quant_method: "modelopt"`, and in hf_quant_config.json):
E2M1 weights with an e4m3 scale per 16 input channels times the fp32 `weight_scale_2`, and FP4
activations rounded per group of 16 under the static `input_scale` (docs/formats.md §15).

ModelOpt's config is read by fp8_checkpoint.py, which owns its FP8 algorithms and hands every
other `quant_algo` to the stored format registered as "modelopt-<algo>": this one. The tensors are
compressed-tensors' NVFP4 under other names, so the linear method is the one of
compressed_tensors/nvfp4.py.
"""

from qrt.errors import UnsupportedError
from qrt.formats.compressed_tensors.nvfp4 import Nvfp4LinearMethod, Nvfp4Tensors
from qrt.formats.registry import stored_format
from qrt.formats.scheme import QuantScheme

_TENSORS = Nvfp4Tensors("ModelOpt", "weight", "weight_scale", "weight_scale_2", global_divides=False,
                        input_global="input_scale", input_global_inverted=True)


@stored_format("modelopt-nvfp4", computes=("qrt.lut4_linear",),
               summary="ModelOpt NVFP4: FP4 E2M1 weights, an E4M3 scale per 16 input channels "
               "times an fp32 weight_scale_2, FP4 activations per group of 16 under a static input_scale; optional "
               "FP8 KV cache",
               detected_from="ModelOpt `quant_algo: \"NVFP4\"` (config.json's `quantization_config` or "
                             "`hf_quant_config.json`)")
def modelopt_nvfp4_scheme(config: dict, source) -> QuantScheme:
    algo = str(config.get("quant_algo")).upper()
    if algo != "NVFP4":
        raise UnsupportedError(f"{source}: ModelOpt quant_algo={algo!r} read as NVFP4; supported: 'NVFP4'")
    kv_algo = config.get("kv_cache_quant_algo")
    if kv_algo is not None and str(kv_algo).upper() != "FP8":
        raise UnsupportedError(f"{source}: ModelOpt kv_cache_quant_algo={kv_algo!r} is not supported; only FP8")
    kv = "modelopt" if kv_algo is not None else None
    description = _TENSORS.describe() + (", fp8 KV cache" if kv else "")
    return QuantScheme("nvfp4", lambda names: Nvfp4LinearMethod(_TENSORS, names), config.get("ignore") or (),
                       description, kv)
