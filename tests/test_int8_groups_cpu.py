"""qrt's CPU kernel for byte-wide codes with a scale and an offset per group along K
(kernels/int8_groups_cpu.py, csrc/int8_groups_cpu.cpp): its layout, both of its routes against the
reference on random weights (full 8-bit codes, 6-bit codes around 32 as GGUF's Q6_K, 5-bit codes
with fractional zero points as Q5_K), rows that do not depend on their batch, which weights choose
it, and a GPTQ 8-bit grouped checkpoint compiled onto it."""

import pytest
import torch
from torch import nn

from helpers.checkpoints.integer import make_int_checkpoint
from helpers.compare import relative_l2
from helpers.graph_checks import decode_without_recompiles
from helpers.kernel_checks import SUM_RTOL, assert_within
from qrt import runtime
from qrt.formats.int_weights import install_int_weights
from qrt.kernels import int8_groups_cpu, native_cpu
from qrt.kernels.choices import choose
from qrt.kernels.int_reference import IntWeights, int_linear_reference, pack_rows

# Skipped only where the kernels are not wanted; where they are, a failed build fails the tests.
pytestmark = pytest.mark.skipif(native_cpu.why_not_wanted() is not None, reason=f"{native_cpu.why_not_wanted()}")

THRESHOLD = int8_groups_cpu.MIN_ROWS_DEQUANTIZED


@pytest.fixture(scope="module", autouse=True)
def _library():
    assert native_cpu.available(), native_cpu.why_unavailable()  # loads torch.ops.qrt_cpu


def _weights(kind: str, k: int, n: int, group: int, gen: torch.Generator) -> IntWeights:
    """Random codes [K, N] and per-group scales and zero points [K / g, N] of one of three kinds:
    "full" 8-bit codes with integer zero points anywhere in 0..255, "q6k" codes in 0..63 around 32,
    "q5k" codes in 0..31 with fractional zero points (GGUF's min, divided by the scale)."""
    groups = k // group
    bits = {"full": 8, "q6k": 6, "q5k": 5}[kind]
    q = torch.randint(0, 2**bits, (k, n), generator=gen, dtype=torch.int32)  # [K, N]
    scales = torch.rand(groups, n, generator=gen) * 0.02 + 0.001  # [K / g, N]
    if kind == "full":
        zeros = torch.randint(0, 256, (groups, n), generator=gen).float()
    elif kind == "q6k":
        zeros = torch.full((groups, n), 32.0)
    else:
        zeros = torch.rand(groups, n, generator=gen) * 31
    return IntWeights(q, scales, zeros, 8, group)


def _packed(w: IntWeights):
    centres = int8_groups_cpu.code_centres(w.q, w.zeros)  # [N]
    return (int8_groups_cpu.pack_codes(w.q, centres),
            int8_groups_cpu.pack_scale_offsets(w.scales, w.zeros, centres, torch.bfloat16)), centres


