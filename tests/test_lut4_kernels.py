"""4-bit table-lookup kernels (`qrt::lut4_linear`: NF4, FP4, NVFP4, MXFP4) against the reference:
the reference's dequantization against values decoded by hand from each scale format's definition,
qrt's AVX-512 CPU kernel against the arithmetic it promises (the table in bf16, exact products,
fp32 sums, one rounding) and against the exact weight, and the Triton GEMM, interpreted on the CPU,
against the reference."""

import math

import pytest
import torch

import qrt.kernels.lut4_triton  # noqa: F401  (registers qrt::lut4_linear_triton)
from helpers.compare import relative_l2
from helpers.kernel_checks import BF16_RTOL, SUM_RTOL, assert_within, on_device, random_rows
from qrt.kernels import lut4_cpu, native_cpu
from qrt.kernels.choices import choose
from qrt.kernels.lut4_reference import (LUT4_CODES, SCALE_FORMATS, Lut4Weights, decode_scales, e2m1_table,
                                        pack_nibbles, unpack_nibbles)

# bitsandbytes' NF4 values (the normal distribution's quantiles, scaled to [-1, 1]), as a table
# that is not exact in bf16.
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])

CASES = {  # name: (table, group size, scale format, global scale, divides)
    "nf4-fp32-g64": (NF4, 64, "fp32", None, False),
    "nvfp4-e4m3-g16-divided": (e2m1_table(), 16, "e4m3", 448.0 * 6 / 3.5, True),
    "nvfp4-e4m3-g16-multiplied": (e2m1_table(), 16, "e4m3", 0.0021, False),
    "mxfp4-e8m0-g32": (e2m1_table(), 32, "e8m0", None, False),
}


