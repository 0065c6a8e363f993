"""`qrt::lora_delta` (each batch row's LoRA product over stacked adapter slots): the reference
against float64 arithmetic, and qrt's CPU kernel against the reference, at decode's few tokens
(its own loop) and at prefill's many (the gathered batched GEMM), in bf16 and fp32."""

import pytest
import torch

from qrt.kernels import native_cpu
from qrt.kernels.lora_cpu import lora_delta_op

needs_native = pytest.mark.skipif(not native_cpu.available(), reason="qrt's CPU kernels do not build here")
SLOTS, WIDTH, K, N = 5, 48, 576, 960  # the default model's q/k/v: rank 16 times 3 shards
ROWS = torch.tensor([2, 0, 3, 2, 1, 4, 0, 2])  # the adapter slot of each batch row (0: none)


def pairs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(SLOTS, WIDTH, K, generator=gen) / K**0.5).to(dtype)  # [S, W, K]
    b = torch.randn(SLOTS, N, WIDTH, generator=gen).to(dtype)  # [S, N, W]
    a[0], b[0] = 0, 0  # slot 0 holds no adapter
    return a, b


def exact(x, a, b, rows):
    """float64 b[rows[i]] @ round(a[rows[i]] @ x[i]): the shrink rounded to x's dtype, as promised."""
    batch = x.shape[0]
    flat = x.double().reshape(batch, -1, x.shape[-1])
    shrunk = (flat @ a[rows[:batch]].double().transpose(1, 2)).to(x.dtype).double()
    return (shrunk @ b[rows[:batch]].double().transpose(1, 2)).reshape(*x.shape[:-1], b.shape[1])


SHAPES = [(1, 1, K), (8, 1, K), (2, 5, K), (1, 40, K), (3, 7, K)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_is_each_rows_product(dtype, shape):
    a, b = pairs(dtype)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = torch.ops.qrt.lora_delta(x, a, b, ROWS).double()
    want = exact(x, a, b, ROWS)
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert (got - want).abs().max() <= rtol * want.abs().max()
    assert not got[ROWS[:shape[0]] == 0].any()  # rows without an adapter get nothing


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_kernel_equals_the_reference(dtype, shape):
    assert lora_delta_op(torch.device("cpu"), dtype) is torch.ops.qrt_cpu.lora_delta
    a, b = pairs(dtype, seed=2)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = torch.ops.qrt_cpu.lora_delta(x, a, b, ROWS).double()
    want = exact(x, a, b, ROWS)
    # fp32 sums in another order; in bf16 a shrunk value may round the other way (one bf16 step of
    # one of W terms) and the output is rounded once more.
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -6
    assert (got - want).abs().max() <= rtol * want.abs().max()
    assert not got[ROWS[:shape[0]] == 0].any()


@needs_native
def test_cpu_kernel_rows_do_not_depend_on_their_batch():
    a, b = pairs(torch.bfloat16, seed=4)
    x = torch.randn(8, 1, K, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    together = torch.ops.qrt_cpu.lora_delta(x, a, b, ROWS)
    for row in range(8):
        alone = torch.ops.qrt_cpu.lora_delta(x[row:row + 1], a, b, ROWS[row:row + 1])
        assert torch.equal(alone[0], together[row])


@needs_native
def test_cpu_kernel_refuses_a_slot_outside_the_stack():
    a, b = pairs(torch.float32)
    with pytest.raises(RuntimeError, match="adapter slot 9 of row 0 is outside the 5 slots"):
        torch.ops.qrt_cpu.lora_delta(torch.randn(1, 1, K), a, b, torch.tensor([9]))
