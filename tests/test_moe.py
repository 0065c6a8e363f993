"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3) against
transformers on tiny checkpoints: logits and greedy tokens compiled, one graph per role whatever the routing, every
sparse block one qrt::fused_experts call; quantized experts in the stored formats' exact on-disk
layouts and in the online formats against their dequantized references; a missing expert named;
latent attention's cache."""

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.activation_rounding import (fp8_per_group, fp8_per_token, fp8_static, int8_per_token, rounded_inputs,
                                         with_int8_lm_head, with_rounded_weights)
from helpers.checkpoints.moe import (MOE_ARCHS, QUANTIZED, make_moe_checkpoint, make_quantized_moe_checkpoint,
                                     online_int_reference)
from helpers.checkpoints.tiny import random_ids
from helpers.compare import relative_l2
from helpers.graph_checks import (assert_no_graph_breaks, assert_one_graph_per_role, decode_without_recompiles,
                                  swap_record)
from helpers.kernel_checks import fp8_cpu_kernel
from qrt import runtime
from qrt.errors import CheckpointError
from qrt.runtime.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from qrt.runtime.models.mla import cache_bytes_per_token

SPARSE_BLOCKS = {"mixtral": 2, "qwen2_moe": 1, "qwen3_moe": 2, "deepseek_v2": 2, "deepseek_v3": 2}


@dataclass
class Moe:
    name: str
    folder: Path
    hf: torch.nn.Module
    models: dict = field(default_factory=dict)

    def compiled(self):
        if "compiled" not in self.models:
            self.models["compiled"] = runtime.compile_model(self.folder, progress=False, max_seq_len=128)
        return self.models["compiled"]


# Every family compiles in `make test-slow` (the default run compiles gpt-oss's experts in
# test_gpt_oss.py), and all of them run eagerly below in both.
COMPILED_BY_DEFAULT = ()


@pytest.fixture(scope="module", params=[arch if arch in COMPILED_BY_DEFAULT else pytest.param(arch, marks=pytest.mark.slow)
                                        for arch in MOE_ARCHS])
