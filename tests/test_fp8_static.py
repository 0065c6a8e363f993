"""Static-activation fp8 (AutoFP8 / ModelOpt FP8): the reference (kernels/fp8_static_reference.py),
its CPU kernel (kernels/fp8_static_cpu.py) and the Triton kernels (kernels/fp8_static_triton.py),
on random inputs.

Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter (switched on in
conftest.py).
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import qrt.kernels  # noqa: F401  (registers the ops)
from helpers.kernel_checks import (BF16_RTOL, DEVICE, DTYPES, FP8_MMA_RTOL, assert_within, fp8_sum_bound, fp8_weights,
                                   random_bias)
from qrt.kernels.fp8_reference import FP8_DTYPE, FP8_MAX
from qrt.kernels.fp8_static_cpu import fp8_static_linear_cpu
from qrt.kernels.fp8_static_reference import quantize_static_fp8
from qrt.kernels.fp8_static_triton import quantize_static_fp8_triton


def _static_inputs(
    gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random activations and a calibrated-looking input scale ([1] fp32, 3e-4 to 3e-3).

    Row magnitudes run from 1e-4 to 10, so x / input_scale spans fp8 subnormals up to well past
    448: the large rows saturate, as static scales do on outliers.
    """
    mag = 10.0 ** torch.empty(*shape[:-1], 1).uniform_(-4, 1, generator=gen)
    x = (torch.randn(*shape, generator=gen) * mag).to(dtype)
    input_scale = 10.0 ** torch.empty(1).uniform_(-3.5, -2.5, generator=gen)  # [1] fp32
    return x.to(DEVICE), input_scale.to(DEVICE)


