"""Latent attention's per-query attention (qrt/runtime/models/mla.py), the one its decode steps and
speculative checks use: on random inputs it is attention within fp32 rounding, a query allowed no
entry gets zeros as SDPA gives, and compiled, a call of four queries gives each of them the bits of a
one-query call: what lets a check of 1 + k places score each as the decode step would."""

import pytest
import torch
import torch.nn.functional as F

from qrt.runtime.models.mla import attention_per_query

B, H, KEYS, QK, VD = 3, 4, 37, 32, 16


def _inputs(dtype, queries, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, queries, QK, generator=g).to(dtype)  # [B, H, T, qk]
    k = torch.randn(B, H, KEYS, QK, generator=g).to(dtype)  # [B, H, S', qk]
    v = torch.randn(B, H, KEYS, VD, generator=g).to(dtype)  # [B, H, S', vd]
    last = torch.tensor([KEYS - queries - 5, KEYS - queries, 11])  # each row's first query's last entry
    places = last[:, None] + torch.arange(queries)  # [B, T]
    mask = torch.arange(KEYS) <= places[..., None]  # [B, T, S'] causal over each row's entries
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_it_is_attention_within_rounding(dtype):
    q, k, v, mask = _inputs(dtype, 4)
    scale = QK ** -0.5
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.unsqueeze(1),
                                              scale=scale)
    got = attention_per_query(q, k, v, mask, scale)
    assert got.dtype == dtype and got.shape == (B, H, 4, VD)
    # fp32 sums of 32 and 37 terms, then one rounding to the dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)


def test_a_query_allowed_no_entry_gets_zeros():
    q, k, v, mask = _inputs(torch.float32, 2)
    mask[1, 0] = False
    got = attention_per_query(q, k, v, mask, 0.25)
    assert torch.equal(got[1, :, 0], torch.zeros(H, VD))
    assert torch.isfinite(got).all() and got[1, :, 1].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_four_queries_give_each_the_bits_of_one(dtype):
    """In float32 every difference in summation order shows (compiled SDPA differs here at every
    place: one GEMM for four queries, a reduction for one)."""
    q, k, v, mask = _inputs(dtype, 4, seed=3)
    attend = torch.compile(attention_per_query, dynamic=False, fullgraph=True)
    together = attend(q, k, v, mask, QK ** -0.5)  # [B, H, 4, vd]
    for place in range(4):
        alone = attend(q[:, :, place:place + 1], k, v, mask[:, place:place + 1], QK ** -0.5)
        assert torch.equal(together[:, :, place:place + 1], alone), place
