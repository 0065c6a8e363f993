"""W8A8 and W4A8 kernels against their references: the references against explicit
dequantized arithmetic (the zero-point correction, QQQ's fp16 multiply-add), the CPU int8 kernel,
the Triton activation quantizer, int8 GEMM, W4A8 GEMM and fused norm/activation quantizers
(interpreted on the CPU), on random inputs, M = 1 and ragged shapes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qrt.kernels.int8_fused_triton  # noqa: F401  (registers the Triton ops)
import qrt.kernels.int8_triton  # noqa: F401
import qrt.kernels.w4a8_triton  # noqa: F401
from helpers.compare import relative_l2
from helpers.kernel_checks import on_device, random_rows
from qrt.kernels.int8_fused_reference import rms_norm_quant_int8_reference, silu_mul_quant_int8_reference
from qrt.kernels.int8_reference import (int8_linear_reference, quantize_activations_int8, quantize_rows_int8,
                                        weight_row_sums)
from qrt.kernels.int8_triton import quantize_activations_int8_triton
from qrt.kernels.int_reference import pack_rows, unpack_rows
from qrt.kernels.w4a8_reference import w4a8_int8_weights, w4a8_linear_reference

# activation scheme -> (input_scale, input_zero_point, asymmetric)
SCHEMES = {
    "dynamic-symmetric": (None, None, False),
    "dynamic-asymmetric": (None, None, True),
    "static-symmetric": (torch.tensor([0.02]), None, False),
    "static-asymmetric": (torch.tensor([0.025]), torch.tensor([-17], dtype=torch.int32), True),
}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def random_int8_layer(n, k, seed=0):
    gen = _gen(seed)
    weight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)  # [N, K]
    weight_scale = torch.rand(n, generator=gen) * 0.01 + 1e-3  # [N] fp32
    return weight, weight_scale


def _scheme_args(name, weight):
    input_scale, zero, asym = SCHEMES[name]
    return input_scale, zero, weight_row_sums(weight) if asym else None


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_reference_equals_explicit_dequantized_matmul(scheme):
    """The reference's correction form, s_x s_w (Σ q q_w - z Σ q_w), equals the plain product of
    the dequantized activations s_x (q - z) and weights s_w q_w."""
    weight, weight_scale = random_int8_layer(24, 80)
    x = random_rows(5, 80, shift=0.7)  # off-centre rows: asymmetric zero points far from 0
    bias = torch.randn(24)
    input_scale, zero_point, sums = _scheme_args(scheme, weight)
    q, s, z = quantize_activations_int8(x, input_scale, zero_point, sums is not None)
    x_dequantized = s.double() * (q.double() - (0 if z is None else z.double()))  # [M, K]
    expected = x_dequantized @ (weight.double() * weight_scale.double()[:, None]).t() + bias.double()
    out = int8_linear_reference(x, weight, weight_scale, input_scale, zero_point, sums, bias)
    assert relative_l2(out, expected) < 1e-6
    if input_scale is None:  # dynamic ranges never saturate: every value is within half a step
        assert ((x_dequantized - x.double()).abs() <= s.double() / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("asymmetric", [False, True])
def test_dynamic_quantization_properties(asymmetric):
    x = random_rows(6, 50, shift=0.5)
    x[2] = 0.0  # an all-zero row quantizes to its zero point and dequantizes to exactly 0
    x[3] = x[3].abs() + 1.0  # all positive: the range is widened to include 0
    q, s, z = quantize_rows_int8(x, asymmetric)
    zero = torch.zeros_like(s) if z is None else z.float()
    assert torch.equal((q.float() - zero)[2], torch.zeros(50))
    assert ((s * (q.float() - zero) - x).abs() <= s / 2 * (1 + 1e-6)).all()
    if asymmetric:
        assert z.min() >= -128 and z.max() <= 127 and int(z[3]) == -128
        assert int(q[3].min()) >= -128 and int(q[3].max()) == 127
    else:
        assert int(q.abs().max()) == 127


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [128, 100])  # 100: padded to a multiple of 16 for ATen's kernel
def test_cpu_int8_kernel_matches_reference(scheme, dtype, k):
    weight, weight_scale = random_int8_layer(40, k, seed=k)
    input_scale, zero_point, sums = _scheme_args(scheme, weight)
    bias = torch.randn(40).to(dtype)
    for m in (1, 7):
        x = random_rows(m, k, dtype, shift=0.3)
        out = torch.ops.qrt.int8_linear_cpu(x, weight, weight_scale, input_scale, zero_point, sums, bias)
        expected = int8_linear_reference(x, weight, weight_scale, input_scale, zero_point, sums, bias)
        assert out.dtype == dtype and out.shape == (m, 40)
        # Same int8 codes; the integer sums come out of ATen rounded to bf16 (2**-9 relative).
        assert relative_l2(out, expected) < 5e-3


@pytest.mark.parametrize("scheme", ["dynamic-asymmetric", "static-asymmetric"])
def test_compiled_cpu_int8_kernel_equals_eager(scheme):
    """What Inductor generates around the ATen matmul (quantization, zero point, rescale) computes
    the same values as the ops run one by one."""
    weight, weight_scale = random_int8_layer(40, 128, seed=1)
    args = _scheme_args(scheme, weight)

    def linear(x):
        return torch.ops.qrt.int8_linear_cpu(x, weight, weight_scale, *args, None)

    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        compiled = torch.compile(linear, fullgraph=True, dynamic=True)
        for m in (1, 5):
            x = random_rows(m, 128, shift=0.3)
            assert torch.equal(compiled(x), linear(x))


@settings(max_examples=20, deadline=None)
@given(m=st.sampled_from([1, 3, 17]), k=st.integers(1, 1500), scheme=st.sampled_from(sorted(SCHEMES)),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_triton_activation_quantization_matches_reference_exactly(m, k, scheme, dtype):
    input_scale, zero_point, asym = SCHEMES[scheme]
    x = random_rows(m, k, dtype, seed=k, shift=0.4) * 3
    expected = quantize_activations_int8(x, input_scale, zero_point, asym)
    got = on_device(quantize_activations_int8_triton)(x, input_scale, zero_point, asym)
    for a, b in zip(got, expected):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


@settings(max_examples=20, deadline=None)
@given(m=st.sampled_from([1, 3, 16, 33]), k=st.integers(1, 40).map(lambda v: 8 * v), n=st.integers(1, 80),
       scheme=st.sampled_from(sorted(SCHEMES)), with_bias=st.booleans())
def test_triton_int8_gemm_matches_reference(m, k, n, scheme, with_bias):
    weight, weight_scale = random_int8_layer(n, k, seed=m * k + n)
    input_scale, zero_point, sums = _scheme_args(scheme, weight)
    bias = torch.randn(n) if with_bias else None
    x = random_rows(m, k, shift=0.2)
    out = on_device(torch.ops.qrt.int8_linear_triton)(x, weight, weight_scale, input_scale, zero_point, sums, bias)
    expected = int8_linear_reference(x, weight, weight_scale, input_scale, zero_point, sums, bias)
    assert out.shape == (m, n)
    # Exact integer sums and the reference's epilogue order: equal up to fp32 rounding.
    assert relative_l2(out, expected) < 1e-6


def test_triton_int8_gemm_half_precision_and_batch_dims():
    weight, weight_scale = random_int8_layer(72, 320, seed=4)
    x = random_rows(5, 320, torch.bfloat16).reshape(1, 5, 320)
    out = on_device(torch.ops.qrt.int8_linear_triton)(x, weight, weight_scale, None, None, None, None)
    assert out.shape == (1, 5, 72) and out.dtype == torch.bfloat16
    expected = int8_linear_reference(x, weight, weight_scale, None, None, None, None)
    # The interpreter truncates the bf16 output (the GPU rounds it): up to 2**-8 relative.
    assert relative_l2(out, expected) < 1e-2


def random_w4a8_layer(k, n, group_size, seed=0):
    gen = _gen(seed)
    group = k if group_size == -1 else group_size
    q = torch.randint(0, 16, (k, n), generator=gen)  # [K, N] unsigned 4-bit
    # fp16 multipliers of QQQ's range: |code| <= 8 times < 15.9 stays inside int8.
    group_scales = (torch.rand(-(-k // group), n, generator=gen) * 14.9 + 1).half().float()
    channel_scales = torch.rand(n, generator=gen) * 1e-3 + 1e-4
    return pack_rows(q, 4), group_scales, channel_scales, group


def test_w4a8_int8_weights_are_qqq_fp16_multiply_add():
    """QQQ's kernel computes fp16((q - 8) * s + 1152) with one rounding and keeps the low byte;
    float64 holds the exact sum, so one conversion to fp16 reproduces that rounding."""
    qweight, group_scales, _, group = random_w4a8_layer(256, 64, 128, seed=2)
    q = unpack_rows(qweight, 4, 256)
    g = torch.arange(256) // group
    fma = ((q.double() - 8) * group_scales.double()[g] + 1152.0).half().float()  # [K, N] in [1024, 2048)
    assert torch.equal(w4a8_int8_weights(qweight, group_scales, group, 256).float(), fma - 1152.0)


def test_w4a8_reference_equals_explicit_int8_weights():
    qweight, group_scales, channel_scales, group = random_w4a8_layer(192, 48, 64, seed=3)
    w8 = w4a8_int8_weights(qweight, group_scales, group, 192).double()  # [K, N]
    x = random_rows(4, 192)
    q, s, _ = quantize_rows_int8(x)
    expected = (s.double() * q.double()) @ (w8 * channel_scales.double())
    assert relative_l2(w4a8_linear_reference(x, qweight, group_scales, channel_scales, None, group), expected) < 1e-6


@settings(max_examples=20, deadline=None)
@given(m=st.sampled_from([1, 3, 16, 33]), k=st.integers(2, 40).map(lambda v: 8 * v), n=st.integers(1, 80),
       group_size=st.sampled_from([32, 128, -1]), with_bias=st.booleans())
def test_triton_w4a8_gemm_matches_reference(m, k, n, group_size, with_bias):
    qweight, group_scales, channel_scales, group = random_w4a8_layer(k, n, group_size, seed=m + k * n)
    bias = torch.randn(n) if with_bias else None
    x = random_rows(m, k)
    out = on_device(torch.ops.qrt.w4a8_linear_triton)(x, qweight, group_scales, channel_scales, bias, group)
    expected = w4a8_linear_reference(x, qweight, group_scales, channel_scales, bias, group)
    assert out.shape == (m, n)
    assert relative_l2(out, expected) < 1e-6


def _codes_agree(got, expected):
    """Same scales (to fp32 rounding) and codes, but for the odd one off by one where the fused
    kernel's exp, mean or rsqrt differ from ATen's in the last bit and a value sits on a rounding edge."""
    (q, s), (q_ref, s_ref) = got, expected
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    assert torch.allclose(s, s_ref, rtol=1e-5, atol=0)
    diff = (q.int() - q_ref.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-2


@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama-norm", "gemma-norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 200), (7, 1100)])
def test_fused_rms_norm_quantization_matches_reference(dtype, shape, unit_offset):
    x = (torch.randn(*shape, generator=_gen(5)) * 2).to(dtype)
    weight = (torch.randn(shape[-1], generator=_gen(6)) * 0.1 + (0 if unit_offset else 1)).to(dtype)
    _codes_agree(on_device(torch.ops.qrt.rms_norm_quant_int8_triton)(x, weight, 1e-5, unit_offset),
                 rms_norm_quant_int8_reference(x, weight, 1e-5, unit_offset))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 320), (7, 2200)])
def test_fused_silu_mul_quantization_matches_reference(dtype, shape):
    y = (torch.randn(*shape, generator=_gen(7)) * 3).to(dtype)
    _codes_agree(on_device(torch.ops.qrt.silu_mul_quant_int8_triton)(y), silu_mul_quant_int8_reference(y))


def test_gemm_only_ops_match_the_full_kernels():
    weight, weight_scale = random_int8_layer(48, 160, seed=8)
    x = random_rows(2, 160).reshape(2, 1, 160)
    q, s, _ = quantize_rows_int8(x.reshape(2, 160))
    got = on_device(torch.ops.qrt.int8_gemm_triton)(q.reshape(2, 1, 160), s.reshape(2, 1, 1), weight, weight_scale, None,
                                         torch.float32)
    assert torch.equal(got, on_device(torch.ops.qrt.int8_linear_triton)(x, weight, weight_scale, None, None, None, None))
    qweight, group_scales, channel_scales, group = random_w4a8_layer(160, 48, 32, seed=9)
    got = on_device(torch.ops.qrt.w4a8_gemm_triton)(q, s, qweight, group_scales, channel_scales, None, group, torch.float32)
    assert torch.equal(got, on_device(torch.ops.qrt.w4a8_linear_triton)(x.reshape(2, 160), qweight, group_scales,
                                                             channel_scales, None, group))


def test_inconsistent_activation_arguments_are_refused():
    weight, weight_scale = random_int8_layer(8, 32)
    x = random_rows(2, 32)
    with pytest.raises(ValueError, match="zero point needs a static input scale"):
        int8_linear_reference(x, weight, weight_scale, None, torch.tensor([3]), weight_row_sums(weight), None)
    with pytest.raises(ValueError, match="need weight_sums"):
        on_device(torch.ops.qrt.int8_linear_triton)(x, weight, weight_scale, torch.tensor([0.1]), torch.tensor([3]), None, None)
