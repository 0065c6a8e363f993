"""Decode attention: the reference op `qrt::decode_attention` against attention written out in
float64, and qrt's AVX-512 kernel `qrt_cpu::decode_attention` against the reference, on random
caches (bf16, fp16, fp32 and e4m3), extents across its chunks of 128 entries, sliding windows,
Gemma's soft-cap, every query-group size of the supported models; and the property it exists
for: a row's result is bit-identical whatever rows share its batch."""

import pytest
import torch

import qrt.kernels.decode_attention_triton  # noqa: F401  (registers qrt::decode_attention_triton)
from helpers.compare import relative_l2
from helpers.kernel_checks import BF16_RTOL, DEVICE, on_device
from qrt.kernels import native_cpu
from qrt.kernels.decode_attention_reference import cache_values

needs_kernel = pytest.mark.skipif(native_cpu.why_not_wanted() is not None, reason=f"{native_cpu.why_not_wanted()}")


@pytest.fixture(autouse=True, scope="module")
def _built_kernels():
    """Where the kernels are wanted they must build (a failure is a failure here, not a skip)."""
    if native_cpu.why_not_wanted() is None:
        assert native_cpu.why_unavailable() is None

# (query heads, KV heads, head_dim): the default model (9/3/64), Llama-3-8B-like (32/8/128),
# MHA (4/4/64), one KV head for 8 (8/1/128) and Gemma 2's 256-wide heads (8/4/256).
HEADS = [(9, 3, 64), (32, 8, 128), (4, 4, 64), (8, 1, 128), (8, 4, 256)]
# Each row: (first, last) entries attended; within one chunk of 128 entries, at its edges, over
# several, and lengths that leave the last block of 16 entries part-full.
EXTENTS = [(0, 0), (0, 126), (0, 127), (0, 128), (10, 700), (300, 301), (0, 1023), (5, 20)]
SEQ = 1024


