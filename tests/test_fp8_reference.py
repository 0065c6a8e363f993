"""The fp8 reference and the CPU kernel, on random inputs."""

import torch
from hypothesis import given, settings, strategies as st

import qrt.kernels  # noqa: F401
from qrt.kernels.fp8_cpu import fp8_linear_cpu
from qrt.kernels.fp8_reference import FP8_MAX, MIN_SCALE, fp8_linear_reference, quantize_rows_fp8


def test_quantize_rows_uses_the_full_range_and_bounds_the_error():
    x = torch.randn(64, 300) * torch.logspace(-3, 3, 64)[:, None]
    q, scale = quantize_rows_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((64,), FP8_MAX))
    err = (q.float() * scale - x).abs()
    # Half a step of e4m3: 2**-4 relative for normals, half the subnormal step below them.
    assert torch.all(err <= x.abs() * 2**-4 + scale * 2**-10)


def test_all_zero_rows_use_the_scale_floor():
    q, scale = quantize_rows_fp8(torch.zeros(2, 8))
    assert torch.equal(scale, torch.full((2, 1), MIN_SCALE)) and torch.equal(q.float(), torch.zeros(2, 8))


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 70), k=st.integers(1, 70), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_cpu_kernel_matches_reference(m, n, k, bias, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    weight, scale = quantize_rows_fp8(torch.randn(n, k, generator=gen))
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    expected = fp8_linear_reference(x, weight, scale.squeeze(1), b)
    got = fp8_linear_cpu(x, weight.to(dtype), scale.squeeze(1), b)
    if dtype == torch.float32:  # summation order only
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        return
    # bf16: the kernel rounds the GEMM output to bf16 before scaling and adding the bias, one
    # rounding (2**-8 relative to the product, which a bias can nearly cancel) on top of the final
    # one both sides share (2**-8 relative to the output).
    product = fp8_linear_reference(x, weight, scale.squeeze(1), None).float().abs()
    bound = 2**-7 * (product + expected.float().abs()) + 2**-7
    assert ((got.float() - expected.float()).abs() <= bound).all()


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 70), k=st.integers(16, 300), seed=st.integers(0, 2**16))
def test_cpu_kernel_in_float16_does_not_overflow(m, n, k, seed):
    """The GEMM multiplies fp8 values (up to 448 each), whose sums pass float16's 65504 long before
    the scales bring them back: in float16 it runs in float32, so only the output's rounding to
    float16 (2**-11 relative) differs from the reference, beyond summation order."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 4).half()
    weight, scale = quantize_rows_fp8(torch.randn(n, k, generator=gen) * 0.05)
    expected = fp8_linear_reference(x, weight, scale.squeeze(1), None).float()
    got = fp8_linear_cpu(x, weight.half(), scale.squeeze(1), None)
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected, rtol=2**-10, atol=1e-3)


def test_reference_op_on_3d_input_matches_a_dequantized_matmul():
    x = torch.randn(2, 5, 32)
    weight, scale = quantize_rows_fp8(torch.randn(16, 32))
    out = torch.ops.qrt.fp8_linear(x, weight, scale.squeeze(1), None)
    xq, xs = quantize_rows_fp8(x.reshape(10, 32))
    expected = ((xq.float() * xs) @ (weight.float() * scale).t()).reshape(2, 5, 16)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
