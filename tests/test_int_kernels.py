"""Integer weight-only kernels against the reference: the reference against an explicit
dequantization, the CPU int4/int8 pack kernels and the Triton GEMM (interpreted on the CPU)
against the reference, on random weights, group sizes 32/64/128/channel, partial last groups,
act-order permutations, M = 1 and ragged shapes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch import nn

import qrt.kernels.int_triton  # noqa: F401  (registers qrt::int_linear_triton)
from helpers.checkpoints.integer import pack_fields
from helpers.compare import relative_l2
from helpers.kernel_checks import on_device, random_rows
from qrt.formats.int_weights import install_int_weights
from qrt.kernels import native_cpu, pair_layout
from qrt.kernels.int_cpu import MIN_ROWS_DEQUANTIZED, int4_cpu_group, pack_int4_for_cpu, pack_int8_for_cpu
from qrt.kernels.int_reference import IntWeights, int_linear_reference, unpack_rows


def random_layer(k, n, bits, group_size, *, act_order=False, asym=True, seed=0):
    """Random canonical tensors and the explicit fp32 weight they stand for."""
    gen = torch.Generator().manual_seed(seed)
    group = k if group_size == -1 else group_size
    groups = -(-k // group)
    q = torch.randint(0, 2**bits, (k, n), generator=gen)  # [K, N]
    scales = torch.rand(groups, n, generator=gen) * 0.02 + 0.001
    if asym:
        zeros = torch.randint(0, 2**bits, (groups, n), generator=gen).float()
    else:
        zeros = torch.full((groups, n), 2.0 ** (bits - 1))
    perm = torch.randperm(k, generator=gen) if act_order else None
    g = torch.arange(k) // group
    w_sorted = (q.float() - zeros[g]) * scales[g]  # [K, N], rows in sorted (kernel) order
    weight = torch.empty_like(w_sorted)
    weight[perm if perm is not None else torch.arange(k)] = w_sorted  # [K, N] in original input order
    return dict(qweight=pack_fields(q, bits, dim=0), scales=scales, zeros=zeros, perm=perm, bits=bits,
                group_size=group), weight


def _reference(x, layer, bias=None):
    return int_linear_reference(x, layer["qweight"], layer["scales"], layer["zeros"], layer["perm"], bias,
                                layer["bits"], layer["group_size"])


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [32, 48, -1])
@pytest.mark.parametrize("act_order", [False, True])
def test_reference_equals_explicit_dequantized_matmul(bits, group_size, act_order):
    layer, weight = random_layer(80, 24, bits, group_size, act_order=act_order)
    x = random_rows(3, 80)
    bias = torch.randn(24)
    assert relative_l2(_reference(x, layer, bias), x @ weight + bias) < 1e-6


@pytest.mark.parametrize("k,n,group_size", [(256, 64, 32), (576, 96, 128), (160, 48, 64), (128, 32, -1)])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_int4_pack_kernel_matches_reference(k, n, group_size, act_order, dtype):
    layer, _ = random_layer(k, n, 4, group_size, act_order=act_order, seed=k)
    cpu_group = int4_cpu_group(k, n, layer["group_size"])
    codes = unpack_rows(layer["qweight"], 4, k)  # [K, N]
    packed, scale_offsets = pack_int4_for_cpu(codes, layer["scales"], layer["zeros"], layer["group_size"], cpu_group, dtype)
    for m in (1, 7, MIN_ROWS_DEQUANTIZED + 1):  # the last dequantizes to bf16 where qrt's CPU kernels build
        x = random_rows(m, k, dtype)
        out = torch.ops.qrt.int4pack_linear(x, packed, scale_offsets, layer["perm"], None, cpu_group)
        expected = _reference(x.float(), layer)
        # fp32: summation order only. bf16: scales and offsets rounded to bf16 (2**-9 relative each)
        # and a bf16 output.
        assert relative_l2(out, expected) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_int4_cpu_group_splits_coarse_groups_and_refuses_what_aten_cannot_run():
    assert int4_cpu_group(576, 64, 128) == 64  # 576 = 4.5 groups of 128: split into groups of 64
    assert int4_cpu_group(2048, 64, 2048) == 256  # one group per channel
    assert int4_cpu_group(96, 64, 48) is None  # 48 has no divisor among 32..256
    assert int4_cpu_group(128, 40, 32) is None  # N must be a multiple of 16


@pytest.mark.parametrize("n", [48, 128])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_int8_pack_kernel_matches_reference(n, asym, dtype):
    """N = 128 in bf16 runs qrt's kernel on codes packed in pairs where its library builds; the rest ATen's layout."""
    k = 192
    layer, _ = random_layer(k, n, 8, -1, asym=asym, seed=3)
    weight, scales, zero_terms = pack_int8_for_cpu(unpack_rows(layer["qweight"], 8, k), layer["scales"], layer["zeros"],
                                                     dtype)
    assert (zero_terms is None) == (not asym)
    pairs = n % 64 == 0 and dtype == torch.bfloat16 and native_cpu.available()
    assert pair_layout.is_pair_packed(weight) == pairs
    bias = torch.randn(n).to(dtype)
    for m in (1, 5, MIN_ROWS_DEQUANTIZED):
        x = random_rows(m, k, dtype)
        out = torch.ops.qrt.int8pack_linear(x, weight, scales, zero_terms, bias)
        expected = _reference(x.float(), layer, bias.float())
        assert relative_l2(out, expected) < (1e-5 if dtype == torch.float32 else 1e-2)


@settings(max_examples=25, deadline=None)
@given(m=st.sampled_from([1, 3, 16, 33]), k=st.integers(2, 40).map(lambda v: 8 * v),
       n=st.integers(1, 80), bits=st.sampled_from([2, 4, 8]), group_size=st.sampled_from([32, 64, 128, -1]),
       act_order=st.booleans(), with_bias=st.booleans())
def test_triton_int_gemm_matches_reference(m, k, n, bits, group_size, act_order, with_bias):
    layer, _ = random_layer(k, n, bits, group_size, act_order=act_order, seed=m * k + n)
    x = random_rows(m, k)
    bias = torch.randn(n) if with_bias else None
    out = on_device(torch.ops.qrt.int_linear_triton)(x, layer["qweight"], layer["scales"], layer["zeros"], layer["perm"], bias,
                                          layer["bits"], layer["group_size"])
    assert out.shape == (m, n)
    assert relative_l2(out, _reference(x, layer, bias)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_int_gemm_half_precision_activations(dtype):
    layer, _ = random_layer(320, 72, 4, 128, act_order=True, seed=9)  # 320 = 2.5 groups of 128
    x = random_rows(5, 320, dtype).reshape(1, 5, 320)  # leading batch dim is flattened and restored
    out = on_device(torch.ops.qrt.int_linear_triton)(x, layer["qweight"], layer["scales"].to(dtype), layer["zeros"].to(dtype),
                                          layer["perm"], None, 4, 128)
    assert out.shape == (1, 5, 72) and out.dtype == dtype
    expected = _reference(x.float(), {**layer, "scales": layer["scales"].to(dtype)})
    assert relative_l2(out, expected) < 1e-2


@pytest.mark.parametrize("k,layout", [(48, "int8pack"), (40, "dense")])
def test_int8_cpu_kernel_is_only_chosen_where_aten_computes_it_right(k, layout):
    # ATen's bf16 int8 matmul returns garbage when K is not a multiple of 16 (K = 24, 40, 72 seen).
    canonical, _ = random_layer(k, 32, 8, -1, asym=False, seed=k)
    weights = IntWeights(unpack_rows(canonical["qweight"], 8, k), canonical["scales"], canonical["zeros"], 8, k)
    layer = nn.Module()
    layer.params_dtype, layer.bias = torch.bfloat16, None
    chosen = install_int_weights(layer, weights, torch.device("cpu"), "test")
    assert chosen.name == layout
    x = random_rows(3, k, torch.bfloat16)
    expected = x.float() @ weights.dequantize().t()
    assert relative_l2(chosen.linear(layer, x, 8, k), expected) < 1e-2


def test_triton_int_gemm_reads_scales_and_zeros_by_their_own_strides():
    """GPTQ's zero points come out of unpacking transposed ([groups, N] with strides (1, groups));
    the kernel once read them with the scales' strides."""
    layer, _ = random_layer(128, 96, 4, 32, seed=11)
    zeros = layer["zeros"].t().contiguous().t()  # the same values, column-major
    assert zeros.stride() != layer["scales"].stride()
    x = random_rows(3, 128)
    out = on_device(torch.ops.qrt.int_linear_triton)(x, layer["qweight"], layer["scales"], zeros, None, None, 4, 32)
    assert relative_l2(out, _reference(x, layer)) < 1e-5


