"""Fuse the per-token int8 quantization of a W8A8/W4A8 GEMM's input into the op that produces that
input: the models' RMSNorm (before q/k/v and gate/up) or SiLU-and-mul (before down_proj).

Runs on CUDA graphs, after the swap pass. A Triton int8 kernel op (`int8_linear_triton` with
dynamic symmetric activations, or `w4a8_linear_triton`) quantizes its own input: the activation is
written in the model dtype by the norm (or activation) kernel and read back by the quantization
kernel. When that input is an RMSNorm or silu(gate) * up whose result feeds nothing else, the
pass replaces

    h = rms_norm(x, w, eps)            ->   q, s = rms_norm_quant_int8_triton(x, w, eps)
    y = int8_linear_triton(h, W, ...)       y = int8_gemm_triton(q, s, W, ...)

(and likewise with silu_mul_quant_int8_triton), so the activation leaves its kernel as int8 with
one scale per token: half the bytes of bf16, one kernel launch fewer, identical numerics (the
fused kernels make every rounding the unfused graph makes).

Not on the CPU: there the W8A8 kernel is a composite op, so Inductor already generates the
quantization in the same loops as the norm around one ATen matmul; this pass would have nothing
to add.

The patterns are matched on the Dynamo graph as the models write them (runtime/models/layers.py):
`x.float()`, `pow(2)`, `mean(-1, keepdim=True)`, `+ eps`, `torch.rsqrt`, `*`, `.to(dtype)`,
`weight *`; and `chunk(2, dim=-1)`, `getitem`, `F.silu`, `*`. Anything else is left alone.
"""

import operator

import torch
import torch.fx

from .base import GraphPass, target_name


def _name(node) -> str:
    """'mul', 'rsqrt', 'float', ... for call_function and call_method nodes; '' otherwise."""
    if not isinstance(node, torch.fx.Node):
        return ""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", "")
    return ""


def _value(node):
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _only_used_by(node, users) -> bool:
    return set(node.users) <= set(users)


def _other(node, operand):
    """For a binary node, the argument that is not `operand` (or None)."""
    a, b = node.args[:2]
    return b if a is operand else a if b is operand else None


def match_rms_norm(out):
    """If `out` is the models' RMSNorm of some x, return (x, weight, eps, chain nodes); else None."""
    if _name(out) != "mul" or len(out.args) != 2:
        return None
    to = next((a for a in out.args if _name(a) == "to"), None)
    weight = _other(out, to) if to is not None else None
    if weight is None or not isinstance(weight, torch.fx.Node):
        return None
    scaled = to.args[0]
    if _name(scaled) != "mul":
        return None
    rsqrt = next((a for a in scaled.args if _name(a) == "rsqrt"), None)
    x32 = _other(scaled, rsqrt) if rsqrt is not None else None
    if _name(x32) != "float":
        return None
    add = rsqrt.args[0]
    if _name(add) != "add" or not isinstance(add.args[1], float):
        return None
    mean, eps = add.args
    dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    if _name(mean) != "mean" or dims not in (-1, [-1], (-1,)) or not mean.kwargs.get("keepdim", False):
        return None
    power = mean.args[0]
    if _name(power) != "pow" or tuple(power.args) != (x32, 2):
        return None
    x = x32.args[0]
    values = [_value(v) for v in (x, weight, out)]
    if any(v is None for v in values) or len({v.dtype for v in values}) != 1 or to.args[1:] != (values[0].dtype,):
        return None  # the fused kernel rounds to x's dtype, as the model's code does
    chain = [out, to, scaled, rsqrt, add, mean, power, x32]
    users_ok = (_only_used_by(to, [out]) and _only_used_by(scaled, [to]) and _only_used_by(rsqrt, [scaled])
                and _only_used_by(add, [rsqrt]) and _only_used_by(mean, [add]) and _only_used_by(power, [mean])
                and _only_used_by(x32, [power, scaled]))
    return (x, weight, eps, chain) if users_ok else None


def match_silu_mul(out):
    """If `out` is silu(gate) * up with gate, up = y.chunk(2, dim=-1), return (y, chain); else None."""
    if _name(out) != "mul" or len(out.args) != 2:
        return None
    silu = next((a for a in out.args if _name(a) == "silu"), None)
    up = _other(out, silu) if silu is not None else None
    if silu is None or silu.kwargs.get("inplace", False) or _name(up) != "getitem":
        return None
    gate = silu.args[0]
    if _name(gate) != "getitem" or gate.args[0] is not up.args[0] or (gate.args[1], up.args[1]) != (0, 1):
        return None
    chunk = gate.args[0]
    dim = chunk.kwargs.get("dim", chunk.args[2] if len(chunk.args) > 2 else 0)
    y, y_value = chunk.args[0], _value(chunk.args[0])
    if _name(chunk) != "chunk" or chunk.args[1] != 2 or y_value is None or dim not in (-1, y_value.dim() - 1):
        return None
    if y_value.shape[-1] % 2 or _value(out) is None or _value(out).dtype != y_value.dtype:
        return None
    chain = [out, silu, gate, up, chunk]
    users_ok = (_only_used_by(silu, [out]) and _only_used_by(gate, [silu]) and _only_used_by(up, [out])
                and _only_used_by(chunk, [gate, up]))
    return (y, chain) if users_ok else None


class FuseActivationQuant(GraphPass):
    name = "fuse_act_quant"

    def run(self, gm: torch.fx.GraphModule, report, calls: int = 1) -> int:
        changed = 0
        graph = gm.graph
        for node in list(graph.nodes):
            gemm = self._gemm(node)
            if gemm is None:
                continue
            x = node.args[0]
            if len(x.users) != 1:
                continue
            norm = match_rms_norm(x)
            silu = None if norm is not None else match_silu_mul(x)
            if norm is None and silu is None:
                continue
            out_dtype = _value(node).dtype
            with graph.inserting_before(node):
                if norm is not None:
                    source, weight, eps, chain = norm
                    fused = graph.call_function(torch.ops.qrt.rms_norm_quant_int8_triton.default, (source, weight, eps))
                else:
                    source, chain = silu
                    fused = graph.call_function(torch.ops.qrt.silu_mul_quant_int8_triton.default, (source,))
                q = graph.call_function(operator.getitem, (fused, 0))
                scale = graph.call_function(operator.getitem, (fused, 1))
                new = graph.call_function(gemm, (q, scale, *self._weights(node), out_dtype))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            for dead in chain:  # output side first, so each has no users left when erased
                graph.erase_node(dead)
            changed += 1
        if changed:
            graph.lint()
            gm.recompile()
        return changed

    @staticmethod
    def _gemm(node):
        """The GEMM-only op for a fusable kernel node, else None."""
        if node.op != "call_function":
            return None
        name = target_name(node.target)
        if name == "qrt.int8_linear_triton" and all(a is None for a in node.args[3:6]):
            return torch.ops.qrt.int8_gemm_triton.default  # dynamic symmetric activations only
        if name == "qrt.w4a8_linear_triton":
            return torch.ops.qrt.w4a8_gemm_triton.default
        return None

    @staticmethod
    def _weights(node) -> tuple:
        """The kernel node's weight-side arguments, as the GEMM-only op takes them."""
        if target_name(node.target) == "qrt.int8_linear_triton":
            _, weight, weight_scale, _, _, _, bias = node.args
            return weight, weight_scale, bias
        _, qweight, group_scales, channel_scales, bias, group_size = node.args
        return qweight, group_scales, channel_scales, bias, group_size
