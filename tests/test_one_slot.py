"""One decoding request among several KV-cache slots runs through the graph of its slot alone
(one row through the matmuls instead of one per slot), where that gives the bits the graph of
every slot gives it: warmup checks, and the engine relies on the check."""

import pytest
import torch

from helpers.checkpoints.tiny import make_checkpoint
from qrt import runtime
from qrt.runtime.engine import Engine
from qrt.runtime.sampling import SamplingParams

SLOTS, MAX_SEQ_LEN = 3, 128


def _model(folder, dtype):
    make_checkpoint(folder, "llama", dtype=dtype, max_position_embeddings=MAX_SEQ_LEN)
    return runtime.compile_model(folder, progress=False, max_seq_len=MAX_SEQ_LEN, max_batch_size=SLOTS)


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    """bf16: qrt's CPU kernels, whose rows do not depend on the row count."""
    return _model(tmp_path_factory.mktemp("bf16"), torch.bfloat16)


def _counting(model, name):
    calls = []
    original = getattr(model, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    setattr(model, name, counted)
    return calls


def test_the_slot_graph_gives_the_row_of_every_slot(bf16_model):
    model = bf16_model
    assert model.one_slot_exact and model.compile_report()["decode_slot"] == 1
    prompt = list(range(5, 40))
    model.prefill_chunk(prompt, 0, 2)
    tokens, positions = model.idle_decode_rows()
    tokens[2], positions[2] = 17, len(prompt)
    every = model.decode_step(tokens, positions, len(prompt) + 1)[2]
    assert torch.equal(model.decode_slot(2, 17, len(prompt)), every)


def test_a_request_alone_decodes_through_its_slot_and_keeps_its_tokens_in_company(bf16_model):
    model = bf16_model
    requests = [model.request(list(range(seed, seed + length)), 20, SamplingParams(), stop_at_eos=False)
                for seed, length in ((3, 30), (50, 7), (90, 19))]
    engine = Engine(model)
    alone_calls = _counting(model, "decode_slot")
    alone = []
    for request in requests:
        seq = engine.submit(request)
        engine.run([seq])
        alone.append(seq.tokens)
    assert len(alone_calls) == sum(r.max_tokens - 1 for r in requests)  # every step after the prefill's token
    del model.decode_slot  # the instance attribute `_counting` set: the method again
    sequences = [engine.submit(r) for r in requests]
    engine.run(sequences)
    assert [s.tokens for s in sequences] == alone


def test_where_the_check_fails_every_slot_runs(bf16_model):
    """The engine takes the slot graph only on warmup's word (one_slot_exact, False where the
    kernels' sums depend on the row count, as ATen's float32 matmuls may)."""
    model = bf16_model
    model.one_slot_exact = False
    try:
        calls = _counting(model, "decode_slot")
        model.generate(list(range(3, 20)), 6, stop_at_eos=False)
        assert calls == []
    finally:
        model.one_slot_exact = True
        del model.decode_slot