@pytest.mark.parametrize("rows", [8, 10, 192])
@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_rows_to_bytes_is_the_int32_unpack(bits, rows):
    """The loader unpacks online codes to bytes (8-bit through a view of the words' bytes): the same
    values as the int32 unpack, ragged last word included."""
    from qrt.kernels.int_reference import pack_rows

    q = torch.randint(0, 2**bits, (rows, 37), generator=torch.Generator().manual_seed(rows), dtype=torch.int32)
    words = pack_rows(q, bits)
    as_bytes = unpack_rows(words, bits, rows, torch.uint8)
    assert as_bytes.dtype == torch.uint8 and torch.equal(as_bytes.to(torch.int32), unpack_rows(words, bits, rows))
    assert torch.equal(unpack_rows(words, bits, rows), q)


def test_the_dense_fallback_holds_its_weight_row_major():
    """Weights no quantized kernel takes are dequantized for ATen's linear as [N, K] row-major: the
    integer form dequantizes to a transposed view, which ATen's bf16 GEMM on a CPU without AVX-512
    multiplied 25x slower (the default model's output layer)."""
    from qrt.kernels.int_reference import IntWeights
    from qrt.kernels.onednn_cpu import DENSE

    k, n, group = 64, 96, 32
    gen = torch.Generator().manual_seed(0)
    weights = IntWeights(torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32),
                         torch.rand(k // group, n, generator=gen) + 0.5, torch.full((k // group, n), 8.0), 4, group)
    assert not weights.dequantize().is_contiguous()  # the case this guards: a [K, N] buffer seen as [N, K]
    packed = DENSE.pack(weights, torch.bfloat16).tensors["weight"]
    assert packed.shape == (n, k) and packed.stride() == (k, 1)
    assert torch.equal(packed, weights.dequantize().to(torch.bfloat16))
