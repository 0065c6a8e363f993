"""qrt's own CPU kernels (qrt/kernels/csrc/quantized_cpu.cpp) against their references, on random
inputs, by both of their routes (the GEMV and the dequantize + dense GEMM): `qrt_cpu::fp8_linear`
and the three fp8 kernel ops against their logical reference ops, its activation quantization
against torch's exactly, the int4/int8 pack kernels' dequantized route against the exact sum (the
middle route is ATen's, tested in test_int_kernels.py), the int4 GEMV of one row, the GEMV on
weights packed in pairs (csrc/pair_gemv.h) with bf16 weights (dense_bf16_cpu.cpp), int8 codes
(int8_pairs_cpu.cpp) and e4m3 codes (fp8_pairs_cpu.cpp), and qrt's int4 kernel on its own pack
(int4_pairs_cpu.cpp)."""

import os
import time

import pytest
import torch

from helpers.kernel_checks import SUM_RTOL, assert_within
from qrt.kernels import (bf16_native_cpu, fp8_native_cpu, fp8_pairs_cpu, int4_pairs_cpu, int8_pairs_cpu, int_cpu,
                         native_cpu, pair_layout)
from qrt.kernels.fp8_block_reference import fp8_block_linear_reference, quantize_groups_fp8
from qrt.kernels.fp8_reference import fp8_linear_reference, quantize_rows_fp8
from qrt.kernels.fp8_static_reference import fp8_static_linear_reference, quantize_static_fp8

# Skipped only where the kernels are not wanted (switched off, or a CPU without their
# instructions). Where they are, a failed build fails the first test below, not skips the file.
pytestmark = pytest.mark.skipif(native_cpu.why_not_wanted() is not None, reason=f"{native_cpu.why_not_wanted()}")


def test_the_kernels_build_on_a_cpu_with_their_instructions():
    assert native_cpu.why_unavailable() is None


def test_a_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path, capsys):
    """torch's builder would wait forever on a lock a killed build left; a build running now keeps its."""
    stale, fresh = tmp_path / "stale", tmp_path / "fresh"
    stale.touch()
    fresh.touch()
    long_ago = time.time() - native_cpu.STALE_LOCK_SECONDS - 60
    os.utime(stale, (long_ago, long_ago))
    native_cpu._remove_stale_lock(stale)
    native_cpu._remove_stale_lock(fresh)
    native_cpu._remove_stale_lock(tmp_path / "absent")
    assert not stale.exists() and fresh.exists()
    assert f"removing {stale}" in capsys.readouterr().err


@pytest.fixture(autouse=True)
def _library_loaded():
    """Every test calls torch.ops.qrt_cpu.* directly, so the library is loaded first (a failed build
    fails the test above; here it would leave the ops missing)."""
    native_cpu.available()

ROUTES = {"gemv": 2**62, "dequantized": 0}  # min_rows_dequantized that forces each route
# (M, N, K, block_n, block_k): one K-block (per channel) and block grids, whole and ragged, with
# K below, at and past one 64-wide chunk, M across the GEMV's tiles of 8 rows.
SHAPES = [(1, 48, 576, 1, 576), (3, 37, 200, 1, 200), (9, 64, 256, 32, 32), (5, 33, 300, 128, 128),
          (17, 70, 130, 16, 48), (8, 20, 64, 1, 64), (2, 16, 20, 1, 20)]


