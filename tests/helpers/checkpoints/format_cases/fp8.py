"""Stored FP8 formats: HF fp8, ModelOpt (config and side file), compressed-tensors float-quantized."""

from helpers.checkpoints.fp8 import make_fp8_checkpoint
from helpers.kernel_checks import fp8_cpu_kernel

from . import FormatCase


def _fp8(family: str, cpu: str, cuda: str) -> FormatCase:
    return FormatCase(lambda folder: make_fp8_checkpoint(folder, family), None, frozenset({cpu}), frozenset({cuda}))


CASES = {
    "stored:fp8": _fp8("hf-fp8-dynamic", fp8_cpu_kernel("qrt.fp8_linear"), "qrt.fp8_linear_triton"),
    "stored:modelopt": _fp8("modelopt-fp8-kv-cache", fp8_cpu_kernel("qrt.fp8_static_linear"), "qrt.fp8_static_linear_triton"),
    "side-file:hf_quant_config.json": _fp8("modelopt-fp8-side-file", fp8_cpu_kernel("qrt.fp8_static_linear"),
                                           "qrt.fp8_static_linear_triton"),
    "compressed-tensors:float-quantized": _fp8("ct-fp8-block", fp8_cpu_kernel("qrt.fp8_block_linear"),
                                               "qrt.fp8_block_linear_triton"),
}
