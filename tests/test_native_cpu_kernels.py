"""qrt's own CPU kernels (qrt/kernels/csrc/quantized_cpu.cpp) against their references, on random
inputs, by both of their routes (the GEMV and the dequantize + dense GEMM): `qrt_cpu::fp8_gemm`
against a float computation of the same sum, the three fp8 kernel ops against their logical
reference ops, and the int4/int8 pack kernels' dequantized route against the reference (the
few-rows route is ATen's, tested in test_int_kernels.py)."""

import pytest
import torch

from kernel_checks import SUM_RTOL, assert_within
from qrt.kernels import fp8_native_cpu, int_cpu, native_cpu
from qrt.kernels.fp8_block_reference import fp8_block_linear_reference
from qrt.kernels.fp8_reference import fp8_linear_reference, quantize_rows_fp8
from qrt.kernels.fp8_static_reference import fp8_static_linear_reference

pytestmark = pytest.mark.skipif(not native_cpu.available(), reason=f"{native_cpu.why_unavailable()}")

ROUTES = {"gemv": 2**62, "dequantized": 0}  # min_rows_dequantized that forces each route
# (M, N, K, block_n, block_k): one K-block (per channel) and block grids, whole and ragged, with
# K below, at and past one 64-wide chunk, M across the GEMV's tiles of 8 rows.
SHAPES = [(1, 48, 576, 1, 576), (3, 37, 200, 1, 200), (9, 64, 256, 32, 32), (5, 33, 300, 128, 128),
          (17, 70, 130, 16, 48), (8, 20, 64, 1, 64), (2, 16, 20, 1, 20)]


