"""`qrt::lora_add` (a layer's output plus each batch row's LoRA product over stacked adapter
slots): the reference against float64 arithmetic, and qrt's CPU kernel against the reference, at
decode's few tokens (its own loop) and at prefill's many (the gathered batched GEMM), in bf16 and
fp32."""

import pytest
import torch

from qrt.kernels import native_cpu
from qrt.kernels.lora_cpu import lora_add_op

needs_native = pytest.mark.skipif(not native_cpu.available(), reason="qrt's CPU kernels do not build here")
SLOTS, WIDTH, K, N = 5, 48, 576, 960  # the default model's q/k/v: rank 16 times 3 shards
ROWS = torch.tensor([2, 0, 3, 2, 1, 4, 0, 2])  # the adapter slot of each batch row (0: none)
SHAPES = [(1, 1), (8, 1), (2, 5), (1, 40), (3, 7)]  # (rows, tokens): decode's few tokens, then prefill's many


def operands(dtype, rows: int, tokens: int, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(SLOTS, WIDTH, K, generator=gen) / K**0.5).to(dtype)  # [S, W, K]
    b = torch.randn(SLOTS, WIDTH, N, generator=gen).to(dtype)  # [S, W, N]: B transposed
    a[0], b[0] = 0, 0  # slot 0 holds no adapter
    x = torch.randn(rows, tokens, K, generator=gen).to(dtype)  # [B, T, K]
    y = torch.randn(rows, tokens, N, generator=gen).to(dtype)  # [B, T, N]: the base's output
    return y, x, a, b


def exact_delta(x, a, b, rows):
    """float64 round(x[i] @ a[rows[i]]ᵀ) @ b[rows[i]]: the shrink rounded to x's dtype, as promised."""
    slot = rows[:x.shape[0]]
    shrunk = (x.double() @ a[slot].double().transpose(1, 2)).to(x.dtype).double()
    return shrunk @ b[slot].double()


def check(got, y, x, a, b, rtol):
    delta = exact_delta(x, a, b, ROWS)
    # One rounding of the delta and one of the sum, each at most half a step of the larger value.
    bound = rtol * (delta.abs().max() + y.double().abs().max())
    assert (got.double() - y.double() - delta).abs().max() <= bound
    none = ROWS[:x.shape[0]] == 0
    assert torch.equal(got[none], y[none])  # rows without an adapter are the base's output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, tokens", SHAPES)
def test_reference_adds_each_rows_product(dtype, rows, tokens):
    y, x, a, b = operands(dtype, rows, tokens, seed=1)
    check(torch.ops.qrt.lora_add(y, x, a, b, ROWS), y, x, a, b, 1e-5 if dtype == torch.float32 else 2**-7)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, tokens", SHAPES)
def test_cpu_kernel_adds_each_rows_product(dtype, rows, tokens):
    assert lora_add_op(torch.device("cpu"), dtype) is torch.ops.qrt_cpu.lora_add
    y, x, a, b = operands(dtype, rows, tokens, seed=2)
    # fp32 sums in another order; in bf16 a shrunk value may round the other way (one bf16 step of
    # one of W terms) besides the two roundings.
    check(torch.ops.qrt_cpu.lora_add(y, x, a, b, ROWS), y, x, a, b, 1e-5 if dtype == torch.float32 else 2**-6)


@needs_native
def test_cpu_kernel_rows_do_not_depend_on_their_batch():
    y, x, a, b = operands(torch.bfloat16, 8, 1, seed=4)
    together = torch.ops.qrt_cpu.lora_add(y, x, a, b, ROWS)
    for row in range(8):
        alone = torch.ops.qrt_cpu.lora_add(y[row:row + 1], x[row:row + 1], a, b, ROWS[row:row + 1])
        assert torch.equal(alone[0], together[row])


@needs_native
def test_cpu_kernel_refuses_a_slot_outside_the_stack():
    y, x, a, b = operands(torch.float32, 1, 1)
    with pytest.raises(RuntimeError, match="adapter slot 9 of row 0 is outside the 5 slots"):
        torch.ops.qrt_cpu.lora_add(y, x, a, b, torch.tensor([9]))
