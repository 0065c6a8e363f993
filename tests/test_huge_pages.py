"""A CPU model's weights moved into transparent huge pages after loading (runtime/huge_pages.py):
the same values in a 2 MiB-aligned mapping the kernel backs with huge pages, a tied weight moved
once, tensors that share storage left alone, and QRT_HUGE_PAGES=0 honoured."""

import pytest
import torch
from torch import nn

from qrt.runtime import huge_pages
from qrt.runtime.huge_pages import HUGE_PAGE, place_weights_in_huge_pages

pytestmark = pytest.mark.skipif(not huge_pages.huge_pages_available(),
                                reason="transparent huge pages are off here (or QRT_HUGE_PAGES=0)")


def _anon_huge_kib() -> int:
    text = open("/proc/self/smaps_rollup").read()
    return int(text.split("AnonHugePages:")[1].split()[0])


def test_weights_move_into_huge_pages_with_their_values():
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024, bias=False)).to(torch.bfloat16)
    embedding = nn.Embedding(4096, 1024).to(torch.bfloat16)
    model.append(embedding)
    model[1].weight = nn.Parameter(torch.randn(1024, 2048, generator=gen).to(torch.bfloat16))
    tied = nn.Linear(1024, 4096, bias=False).to(torch.bfloat16)
    tied.weight = embedding.weight  # one parameter, two modules
    model.append(tied)
    view_owner = nn.Linear(512, 512)
    view_owner.weight = nn.Parameter(torch.randn(1024, 512, generator=gen)[:512])  # a view of a larger storage
    model.append(view_owner)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    huge_before = _anon_huge_kib()

    moved = place_weights_in_huge_pages(model)

    sizes = [model[0].weight, model[1].weight, embedding.weight]  # the small bias stays where it was
    assert moved == sum(p.numel() * p.element_size() for p in sizes)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert tied.weight is embedding.weight
    assert model[0].weight.data_ptr() % HUGE_PAGE == 0  # the first tensor starts the mapping's huge page
    assert view_owner.weight.untyped_storage().nbytes() > view_owner.weight.numel() * 4  # not moved
    assert _anon_huge_kib() - huge_before >= 2048  # at least one huge page backs them


def test_qrt_huge_pages_0_leaves_the_weights(monkeypatch):
    monkeypatch.setenv("QRT_HUGE_PAGES", "0")
    model = nn.Linear(1024, 1024)
    pointer = model.weight.data_ptr()
    assert place_weights_in_huge_pages(model) == 0 and model.weight.data_ptr() == pointer