def _fp8_weights(n, k, block_n, block_k, seed):
    """Random e4m3 weights spanning many binades (subnormals included) and per-block scales:
    (w [N, K] e4m3, w_scale [ceil(N / block_n), ceil(K / block_k)] fp32)."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = 2.0 ** torch.randint(-12, 7, (n, k), generator=gen)
    w = (torch.randn(n, k, generator=gen) * magnitudes).to(torch.float8_e4m3fn)
    w_scale = (torch.rand(-(-n // block_n), -(-k // block_k), generator=gen) + 0.5) * 1e-2
    return w, w_scale


def _activations(m, k, dtype, seed):
    """[M, K] activations over several decades, so that quantized rows use the whole e4m3 range."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen) * 2.0 ** torch.randint(-8, 4, (m, k), generator=gen)).to(dtype)


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_linear_matches_the_reference(shape, dtype, route):
    m, n, k, block_n, block_k = shape
    w, w_scale = _fp8_weights(n, k, block_n, block_k, seed=sum(shape))
    x = _activations(m, k, dtype, seed=m)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    got = torch.ops.qrt_cpu.fp8_linear(x, w, w_scale, bias, block_n, block_k, None, ROUTES[route])
    one_block = block_n == 1 and block_k == k
    if one_block:
        expected = fp8_linear_reference(x, w, w_scale.view(-1), bias)
    else:
        expected = fp8_block_linear_reference(x, w, w_scale, bias, block_n, block_k)
    assert got.dtype == dtype and got.shape == (m, n)
    q, x_scale = quantize_groups_fp8(x, block_k)
    x_deq = q.float() * x_scale.repeat_interleave(block_k, 1)[:, :k]
    w_deq = w.float() * w_scale.repeat_interleave(block_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]
    terms = x_deq.abs() @ w_deq.abs().t() + bias.float().abs()  # sum(|terms|) of each output
    if dtype == torch.float32:
        tolerance = SUM_RTOL * terms  # the summation order only
    elif route == "gemv" or one_block:
        # Both outputs rounded to bf16; the dequantized route's GEMM output once more.
        tolerance = 2.0**-8 * (expected.float().abs() + terms)
    else:
        tolerance = 2.0**-7 * terms + 2.0**-8 * expected.float().abs()  # bf16 operands and output
    assert_within(got, expected, tolerance + 1e-30)


