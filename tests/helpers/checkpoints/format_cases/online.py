"""Online formats (`quant=`) and the unquantized baseline, on the suite's tiny bf16 llama (shared
with the other tests' compiled models)."""

from helpers.kernel_checks import fp8_cpu_kernel

from . import INT_CUDA, FormatCase

# The weight-only integer formats and online fp8 quantize lm_head to int8 per channel too.
INT4_AND_INT8_LM_HEAD = frozenset({"qrt.int4pack_linear", "qrt.int8pack_linear"})


CASES = {
    "none": FormatCase(None, None, frozenset(), frozenset()),
    "online:fp8": FormatCase(None, "fp8", frozenset({fp8_cpu_kernel("qrt.fp8_linear"), "qrt.int8pack_linear"}),
                             frozenset({"qrt.fp8_linear_triton", *INT_CUDA})),
    "online:int4": FormatCase(None, "int4", INT4_AND_INT8_LM_HEAD, INT_CUDA),
    "online:int4-g128": FormatCase(None, "int4-g128", INT4_AND_INT8_LM_HEAD, INT_CUDA),
    "online:int8": FormatCase(None, "int8", frozenset({"qrt.int8pack_linear"}), INT_CUDA),
    "online:w8a8": FormatCase(None, "w8a8", frozenset({"qrt.int8_linear_cpu"}), frozenset({"qrt.int8_linear_triton"}),
                              fuses_on_cuda=True),
}
