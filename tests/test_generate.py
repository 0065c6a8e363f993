"""Sampling and the checks generate() makes before anything reaches a compiled graph."""

import pytest
import torch

from helpers.graph_checks import no_recompiles
from qrt.runtime.sampling import SamplingParams, sample


def test_top_k_only_samples_the_k_best():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0, 3.0]])
    gen = torch.Generator().manual_seed(0)
    drawn = {int(sample(logits, SamplingParams(1.0, top_k=2), gen)) for _ in range(200)}
    assert drawn == {1, 2}


def test_top_p_keeps_the_smallest_set_covering_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    drawn = {int(sample(logits, SamplingParams(1.0, top_p=0.75), gen)) for _ in range(300)}
    assert drawn == {0, 1}


def test_greedy_is_argmax_and_seeded_sampling_repeats():
    logits = torch.randn(3, 50)
    assert torch.equal(sample(logits, SamplingParams(), None), logits.argmax(-1))
    a = [int(sample(logits[:1], SamplingParams(0.8), torch.Generator().manual_seed(7))) for _ in range(5)]
    b = [int(sample(logits[:1], SamplingParams(0.8), torch.Generator().manual_seed(7))) for _ in range(5)]
    assert a == b


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_k=0), dict(top_k=2.5),
                                    dict(top_p=0), dict(top_p=1.5)])
def test_invalid_sampling_parameters_are_value_errors(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_generate_rejects_bad_inputs_before_running(llama_dir, compiled):
    model = compiled(llama_dir)
    with pytest.raises(ValueError, match="at least one token"):
        model.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"in \[0, 300\)"):
        model.generate([1, 300], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"in \[0, 300\)"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="exceeds the KV cache of 128 tokens"):
        model.generate(list(range(100)), max_new_tokens=29)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate([1, 2], max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        model.generate([1, 2], temperature=-0.5)
    with pytest.raises(ValueError, match="no usable tokenizer"):
        model.generate("hello")
    assert model.compile_report()["decode"] <= 1


def test_generate_streams_each_token_and_stops_at_eos(llama_dir, compiled):
    model = compiled(llama_dir)
    streamed = []
    ids = model.generate([7, 8, 9], max_new_tokens=6, stop_at_eos=False, stream=streamed.append)
    assert ids == streamed and len(ids) == 6
    first = ids[0]
    model.eos_ids.add(first)
    try:
        assert model.generate([7, 8, 9], max_new_tokens=6) == [first]
    finally:
        model.eos_ids.discard(first)


def test_sampled_generation_is_reproducible_with_a_seed(llama_dir, compiled):
    model = compiled(llama_dir)
    a = model.generate([4, 5], max_new_tokens=8, temperature=1.0, top_k=50, seed=3, stop_at_eos=False)
    b = model.generate([4, 5], max_new_tokens=8, temperature=1.0, top_k=50, seed=3, stop_at_eos=False)
    assert a == b


def test_broken_tokenizer_files_leave_token_ids_working(llama_dir, tmp_path):
    import shutil

    from qrt import runtime

    folder = tmp_path / "ckpt"
    shutil.copytree(llama_dir, folder)
    (folder / "tokenizer.json").write_text("{ this is not a tokenizer")
    with pytest.warns(UserWarning, match="tokenizer files present but unusable"):
        model = runtime.compile_model(folder, compile=False, progress=False, max_seq_len=32)
    assert len(model.generate([1, 2, 3], max_new_tokens=2, stop_at_eos=False)) == 2
    with pytest.raises(ValueError, match="no usable tokenizer.*pass token ids instead"):
        model.generate("hello")


def test_batched_generation_continues_each_prompt_as_alone(llama_dir, compiled):
    from qrt import runtime

    single = compiled(llama_dir)
    batched = runtime.compile_model(llama_dir, progress=False, max_seq_len=128, max_batch_size=3)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42, 43, 44], [7, 7, 7, 7, 7]]
    rows = batched.generate_batch(prompts, max_new_tokens=12, stop_at_eos=False)
    assert rows == [single.generate(p, max_new_tokens=12, stop_at_eos=False) for p in prompts]
    # Other lengths, one prompt more than there are slots (it waits for one): no new graph.
    uneven = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46], [9], [11, 12, 13, 14]]
    with no_recompiles(batched):
        rows = batched.generate_batch(uneven, max_new_tokens=9, stop_at_eos=False)
    assert rows == [single.generate(p, max_new_tokens=9, stop_at_eos=False) for p in uneven]
    with pytest.raises(ValueError, match="non-empty list of token-id lists"):
        batched.generate_batch([], max_new_tokens=2)
    with pytest.raises(ValueError, match="exceeds the KV cache of 128 tokens"):
        batched.generate_batch([[1, 2], list(range(120))], max_new_tokens=9)