def _rounded_weight(w: IntWeights, centres: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight the kernel stands for, (q - c_n) * scale + offset with scale and offset rounded to
    bf16 as stored, float64 [N, K]; and |q - c_n| * |scale| + |offset|, the size of its terms."""
    group = torch.arange(w.q.shape[0]) // w.group_size  # [K]
    s = w.scales.to(torch.bfloat16).double()[group]  # [K, N]
    o = ((centres.float() - w.zeros.float()) * w.scales.float()).to(torch.bfloat16).double()[group]
    codes = w.q.double() - centres.double()
    return (codes * s + o).t(), (codes.abs() * s.abs() + o.abs()).t()


def test_layout_holds_each_code_and_pair_where_the_kernel_reads_it():
    """Element (b, j, d, t) of the codes is q[2 j + t, 64 b + d] - c; (b, h, d) of the pairs is the
    (scale, offset) of output 64 b + d in group h; `dequantize` reads both back."""
    gen = torch.Generator().manual_seed(1)
    w = _weights("full", 64, 128, 16, gen)
    (packed, pairs), centres = _packed(w)
    assert packed.shape == (2, 32, 64, 2) and packed.dtype == torch.int8
    assert pairs.shape == (2, 4, 64, 2) and pairs.dtype == torch.bfloat16
    b, j, d, t = torch.meshgrid(torch.arange(2), torch.arange(32), torch.arange(64), torch.arange(2), indexing="ij")
    assert torch.equal(packed[b, j, d, t].int(), w.q[2 * j + t, 64 * b + d] - centres[64 * b + d])
    assert torch.equal(pairs[1, 3, 5, 0], w.scales[3, 69].to(torch.bfloat16))
    assert torch.equal(pairs[1, 3, 5, 1], ((centres[69] - w.zeros[3, 69]) * w.scales[3, 69]).to(torch.bfloat16))
    weight, size = _rounded_weight(w, centres)
    assert_within(int8_groups_cpu.dequantize(packed, pairs.float()), weight, 2.0**-22 * size)


def test_rows_read_back_the_dequantized_weights_rows():
    """An embedding that shares the layer's weight looks rows up through the layout: the same values
    as the dequantized weight's rows, for ids from every block and lane, in any shape."""
    gen = torch.Generator().manual_seed(3)
    w = _weights("q5k", 96, 192, 32, gen)
    (packed, pairs), _ = _packed(w)
    layer = nn.Module()
    layer.weight, layer.scale_offsets, layer.perm = nn.Parameter(packed, requires_grad=False), pairs, None
    ids = torch.randint(0, 192, (3, 7), generator=gen)
    rows = int8_groups_cpu.Int8GroupsLayout().rows(layer, ids)
    assert rows.shape == (3, 7, 96) and rows.dtype == torch.bfloat16
    assert torch.equal(rows, int8_groups_cpu.dequantize(packed, pairs)[ids])


@pytest.mark.parametrize("low,high,zeros,centre", [
    (0, 255, [128.0], 128),  # symmetric GPTQ: offsets 0
    (0, 63, [32.0], 32),  # Q6_K: offsets 0
    (0, 31, [3.2, 7.6, 9.0], 8),  # Q5_K: the median zero point, rounded
    (0, 255, [3.0], 128),  # asymmetric full-range codes: q - c must stay within int8
    (200, 255, [250.0], 250)])
def test_the_centre_keeps_codes_in_int8_and_offsets_small(low, high, zeros, centre):
    q = torch.tensor([[low], [high]], dtype=torch.int32)
    assert int8_groups_cpu.code_centres(q, torch.tensor(zeros)[:, None]).tolist() == [centre]


def test_each_output_has_its_own_centre_so_narrow_codes_beside_wide_ones_keep_small_offsets():
    """A fused layer of GGUF's Q5_K_M: q and k in Q5_1 (codes 0..31, fractional zero points -min / d
    within them) beside v in Q8_0 (codes 0..255, zero 128). Each output is centred on its own zero
    points, so the narrow shard's offsets stay within 32 of its scales and it comes back near bf16's
    rounding of its scales. One centre of 128 for the whole layer leaves it offsets of ~112 scales,
    whose rounding to bf16 costs several times more."""
    gen = torch.Generator().manual_seed(8)
    k, narrow, wide, group = 128, 128, 64, 32
    q = torch.cat([torch.randint(0, 32, (k, narrow), generator=gen),
                   torch.randint(0, 256, (k, wide), generator=gen)], dim=1).int()  # [K, N]
    zeros = torch.cat([torch.rand(k // group, narrow, generator=gen) * 31,
                       torch.full((k // group, wide), 128.0)], dim=1)  # [K / g, N]
    scales = torch.rand(k // group, narrow + wide, generator=gen) * 0.02 + 0.001  # [K / g, N]
    w = IntWeights(q, scales, zeros, 8, group)
    (packed, pairs), centres = _packed(w)
    assert centres[:narrow].min() >= 0 and centres[:narrow].max() <= 31 and centres[narrow:].tolist() == [128] * wide
    offsets_in_scales = (pairs[..., 1].float() / pairs[..., 0].float()).abs()  # [N / 64, K / g, 64]
    assert offsets_in_scales[:narrow // 64].max() <= 32 and offsets_in_scales[narrow // 64:].max() == 0

    per_k = lambda t: t.double().repeat_interleave(group, 0)  # [K / g, N] -> [K, N]
    exact = ((q.double() - per_k(zeros)) * per_k(scales)).t()  # [N, K]
    got = int8_groups_cpu.dequantize(packed, pairs.float()).double()  # scales and offsets as stored in bf16
    narrow_error = relative_l2(got[:narrow], exact[:narrow])
    assert narrow_error < 2.0**-6, narrow_error

    one_centre = torch.full_like(centres, 128)
    pairs_of_one_centre = int8_groups_cpu.pack_scale_offsets(scales, zeros, one_centre, torch.bfloat16)
    got_of_one_centre = int8_groups_cpu.dequantize(int8_groups_cpu.pack_codes(q, one_centre), pairs_of_one_centre.float())
    assert relative_l2(got_of_one_centre[:narrow], exact[:narrow]) > 4 * narrow_error


@pytest.mark.parametrize("m,bias", [(1, False), (3, True), (4, False), (5, True), (64, False), (70, True)])
@pytest.mark.parametrize("group", [16, 32, 128])
@pytest.mark.parametrize("kind", ["full", "q6k", "q5k"])
def test_matches_the_reference(kind, group, m, bias):
    """Against the weight with the stored (bf16) scales and offsets, tightly: below the threshold
    only the summation order and the bf16 output (2**-8 of it) differ; from it W is also rounded to
    bf16 (2**-8 of each term). Against the fp32 reference op, loosely: the scales and offsets
    rounded to bf16 too, and its own output rounded."""
    k, n = 384, 192
    gen = torch.Generator().manual_seed(m * 1000 + group + len(kind))
    w = _weights(kind, k, n, group, gen)
    (packed, pairs), centres = _packed(w)
    x = (torch.randn(m, k, generator=gen) + 0.3).to(torch.bfloat16)  # off-centre rows: sum(x) matters
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    got = torch.ops.qrt.int8_groups_linear(x, packed, pairs, None, b)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16

    weight, size = _rounded_weight(w, centres)
    b64 = b.double() if bias else torch.zeros(n, dtype=torch.float64)
    expected = x.double() @ weight.t() + b64
    terms = x.double().abs() @ size.t() + b64.abs()
    rounded_w = 2.0**-8 * terms if m >= THRESHOLD else SUM_RTOL * terms
    assert_within(got, expected, 2.0**-8 * expected.abs() + rounded_w)

    reference = int_linear_reference(x.float(), pack_rows(w.q, 8), w.scales, w.zeros, None,
                                     b.float() if bias else None, 8, group)
    assert_within(got, reference, 2.0**-7 * (reference.abs().double() + terms))


def test_rows_do_not_depend_on_their_batch():
    """Below the threshold a row's result is the same bit for bit alone or in a batch: up to 4 rows
    the codes widen in registers, from 5 once per block, and both are exact."""
    gen = torch.Generator().manual_seed(6)
    w = _weights("full", 512, 192, 32, gen)
    (packed, pairs), _ = _packed(w)
    x = torch.randn(THRESHOLD - 1, 512, generator=gen).to(torch.bfloat16)
    bias = torch.randn(192, generator=gen).to(torch.bfloat16)
    together = torch.ops.qrt.int8_groups_linear(x, packed, pairs, None, bias)
    for rows in (slice(0, 1), slice(3, 7), slice(9, 12), slice(13, 18), slice(THRESHOLD - 3, THRESHOLD - 1)):
        alone = torch.ops.qrt.int8_groups_linear(x[rows], packed, pairs, None, bias)
        assert torch.equal(alone, together[rows]), rows


def test_names_what_it_expected():
    (packed, pairs), _ = _packed(_weights("full", 128, 64, 32, torch.Generator().manual_seed(0)))
    x = torch.ones(2, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"bf16 x \[M, 128\] expected"):
        torch.ops.qrt_cpu.int8_groups_linear(x[:, :64], packed, pairs, None, THRESHOLD)
    with pytest.raises(RuntimeError, match=r"int8 codes \[N / 64, K / 2, 64, 2\] expected"):
        torch.ops.qrt_cpu.int8_groups_linear(x, packed.view(torch.uint8), pairs, None, THRESHOLD)
    with pytest.raises(RuntimeError, match=r"scale_offsets \[1, groups of an even size dividing K = 128, 64, 2\]"):
        torch.ops.qrt_cpu.int8_groups_linear(x, packed, pairs[:, :3].contiguous(), None, THRESHOLD)


def _facts(**changes):
    return dict(dict(bits=8, group_size=128, k=896, n=4864, contiguous_groups=True), **changes)


@pytest.mark.parametrize("facts,kernel", [
    (_facts(), "qrt.int8_groups_linear"),  # GPTQ 8-bit g128
    (_facts(group_size=16, k=160, n=64), "qrt.int8_groups_linear"),  # Q6_K-like groups of 16
    (_facts(group_size=896), "qrt.int8pack_linear"),  # one group per channel: the int8 per-channel kernel
    (_facts(group_size=168, k=168, n=64), "qrt.int8_groups_linear"),  # ... where it cannot (K % 16)
    (_facts(n=100), "aten.linear"),  # N not whole blocks of 64
    (_facts(group_size=8), "aten.linear"),  # scales and offsets would cost half a byte a weight
    (_facts(group_size=48, k=160), "aten.linear"),  # groups that do not divide K
    (_facts(contiguous_groups=False), "aten.linear"),
    (_facts(bits=4), "qrt.int4pack_linear")])
def test_which_weights_choose_it(facts, kernel):
    assert choose("qrt.int_linear", "cpu", **facts).op == kernel


def test_it_steps_aside_without_the_library(monkeypatch):
    monkeypatch.setenv("QRT_NATIVE_CPU", "0")
    assert choose("qrt.int_linear", "cpu", **_facts()).op == "aten.linear"


def _act_order_weights(k, n, group, gen) -> IntWeights:
    """Random Q6_K-like weights whose groups pick input channels anywhere (an act-order g_idx)."""
    w = _weights("q6k", k, n, group, gen)
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)].to(torch.int32)  # [K]
    return IntWeights(w.q, w.scales, w.zeros, 8, group, g_idx)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_loader_pass_packs_it_with_an_act_order_permutation(dtype):
    """bf16 models run the kernel; fp32 ones keep the layout and dequantize it in fp32 (scales and
    offsets in fp32 too), matching the reference to its summation order."""
    gen = torch.Generator().manual_seed(4)
    w = _act_order_weights(256, 128, 32, gen)
    layer = nn.Module()
    layer.params_dtype, layer.bias = dtype, None
    chosen = install_int_weights(layer, w, torch.device("cpu"), "test")
    assert chosen.name == "int8groups" and layer.perm is not None
    storage = layer.weight.storage_layout
    assert storage.startswith("int8 centred codes in pairs") and storage.endswith("g32")
    assert layer.scale_offsets.dtype == dtype
    x = torch.randn(2, 3, 256, generator=gen).to(dtype)
    expected = x.double() @ w.dequantize().double().t()
    assert relative_l2(chosen.linear(layer, x, 8, 32), expected) < (1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.fixture(scope="module")
def gptq_8bit_g32(tmp_path_factory):
    """A tiny GPTQ 8-bit g32 asymmetric checkpoint and the transformers model of its dequantized weights."""
    folder = tmp_path_factory.mktemp("gptq-8bit-g32")
    config = {"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": False, "sym": False,
              "checkpoint_format": "gptq"}
    return folder, make_int_checkpoint(folder, "gptq", config, bits=8, group_size=32, sym=False)


def _quantized_layers(model) -> list:
    return [m for m in model.modules() if getattr(getattr(m, "quant_method", None), "layout", None)]


def test_a_gptq_8bit_grouped_checkpoint_matches_its_dequantized_model(gptq_8bit_g32):
    """In its fp32 form (the checkpoint's dtype), every linear of the tiny model (K = 64 and 160,
    N = 64 to 320) takes the layout, whose fp32 scales and offsets lose nothing that matters."""
    folder, reference = gptq_8bit_g32
    eager = runtime.compile_model(folder, compile=False, progress=False, max_seq_len=128)
    layers = _quantized_layers(eager.model)
    assert layers and {m.quant_method.layout.name for m in layers} == {"int8groups"}
    assert {m.weight.kernel for m in layers} == {"qrt.int8_groups_linear"}
    assert "GPTQ 8-bit g32, asymmetric" in eager.scheme.describe()
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert relative_l2(eager(ids), reference(ids).logits) < 1e-5


@pytest.mark.slow  # about 12 s of compiling; the kernel itself is checked by default above
def test_a_gptq_8bit_grouped_checkpoint_compiles_onto_it(gptq_8bit_g32, compiled):
    """In bf16 the kernel runs: the compiled model matches the eager one and decodes without
    recompiles."""
    folder, _ = gptq_8bit_g32
    model = compiled(folder, None, "bfloat16")
    assert {m.quant_method.layout.name for m in _quantized_layers(model.model.model)} == {"int8groups"}
    eager = runtime.compile_model(folder, compile=False, progress=False, max_seq_len=128, dtype="bfloat16")
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert relative_l2(model(ids), eager(ids)) < 1e-2
    decode_without_recompiles(model, [3, 1, 4, 1, 5], 8)
