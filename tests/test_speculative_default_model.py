"""Speculative decoding on the default model as users run it (bf16, and its int4 copy): the
verify call's logits are the decode step's bit for bit, so greedy output cannot change, even at
near-ties that bf16 rounding would flip; and a request's tokens are the same with speculation
as without, alone and among others."""

import pytest
import torch

from bench.speculative import WORKLOADS
from helpers.speculation import run_requests, verify_beside_decode
from qrt import runtime
from qrt.runtime.engine import Engine
from qrt.runtime.default_model import default_model_path
from qrt.runtime.evaluate import DEFAULT_TEXT
from qrt.runtime.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.runs_first]  # minutes of bf16 default-model work

K, SLOTS, MAX_SEQ_LEN = 3, 3, 1024


@pytest.fixture(scope="module", params=[None, "int4"], ids=["bf16", "int4"])
def model(request):
    return runtime.compile_model(default_model_path(progress=False), quant=request.param, progress=False, max_batch_size=SLOTS,
                                 max_seq_len=MAX_SEQ_LEN, speculative={"method": "ngram", "num_speculative_tokens": K})


def test_verify_logits_are_the_decode_logits_bit_for_bit(model):
    words = DEFAULT_TEXT.read_text().split()
    prompt = model.encode(" ".join(words[:700]))[:500]
    slot = 2
    verified, decoded, tokens, positions = verify_beside_decode(model, prompt, slot, K)
    for place in range(K + 1):
        assert torch.equal(verified[place], decoded[place]), f"place {place}"
    # The graphs of one slot alone give the same bits, so the engine may use them.
    assert model.one_slot_exact
    assert torch.equal(model.verify_slot(slot, tokens, positions, len(prompt) + K + 1), verified)
    assert torch.equal(model.decode_slot(slot, int(tokens[0]), len(prompt)), decoded[0])


def test_greedy_answers_are_unchanged_alone_and_in_company(model):
    requests = [model.request(model.encode_messages([{"role": "user", "content": WORKLOADS[name]}]), 96,
                              SamplingParams(), stop_at_eos=False) for name in ("passage", "code", "free")]
    alone = [run_requests(Engine(model, speculate=False), [r])[0] for r in requests]
    speculating = Engine(model)
    assert [run_requests(speculating, [r])[0] for r in requests] == alone
    assert run_requests(speculating, requests, [0, 4, 9]) == alone
    assert speculating.speculator.accepted > 0