@pytest.mark.parametrize("mode", ["token", "group", "static"])
def test_activation_quantization_is_the_reference_one(mode):
    """Through an identity weight, each output is one quantized activation times its scale, so the
    kernel's fp8 rounding (ties, subnormals, clipping at ±448) must equal torch's exactly."""
    k = 96
    x = _activations(5, k, torch.float32, seed=3)
    x[0, :8] = torch.tensor([0.0, -0.0, 2.0**-12, 3 * 2.0**-10, -(2.0**-6), 1e-30, 17.5, 9.0])  # ties, tiny
    eye = torch.eye(k).to(torch.float8_e4m3fn)  # [K, K]
    if mode == "static":
        input_scale = torch.tensor([x.abs().max().item() / 300.0])  # some activations clip at ±448
        expected = quantize_static_fp8(x, input_scale).float() * input_scale
        got = torch.ops.qrt_cpu.fp8_linear(x, eye, torch.ones(k, 1), None, 1, k, input_scale, ROUTES["gemv"])
    else:
        group = k if mode == "token" else 32
        q, scale = quantize_groups_fp8(x, group)
        expected = q.float() * scale.repeat_interleave(group, 1)
        got = torch.ops.qrt_cpu.fp8_linear(x, eye, torch.ones(k, k // group), None, 1, group, None, ROUTES["gemv"])
    assert torch.equal(got, expected)


def test_fp8_linear_names_what_it_expected():
    w, w_scale = _fp8_weights(16, 64, 1, 64, seed=0)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"weight_scale \[ceil\(N / block_n\), ceil\(K / block_k\)\]"):
        torch.ops.qrt_cpu.fp8_linear(x, w, w_scale[:8], None, 1, 64, None, 0)
    with pytest.raises(RuntimeError, match="e4m3 weight expected"):
        torch.ops.qrt_cpu.fp8_linear(x, w.float(), w_scale, None, 1, 64, None, 0)


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
    w, w_scale = _fp8_weights(n, k, block_n, block_k, seed=6)
    x = torch.randn(3, 4, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    expected = fp8_block_linear_reference(x, w, w_scale, bias, block_n, block_k)
    got = torch.ops.qrt.fp8_block_linear_native_cpu(x, w, w_scale, bias, block_n, block_k)
    assert_within(got, expected, _output_bound(expected.float(), dtype))


@pytest.mark.parametrize("rows", ["one", "many"])
@pytest.mark.parametrize("n,k,group", [(64, 256, 32), (192, 576, 64), (128, 128, 128), (256, 64, 64)])
def test_int4_pack_gemv_and_dequantized_routes_match_the_exact_sum(n, k, group, rows):
    """One row: qrt's GEMV on ATen's pack; many: dequantized to bf16 and one GEMM."""
    gen = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)  # [N, K / 2]
    scale_offsets = (torch.randn(k // group, n, 2, generator=gen) * 0.05).to(torch.bfloat16)
    m = 1 if rows == "one" else int_cpu.MIN_ROWS_DEQUANTIZED + 3
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    s, o = scale_offsets.float().unbind(-1)  # [K / g, N] each
    weight = (codes.float() - 8) * s.t().repeat_interleave(group, 1) + o.t().repeat_interleave(group, 1)  # [N, K]
    expected = x.double() @ weight.double().t()
    got = torch.ops.qrt_cpu.int4pack_mm(x, packed, group, scale_offsets, int_cpu.MIN_ROWS_DEQUANTIZED)
    # GEMV: exact products summed in fp32, a bf16 output (2**-9). Dequantized: the weight rounded to
    # bf16 (2**-9) too.
    bound = 2.0**-8 * (x.double().abs() @ weight.double().abs().t())
    assert_within(got, expected, bound)


@pytest.mark.parametrize("m", [1, 5, 9, int_cpu.MIN_ROWS_DEQUANTIZED])
@pytest.mark.parametrize("n,k", [(96, 192), (37, 100)])
def test_int8_pack_gemv_and_dequantized_routes_match_the_exact_sum(m, n, k):
    """Below the threshold: qrt's GEMV (the codes widened by conversion); from it: dequantized."""
    gen = torch.Generator().manual_seed(8)
    weight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    exact = weight.double() * scales.double()[:, None]  # [N, K]
    expected = x.double() @ exact.t()
    got = torch.ops.qrt_cpu.int8pack_mm(x, weight, scales, int_cpu.MIN_ROWS_DEQUANTIZED)
    # GEMV: exact products summed in fp32, one bf16 output; dequantized: a bf16 GEMM output too.
    assert_within(got, expected, 2.0**-7 * (x.double().abs() @ exact.abs().t()))


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("m,n,k", [(1, 64, 576), (3, 192, 98), (4, 128, 2), (5, 64, 130), (9, 320, 64),
                                   (130, 128, 200)])
def test_bf16_pairs_linear_matches_the_exact_sum(m, n, k, bias):
    """M across the kernel's tiles of 4 rows (and a ragged last tile), K from one pair up."""
    gen = torch.Generator().manual_seed(m + n + k)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    expected = x.double() @ weight.double().t() + (b.double() if bias else 0)
    got = torch.ops.qrt_cpu.bf16_linear(x, bf16_native_cpu.pack_weight(weight), b)
    # Exact products summed in fp32 (K * 2**-24 of the terms), one rounding to bf16 (2**-9).
    terms = x.double().abs() @ weight.double().abs().t() + (b.double().abs() if bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert_within(got, expected, 2.0**-8 * terms)


def test_bf16_pairs_layout_holds_each_weight_where_the_kernel_reads_it():
    """Element (b, j, d, t) of the packed weight is W[64 b + d, 2 j + t]."""
    n, k = 128, 10
    weight = (torch.arange(n * k) % 256).to(torch.bfloat16).reshape(n, k)  # exact in bf16; distinct in any 256
    packed = bf16_native_cpu.pack_weight(weight)
    assert packed.shape == (n // 64, k // 2, 64, 2)
    b, j, d, t = torch.meshgrid(*(torch.arange(size) for size in packed.shape), indexing="ij")
    assert torch.equal(packed, weight[64 * b + d, 2 * j + t])


def test_bf16_pairs_linear_rows_do_not_depend_on_their_batch():
    """Each output is summed in one fixed order, whatever the number of rows beside it."""
    gen = torch.Generator().manual_seed(3)
    packed = bf16_native_cpu.pack_weight((torch.randn(192, 576, generator=gen) * 0.05).to(torch.bfloat16))
    x = torch.randn(11, 576, generator=gen).to(torch.bfloat16)
    together = torch.ops.qrt_cpu.bf16_linear(x, packed, None)
    for row in (0, 4, 10):
        assert torch.equal(torch.ops.qrt_cpu.bf16_linear(x[row:row + 1], packed, None), together[row:row + 1])


def test_bf16_pairs_names_what_it_expected():
    with pytest.raises(RuntimeError, match=r"N a multiple of 64 and K even"):
        bf16_native_cpu.pack_weight(torch.zeros(48, 64, dtype=torch.bfloat16))
    packed = bf16_native_cpu.pack_weight(torch.ones(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"bf16 x \[M, 64\] expected"):
        torch.ops.qrt_cpu.bf16_linear(torch.ones(2, 32, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match=r"packed as \[N / 64, K / 2, 64, 2\]"):
        torch.ops.qrt_cpu.bf16_linear(torch.ones(2, 64, dtype=torch.bfloat16), packed.float(), None)
    assert not bf16_native_cpu.packable(torch.ones(100, 64, dtype=torch.bfloat16))
    assert not bf16_native_cpu.packable(torch.ones(64, 64))  # fp32: oneDNN or ATen run it


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("m,n,k", [(1, 64, 576), (3, 192, 98), (4, 128, 2), (5, 64, 130), (9, 320, 64),
                                   (130, 128, 200)])
def test_int8_pairs_linear_matches_the_exact_sum(m, n, k, bias, scale_dtype):
    """Up to 4 rows the codes are widened in registers, from 5 once per block: both, ragged tiles too."""
    gen = torch.Generator().manual_seed(m + n + k)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, generator=gen) * 0.01 + 0.001).to(scale_dtype)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    exact = codes.double() * scales.double()[:, None]  # [N, K]
    expected = x.double() @ exact.t() + (b.double() if bias else 0)
    got = torch.ops.qrt_cpu.int8_pairs_linear(x, int8_pairs_cpu.pack_weight(codes), scales, b)
    # Exact products summed in fp32, scaled once in fp32, one rounding to bf16 (2**-9).
    terms = x.double().abs() @ exact.abs().t() + (b.double().abs() if bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert_within(got, expected, 2.0**-8 * terms)


def test_int8_pairs_layout_holds_each_code_where_the_kernel_reads_it():
    """Element (b, j, d, t) of the packed codes is q[64 b + d, 2 j + t]."""
    n, k = 128, 10
    codes = ((torch.arange(n * k) % 256) - 128).to(torch.int8).reshape(n, k)
    packed = int8_pairs_cpu.pack_weight(codes)
    assert packed.shape == (n // 64, k // 2, 64, 2) and pair_layout.is_pair_packed(packed)
    b, j, d, t = torch.meshgrid(*(torch.arange(size) for size in packed.shape), indexing="ij")
    assert torch.equal(packed, codes[64 * b + d, 2 * j + t])
    assert pair_layout.output_features(packed) == n and pair_layout.output_features(codes) == n


def test_int8_pairs_linear_rows_do_not_depend_on_their_batch():
    """The same fixed order per output whether the block is widened in registers (M <= 4) or once (M > 4)."""
    gen = torch.Generator().manual_seed(4)
    packed = int8_pairs_cpu.pack_weight(torch.randint(-128, 128, (192, 576), generator=gen, dtype=torch.int8))
    scales = (torch.rand(192, generator=gen) * 0.01).to(torch.bfloat16)
    x = torch.randn(11, 576, generator=gen).to(torch.bfloat16)
    together = torch.ops.qrt_cpu.int8_pairs_linear(x, packed, scales, None)
    for row in (0, 4, 10):
        assert torch.equal(torch.ops.qrt_cpu.int8_pairs_linear(x[row:row + 1], packed, scales, None),
                           together[row:row + 1])


def test_int8_pairs_names_what_it_expected():
    packed = int8_pairs_cpu.pack_weight(torch.ones(64, 64, dtype=torch.int8))
    scales = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"bf16 x \[M, 64\] expected"):
        torch.ops.qrt_cpu.int8_pairs_linear(torch.ones(2, 32, dtype=torch.bfloat16), packed, scales, None)
    with pytest.raises(RuntimeError, match=r"packed as \[N / 64, K / 2, 64, 2\]"):
        torch.ops.qrt_cpu.int8_pairs_linear(torch.ones(2, 64, dtype=torch.bfloat16), packed.float(), scales, None)
    with pytest.raises(RuntimeError, match=r"bf16 or fp32 scales \[64\] expected"):
        torch.ops.qrt_cpu.int8_pairs_linear(torch.ones(2, 64, dtype=torch.bfloat16), packed, scales[:32], None)
    assert not int8_pairs_cpu.packable(torch.ones(100, 64, dtype=torch.int8), torch.bfloat16)
    assert not int8_pairs_cpu.packable(torch.ones(64, 64, dtype=torch.int8), torch.float32)  # ATen's layout


def _int4_weight(n, k, group, gen):
    """Random 4-bit codes [N, K], (scale, offset) pairs [K / g, N, 2] in bf16 (scales of both signs)
    and the weight they stand for, W = (q - 8) * scale + offset, in float64 [N, K]."""
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scale_offsets = (torch.randn(k // group, n, 2, generator=gen) * 0.05).to(torch.bfloat16)
    s, o = scale_offsets.double().unbind(-1)  # [K / g, N] each
    weight = (codes.double() - 8) * s.t().repeat_interleave(group, 1) + o.t().repeat_interleave(group, 1)
    return codes, scale_offsets, weight


def _unpack_int4_pairs(packed):
    """The inverse of `int4_pairs_cpu.pack_codes`: uint8 [N / 64, K / 2, 64] -> int32 codes [K, N]."""
    blocks, half_k, _ = packed.shape
    words = packed.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [b, j, 32]
    words = words.view(blocks, half_k, 16, 2)  # [b, j, i, t]
    parts = torch.stack([(words >> (4 * c)) & 0xF for c in range(4)], dim=2)  # [b, j, c, i, t]
    return parts.permute(1, 4, 0, 2, 3).reshape(2 * half_k, blocks * int4_pairs_cpu.OUTPUTS_PER_BLOCK)  # [K, N]


def _int4_pairs(codes, scale_offsets):
    return int4_pairs_cpu.pack_codes(codes.t()), int4_pairs_cpu.pack_scale_offsets(scale_offsets)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("m,n,k,group", [(1, 64, 576, 64), (1, 192, 256, 32), (1, 128, 256, 256), (2, 64, 128, 128),
                                         (3, 192, 576, 64), (5, 128, 64, 32), (9, 320, 128, 64), (31, 128, 256, 64),
                                         (32, 128, 256, 64), (40, 1088, 2048, 128)])
def test_int4_pairs_linear_matches_the_exact_sum(m, n, k, group, bias):
    """Below the threshold (32 rows): tiles of up to 4 rows, exact products summed in fp32 per group,
    the group's scale and offset applied after (ragged tiles too); from it: W rounded to bf16 a tile
    of blocks at a time and oneDNN's GEMM (1088 x 2048 takes two tiles of 4 MiB)."""
    gen = torch.Generator().manual_seed(m + n + k + group)
    codes, scale_offsets, weight = _int4_weight(n, k, group, gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    expected = x.double() @ weight.t() + (b.double() if bias else 0)
    got = torch.ops.qrt_cpu.int4_pairs_linear(x, *_int4_pairs(codes, scale_offsets), group, b,
                                              int4_pairs_cpu.MIN_ROWS_DEQUANTIZED)
    # A bf16 output (2**-9); from the threshold on also W rounded to bf16 (2**-9 of each term).
    terms = x.double().abs() @ weight.abs().t() + (b.double().abs() if bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert_within(got, expected, 2.0**-8 * terms)


def test_int4_pairs_layout_holds_each_code_where_the_kernel_reads_it():
    """Word 2 i + t of step (b, j) holds q[64 b + 16 c + i, 2 j + t] in its nibble c; a block's
    (scale, offset) pairs of group h lie at (b, h)."""
    n, k = 128, 6
    codes = (torch.arange(n * k) * 7 % 16).reshape(n, k).to(torch.int32)  # [N, K]
    packed = int4_pairs_cpu.pack_codes(codes.t())
    assert packed.shape == (n // 64, k // 2, 64) and packed.dtype == torch.uint8 and int4_pairs_cpu.is_packed(packed)
    words = packed.view(torch.int16).to(torch.int32) & 0xFFFF  # [b, j, 32]
    b, j, i, t, c = torch.meshgrid(torch.arange(n // 64), torch.arange(k // 2), torch.arange(16), torch.arange(2),
                                   torch.arange(4), indexing="ij")
    assert torch.equal((words[b, j, 2 * i + t] >> (4 * c)) & 0xF, codes[64 * b + 16 * c + i, 2 * j + t])
    assert torch.equal(_unpack_int4_pairs(packed), codes.t())
    pairs = torch.randn(3, n, 2).to(torch.bfloat16)  # [K / g, N, 2]
    blocked = int4_pairs_cpu.pack_scale_offsets(pairs)
    assert blocked.shape == (n // 64, 3, 64, 2) and torch.equal(blocked[1, 2, 5], pairs[2, 64 + 5])
    assert int4_pairs_cpu.output_features(packed) == n


def test_int4_pairs_linear_rows_do_not_depend_on_their_batch():
    """Below the threshold a row's arithmetic is the same alone (M = 1) or in any tile of a batch."""
    gen = torch.Generator().manual_seed(6)
    codes, scale_offsets, _ = _int4_weight(192, 576, 64, gen)
    packed = _int4_pairs(codes, scale_offsets)
    x = torch.randn(int4_pairs_cpu.MIN_ROWS_DEQUANTIZED - 1, 576, generator=gen).to(torch.bfloat16)
    together = torch.ops.qrt_cpu.int4_pairs_linear(x, *packed, 64, None, int4_pairs_cpu.MIN_ROWS_DEQUANTIZED)
    for rows in (slice(0, 1), slice(3, 8), slice(9, 11), slice(29, 31)):
        alone = torch.ops.qrt_cpu.int4_pairs_linear(x[rows], *packed, 64, None, int4_pairs_cpu.MIN_ROWS_DEQUANTIZED)
        assert torch.equal(alone, together[rows])


def test_int4_pairs_names_what_it_expected():
    codes, scale_offsets, _ = _int4_weight(64, 128, 64, torch.Generator().manual_seed(0))
    packed, blocked = _int4_pairs(codes, scale_offsets)
    x = torch.ones(2, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"bf16 x \[M, 128\] expected"):
        torch.ops.qrt_cpu.int4_pairs_linear(x[:, :64], packed, blocked, 64, None, 64)
    with pytest.raises(RuntimeError, match=r"uint8 codes \[N / 64, K / 2, 64\] expected"):
        torch.ops.qrt_cpu.int4_pairs_linear(x, packed.view(64, 64), blocked, 64, None, 64)
    with pytest.raises(RuntimeError, match=r"scale_offsets \[1, 2, 64, 2\] expected"):
        torch.ops.qrt_cpu.int4_pairs_linear(x, packed, scale_offsets, 64, None, 64)
    with pytest.raises(RuntimeError, match=r"an even group size dividing K = 128"):
        torch.ops.qrt_cpu.int4_pairs_linear(x, packed, blocked, 48, None, 64)
    assert not int4_pairs_cpu.packable(100, 128, 64, torch.bfloat16)
    assert not int4_pairs_cpu.packable(64, 128, 64, torch.float16)  # ATen's pack


@pytest.mark.parametrize("activations", ["token", "static"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("m,n,k", [(1, 64, 576), (3, 192, 98), (4, 128, 2), (5, 64, 130), (9, 320, 64),
                                   (130, 128, 200)])
def test_fp8_pairs_linear_matches_the_reference(m, n, k, bias, activations):
    """Against the logical ops' references (activations per token, or a static scale), M across the
    tiles of 4 rows widened in registers and the blocks widened once from 5 rows."""
    w, w_scale = _fp8_weights(n, k, 1, k, seed=m + n + k)
    w_scale = w_scale.view(-1)  # [N]
    x = _activations(m, k, torch.bfloat16, seed=m)
    b = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16) if bias else None
    packed = fp8_pairs_cpu.pack_weight(w)
    if activations == "token":
        got = fp8_pairs_cpu.linear(x, packed, w_scale, b)
        expected = fp8_linear_reference(x, w, w_scale, b)
        q, x_scale = quantize_rows_fp8(x)
    else:
        input_scale = x.float().abs().amax().reshape(1) / 300  # clips the largest activations at 448
        got = fp8_pairs_cpu.linear(x, packed, w_scale, b, input_scale)
        expected = fp8_static_linear_reference(x, w, w_scale, input_scale, b)
        q, x_scale = quantize_static_fp8(x, input_scale), input_scale
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    terms = (q.float() * x_scale).abs() @ (w.float() * w_scale[:, None]).abs().t() + (b.float().abs() if bias else 0)
    # The same codes and scales; fp32 sums in another order, both outputs rounded to bf16.
    assert_within(got, expected, 2.0**-8 * (expected.float().abs() + terms) + 1e-30)


def test_fp8_pairs_layout_puts_each_pair_where_the_byte_unpack_reads_it():
    """Output d = 32 h + 16 u + 4 L + r of a block sits at entry 32 h + 8 L + 4 u + r of each step."""
    n, k = 128, 6
    w, _ = _fp8_weights(n, k, 1, k, seed=1)
    packed = fp8_pairs_cpu.pack_weight(w)
    assert packed.shape == (n // 64, k // 2, 64, 2) and pair_layout.is_pair_packed(packed)
    assert torch.equal(fp8_pairs_cpu.unpack_weight(packed).view(torch.uint8), w.view(torch.uint8))
    codes = w.view(torch.uint8)
    for b, j, d, t in [(0, 0, 0, 0), (0, 1, 5, 1), (1, 2, 17, 0), (1, 0, 38, 1), (0, 2, 63, 1)]:
        h, u, lane, r = d // 32, d % 32 // 16, d % 16 // 4, d % 4
        assert packed.view(torch.uint8)[b, j, 32 * h + 8 * lane + 4 * u + r, t] == codes[64 * b + d, 2 * j + t]


def test_fp8_pairs_linear_rows_do_not_depend_on_their_batch():
    w, w_scale = _fp8_weights(192, 576, 1, 576, seed=5)
    packed = fp8_pairs_cpu.pack_weight(w)
    x = _activations(11, 576, torch.bfloat16, seed=6)
    together = fp8_pairs_cpu.linear(x, packed, w_scale.view(-1), None)
    for row in (0, 4, 10):
        assert torch.equal(fp8_pairs_cpu.linear(x[row:row + 1], packed, w_scale.view(-1), None), together[row:row + 1])


def test_fp8_pairs_names_what_it_expected():
    w, w_scale = _fp8_weights(64, 64, 1, 64, seed=2)
    packed = fp8_pairs_cpu.pack_weight(w)
    with pytest.raises(RuntimeError, match=r"bf16 x \[M, 64\] expected"):
        torch.ops.qrt_cpu.fp8_pairs_linear(torch.ones(2, 32, dtype=torch.bfloat16), packed, w_scale.view(-1), None, None)
    with pytest.raises(RuntimeError, match=r"packed as \[N / 64, K / 2, 64, 2\]"):
        torch.ops.qrt_cpu.fp8_pairs_linear(torch.ones(2, 64, dtype=torch.bfloat16), packed.float(), w_scale.view(-1),
                                           None, None)
    with pytest.raises(RuntimeError, match=r"fp32 weight_scale \[64\] expected"):
        torch.ops.qrt_cpu.fp8_pairs_linear(torch.ones(2, 64, dtype=torch.bfloat16), packed, w_scale.view(-1)[:1],
                                           None, None)
    assert not fp8_pairs_cpu.packable(w[:48], torch.bfloat16)
    assert not fp8_pairs_cpu.packable(w, torch.float32)  # fp32 models keep [N, K] codes


def test_unavailable_kernels_step_aside(monkeypatch):
    """QRT_NATIVE_CPU=0: the declarations refuse, so the loader pass chooses the kernels before them."""
    from qrt.kernels.choices import choose

    assert choose("qrt.fp8_linear", "cpu").op == "qrt.fp8_linear_native_cpu"
    monkeypatch.setenv("QRT_NATIVE_CPU", "0")
    assert choose("qrt.fp8_linear", "cpu").op == "qrt.fp8_linear_cpu"
    assert choose("qrt.fp8_block_linear", "cpu").op == "qrt.fp8_block_linear_cpu"
    assert not bf16_native_cpu.packable(torch.ones(64, 64, dtype=torch.bfloat16))
    assert not int8_pairs_cpu.packable(torch.ones(64, 64, dtype=torch.int8), torch.bfloat16)