def moe(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return Moe(request.param, folder, make_moe_checkpoint(folder, request.param))


@pytest.mark.parametrize("arch", list(MOE_ARCHS))
def test_bf16_checkpoints_match_transformers_in_fp32(arch, tmp_path):
    """A bf16 checkpoint run in bf16 against transformers in fp32 on the same weights: the routers'
    choices hold through bf16's rounding of the hidden states."""
    hf = make_moe_checkpoint(tmp_path / arch, arch, dtype=torch.bfloat16)
    model = runtime.compile_model(tmp_path / arch, compile=False, progress=False, max_seq_len=64)
    assert next(model.model.parameters()).dtype == torch.bfloat16
    ids, prompt = random_ids(0, (2, 24)), random_ids(1, (1, 10))
    with torch.no_grad():
        # bf16 activations move these tiny models' logits by 1-6% (measured); a flipped expert
        # choice for some tokens moves them by 15% or more.
        assert relative_l2(model(ids), hf(ids).logits) < 0.08
        expected = hf.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert model.generate(prompt[0].tolist(), max_new_tokens=16, stop_at_eos=False) == expected[0, 10:].tolist()


@pytest.mark.parametrize("arch", list(MOE_ARCHS))
def test_eager_logits_and_greedy_generation_match_transformers(arch, tmp_path):
    hf = make_moe_checkpoint(tmp_path / arch, arch)
    model = runtime.compile_model(tmp_path / arch, compile=False, progress=False, max_seq_len=64)
    ids, prompt = random_ids(0, (2, 24)), random_ids(1, (1, 10))
    with torch.no_grad():
        assert relative_l2(model(ids), hf(ids).logits) < 1e-3
        expected = hf.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert model.generate(prompt[0].tolist(), max_new_tokens=24, stop_at_eos=False) == expected[0, 10:].tolist()


def test_compiled_logits_match_transformers(moe):
    # Through the prefill graph (its length is dynamic): the last token's logits of prompts of
    # three lengths, every token having routed through its own experts on the way.
    for length in (9, 17, 24):
        ids = random_ids(length, (1, length))
        with torch.no_grad():
            expected = moe.hf(ids).logits[0, -1]
            got = moe.compiled().prefill(ids)[0, -1]
        assert relative_l2(got, expected) < 1e-3, length


def test_greedy_generation_matches_transformers(moe):
    prompt = random_ids(1, (1, 10))
    with torch.no_grad():
        expected = moe.hf.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert moe.compiled().generate(prompt[0].tolist(), max_new_tokens=24, stop_at_eos=False) == expected[0, 10:].tolist()


def test_routing_is_data_one_graph_per_role_and_one_experts_op_per_sparse_block(moe):
    model = moe.compiled()
    prompt = list(range(10, 27))
    # The tokens of a prompt and of each decode step pick different experts; none of it recompiles.
    chosen = _routed_experts(moe.hf, torch.tensor([prompt]))
    assert len({tuple(sorted(row)) for row in chosen}) > 1
    decode_without_recompiles(model, prompt, 24)
    assert_one_graph_per_role(model, forward=False)
    for role in ("prefill", "decode"):
        _, swap = swap_record(model.backends[role].log, "swap_fused_experts")
        assert swap.ops_before.get("qrt.fused_experts", 0) == SPARSE_BLOCKS[moe.name], role
        assert swap.ops_after.get("qrt.fused_experts_kernels", 0) == SPARSE_BLOCKS[moe.name], role
        assert swap.changed == SPARSE_BLOCKS[moe.name], role


def _routed_experts(hf, ids) -> list[list[int]]:
    """The experts transformers' first sparse block picks for each token of `ids`."""
    picked = []
    block = next(m for m in hf.modules() if hasattr(m, "gate") and hasattr(m, "experts"))
    handle = block.gate.register_forward_hook(lambda mod, args, out: picked.extend(out[2].tolist()))
    with torch.no_grad():
        hf(ids)
    handle.remove()
    return picked


def test_dynamo_explain_finds_no_graph_breaks_in_decode(moe):
    # Last in the group: explain() resets Dynamo, which discards the compiled graphs above.
    assert_no_graph_breaks(moe.compiled(), "decode")


def _experts_kernels(model) -> set:
    return {p.kernel for n, p in model.model.named_parameters() if ".experts." in n and n.endswith(".weight")}


# Each format on one of the two layouts of expert names (Mixtral's w1/w3/w2, Qwen2-MoE's with its
# shared expert), alternating; the other pairing runs in `make test-slow`.
FORMAT_CASES = [pytest.param(arch, fmt, marks=[pytest.mark.slow] if (i + j) % 2 else [])
                for i, fmt in enumerate(QUANTIZED) for j, arch in enumerate(("mixtral", "qwen2_moe"))]


@pytest.mark.parametrize("arch,fmt", FORMAT_CASES)
def test_quantized_experts_match_the_dequantized_model(arch, fmt, tmp_path):
    """Experts stored in each format (Mixtral's w1/w2/w3 names, Qwen2-MoE's shared expert) load
    into their kernel's layout and compute what the dequantized checkpoint does in transformers."""
    reference = make_quantized_moe_checkpoint(tmp_path / fmt, arch, fmt)
    model = runtime.compile_model(tmp_path / fmt, compile=False, progress=False, max_seq_len=64)
    _, _, kernel = QUANTIZED[fmt]
    assert _experts_kernels(model) == {kernel}
    ids = random_ids(2, (2, 16))
    rounding = ACTIVATION_ROUNDING.get(fmt)
    if fmt == "modelopt-fp8-tensor":
        rounding = static_input_rounding(tmp_path / fmt)
    with torch.no_grad(), (rounded_inputs(reference, rounding)):
        expected = reference(ids).logits
    assert relative_l2(model(ids), expected) < TOLERANCE.get(fmt, 1e-4)


# The formats that quantize activations, rounded the same way in the reference: what is left is the
# order of fp32 sums (measured 2-5e-7), unless an activation lies on a rounding edge and one side
# takes the neighbouring code, an e4m3 step of 2**-3 of that value (~1e-3 on the logits, seen once
# in DeepSeek-V3's latent attention). The static-scale ModelOpt experts round with the checkpoint's
# own input scales (static_input_rounding), and fall under the same bounds.
ACTIVATION_ROUNDING = {"fp8-block": fp8_per_group(32), "ct-fp8-channel": fp8_per_token, "ct-w8a8": int8_per_token}
ONE_EDGE = 5e-3
TOLERANCE = {"fp8-block": 1e-5, "ct-fp8-channel": 1e-5, "ct-w8a8": 1e-5, "modelopt-fp8-tensor": 1e-5}

# A checkpoint expert's projection -> transformers' stacked parameter holding it.
_EXPERT = re.compile(r"^(?P<layer>model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(?P<e>\d+)\."
                     r"(?P<proj>w1|w3|gate_proj|up_proj|w2|down_proj)$")


def static_input_rounding(folder: Path) -> dict:
    """{reference parameter (or (stacked parameter, expert)): fp8_static(the checkpoint's input_scale
    of that linear)}. The writer gives q/k/v one scale and an expert's gate and up one, so the
    max() that qrt's fused layers take of their shards' scales is each shard's own."""
    (path,) = folder.glob("*.safetensors")
    rounding = {}
    for name, scale in load_file(str(path)).items():
        if not name.endswith(".input_scale"):
            continue
        module = name.removesuffix(".input_scale")
        if match := _EXPERT.match(module):
            stacked = "gate_up_proj" if match["proj"] in ("w1", "w3", "gate_proj", "up_proj") else "down_proj"
            key = (f"{match['layer']}.mlp.experts.{stacked}", int(match["e"]))
        else:
            key = f"{module}.weight"
        rounding[key] = fp8_static(scale.item())
    return rounding


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-w8a16"])
def test_deepseek_v3_quantized_with_latent_attention(fmt, tmp_path):
    """DeepSeek-V3's own layout, FP8 with block scales (`weight_scale_inv`), and a weight-only one,
    latent attention's projections included."""
    reference = make_quantized_moe_checkpoint(tmp_path / "v3", "deepseek_v3", fmt)
    model = runtime.compile_model(tmp_path / "v3", compile=False, progress=False, max_seq_len=64)
    _, _, kernel = QUANTIZED[fmt]
    assert _experts_kernels(model) == {kernel}
    assert model.model.model.layers[1].self_attn.kv_b_proj.weight.kernel == kernel
    ids = random_ids(2, (2, 16))
    rounding = ACTIVATION_ROUNDING.get(fmt)
    with torch.no_grad(), (rounded_inputs(reference, rounding)):
        expected = reference(ids).logits
    # With the reference's activations rounded alike, FP8's block rounding no longer flips the
    # sigmoid router's near-tied choices (unrounded: 0.28 apart).
    assert relative_l2(model(ids), expected) < (ONE_EDGE if fmt == "fp8-block" else 1e-4)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2-moe-online")
    return folder, make_moe_checkpoint(folder, "qwen2_moe")


@pytest.mark.parametrize("bits", [4, 8])
def test_online_int_experts_match_their_dequantized_weights(qwen2_moe, bits):
    folder, _ = qwen2_moe
    model = runtime.compile_model(folder, quant=f"int{bits}", compile=False, progress=False, max_seq_len=64)
    assert _experts_kernels(model) == {f"qrt.int{bits}pack_linear"}
    ids = random_ids(3, (2, 16))
    with torch.no_grad():
        expected = online_int_reference(folder, bits)(ids).logits
    assert relative_l2(model(ids), expected) < 1e-4


@pytest.mark.parametrize("quant,kernel", [("fp8", fp8_cpu_kernel("qrt.fp8_linear")), ("w8a8", "qrt.int8_linear_cpu")])
def test_online_activation_quantized_experts(qwen2_moe, quant, kernel):
    folder, hf = qwen2_moe
    model = runtime.compile_model(folder, quant=quant, compile=False, progress=False, max_seq_len=64)
    assert _experts_kernels(model) == {kernel}
    ids = random_ids(3, (2, 16))
    # The reference: weights rounded as the online format stores them (per output channel), and
    # activations per token, both written here from the formats' definitions.
    rounding = {"fp8": fp8_per_token, "w8a8": int8_per_token}[quant]
    reference = with_rounded_weights(hf, rounding)
    if quant == "fp8":
        with_int8_lm_head(reference)  # online fp8 stores lm_head int8 per channel
    with torch.no_grad(), rounded_inputs(reference, rounding):
        expected = reference(ids).logits
    assert relative_l2(model(ids), expected) < 1e-5


@pytest.mark.slow
def test_compiled_int4_experts_match_eager(qwen2_moe):
    folder, _ = qwen2_moe
    compiled = runtime.compile_model(folder, quant="int4", progress=False, max_seq_len=64)
    eager = runtime.compile_model(folder, quant="int4", compile=False, progress=False, max_seq_len=64)
    prompt = list(range(20, 36))
    with torch.no_grad():
        assert relative_l2(compiled.prefill(torch.tensor([prompt]))[0, -1],
                           eager.prefill(torch.tensor([prompt]))[0, -1]) < 1e-3
    assert compiled.generate(prompt, max_new_tokens=8, stop_at_eos=False) == \
        eager.generate(prompt, max_new_tokens=8, stop_at_eos=False)


def test_a_missing_expert_tensor_names_the_layer_and_the_expert(qwen2_moe, tmp_path):
    folder, _ = qwen2_moe
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    state = load_file(str(next(folder.glob("*.safetensors"))))
    del state["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"experts\.3\.gate_up_proj\.weight \(shard 1\) \(layer 0, expert 3\)"):
        runtime.compile_model(broken, compile=False, progress=False, max_seq_len=64)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_latent_attention_caches_the_latent_and_the_rotary_key(arch, tmp_path):
    model = runtime.compile_model(_checkpoint(tmp_path, arch), compile=False, progress=False, max_seq_len=64,
                                  max_batch_size=2)
    cfg = model.model.config
    attention = model.model.model.layers[0].self_attn
    assert tuple(attention.latent_cache.shape) == (2, 1, 64, cfg.mla.kv_lora_rank)
    assert tuple(attention.rope_cache.shape) == (2, 1, 64, cfg.mla.qk_rope_head_dim)
    held = sum(b.numel() * b.element_size() for name, b in model.model.named_buffers() if name.endswith("_cache"))
    assert held == 2 * 64 * cache_bytes_per_token(cfg, torch.float32)


def _checkpoint(root: Path, arch: str) -> Path:
    make_moe_checkpoint(root / arch, arch)
    return root / arch


def test_full_size_deepseek_caches_are_those_of_mla():
    """The README's figures: DeepSeek-V3's own config (transformers' defaults) and V2-Lite's."""
    import transformers

    v3 = transformers.DeepseekV3Config().to_dict()
    v2_lite = transformers.DeepseekV2Config(num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None,
                                            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                            v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6).to_dict()
    for hf, cls, layers, heads in ((v3, DeepseekV3ForCausalLM, 61, 128), (v2_lite, DeepseekV2ForCausalLM, 27, 16)):
        cfg = cls.read_config(hf, "config.json")
        assert cache_bytes_per_token(cfg, torch.bfloat16) == layers * (512 + 64) * 2
        multi_head = layers * heads * (192 + 128) * 2
        assert multi_head / cache_bytes_per_token(cfg, torch.bfloat16) == pytest.approx(
            {61: 71.1, 27: 8.89}[layers], rel=1e-3)


def test_deepseek_v3_skips_its_multi_token_prediction_layers(tmp_path):
    folder = _checkpoint(tmp_path, "deepseek_v3")
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)  # the MTP layer after the 3 decoder layers
    save_file(state, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        runtime.compile_model(folder, compile=False, progress=False, max_seq_len=64)
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    runtime.compile_model(folder, compile=False, progress=False, max_seq_len=64)


@pytest.mark.parametrize("quant,kernel_device,kernel", [
    (None, "cuda", "qrt.fused_experts_triton"), ("int4", "cuda", "qrt.fused_experts_triton"),
    # fp8 experts on CUDA: each through its Triton fp8 linear
    pytest.param("fp8", "cuda", "qrt.fused_experts_kernels", marks=pytest.mark.slow),
    ("fp8", "cpu", "qrt.fused_experts_kernels"),
    pytest.param("w8a8", "cpu", "qrt.fused_experts_kernels", marks=pytest.mark.slow)])
def test_the_swap_pass_puts_the_recorded_experts_kernel_in_place(qwen2_moe, quant, kernel_device, kernel):
    """The loader records the experts kernel for the layout it made (with the CUDA layouts: the
    Triton experts kernel where it reads them), the swap pass puts it in place of the reference
    loop whichever of the format's tensors carries the record, and it computes what the reference
    does (Triton kernels under the interpreter)."""
    from qrt.checkpoint.config import DeviceConfig
    from qrt.passes.backend import QrtBackend
    from qrt.runtime.graph_runner import own_copy

    folder, _ = qwen2_moe
    eager = runtime.compile_model(folder, quant, compile=False, progress=False, max_seq_len=64,
                                  device_config=DeviceConfig("cpu", kernel_device=kernel_device))
    assert eager.model.model.layers[0].mlp.experts.gate_up_proj.weight.experts_kernel == kernel
    backend = QrtBackend(f"{kernel_device}-layouts", inductor=False, device=kernel_device)
    traced = torch.compile(own_copy(_forward, f"moe_{kernel_device}_{quant}"), backend=backend, fullgraph=True)
    ids = random_ids(4, (2, 12))
    with torch.no_grad():
        got, expected = traced(eager.model, ids), eager.model(ids)
    (graph,) = backend.log.graphs
    swap = next(record for record in graph.passes if record.name == "swap_fused_experts")
    assert swap.changed == SPARSE_BLOCKS["qwen2_moe"]
    assert swap.ops_after.get(kernel) == SPARSE_BLOCKS["qwen2_moe"]
    # fp8: kernel and reference may round an activation to neighbouring codes. w8a8: the CPU
    # kernel rounds its integer sums to bf16 where the reference keeps them exact, moving some
    # activations across int8 rounding edges downstream (as in test_format_contract.py).
    assert relative_l2(got, expected) < {"fp8": 1e-3, "w8a8": 0.05}.get(quant, 1e-4)


def _forward(model, ids):
    return model(ids)


@pytest.mark.parametrize("quant,substituted", [("fp8", True), ("int4", False), (None, False)])
def test_the_kernels_loop_runs_each_experts_chosen_kernel(qwen2_moe, quant, substituted):
    """qrt::fused_experts_kernels (what the swap pass puts in compiled graphs) against the reference
    loop: fp8 experts call the logical op, which their CPU kernel replaces; int4 ones call their
    kernel op themselves (an opaque layout); bf16 ones the dense GEMM."""
    from qrt.kernels.choices import kernel_named
    from qrt.layers.experts import KernelInPlaceOfLogicalOp

    folder, _ = qwen2_moe
    model = runtime.compile_model(folder, quant, compile=False, progress=False, max_seq_len=64)
    experts = model.model.model.layers[0].mlp.experts
    assert KernelInPlaceOfLogicalOp(kernel_named(experts.gate_up_proj.weight.kernel)).active == substituted
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 64, generator=gen)
    weights, ids = torch.randn(7, 6, generator=gen).softmax(-1).topk(2, dim=-1)
    args = (x, ids, weights, experts.gate_up_proj.tensors(), experts.down_proj.tensors(), experts.name, "silu")
    reference, kernels = torch.ops.qrt.fused_experts(*args), torch.ops.qrt.fused_experts_kernels(*args)
    assert relative_l2(kernels, reference) < 1e-3


def test_bf16_experts_are_prepacked_one_carrier_per_block(tmp_path):
    """Compiled CPU builds prepack dense experts for oneDNN: expert e's slice of the block's
    carrier finds expert e's packed weight, and the experts compute what the dense ones do."""
    from qrt.kernels.onednn_cpu import is_prepacked, onednn_prepack_supported
    from qrt.layers.prepack import prepack_cpu_weights

    if not onednn_prepack_supported(torch.bfloat16):
        pytest.skip("this CPU has no bf16 oneDNN linear")
    make_moe_checkpoint(tmp_path / "m", "qwen2_moe", dtype=torch.bfloat16)
    model = runtime.compile_model(tmp_path / "m", compile=False, progress=False, max_seq_len=64)
    experts = model.model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    weights, ids = torch.randn(5, 6, generator=gen).softmax(-1).topk(2, dim=-1)

    def run(op):
        return op(x, ids, weights, experts.gate_up_proj.tensors(), experts.down_proj.tensors(), experts.name, "silu")

    dense = run(torch.ops.qrt.fused_experts_kernels)
    prepack_cpu_weights(model.model)
    carrier = experts.gate_up_proj.weight
    assert carrier.shape == (6, 128, 64) and carrier.stride() == (1, 0, 0) and is_prepacked(carrier[3])
    # The same bf16 products, summed by another GEMM implementation.
    assert relative_l2(run(torch.ops.qrt.fused_experts_kernels), dense) < 1e-2
