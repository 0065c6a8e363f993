"""The Triton fp8 kernels against the plain-torch reference (fp8_reference.py). Without a GPU the
kernels run on CPU tensors in Triton's interpreter (switched on in conftest.py).
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from helpers.kernel_checks import (BF16_RTOL, DEVICE, DTYPES, FP8_MMA_RTOL, assert_within, fp8_sum_bound, fp8_weights,
                                   random_bias)
from qrt.kernels.fp8_reference import FP8_DTYPE, quantize_rows_fp8
from qrt.kernels.fp8_triton import fp8_gemm_triton, quantize_rows_fp8_triton


def _activations(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # Row magnitudes from 1e-6 to 1e3: the small rows hit the MIN_SCALE floor, and every row has
    # elements far below its amax, which land on fp8 subnormals.
    mag = 10.0 ** torch.empty(*shape[:-1], 1).uniform_(-6, 3, generator=gen)
    return (torch.randn(*shape, generator=gen) * mag).to(dtype).to(DEVICE)


def _e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """One e4m3 step at the magnitude of v: 2**(exponent - 3), and 2**-9 among subnormals."""
    return torch.exp2(torch.floor(torch.log2(v.abs())).clamp(min=-6) - 3)


def check_quantize(m: int, k: int, dtype: torch.dtype, seed: int, transpose: bool = False) -> None:
    gen = torch.Generator().manual_seed(seed)
    if transpose:
        x = _activations(gen, (k, m), dtype).t()  # [M, K], K not contiguous
    else:
        x = _activations(gen, (m, k), dtype)  # [M, K]
    q, scale = quantize_rows_fp8_triton(x)
    q_ref, scale_ref = quantize_rows_fp8(x)

    assert q.dtype == FP8_DTYPE and q.shape == (m, k)
    assert scale.dtype == torch.float32 and scale.shape == (m, 1)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    same = (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item()
    assert same >= 0.99, f"only {same:.2%} of fp8 codes match the reference"
    # Division rounding may move a code by one e4m3 step, never more.
    step = _e4m3_step(q_ref.float()) * scale_ref * (1 + 1e-6)
    assert_within(q.float() * scale, q_ref.float() * scale_ref, step)


def check_gemm(m: int, n: int, k: int, out_dtype: torch.dtype, has_bias: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    xq, x_scale = quantize_rows_fp8(_activations(gen, (m, k), torch.float32))  # [M, K], [M, 1]
    wq, w_scale = fp8_weights(gen, n, k)
    bias = random_bias(gen, n, torch.float32) if has_bias else None

    out = fp8_gemm_triton(xq, wq, x_scale, w_scale, bias, out_dtype)

    assert out.dtype == out_dtype and out.shape == (m, n)
    expected = (xq.float() @ wq.float().t()) * x_scale * w_scale[None, :]  # [M, N] fp32
    if bias is not None:
        expected = expected + bias
    tol = FP8_MMA_RTOL * fp8_sum_bound(xq, x_scale, wq, w_scale, bias)
    if out_dtype == torch.bfloat16:
        tol = tol + BF16_RTOL * expected.abs()
    assert_within(out, expected, tol)


def check_linear(b: int, t: int, n: int, k: int, dtype: torch.dtype, has_bias: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = _activations(gen, (b, t, k), dtype)  # [B, T, K]
    wq, w_scale = fp8_weights(gen, n, k)
    bias = random_bias(gen, n, dtype) if has_bias else None

    out = torch.ops.qrt.fp8_linear_triton(x, wq, w_scale, bias)
    expected = torch.ops.qrt.fp8_linear(x, wq, w_scale, bias)

    assert out.dtype == dtype and out.shape == (b, t, n)
    xq, x_scale = quantize_rows_fp8(x.reshape(-1, k))
    tol = FP8_MMA_RTOL * fp8_sum_bound(xq, x_scale, wq, w_scale, bias).reshape(b, t, n)
    if dtype != torch.float32:
        # The kernel's output is up to one step off the exact value, the reference's half a step.
        tol = tol + 1.5 * BF16_RTOL * expected.float().abs()
    assert_within(out, expected, tol)


@settings(max_examples=50, deadline=None)
@given(
    m=st.integers(1, 40),
    k=st.integers(1, 200),
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_matches_reference(m, k, dtype, seed):
    check_quantize(m, k, DTYPES[dtype], seed)


@pytest.mark.parametrize(
    "m, k, transpose",
    [
        (1, 1, False),
        (1, 1500, False),  # two K chunks, the second ragged
        (3, 1024, False),  # exactly one chunk
        (7, 300, True),  # K stride != 1
    ],
)
def test_quantize_fixed_shapes(m, k, transpose):
    check_quantize(m, k, torch.bfloat16, seed=m * 1000 + k, transpose=transpose)


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 200),
    k=st.integers(1, 200),
    out_dtype=st.sampled_from(["fp32", "bf16"]),
    has_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_gemm_matches_fp32_reference(m, n, k, out_dtype, has_bias, seed):
    check_gemm(m, n, k, DTYPES[out_dtype], has_bias, seed)


@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize(
    "m, n, k",
    [
        (1, 200, 600),  # decode tiles, three K tiles, the last ragged
        (17, 33, 129),  # smallest M on the mid-size tiles, K one past a tile
        (300, 130, 260),  # prefill tiles, ragged in M, N and K
    ],
)
def test_gemm_fixed_shapes(m, n, k, has_bias):
    check_gemm(m, n, k, torch.float32, has_bias, seed=m + n + k)


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 13),
    n=st.integers(1, 200),
    k=st.integers(1, 200),
    dtype=st.sampled_from(["bf16", "fp32"]),
    has_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_op_matches_reference_op(b, t, n, k, dtype, has_bias, seed):
    check_linear(b, t, n, k, DTYPES[dtype], has_bias, seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("has_bias", [False, True])
def test_op_fixed_shapes(dtype, has_bias):
    check_linear(2, 9, 96, 333, dtype, has_bias, seed=7)


def test_fake_impl_shape_and_dtype():
    with FakeTensorMode():
        x = torch.empty(2, 5, 64, dtype=torch.bfloat16, device=DEVICE)  # [B, T, K]
        w = torch.empty(48, 64, dtype=FP8_DTYPE, device=DEVICE)  # [N, K]
        out = torch.ops.qrt.fp8_linear_triton(x, w, torch.empty(48, device=DEVICE), None)
    assert out.shape == (2, 5, 48) and out.dtype == torch.bfloat16 and out.device.type == DEVICE


@pytest.mark.parametrize("has_bias", [False, True])
def test_opcheck(has_bias):
    gen = torch.Generator().manual_seed(3)
    x = _activations(gen, (2, 3, 40), torch.bfloat16)
    wq, w_scale = fp8_weights(gen, 24, 40)
    bias = random_bias(gen, 24, torch.bfloat16) if has_bias else None
    # test_schema is left out: its mutation check multiplies the fp8 weight, which ATen does not
    # implement for float8 tensors.
    torch.library.opcheck(
        torch.ops.qrt.fp8_linear_triton.default,
        (x, wq, w_scale, bias),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
