"""Graph-break and recompile regressions of the builds: Dynamo finds no breaks, the regional build
prepacks (and, in `make test-slow`, matches the frozen one). Every format's graphs are checked by test_format_contract.py."""

import pytest

from graph_checks import (assert_no_graph_breaks, assert_one_graph_per_role,
                          decode_without_recompiles, swap_record)

LINEARS_PER_LAYER = 4  # qkv_proj, o_proj, gate_up_proj, down_proj
TINY_LAYERS = 2


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_dynamo_explain_finds_no_graph_breaks(llama_dir, compiled, role):
    assert_no_graph_breaks(compiled(llama_dir, "fp8"), role)


@pytest.fixture(scope="module")
def bf16_regional(llama_dir):
    from qrt import runtime

    return runtime.compile_model(llama_dir, dtype="bfloat16", progress=False, max_seq_len=128)


def test_regional_build_prepacks_dense_weights(llama_dir, bf16_regional):
    from qrt import runtime
    from qrt.kernels.onednn_cpu import is_prepacked

    linears = [m for m in bf16_regional.model.modules() if hasattr(m, "quant_method")]
    assert len(linears) == LINEARS_PER_LAYER * TINY_LAYERS + 1
    assert all(is_prepacked(m.weight) for m in linears)
    decode, _ = swap_record(bf16_regional.backends["decode"].log)
    assert [c.kernel for c in decode.kernel_choices] == ["qrt.onednn_linear"] * len(linears)
    # Its tokens against the frozen build's: test_regional_build_matches_the_frozen_build (slow).
    # Against eager bf16 they part after a few tokens: the tiny model's top logits nearly tie, and
    # the two round differently.
    assert len(decode_without_recompiles(bf16_regional, [5, 6, 7, 8], 12)) == 12
    with pytest.raises(ValueError, match="needs build='frozen'"):
        runtime.compile_model(llama_dir, progress=False, autotune=True)


@pytest.mark.slow  # compiling the older frozen build: about 40 s of the default run's 12 minutes
def test_regional_build_matches_the_frozen_build(llama_dir, bf16_regional):
    from qrt import runtime
    from qrt.kernels.onednn_cpu import is_prepacked

    frozen = runtime.compile_model(llama_dir, dtype="bfloat16", progress=False, max_seq_len=128, build="frozen")
    assert not any(is_prepacked(m.weight) for m in frozen.model.modules() if hasattr(m, "quant_method"))
    prompt = [5, 6, 7, 8]
    assert decode_without_recompiles(bf16_regional, prompt, 12) == decode_without_recompiles(frozen, prompt, 12)


@pytest.mark.slow  # autotuning every decode GEMM: about 25 s of the default run's 12 minutes
def test_frozen_build_autotuned_decode_gives_the_same_tokens_in_one_graph(llama_dir):
    from qrt import runtime

    eager = runtime.compile_model(llama_dir, compile=False, progress=False, max_seq_len=128)
    autotuned = runtime.compile_model(llama_dir, progress=False, max_seq_len=128, build="frozen", autotune=True)
    assert autotuned.backends["decode"].config_patches.get("max_autotune") is True
    prompt = [5, 6, 7, 8]
    tokens = decode_without_recompiles(autotuned, prompt, 12)
    assert tokens == eager.generate(prompt, max_new_tokens=12, stop_at_eos=False)
    assert_one_graph_per_role(autotuned, forward=False)