def _fp8_operands(m, n, k, block_n, block_k, seed):
    """Random fp8 activations and weights spanning many binades (subnormals included), with
    per-block scales: (xq [M, K] e4m3, x_scale [M, Kb], w [N, K] e4m3, w_scale [Nb, Kb])."""
    gen = torch.Generator().manual_seed(seed)
    xq = (torch.randn(m, k, generator=gen) * 4).to(torch.float8_e4m3fn)
    magnitudes = 2.0 ** torch.randint(-12, 7, (n, k), generator=gen)
    w = (torch.randn(n, k, generator=gen) * magnitudes).to(torch.float8_e4m3fn)
    k_blocks, n_blocks = -(-k // block_k), -(-n // block_n)
    x_scale = torch.rand(m, k_blocks, generator=gen) + 0.5
    w_scale = torch.rand(n_blocks, k_blocks, generator=gen) + 0.5
    return xq, x_scale, w, w_scale


def _expected_and_bound(xq, x_scale, w, w_scale, block_n, block_k):
    """The exact sum in fp64, and sum(|terms|) to measure rounding against."""
    k, n = xq.shape[1], w.shape[0]
    xs = x_scale.double().repeat_interleave(block_k, 1)[:, :k]
    ws = w_scale.double().repeat_interleave(block_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]
    x, weight = xq.double() * xs, w.double() * ws
    return x @ weight.t(), x.abs() @ weight.abs().t()


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_gemm_matches_the_exact_sum(shape, dtype, route):
    m, n, k, block_n, block_k = shape
    xq, x_scale, w, w_scale = _fp8_operands(m, n, k, block_n, block_k, seed=sum(shape))
    got = torch.ops.qrt_cpu.fp8_gemm(xq.to(dtype), x_scale, w, w_scale, block_n, block_k, ROUTES[route])
    assert got.dtype == torch.float32 and got.shape == (m, n)
    expected, bound = _expected_and_bound(xq, x_scale, w, w_scale, block_n, block_k)
    if route == "gemv" or dtype == torch.float32:
        # Exact products summed in fp32: only the order of the sum differs.
        assert_within(got, expected, SUM_RTOL * bound + 1e-30)
    elif w_scale.shape[1] == 1:
        # Exact bf16 operands, a bf16 GEMM output (half a step) scaled after.
        assert_within(got, expected, 2.0**-8 * (bound + expected.abs()))
    else:
        # Both operands dequantized to bf16 (2**-9 each) and a bf16 output.
        assert_within(got, expected, 2.0**-7 * bound + 2.0**-8 * expected.abs())


def test_fp8_gemm_names_what_it_expected():
    xq, x_scale, w, w_scale = _fp8_operands(2, 16, 64, 1, 64, seed=0)
    with pytest.raises(RuntimeError, match=r"weight_scale \[ceil\(N / block_n\), ceil\(K / block_k\)\]"):
        torch.ops.qrt_cpu.fp8_gemm(xq.float(), x_scale, w, w_scale[:8], 1, 64, 0)
    with pytest.raises(RuntimeError, match="e4m3 weight expected"):
        torch.ops.qrt_cpu.fp8_gemm(xq.float(), x_scale, w.float(), w_scale, 1, 64, 0)


def _random_fp8_layer(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    w, scale = quantize_rows_fp8(torch.randn(n, k, generator=gen) * 0.05)  # [N, K] e4m3, [N, 1]
    return w, scale.view(-1), torch.randn(n, generator=gen)


@pytest.fixture(params=list(ROUTES))
def route(request, monkeypatch):
    """Each fp8 kernel op run by one route of its GEMM."""
    monkeypatch.setattr(fp8_native_cpu, "MIN_ROWS_DEQUANTIZED", ROUTES[request.param])
    return request.param


def _output_bound(expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32: summation order only. bf16: roundings of the GEMM's operands or output (2**-8 of the
    terms) and of the final output, as the widened-weight kernels allow (test_fp8_reference.py)."""
    if dtype == torch.float32:
        return 1e-5 * (expected.abs() + 1)
    return 2.0**-6 * (expected.abs() + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_kernel_matches_its_reference(route, dtype):
    w, scale, bias = _random_fp8_layer(72, 160, seed=1)
    x = torch.randn(2, 5, 160, generator=torch.Generator().manual_seed(2)).to(dtype)  # [B, T, K]
    expected = fp8_linear_reference(x, w, scale, bias.to(dtype))
    got = torch.ops.qrt.fp8_linear_native_cpu(x, w, scale, bias.to(dtype))
    assert got.shape == expected.shape and got.dtype == dtype
    assert_within(got, expected, _output_bound(expected.float(), dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_static_linear_kernel_matches_its_reference(route, dtype):
    w, scale, bias = _random_fp8_layer(48, 96, seed=3)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(4)).to(dtype)
    input_scale = x.float().abs().amax().reshape(1) / 300.0  # some activations clipped at ±448
    expected = fp8_static_linear_reference(x, w, scale, input_scale, None)
    got = torch.ops.qrt.fp8_static_linear_native_cpu(x, w, scale, input_scale, None)
    assert_within(got, expected, _output_bound(expected.float(), dtype))


@pytest.mark.parametrize("blocks", [(32, 32), (16, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_block_linear_kernel_matches_its_reference(route, dtype, blocks):
    block_n, block_k = blocks
    n, k = 70, 130  # ragged in both: a partial last block each way
    gen = torch.Generator().manual_seed(5)
    xq, _, w, w_scale = _fp8_operands(1, n, k, block_n, block_k, seed=6)
    w_scale = w_scale * 1e-3
    x = torch.randn(3, 4, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    expected = fp8_block_linear_reference(x, w, w_scale, bias, block_n, block_k)
    got = torch.ops.qrt.fp8_block_linear_native_cpu(x, w, w_scale, bias, block_n, block_k)
    assert_within(got, expected, _output_bound(expected.float(), dtype))


@pytest.mark.parametrize("n,k,group", [(64, 256, 32), (192, 576, 64), (128, 128, 128)])
def test_int4_pack_dequantized_route_matches_aten(n, k, group):
    gen = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)  # [N, K / 2]
    scale_offsets = (torch.randn(k // group, n, 2, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(int_cpu.MIN_ROWS_DEQUANTIZED + 3, k, generator=gen).to(torch.bfloat16)
    s, o = scale_offsets.float().unbind(-1)  # [K / g, N] each
    weight = (codes.float() - 8) * s.t().repeat_interleave(group, 1) + o.t().repeat_interleave(group, 1)  # [N, K]
    expected = x.double() @ weight.double().t()
    got = torch.ops.qrt_cpu.int4pack_mm(x, packed, group, scale_offsets, int_cpu.MIN_ROWS_DEQUANTIZED)
    # The weight rounded to bf16 (2**-9), the output to bf16 (2**-9).
    bound = 2.0**-8 * (x.double().abs() @ weight.double().abs().t())
    assert_within(got, expected, bound)


def test_int8_pack_dequantized_route_matches_aten():
    gen = torch.Generator().manual_seed(8)
    n, k = 96, 192
    weight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
    x = torch.randn(int_cpu.MIN_ROWS_DEQUANTIZED, k, generator=gen).to(torch.bfloat16)
    exact = weight.double() * scales.double()[:, None]  # [N, K]
    expected = x.double() @ exact.t()
    got = torch.ops.qrt_cpu.int8pack_mm(x, weight, scales, int_cpu.MIN_ROWS_DEQUANTIZED)
    # A bf16 GEMM output, then the scale applied in bf16: two roundings of 2**-9.
    assert_within(got, expected, 2.0**-7 * (x.double().abs() @ exact.abs().t()))


def test_unavailable_kernels_step_aside(monkeypatch):
    """QRT_NATIVE_CPU=0: the declarations refuse, so the loader pass chooses the kernels before them."""
    from qrt.kernels.choices import choose

    assert choose("qrt.fp8_linear", "cpu").op == "qrt.fp8_linear_native_cpu"
    monkeypatch.setenv("QRT_NATIVE_CPU", "0")
    assert choose("qrt.fp8_linear", "cpu").op == "qrt.fp8_linear_cpu"
    assert choose("qrt.fp8_block_linear", "cpu").op == "qrt.fp8_block_linear_cpu"