def random_weights(name: str, n: int = 192, k: int = 256, seed: int = 0) -> Lut4Weights:
    table, g, fmt, global_scale, divides = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)  # [N, K]
    if fmt == "fp32":
        scales = torch.rand(n, k // g, generator=gen) * 0.05 + 0.005  # [N, K / G]
    elif fmt == "e4m3":  # every code of a positive e4m3 but NaN, subnormals included
        scales = torch.randint(1, 0x7F, (n, k // g), generator=gen, dtype=torch.uint8)
    else:  # exponents around 2^0 (E2M1's largest value is 6)
        scales = torch.randint(117, 130, (n, k // g), generator=gen, dtype=torch.uint8)
    return Lut4Weights(codes, table, g, scales, fmt, None if global_scale is None else torch.tensor(global_scale),
                       divides)


def hand_decoded_scale(stored: int, fmt: str) -> float:
    """One stored block scale's value, from the format's definition."""
    if fmt == "e4m3":  # 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0 is subnormal
        exponent, mantissa = (stored >> 3) & 0xF, stored & 0x7
        value = mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
        return -value if stored & 0x80 else value
    return 2.0 ** (stored - 127)  # e8m0: a biased power of two


@pytest.mark.parametrize("name", ["nvfp4-e4m3-g16-divided", "mxfp4-e8m0-g32"])
def test_block_scales_decode_as_their_formats_define(name):
    w = random_weights(name, n=4, k=64)
    expected = torch.tensor([[hand_decoded_scale(int(s), w.scale_format) for s in row] for row in w.scales])
    g = float(w.global_scale) if w.global_scale is not None else 1.0
    expected = expected / g if w.global_divides else expected * g
    assert torch.equal(w.block_scales(), expected.float())


def test_dequantize_is_the_table_value_times_its_blocks_scale():
    w = random_weights("nf4-fp32-g64", n=8, k=128)
    n, k = w.codes.shape
    for row, col in [(0, 0), (3, 63), (3, 64), (7, 127)]:
        expected = NF4[int(w.codes[row, col])] * w.scales[row, col // 64]
        assert w.dequantize()[row, col] == expected


def test_nibbles_round_trip_low_nibble_first():
    codes = torch.randint(0, 16, (5, 32), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (5, 16) and packed[0, 0] == codes[0, 0] | (codes[0, 1] << 4)
    assert torch.equal(unpack_nibbles(packed), codes)


def test_reference_op_equals_x_times_the_dequantized_weight():
    w = random_weights("nvfp4-e4m3-g16-divided")
    p = LUT4_CODES.pack(w, torch.float32).tensors
    x = random_rows(3, 256)
    bias = torch.randn(192)
    y = torch.ops.qrt.lut4_linear(x, p["weight"], p["weight_scales"], p["weight_table"], p["weight_global"], bias,
                                  16, SCALE_FORMATS["e4m3"], True)
    assert torch.allclose(y, x @ w.dequantize().t() + bias, rtol=1e-5, atol=1e-5)


needs_native = pytest.mark.skipif(not native_cpu.available(), reason="qrt's CPU kernels do not build here")


def cpu_kernel_call(w: Lut4Weights, x: torch.Tensor, bias=None) -> torch.Tensor:
    p = lut4_cpu.Lut4PairsLayout().pack(w, torch.bfloat16).tensors
    return torch.ops.qrt.lut4_pairs_linear(x, p["weight"], p["weight_scales"], p["weight_table"], p["weight_global"],
                                           bias, w.group_size, SCALE_FORMATS[w.scale_format])


def kernel_weight(w: Lut4Weights) -> torch.Tensor:
    """The weight the CPU kernel multiplies by, in fp64: the table rounded to bf16, times the
    decoded block scale times the global multiplier."""
    n, k = w.codes.shape
    table = w.table.bfloat16().double()[w.codes.long()]  # [N, K]
    scale = decode_scales(w.scales, w.scale_format).double() * w.global_multiplier().double()  # [N, K / G]
    return (table.view(n, -1, w.group_size) * scale[..., None]).view(n, k)


@needs_native
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("m", [1, 3, 6, 31])
def test_cpu_kernel_is_its_arithmetic_rounded_once(name, m):
    """Below 32 rows: exact products of the bf16 table values with x, fp32 sums, one rounding to
    bf16: within half a bf16 step (2^-8 of the value at most) plus the fp32 sums' error."""
    w = random_weights(name)
    x = random_rows(m, 256, torch.bfloat16, seed=m)
    bias = torch.randn(192, generator=torch.Generator().manual_seed(5))
    assert lut4_cpu.packable(w, torch.bfloat16)
    y = cpu_kernel_call(w, x, bias).double()
    wk = kernel_weight(w)
    expected = x.double() @ wk.t() + bias.double()
    terms = x.double().abs() @ wk.abs().t() + bias.double().abs()
    assert_within(y, expected, expected.abs() * 2.0**-8 + terms * SUM_RTOL)


@needs_native
@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_kernel_rows_do_not_depend_on_their_batch(name):
    w = random_weights(name)
    x = random_rows(7, 256, torch.bfloat16)
    together = cpu_kernel_call(w, x)
    alone = torch.cat([cpu_kernel_call(w, x[i : i + 1]) for i in range(7)])
    assert torch.equal(together, alone)


@needs_native
@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_kernel_on_prompts_uses_the_weight_rounded_to_bf16_once(name):
    w = random_weights(name)
    x = random_rows(40, 256, torch.bfloat16)
    y = cpu_kernel_call(w, x).double()
    wk = kernel_weight(w).bfloat16().double()
    expected = x.double() @ wk.t()
    terms = x.double().abs() @ wk.abs().t()
    assert_within(y, expected, expected.abs() * 2.0**-8 + terms * SUM_RTOL)


@needs_native
@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_kernel_stays_within_bf16_of_the_exact_weight(name):
    """Against the reference's exact fp32 weight: only bf16 roundings apart."""
    w = random_weights(name)
    x = random_rows(2, 256, torch.bfloat16)
    y = cpu_kernel_call(w, x).float()
    assert relative_l2(y, x.float() @ w.dequantize().t()) < 4e-3


@needs_native
def test_cpu_kernel_compiles_whole_and_equals_its_eager_call():
    w = random_weights("nvfp4-e4m3-g16-divided")
    p = lut4_cpu.Lut4PairsLayout().pack(w, torch.bfloat16).tensors
    x = random_rows(3, 256, torch.bfloat16)

    def step(x):
        return torch.ops.qrt.lut4_pairs_linear(x, p["weight"], p["weight_scales"], p["weight_table"],
                                               p["weight_global"], None, 16, SCALE_FORMATS["e4m3"]) * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    assert torch.equal(compiled(x), step(x))


@needs_native
def test_cpu_kernel_takes_only_what_it_reads_exactly():
    w = random_weights("mxfp4-e8m0-g32")
    assert choose("qrt.lut4_linear", "cpu", weights=w, dtype=torch.bfloat16).op == "qrt.lut4_pairs_linear"
    assert choose("qrt.lut4_linear", "cpu", weights=w, dtype=torch.float32).op == "qrt.lut4_linear"
    w.scales[0, 0] = 0  # 2^-127 is not a normal fp32 number
    assert not lut4_cpu.packable(w, torch.bfloat16)
    narrow = random_weights("nf4-fp32-g64", n=96)  # N not a multiple of 64
    assert choose("qrt.lut4_linear", "cpu", weights=narrow, dtype=torch.bfloat16).op == "qrt.lut4_linear"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("m,dtype", [(1, torch.float32), (5, torch.bfloat16), (33, torch.float32)])
def test_triton_kernel_matches_the_reference(name, m, dtype):
    w = random_weights(name, n=96, k=128)
    p = LUT4_CODES.pack(w, dtype).tensors
    x = random_rows(m, 128, dtype, seed=m)
    bias = torch.randn(96, generator=torch.Generator().manual_seed(2))
    args = (p["weight"], p["weight_scales"], p["weight_table"], p["weight_global"], bias, w.group_size,
            SCALE_FORMATS[w.scale_format], w.global_divides)
    got = on_device(torch.ops.qrt.lut4_linear_triton)(x, *args).float()
    expected = torch.ops.qrt.lut4_linear(x.float(), *args)
    terms = x.float().abs() @ w.dequantize().abs().t() + bias.abs()
    rounding = expected.abs() * (BF16_RTOL if dtype == torch.bfloat16 else 0.0)
    assert_within(got, expected, rounding + terms * SUM_RTOL)
    assert math.isfinite(float(got.abs().max()))
