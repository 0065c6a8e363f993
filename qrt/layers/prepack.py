"""Loader step after the loader pass: pack the dense CPU GEMM weights for the kernel that runs them.

A dense bf16 layer's weight is packed in pairs for qrt's own kernel where its library is built
(kernels/bf16_native_cpu.py: 1.4-2.0x oneDNN at one row, 0.84-1.92x from 2 to 512 rows, and called
without Python), and so are the e4m3 codes of the layers that qrt's fp8 GEMV runs with per-channel
or per-tensor scales (kernels/fp8_pairs_cpu.py); every other prepackable weight is prepacked for
oneDNN. Only for compiled CPU models (see
kernels/onednn_cpu.py for why the packing happens here and not in Inductor); eager models keep
their dense weights so that eager mode stays the plain-ATen oracle.
"""

from torch import nn

from qrt.kernels import bf16_native_cpu, fp8_pairs_cpu
from qrt.kernels.choices import kernel_named
from qrt.kernels.onednn_cpu import onednn_prepack_supported, prepack_stacked_weights, prepack_weight

from qrt.layers.experts import StackedExperts
from qrt.layers.linear import replace_parameter

# The fp8 kernels whose weights qrt_cpu.fp8_pairs_linear runs packed: one weight scale per channel
# (per-tensor ones are stored expanded to their rows), activations per token or static.
FP8_PAIR_KERNELS = ("qrt.fp8_linear_native_cpu", "qrt.fp8_static_linear_native_cpu")


def prepack_cpu_weights(model: nn.Module) -> int:
    """Replace every prepackable 2-D weight by its packed form (qrt's pairs or a oneDNN carrier);
    returns how many were packed.

    A tied lm_head gets a packed copy of its own, while the embedding lookup keeps the rows."""
    packed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, StackedExperts):
            packed += _prepack_experts(module)
            continue
        if getattr(module, "quant_method", None) is None or weight is None or weight.dim() != 2:
            continue
        if weight.kernel in FP8_PAIR_KERNELS and fp8_pairs_cpu.packable(weight, module.params_dtype):
            replace_parameter(module, "weight", fp8_pairs_cpu.pack_weight(weight.data), kernel="qrt_cpu.fp8_pairs_linear",
                              storage_layout=f"{weight.storage_layout}, packed in pairs [N / 64, K / 2, 64, 2] "
                                             f"(qrt_cpu.fp8_pairs_linear)")
            # The layer runs through the layout its weight now has (its `linear` calls this kernel).
            module.quant_method.layout = kernel_named("qrt_cpu.fp8_pairs_linear").layout
            packed += 1
            continue
        if weight.device.type != "cpu" or not kernel_named(weight.kernel).prepackable:
            continue
        layout = getattr(weight, "storage_layout", f"{weight.dtype} [N, K]".replace("torch.", ""))
        if weight.kernel == "aten.linear" and bf16_native_cpu.packable(weight):
            replace_parameter(module, "weight", bf16_native_cpu.pack_weight(weight.data), kernel="qrt_cpu.bf16_linear",
                              storage_layout=f"{layout}, packed in pairs [N / 64, K / 2, 64, 2] (qrt_cpu.bf16_linear)")
            packed += 1
            continue
        if not onednn_prepack_supported(weight.dtype):  # qrt's pairs need only qrt's library
            continue
        # A dense layer's GEMM becomes the opaque op itself; a quantized kernel keeps its own op and
        # reaches the packed weight through dense_linear.
        kernel = "qrt.onednn_linear" if weight.kernel == "aten.linear" else weight.kernel
        replace_parameter(module, "weight", prepack_weight(weight.data), kernel=kernel,
                          storage_layout=f"{layout}, prepacked for oneDNN (qrt.onednn_linear)")
        packed += 1
    return packed


def _prepack_experts(experts: StackedExperts) -> int:
    """A block's experts whose kernel reaches a dense weight [E, N, K] through dense_linear (bf16,
    widened fp8): one prepacked weight per expert behind one carrier."""
    weight = experts.weight
    if (weight.device.type != "cpu" or weight.dim() != 3 or not kernel_named(weight.kernel).prepackable
            or not onednn_prepack_supported(weight.dtype)):
        return 0
    replace_parameter(experts, "weight", prepack_stacked_weights(weight.data),
                      storage_layout=f"{weight.storage_layout}, prepacked for oneDNN per expert")
    return weight.shape[0]