def _cache(rows, kv_heads, hd, dtype, seed):
    """Random K and V caches [rows, KVH, S, hd] and their scales (None unless e4m3)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, kv_heads, SEQ, hd)
    if dtype == torch.float8_e4m3fn:
        k = (torch.randn(shape, generator=gen) * 40).to(dtype)
        v = (torch.randn(shape, generator=gen) * 40).to(dtype)
        return k, v, torch.tensor([0.031]), torch.tensor([0.047])
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype), None, None


def _inputs(heads, dtype, cache_dtype, extents, seed=0):
    h, kvh, hd = heads
    rows = len(extents)
    k, v, k_scale, v_scale = _cache(rows + 1, kvh, hd, cache_dtype, seed)
    q = torch.randn(rows, h, hd, generator=torch.Generator().manual_seed(seed + 1)).to(dtype) * 2  # [B, H, hd]
    slots = torch.randperm(rows + 1, generator=torch.Generator().manual_seed(seed + 2))[:rows]  # [B]
    first = torch.tensor([lo for lo, _ in extents])
    last = torch.tensor([hi for _, hi in extents])
    return q, k, v, slots, first, last, k_scale, v_scale


def _float64_attention(q, k, v, slots, first, last, scale, softcap, k_scale, v_scale):
    """Attention written out over each row's extent, in float64: [B, H, hd]."""
    rows, heads, hd = q.shape
    group = heads // k.shape[1]
    out = torch.empty(rows, heads, hd, dtype=torch.float64)
    for b in range(rows):
        slot, lo, hi = int(slots[b]), int(first[b]), int(last[b])
        keys = cache_values(k[slot, :, lo:hi + 1], k_scale, q.dtype).double()  # [KVH, L, hd]
        values = cache_values(v[slot, :, lo:hi + 1], v_scale, q.dtype).double()
        for head in range(heads):
            scores = keys[head // group] @ q[b, head].double() * scale  # [L]
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            out[b, head] = torch.softmax(scores, 0) @ values[head // group]
    return out


# The reference sums in fp32: float64 differs by fp32 rounding; then its output is rounded to the dtype.
ROUNDING = {torch.float32: 1e-6, torch.bfloat16: 4e-3, torch.float16: 5e-4}


@pytest.mark.parametrize("softcap", [0.0, 50.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS[:2], ids=str)
def test_reference_is_attention_over_each_rows_own_extent(heads, dtype, softcap):
    args = _inputs(heads, dtype, dtype, EXTENTS)
    q, k, v, slots, first, last, k_scale, v_scale = args
    scale = heads[2] ** -0.5
    got = torch.ops.qrt.decode_attention(q, k, v, slots, first, last, scale, softcap, k_scale, v_scale)
    expected = _float64_attention(q, k, v, slots, first, last, scale, softcap, k_scale, v_scale)
    assert got.dtype == dtype and got.shape == q.shape
    assert relative_l2(got, expected) < ROUNDING[dtype]


def test_reference_reads_an_fp8_cache_as_the_model_dequantizes_it():
    q, k, v, slots, first, last, k_scale, v_scale = _inputs(HEADS[0], torch.bfloat16, torch.float8_e4m3fn, EXTENTS)
    got = torch.ops.qrt.decode_attention(q, k, v, slots, first, last, 0.125, 0.0, k_scale, v_scale)
    expected = _float64_attention(q, k, v, slots, first, last, 0.125, 0.0, k_scale, v_scale)
    assert relative_l2(got, expected) < ROUNDING[torch.bfloat16]


# The kernel sums in another order (chunks of 128 merged, a polynomial exp) before the same
# rounding: in fp32 a few ulp; in bf16/fp16 an output may round to the neighbouring value.
KERNEL_RTOL = {torch.float32: 2e-6, torch.bfloat16: 2e-3, torch.float16: 3e-4}


def _check_against_reference(run, heads, dtype, cache, rtol):
    cache_dtype = torch.float8_e4m3fn if cache == "e4m3" else dtype
    args = _inputs(heads, dtype, cache_dtype, EXTENTS, seed=sum(heads))
    scale = heads[2] ** -0.5
    expected = torch.ops.qrt.decode_attention(*args[:6], scale, 0.0, *args[6:])
    got = run(*args[:6], scale, 0.0, *args[6:])
    assert got.dtype == dtype and got.shape == expected.shape
    assert relative_l2(got, expected) < rtol
    # every row and head on its own, so that one short row cannot hide under the long ones
    per_row = (got.double() - expected.double()).norm(dim=-1) / expected.double().norm(dim=-1)
    assert per_row.max().item() < 4 * rtol


def _check_soft_cap(run, dtype, rtol):
    args = _inputs(HEADS[4], dtype, dtype, EXTENTS, seed=7)
    q = args[0] * 8  # scores well past the cap, where tanh saturates
    expected = torch.ops.qrt.decode_attention(q, *args[1:6], 0.0625, 50.0, *args[6:])
    assert relative_l2(run(q, *args[1:6], 0.0625, 50.0, *args[6:]), expected) < rtol


@needs_kernel
@pytest.mark.parametrize("cache", ["model dtype", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_kernel_matches_the_reference(heads, dtype, cache):
    _check_against_reference(torch.ops.qrt_cpu.decode_attention, heads, dtype, cache, KERNEL_RTOL[dtype])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_soft_cap_matches_the_reference(dtype):
    _check_soft_cap(torch.ops.qrt_cpu.decode_attention, dtype, 4 * KERNEL_RTOL[dtype])


@pytest.mark.parametrize("op", ["qrt.decode_attention", pytest.param("qrt_cpu.decode_attention", marks=needs_kernel),
                                "qrt.decode_attention_triton"])
def test_a_rows_result_does_not_depend_on_its_batch(op):
    """The same query over the same cache row, alone and among rows of other lengths, other
    slots and more threads' worth of work: bit-identical."""
    namespace, name = op.split(".")
    run = getattr(getattr(torch.ops, namespace), name)
    run = on_device(run) if name.endswith("_triton") else run
    q, k, v, slots, first, last, _, _ = _inputs(HEADS[0], torch.bfloat16, torch.bfloat16, EXTENTS, seed=3)
    together = run(q, k, v, slots, first, last, 0.125, 0.0, None, None)
    for row in range(len(EXTENTS)):
        pick = slice(row, row + 1)
        alone = run(q[pick], k, v, slots[pick], first[pick], last[pick], 0.125, 0.0, None, None)
        assert torch.equal(alone[0], together[row]), f"row {row} changed with its batch"


@needs_kernel
def test_kernel_refuses_an_extent_outside_the_cache():
    q, k, v, slots, first, last, _, _ = _inputs(HEADS[0], torch.float32, torch.float32, [(0, 10)])
    with pytest.raises(RuntimeError, match="attends entries 0..1024"):
        torch.ops.qrt_cpu.decode_attention(q, k, v, slots, first, last + 1014, 0.125, 0.0, None, None)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16"):
        torch.ops.qrt_cpu.decode_attention(q[..., :24], k[..., :24].contiguous(), v[..., :24].contiguous(),
                                           slots, first, last, 0.125, 0.0, None, None)


# Triton's kernel (qrt/kernels/decode_attention_triton.py), on the device where there is one and
# under the interpreter otherwise: the heads of the default model, MQA and Gemma 2.
TRITON_HEADS = [HEADS[0], HEADS[3], HEADS[4]]


def _triton_rtol(dtype) -> float:
    """KERNEL_RTOL, except in bf16 under the interpreter, which truncates fp32 to bf16 where the
    GPU rounds (up to a whole step off, on the output and on e4m3 entries read back)."""
    return 2 * BF16_RTOL if DEVICE == "cpu" and dtype == torch.bfloat16 else KERNEL_RTOL[dtype]


@pytest.mark.parametrize("cache", ["model dtype", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", TRITON_HEADS, ids=str)
def test_triton_kernel_matches_the_reference(heads, dtype, cache):
    _check_against_reference(on_device(torch.ops.qrt.decode_attention_triton), heads, dtype, cache, _triton_rtol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_soft_cap_matches_the_reference(dtype):
    _check_soft_cap(on_device(torch.ops.qrt.decode_attention_triton), dtype, 4 * _triton_rtol(dtype))
