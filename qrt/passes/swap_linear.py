"""Swap each logical quantized-linear op for the kernel op of its device and weight layout."""

from dataclasses import dataclass

import torch
import torch.fx

from .base import GraphPass, target_name

# logical op name -> {(device type, weight dtype kind): (kernel op name, why)}
_CPU_WHY = "CPU: no fp8 arithmetic; the loader pass widened the weights, Inductor fuses activation quantization around one GEMM"
KERNEL_TABLE = {
    "qrt.fp8_linear": {
        ("cuda", "fp8"): ("qrt.fp8_linear_triton", "fp8 weights on a GPU: Triton fp8 GEMM, fused per-token x per-channel scaling"),
        ("cpu", "float"): ("qrt.fp8_linear_cpu", _CPU_WHY),
    },
    "qrt.fp8_static_linear": {
        ("cuda", "fp8"): ("qrt.fp8_static_linear_triton", "fp8 weights on a GPU: static input scale, Triton fp8 GEMM"),
        ("cpu", "float"): ("qrt.fp8_static_linear_cpu", _CPU_WHY),
    },
    "qrt.fp8_block_linear": {
        ("cuda", "fp8"): ("qrt.fp8_block_linear_triton", "block fp8 on a GPU: Triton GEMM with per-block weight and per-group activation scales"),
        ("cpu", "float"): ("qrt.fp8_block_linear_cpu", "CPU: the loader pass dequantized the blocks; Inductor fuses the group quantization of activations around one GEMM"),
    },
    "qrt.int_linear": {
        ("cuda", "int"): ("qrt.int_linear_triton", "integer weights on a GPU: Triton GEMM unpacking and dequantizing the weight tile in registers"),
    },
    "qrt.int8_linear": {
        ("cuda", "int"): ("qrt.int8_linear_triton", "W8A8 on a GPU: Triton per-token int8 quantization, int8 GEMM with the rescale and zero-point correction in its epilogue"),
        ("cpu", "int"): ("qrt.int8_linear_cpu", "CPU: int8 weights in ATen's int8-weight matmul, activations on the int8 grid per token (fused by Inductor)"),
    },
    "qrt.w4a8_linear": {
        ("cuda", "int"): ("qrt.w4a8_linear_triton", "W4A8 on a GPU: Triton int8 GEMM turning 4-bit codes into int8 weights in registers"),
    },
}
# Kernel ops a layer calls directly, because the loader pass already packed its weights in the
# kernel's own opaque layout: nothing to swap, but they are listed with the choices.
DIRECT_KERNELS = {
    "qrt.int4pack_linear": "CPU: the loader pass packed the 4-bit weights for ATen's int4 matmul",
    "qrt.int8pack_linear": "CPU: the loader pass stored int8 weights for ATen's int8 matmul",
    "qrt.onednn_linear": "CPU: the loader pass prepacked the dense weights for oneDNN's linear",
}


@dataclass
class KernelChoice:
    node: str  # FX node name, which encodes the layer path
    logical_op: str
    kernel: str
    reason: str
    weight_shape: tuple
    weight_dtype: str
    device: str


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8"
    return "float" if dtype.is_floating_point else "int"


def _example(node) -> torch.Tensor | None:
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _resolve_op(name: str):
    """The op packet for 'ns.op', or None when it is not registered (e.g. Triton missing)."""
    namespace, op = name.split(".")
    try:
        return getattr(getattr(torch.ops, namespace), op)
    except AttributeError:
        return None


class SwapQuantizedLinear(GraphPass):
    name = "swap_quantized_linear"

    def run(self, gm: torch.fx.GraphModule, report, calls: int = 1) -> int:
        changed = 0
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            logical = target_name(node.target)
            table = KERNEL_TABLE.get(logical)
            if table is None and logical not in DIRECT_KERNELS:
                continue
            x, weight = _example(node.args[0]), _example(node.args[1])
            if x is None or weight is None:
                report.kernel_choices += [KernelChoice(node.name, logical, logical, "no shape metadata; kept reference",
                                                       (), "?", "?")] * calls
                continue
            key = (x.device.type, _dtype_kind(weight.dtype))
            if table is None:
                kernel, reason = logical, DIRECT_KERNELS[logical]
            else:
                kernel, reason = table.get(key, (logical, f"no kernel for {key}; kept the reference op"))
            if kernel != logical:
                op = _resolve_op(kernel)
                if op is None:
                    kernel, reason = logical, f"{kernel} is not registered here; kept the reference op"
                else:
                    node.target = op
                    changed += 1
            # One choice per layer: a nested region's body stands for every layer that calls it.
            report.kernel_choices += [
                KernelChoice(node.name, logical, kernel, reason, tuple(weight.shape),
                             str(weight.dtype).removeprefix("torch."), x.device.type)
            ] * calls
        if changed:
            gm.graph.lint()
            gm.recompile()
        return changed
