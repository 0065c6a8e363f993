"""QQQ's Marlin-style layout: the loader's unpacking inverts an independent packer exactly
(weights per group and per channel, both scale permutations), for random values and shapes."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.checkpoints.w8a8 import qqq_pack, qqq_permute_scales
from qrt.formats.qqq import (channel_scale_permutation, group_scale_permutation, unpack_qqq_weight,
                             unpermute_columns, weight_permutation)


def test_permutations_are_permutations():
    for per_channel in (False, True):
        assert torch.equal(weight_permutation(per_channel).sort().values, torch.arange(1024))
    assert torch.equal(group_scale_permutation().sort().values, torch.arange(64))
    assert torch.equal(channel_scale_permutation().sort().values, torch.arange(32))


@settings(max_examples=30, deadline=None)
@given(k_tiles=st.integers(1, 6), n_runs=st.integers(1, 3), per_channel=st.booleans(), seed=st.integers(0, 2**16))
def test_weight_round_trip(k_tiles, n_runs, per_channel, seed):
    k, n = 16 * k_tiles, 64 * n_runs
    gen = torch.Generator().manual_seed(seed)
    if per_channel:
        codes = torch.randint(-8, 8, (k, n), generator=gen)  # signed, stored in two's complement
        expected = codes + 8
    else:
        codes = torch.randint(0, 16, (k, n), generator=gen)  # unsigned, code = q - 8
        expected = codes
    b = qqq_pack(codes, per_channel)
    assert b.shape == (k // 16, 2 * n) and b.dtype == torch.int32
    assert torch.equal(unpack_qqq_weight(b, k, n, per_channel), expected.to(torch.int32))


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 4), n_runs=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_scale_round_trip(rows, n_runs, seed):
    s = torch.rand(rows, 64 * n_runs, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(unpermute_columns(qqq_permute_scales(s, grouped=True), group_scale_permutation()), s)
    channel = s[:1]
    assert torch.equal(unpermute_columns(qqq_permute_scales(channel, grouped=False), channel_scale_permutation()),
                       channel)


def test_fused_shards_unpack_like_each_shard():
    """Runs never cross a 64-channel boundary, so B of stacked shards unpacks to stacked shards."""
    gen = torch.Generator().manual_seed(3)
    shards = [torch.randint(0, 16, (32, n), generator=gen) for n in (128, 64, 64)]
    fused = torch.cat([qqq_pack(s, False) for s in shards], dim=1)
    assert torch.equal(unpack_qqq_weight(fused, 32, 256, False), torch.cat(shards, dim=1).to(torch.int32))
