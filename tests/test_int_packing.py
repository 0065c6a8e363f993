"""Pack -> unpack is the identity for every integer layout, checked against the independent
packers in helpers/checkpoints/integer.py (property tests over shapes and values)."""

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.checkpoints.integer import AWQ_ORDER, pack_fields, to_int32
from qrt.formats.awq import unpack_awq
from qrt.formats.compressed_tensors.int_weight_only import load_zero_point
from qrt.formats.gptq import gptq_zero_points
from qrt.kernels.int_reference import pack_rows, unpack_rows
from qrt.layers.linear import ShardLayout

SETTINGS = settings(max_examples=40, deadline=None)


def _values(draw, bits, rows, cols):
    seed = draw(st.integers(0, 2**31 - 1))
    return torch.randint(0, 2**bits, (rows, cols), generator=torch.Generator().manual_seed(seed))


@SETTINGS
@given(st.data(), st.sampled_from([2, 4, 8]), st.integers(1, 70), st.integers(1, 9))
def test_canonical_packing_round_trips_and_matches_the_lsb_first_rule(data, bits, rows, cols):
    values = _values(data.draw, bits, rows, cols)
    packed = pack_rows(values, bits)
    assert packed.dtype == torch.int32 and packed.shape == (-(-rows // (32 // bits)), cols)
    assert torch.equal(packed, pack_fields(values, bits, dim=0))
    assert torch.equal(unpack_rows(packed, bits, rows), values.to(torch.int32))


@SETTINGS
@given(st.data(), st.integers(1, 12), st.integers(1, 6))
def test_awq_interleave_is_undone(data, rows, words):
    values = _values(data.draw, 4, rows, 8 * words)  # [R, N] in channel order
    interleaved = values.reshape(rows, -1, 8)[:, :, list(AWQ_ORDER)].reshape(rows, -1)
    packed = pack_fields(interleaved, 4, dim=1)  # what AutoAWQ writes
    assert torch.equal(unpack_awq(packed, 4), values.to(torch.int32))


@SETTINGS
@given(st.data(), st.sampled_from([2, 4, 8]), st.integers(1, 5), st.integers(1, 4))
def test_gptq_v1_zero_points_come_back_exactly_even_when_zero(data, bits, groups, words):
    pf = 32 // bits
    zeros = _values(data.draw, bits, groups, pf * words)
    zeros[0, 0] = 0  # the case a plain per-field "z - 1" cannot store
    true_words = pack_fields(zeros, bits, dim=1)
    assert torch.equal(gptq_zero_points(true_words, bits, pf * words, v2=True), zeros.to(torch.int32))
    # GPTQModel's v1 export subtracts 1 from every field with one word-wide subtraction.
    one_per_field = int(("0" * (bits - 1) + "1") * pf, 2)  # 0x11111111 for 4-bit
    stored = to_int32((true_words.to(torch.int64) & 0xFFFFFFFF) - one_per_field)
    assert torch.equal(gptq_zero_points(stored, bits, pf * words, v2=False), zeros.to(torch.int32))


@SETTINGS
@given(st.data(), st.sampled_from([4, 8]), st.lists(st.integers(1, 20), min_size=1, max_size=3), st.integers(1, 4))
def test_compressed_tensors_zero_points_packed_along_n_load_per_shard(data, bits, shard_sizes, groups):
    layout = ShardLayout.stacked(list(range(len(shard_sizes))), shard_sizes)
    layer = SimpleNamespace(shard_layout=layout)
    target = torch.full((sum(shard_sizes), groups), -1, dtype=torch.int32)
    expected = []
    for shard, size in enumerate(shard_sizes):
        unsigned = _values(data.draw, bits, size, groups)
        expected.append(unsigned)
        load_zero_point(SimpleNamespace(data=target), pack_fields(unsigned, bits, dim=0), shard, layer=layer, bits=bits)
    assert torch.equal(target, torch.cat(expected).to(torch.int32))


def test_compressed_tensors_legacy_int8_zero_points_are_signed():
    layer = SimpleNamespace(shard_layout=None)
    target = torch.empty(3, 2, dtype=torch.int32)
    signed = torch.tensor([[-8, 7], [0, -1], [3, -5]], dtype=torch.int8)
    load_zero_point(SimpleNamespace(data=target), signed, None, layer=layer, bits=4)
    assert torch.equal(target, signed.to(torch.int32) + 8)
