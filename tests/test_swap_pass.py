"""The swap pass on its own: a hand-made graph, ops counted before and after. The pass runs the
kernel recorded on each weight, as a loader pass records it."""

import pytest
import torch

import qrt.kernels  # noqa: F401
from helpers.graph_checks import swap_record
from qrt.kernels.fp8_reference import quantize_rows_fp8
from qrt.passes.backend import QrtBackend
from qrt.passes.base import count_ops


class TwoLinears(torch.nn.Module):
    def __init__(self, weight_dtype, kernel=None):
        super().__init__()
        w1, s1 = quantize_rows_fp8(torch.randn(24, 16))
        w2, s2 = quantize_rows_fp8(torch.randn(8, 24))
        self.w1, self.w2 = (torch.nn.Parameter(w.to(weight_dtype), requires_grad=False) for w in (w1, w2))
        self.s1, self.s2 = s1.squeeze(1), s2.squeeze(1)
        if kernel is not None:
            self.w1.kernel = self.w2.kernel = kernel

    def forward(self, x):
        h = torch.ops.qrt.fp8_linear(x, self.w1, self.s1, None)
        return torch.ops.qrt.fp8_linear(torch.relu(h), self.w2, self.s2, None)


def _compile(module, x, inductor=True):
    backend = QrtBackend("test", inductor=inductor)
    out = torch.compile(module, backend=backend, fullgraph=True)(x)
    return backend.log, out


def test_cpu_graph_gets_the_kernel_recorded_on_its_weights():
    module, x = TwoLinears(torch.float32, kernel="qrt.fp8_linear_cpu"), torch.randn(3, 16)
    log, out = _compile(module, x)
    _, record = swap_record(log)
    assert record.ops_before["qrt.fp8_linear"] == 2 and "qrt.fp8_linear_cpu" not in record.ops_before
    assert record.ops_after.get("qrt.fp8_linear", 0) == 0 and record.ops_after["qrt.fp8_linear_cpu"] == 2
    assert record.ops_after["torch.relu"] == record.ops_before["torch.relu"] == 1
    assert record.code_before != record.code_after and "fp8_linear_cpu" in record.code_after
    torch.testing.assert_close(out, module(x), rtol=1e-5, atol=1e-5)


def test_weights_without_a_recorded_kernel_keep_the_reference_op_and_say_why():
    module, x = TwoLinears(torch.float8_e4m3fn), torch.randn(3, 16)
    log, out = _compile(module, x, inductor=False)
    graph, swap = swap_record(log)
    assert swap.changed == 0
    assert swap.ops_after["qrt.fp8_linear"] == 2
    assert len(graph.kernel_choices) == 2
    assert all(c.kernel == "qrt.fp8_linear" and "no kernel recorded" in c.reason for c in graph.kernel_choices)
    torch.testing.assert_close(out, module(x))


def test_a_kernel_that_does_not_replace_the_called_op_is_an_error():
    module, x = TwoLinears(torch.float32, kernel="qrt.int8_linear_cpu"), torch.randn(3, 16)
    with pytest.raises(Exception, match="chose qrt.int8_linear_cpu for this layer, whose graph calls qrt.fp8_linear"):
        _compile(module, x, inductor=False)


def test_count_ops_names_custom_ops_by_namespace():
    gm = torch.fx.symbolic_trace(TwoLinears(torch.float32))
    assert count_ops(gm)["qrt.fp8_linear"] == 2


def test_pass_uuid_is_stable_and_hex():
    from qrt.passes.swap_linear import SwapQuantizedLinear

    a, b = SwapQuantizedLinear().uuid, SwapQuantizedLinear().uuid
    assert a == b and len(a) == 16 and int(a, 16) >= 0
