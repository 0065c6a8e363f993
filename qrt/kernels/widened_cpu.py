"""Dense bf16 and fp16 GEMMs of many rows computed in float32, on CPUs without bf16 arithmetic.

Where oneDNN has no bf16 instructions to use (an AVX2 CPU: `onednn_prepack_supported` is False),
ATen multiplies bf16 and fp16 matrices row after row, each row as slow as a decode step's: on an
AMD EPYC with AVX2, 2 threads, a [256, 576] x [576, 3072] bf16 GEMM took 88 ms against 17 ms for
the same product widened to float32 (the weight's conversion included), and the default model's
output layer over 256 rows 1.53 s against 0.33 s (`python -m bench.probes.cpu_widened_gemm`).
From 16 rows on widening won on every shape of the default model; below 8 it lost.

Numerics: products of bf16 or fp16 values are exact in float32 and summed there, then rounded
once to the model dtype, as ATen's own GEMM in those dtypes does, in another order of summation.

Where it applies: only within `widened_products`, which graph_runner opens to trace a prompt
graph (prefill, encode) and to run the output layer over a scored prompt's positions. There a
dynamic row count is decided per call inside the opaque op `qrt::widened_linear_by_rows` (a guard
on the size would compile a second graph for short chunks; a Python custom op, about 30 µs a
call, small beside a prompt's GEMMs), a static one when traced. Decode and verify graphs never
widen: float32 GEMMs sum in an order that depends on the row count, and a row there must keep the
bits that the graphs of one slot and a decode step give it (graph_runner's one_slot_exact; a
verify call's rows equal decode steps'), whatever else shares the call, including the attended
keys' rows of latent attention and the tokens routed to one expert.
"""

import contextlib
import math

import torch
import torch.nn.functional as F

# From this many rows on, the float32 GEMM beats the model-dtype one (see above).
MIN_ROWS_WIDENED = 16
_widening = False  # set by widened_products
_WIDENED_DTYPES = (torch.bfloat16, torch.float16)


def cpu_has_bf16_arithmetic() -> bool:
    """Whether oneDNN has the CPU's bf16 instructions to use (AVX-512 BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


# Read once, at import: a model's traced code reads the constant (Dynamo does not trace mkldnn's query).
_CPU_LACKS_HALF_ARITHMETIC = not cpu_has_bf16_arithmetic()


def widens(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x Wᵀ for this pair should go through `qrt::widened_linear` rather than F.linear."""
    return (x.device.type == "cpu" and weight.dtype in _WIDENED_DTYPES and x.dtype == weight.dtype
            and _CPU_LACKS_HALF_ARITHMETIC)


def _in_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), weight.float()).to(x.dtype)


@torch.library.custom_op("qrt::widened_linear_by_rows", mutates_args=())
def widened_linear_by_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [M, K]; weight: [N, K], both bf16 or both fp16 -> [M, N], in float32 from
    MIN_ROWS_WIDENED rows on: the choice made when it runs, for a graph whose M varies."""
    if x.shape[0] >= MIN_ROWS_WIDENED:
        return _in_float32(x, weight)
    return F.linear(x, weight)


@widened_linear_by_rows.register_fake
def _(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0])


def widened_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [..., K]; weight: [N, K] -> [..., N] in x's dtype (no bias: the caller adds it); in
    float32 for many rows, within `widened_products` only.

    CompositeImplicitAutograd: Dynamo records the call, and AOTAutograd traces this body with the
    graph's sizes, where a dynamic one is a SymInt (Dynamo's own tracing shows it as an int)."""
    if not _widening:
        return F.linear(x, weight)
    rows = math.prod(x.shape[:-1])
    if isinstance(rows, torch.SymInt):
        out = torch.ops.qrt.widened_linear_by_rows(x.reshape(-1, x.shape[-1]), weight)  # [M, N]
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return _in_float32(x, weight) if rows >= MIN_ROWS_WIDENED else F.linear(x, weight)


@contextlib.contextmanager
def widened_products():
    """Within it, calls run (eager) or are traced (a prompt graph's compile) to widen many rows."""
    global _widening
    before, _widening = _widening, True
    try:
        yield
    finally:
        _widening = before


_lib = torch.library.Library("qrt", "FRAGMENT")
_lib.define("widened_linear(Tensor x, Tensor weight) -> Tensor")
_lib.impl("widened_linear", widened_linear, "CompositeImplicitAutograd")
