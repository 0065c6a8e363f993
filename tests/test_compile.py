"""Graph-break and recompile regressions, and what the swap pass did, for each (arch, format)."""

import pytest
import torch

from graph_checks import (assert_every_linear_runs, assert_no_graph_breaks, assert_one_graph_per_role,
                          decode_without_recompiles, swap_record)

CASES = [("llama_dir", None), ("llama_dir", "fp8"), ("qwen2_dir", None), ("qwen2_dir", "fp8")]
LINEARS_PER_LAYER = 4  # qkv_proj, o_proj, gate_up_proj, down_proj
TINY_LAYERS = 2


@pytest.fixture
def warmed(request, compiled):
    """A compiled model whose prefill, decode and forward graphs have all run once."""
    arch, quant = request.param
    model = compiled(request.getfixturevalue(arch), quant)
    model.generate([5, 6, 7], max_new_tokens=3, stop_at_eos=False)
    # The forward graph takes any length but a fixed batch size; the parity tests score batches of 2.
    model(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]))
    return model, quant


@pytest.mark.parametrize("warmed", CASES, indirect=True, ids=[f"{a}-{q}" for a, q in CASES])
def test_one_graph_per_function_and_no_decode_recompiles(warmed):
    model, _ = warmed
    assert_one_graph_per_role(model)
    # Prompts of other lengths reuse the dynamic prefill graph; 32 decode steps never recompile.
    decode_without_recompiles(model, list(range(10, 27)), 32)
    decode_without_recompiles(model, [3, 1, 4, 1, 5], 4)
    assert_one_graph_per_role(model)


@pytest.mark.parametrize("warmed", CASES, indirect=True, ids=[f"{a}-{q}" for a, q in CASES])
def test_swap_pass_replaced_every_logical_op(warmed):
    model, quant = warmed
    expected = 0 if quant is None else LINEARS_PER_LAYER * TINY_LAYERS
    assert_every_linear_runs(model, "qrt.fp8_linear_cpu", expected, swapped_from="qrt.fp8_linear")
    for role, backend in model.backends.items():
        _, swap = swap_record(backend.log)
        # Each role compiles one decoder-layer body, which every layer calls.
        assert swap.code_before.count("# ---- subgraph ") == 1, role
        assert f"called {TINY_LAYERS}x per run" in swap.code_before, role


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_dynamo_explain_finds_no_graph_breaks(llama_dir, compiled, role):
    assert_no_graph_breaks(compiled(llama_dir, "fp8"), role)


def test_regional_build_prepacks_dense_weights_and_matches_the_frozen_build(llama_dir):
    from qrt import runtime
    from qrt.kernels.onednn_cpu import is_prepacked

    bf16 = runtime.compile_model(llama_dir, dtype="bfloat16", progress=False, max_seq_len=128)
    linears = [m for m in bf16.model.modules() if hasattr(m, "quant_method")]
    assert len(linears) == LINEARS_PER_LAYER * TINY_LAYERS + 1
    assert all(is_prepacked(m.weight) for m in linears)
    decode, _ = swap_record(bf16.backends["decode"].log)
    assert [c.kernel for c in decode.kernel_choices] == ["qrt.onednn_linear"] * len(linears)
    frozen = runtime.compile_model(llama_dir, dtype="bfloat16", progress=False, max_seq_len=128, build="frozen")
    assert not any(is_prepacked(m.weight) for m in frozen.model.modules() if hasattr(m, "quant_method"))
    prompt = [5, 6, 7, 8]
    assert decode_without_recompiles(bf16, prompt, 12) == decode_without_recompiles(frozen, prompt, 12)
    with pytest.raises(ValueError, match="needs build='frozen'"):
        runtime.compile_model(llama_dir, progress=False, autotune=True)


def test_frozen_build_autotuned_decode_gives_the_same_tokens_in_one_graph(llama_dir):
    from qrt import runtime

    eager = runtime.compile_model(llama_dir, compile=False, progress=False, max_seq_len=128)
    autotuned = runtime.compile_model(llama_dir, progress=False, max_seq_len=128, build="frozen", autotune=True)
    assert autotuned.backends["decode"].config_patches.get("max_autotune") is True
    prompt = [5, 6, 7, 8]
    tokens = decode_without_recompiles(autotuned, prompt, 12)
    assert tokens == eager.generate(prompt, max_new_tokens=12, stop_at_eos=False)
    assert_one_graph_per_role(autotuned, forward=False)