# Reference -------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, 9),
    k=st.integers(1, 300),
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_static_saturates_and_bounds_the_error(m, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x, s = _static_inputs(gen, (m, k), DTYPES[dtype])
    x, s = x.cpu().float(), s.cpu()
    q = quantize_static_fp8(x, s)

    assert q.dtype == FP8_DTYPE and q.shape == (m, k)
    saturated = x.abs() >= FP8_MAX * s
    assert torch.equal(q.float()[saturated], FP8_MAX * x[saturated].sign())
    # Half an e4m3 step in range: 2**-4 relative for normals, half the subnormal step below them.
    err = (q.float() * s - x).abs()[~saturated]
    assert torch.all(err <= x.abs()[~saturated] * 2**-4 + s * 2**-10)
    # Quantizing the dequantized values gives the same codes back.
    assert torch.equal(quantize_static_fp8(q.float() * s, s).view(torch.uint8), q.view(torch.uint8))


def test_reference_op_with_a_per_tensor_weight_scale_matches_a_dequantized_matmul():
    gen = torch.Generator().manual_seed(1)
    x, s_in = _static_inputs(gen, (2, 5, 64), torch.float32)  # [B, T, K]
    x, s_in = x.cpu(), s_in.cpu()
    wq = (torch.randn(48, 64, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [N, K]
    s_w = torch.tensor(0.004)  # an AutoFP8 per-tensor scale, shape []
    bias = torch.randn(48, generator=gen)
    # The loader expands a per-tensor weight scale to one entry per output channel.
    out = torch.ops.qrt.fp8_static_linear(x, wq, s_w.expand(48), s_in, bias)
    x_deq = quantize_static_fp8(x, s_in).float() * s_in
    expected = x_deq @ (wq.float() * s_w).t() + bias
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# CPU kernel ------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 5),
    n=st.integers(1, 140),
    k=st.integers(1, 300),
    dtype=st.sampled_from(["bf16", "fp16", "fp32"]),
    has_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_cpu_kernel_matches_reference(b, t, n, k, dtype, has_bias, seed):
    dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(seed)
    x, s_in = _static_inputs(gen, (b, t, k), dtype)
    wq, ws = fp8_weights(gen, n, k)
    bias = random_bias(gen, n, dtype) if has_bias else None
    # The loader widens the fp8 weight to the model dtype; e4m3 values are exact in bf16 and fp32.
    out = fp8_static_linear_cpu(x, wq.to(dtype), ws, s_in, bias)
    expected = torch.ops.qrt.fp8_static_linear(x, wq, ws, s_in, bias)

    assert out.dtype == dtype and out.shape == (b, t, n)
    bound = fp8_sum_bound(quantize_static_fp8(x.reshape(-1, k), s_in), s_in, wq, ws, bias).reshape(b, t, n)
    if dtype == torch.float32:
        # Same operands as the reference; only the summation order differs.
        tol = FP8_MMA_RTOL * bound
    elif dtype == torch.float16:
        # The sums of fp8 values pass float16's range, so the GEMM runs in float32: the order, and
        # both sides' rounding of the result to float16.
        tol = FP8_MMA_RTOL * bound + 2.0**-10 * expected.float().abs()
    else:
        # The GEMM's output is rounded to bf16 before scaling (half a step, 2**-9 of its sum of
        # |terms|; 2**-8 leaves room for the fp32 order), then both sides round the result.
        tol = 2.0**-8 * bound + BF16_RTOL * expected.float().abs()
    assert_within(out, expected, tol)


# Triton ----------------------------------------------------------------------------------------


def check_quantize(m, k, dtype, seed, transpose=False):
    gen = torch.Generator().manual_seed(seed)
    x, s_in = _static_inputs(gen, (k, m) if transpose else (m, k), dtype)
    if transpose:
        x = x.t()  # [M, K], K not contiguous
    q = quantize_static_fp8_triton(x, s_in)

    assert q.dtype == FP8_DTYPE and q.shape == (m, k)
    # IEEE division and the e4m3 rounding helper make the codes bit-exact.
    assert torch.equal(q.view(torch.uint8), quantize_static_fp8(x, s_in).view(torch.uint8))


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, 20),
    k=st.integers(1, 300),
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_matches_reference(m, k, dtype, seed):
    check_quantize(m, k, DTYPES[dtype], seed)


@pytest.mark.parametrize(
    "m, k, transpose",
    [
        (1, 2500, False),  # three programs along K, the last ragged
        (7, 300, True),  # K stride != 1
    ],
)
def test_quantize_fixed_shapes(m, k, transpose):
    check_quantize(m, k, torch.bfloat16, seed=m * 1000 + k, transpose=transpose)


def test_quantize_rejects_a_non_scalar_scale():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="one value"):
        quantize_static_fp8_triton(x, torch.ones(2, device=DEVICE))


def check_linear(b, t, n, k, dtype, has_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x, s_in = _static_inputs(gen, (b, t, k), dtype)
    wq, ws = fp8_weights(gen, n, k)
    bias = random_bias(gen, n, dtype) if has_bias else None

    out = torch.ops.qrt.fp8_static_linear_triton(x, wq, ws, s_in, bias)
    expected = torch.ops.qrt.fp8_static_linear(x, wq, ws, s_in, bias)

    assert out.dtype == dtype and out.shape == (b, t, n)
    # Codes are bit-exact (tested above) and the epilogue multiplies in the reference's order, so
    # only the order of the fp32 sum differs: K * 2**-24 of the sum of |terms| at most.
    xq = quantize_static_fp8(x.reshape(-1, k), s_in)
    tol = FP8_MMA_RTOL * fp8_sum_bound(xq, s_in, wq, ws, bias).reshape(b, t, n)
    if dtype != torch.float32:
        # The interpreter truncates to bf16 (up to one step off), the reference rounds (half).
        tol = tol + 1.5 * BF16_RTOL * expected.float().abs()
    assert_within(out, expected, tol)


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


@pytest.mark.parametrize(
    "m, n, k",
    [
        (1, 200, 600),  # decode tiles, three K tiles, the last ragged
        (300, 130, 260),  # prefill tiles, ragged in M, N and K
    ],
)
def test_op_fixed_shapes(m, n, k):
    check_linear(1, m, n, k, torch.bfloat16, has_bias=True, seed=m + n + k)


# Fake impls ------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["fp8_static_linear", "fp8_static_linear_triton", "fp8_static_linear_cpu"])
def test_fake_impl_shape_and_dtype(op):
    with FakeTensorMode():
        x = torch.empty(2, 5, 64, dtype=torch.bfloat16, device=DEVICE)  # [B, T, K]
        # The CPU kernel takes the weight the loader widened, the others the fp8 codes.
        w_dtype = torch.bfloat16 if op == "fp8_static_linear_cpu" else FP8_DTYPE
        w = torch.empty(48, 64, dtype=w_dtype, device=DEVICE)  # [N, K]
        ws, s_in = torch.empty(48, device=DEVICE), torch.empty(1, device=DEVICE)  # [N], [1]
        out = getattr(torch.ops.qrt, op)(x, w, ws, s_in, None)
    assert out.shape == (2, 5, 48) and out.dtype == torch.bfloat16 and out.device.type == DEVICE


def test_opcheck():
    gen = torch.Generator().manual_seed(3)
    x, s_in = _static_inputs(gen, (2, 3, 40), torch.bfloat16)
    wq, ws = fp8_weights(gen, 24, 40)
    bias = random_bias(gen, 24, torch.bfloat16)
    # test_schema is left out: its mutation check multiplies the fp8 weight, which ATen does not
    # implement for float8 tensors.
    torch.library.opcheck(
        torch.ops.qrt.fp8_static_linear_triton.default,
        (x, wq, ws, s_in, bias),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
