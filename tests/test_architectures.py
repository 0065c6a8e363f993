"""Qwen3, Mistral, Phi-3, Gemma 2 and Gemma 3 against transformers on tiny sharded checkpoints:
logits, greedy tokens, one graph per compiled function with no graph breaks, no decode
recompiles, online fp8 through the swap pass; plus the RoPE scalings, Phi-3's fused layers and
the older config.json layouts of these families."""

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from helpers.activation_rounding import (DRIFT_FACTOR, fp8_per_token, model_drift, rounded_inputs, with_int8_lm_head,
                                         with_rounded_weights)
from helpers.checkpoints.architectures import ARCHS, make_arch_checkpoint
from helpers.checkpoints.tiny import make_checkpoint, random_ids
from helpers.compare import relative_l2
from helpers.graph_checks import (assert_every_linear_runs, assert_no_graph_breaks, assert_one_graph_per_role,
                                  decode_without_recompiles)
from helpers.kernel_checks import fp8_cpu_kernel
from qrt import runtime

LINEARS_PER_LAYER = 4  # qkv_proj, o_proj, gate_up_proj, down_proj
TINY_LAYERS = 2
# Longer than every sliding window and than the original context (32) of the scaled RoPEs.
PARITY_SHAPE = (2, 40)
# Online fp8 against its references: one activation on a rounding edge costs about 1e-3.
ONE_EDGE = 5e-3


@dataclass
class Arch:
    name: str
    folder: Path
    hf: torch.nn.Module  # float32 transformers model holding the checkpoint's weights
    models: dict = field(default_factory=dict)

    def compiled(self, quant=None):
        if quant not in self.models:
            self.models[quant] = runtime.compile_model(self.folder, quant=quant, progress=False, max_seq_len=128)
        return self.models[quant]


# Every family's compiled tests run in `make test-slow`, to keep the quick loop in its budget (the
# default run compiles Llama and Qwen2 in test_parity.py, and gpt-oss's sliding windows, sinks and
# YaRN in test_gpt_oss.py); the checkpoints' eager checks below run in both.
SLOW_FAMILIES = ("mistral", "gemma2", "gemma3", "qwen3", "phi3")


@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow) if name in SLOW_FAMILIES else name
                                        for name in ARCHS])
def arch(request, tmp_path_factory):
    """One architecture's checkpoint and compiled models; pytest runs the tests grouped by it."""
    folder = tmp_path_factory.mktemp(request.param)
    return Arch(request.param, folder, make_arch_checkpoint(folder, request.param))


def test_checkpoint_is_sharded(arch):
    index = json.loads((arch.folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (arch.folder / "model.safetensors").exists()


def test_compiled_logits_match_transformers(arch):
    ids = random_ids(0, PARITY_SHAPE)
    with torch.no_grad():
        expected = arch.hf(ids).logits
    got = arch.compiled()(ids)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert relative_l2(got, expected) < 1e-3


def test_greedy_generation_matches_transformers(arch):
    # 30 tokens past a 10-token prompt: crosses the sliding windows and, for Phi-3, the switch
    # to long RoPE factors at 32, where generation recomputes the sequence as transformers does.
    prompt = random_ids(1, (1, 10))
    with torch.no_grad():
        expected = arch.hf.generate(prompt, max_new_tokens=30, min_new_tokens=30, do_sample=False)
    got = arch.compiled().generate(prompt[0].tolist(), max_new_tokens=30, stop_at_eos=False)
    assert got == expected[0, 10:].tolist()


def test_one_graph_per_function_and_no_decode_recompiles(arch):
    model = arch.compiled()
    model.generate([5, 6, 7], max_new_tokens=3, stop_at_eos=False)
    model(random_ids(0, PARITY_SHAPE))  # the forward graph is not dynamic: another shape would recompile it
    assert_one_graph_per_role(model)
    # 24 decode steps cross the sliding windows and, for Phi-3, the long-RoPE switch at 32.
    decode_without_recompiles(model, list(range(10, 27)), 24)
    decode_without_recompiles(model, [3, 1, 4, 1, 5], 4)
    assert_one_graph_per_role(model)


# Online fp8 compiles a second model per family: every family in `make test-slow`.
FP8_BY_DEFAULT = ()


@pytest.mark.parametrize("arch", [name if name in FP8_BY_DEFAULT else pytest.param(name, marks=pytest.mark.slow)
                                  for name in ARCHS], indirect=True)
def test_online_fp8_runs_the_cpu_kernel_without_breaks_or_recompiles(arch):
    model = arch.compiled("fp8")
    model.generate([5, 6, 7], max_new_tokens=3, stop_at_eos=False)
    decode_without_recompiles(model, list(range(10, 30)), 16)
    assert_one_graph_per_role(model, forward=False)
    assert_every_linear_runs(model, fp8_cpu_kernel("qrt.fp8_linear"), LINEARS_PER_LAYER * TINY_LAYERS,
                             swapped_from="qrt.fp8_linear", roles=("prefill", "decode"), lm_head="qrt.int8pack_linear")
    ids = random_ids(4, (1, 40))
    eager = runtime.compile_model(arch.folder, quant="fp8", compile=False, progress=False, max_seq_len=128)
    with torch.no_grad():
        got = model.prefill(ids)[0, -1]
        reference = eager.prefill(ids)[0, -1]
        # e4m3 weights per output channel, lm_head int8 per channel
        rounded = with_int8_lm_head(with_rounded_weights(arch.hf, fp8_per_token))
        with rounded_inputs(rounded, fp8_per_token):
            expected = rounded(ids).logits[0, -1]
    # The swapped kernel computes what the logical op's reference computes (same fp8 codes and
    # scales), and both what transformers computes with e4m3 weights per channel and activations
    # per token, rounded by the test's own code: the order of fp32 sums, or activations on
    # rounding edges, whose steps grow through the layers on the sharper families (Gemma's scaled
    # embeddings) as far as the rounded reference itself moves under changes of arithmetic alone.
    bound = max(ONE_EDGE, DRIFT_FACTOR * model_drift(rounded, fp8_per_token, ids))
    assert relative_l2(got, reference) < bound
    assert relative_l2(got, expected) < bound


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_dynamo_explain_finds_no_graph_breaks(arch, role):
    # Last in the group: explain() resets Dynamo, which discards the compiled graphs above.
    assert_no_graph_breaks(arch.compiled(), role)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("phi3-eager")
    return folder, make_arch_checkpoint(folder, "phi3")


def test_phi3_long_rope_switches_per_forward_pass_like_transformers_with_a_cache(phi3):
    """Longrope's factors are chosen per forward pass: short while every position is inside the
    original context, long from position 32 on; keys already cached keep their rotation, as
    in transformers' model run step by step with a cache. (transformers' generate() instead
    recomputes the whole cache with the long factors at the switch.)"""
    import transformers

    folder, hf = phi3
    model = runtime.compile_model(folder, compile=False, progress=False, max_seq_len=128)
    ids = random_ids(5, (1, 40))
    cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        expected = hf(ids[:, :28], cache=cache, use_cache=True).logits[:, -1]
        assert relative_l2(model.prefill(ids[:, :28])[:, -1], expected) < 1e-4
        for pos in range(28, 40):
            expected = hf(ids[:, pos:pos + 1], cache=cache, use_cache=True, position_ids=torch.tensor([[pos]])).logits
            got = model.decode(ids[:, pos:pos + 1], pos)
            assert relative_l2(got[0, -1], expected[0, -1]) < 1e-4, pos


def test_phi3_fused_layers_load_a_per_channel_fp8_checkpoint(phi3, tmp_path):
    """Phi-3's fused qkv_proj and gate_up_proj are single checkpoint tensors: per-channel fp8
    weights and scales load into them whole and give the dequantized model's logits."""
    from safetensors.torch import load_file, save_file

    from helpers.checkpoints.fp8 import quantize_channel

    folder, hf = phi3
    state = {}
    for path in folder.glob("*.safetensors"):
        state.update(load_file(path))
    tensors, dequantized = {}, {}
    for name, value in state.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            codes, scale = quantize_channel(value)  # [N, K] e4m3, [N, 1] fp32
            scale = scale.to(torch.bfloat16)  # compressed-tensors keeps scales in bf16
            tensors[name], tensors[f"{module}.weight_scale"] = codes, scale
            dequantized[name] = codes.float() * scale.float()
        else:
            tensors[name] = value
    (tmp_path / "ckpt").mkdir()
    save_file(tensors, str(tmp_path / "ckpt/model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {**fp8, "dynamic": False, "strategy": "channel"},
                                      "input_activations": {**fp8, "dynamic": True, "strategy": "token"}}},
    }
    (tmp_path / "ckpt/config.json").write_text(json.dumps(config))
    model = runtime.compile_model(tmp_path / "ckpt", compile=False, progress=False, max_seq_len=64)
    assert model.scheme.describe().startswith("fp8 (compressed-tensors: channel")
    fused = {name: m for name, m in model.model.named_modules() if name.endswith(("qkv_proj", "gate_up_proj"))}
    assert len(fused) == 2 * TINY_LAYERS
    for name, module in fused.items():
        # Loaded whole: every row carries its own scale, so the weight is exactly the checkpoint's.
        weight = module.weight.float() * module.weight_scale[:, None]
        assert torch.equal(weight, dequantized[f"{name}.weight"]), name
    reference = type(hf)(hf.config).eval()
    reference.load_state_dict({**hf.state_dict(), **dequantized})
    ids = random_ids(6, (1, 20))
    with torch.no_grad(), rounded_inputs(reference, fp8_per_token):
        expected = reference(ids).logits
    # The per-token fp8 activations rounded in the reference too: the order of fp32 sums is left.
    assert relative_l2(model(ids), expected) < 1e-5


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "linear", "factor": 2.0},
], ids=["llama3", "yarn", "linear"])
def test_rope_scalings_of_llama_configs_match_transformers(rope, tmp_path):
    hf = make_checkpoint(tmp_path, "llama", rope_parameters={**rope, "rope_theta": 500.0})
    model = runtime.compile_model(tmp_path, compile=False, progress=False, max_seq_len=64)
    ids = random_ids(7, (1, 48))
    with torch.no_grad():
        assert relative_l2(model(ids), hf(ids).logits) < 1e-4


OLDER_CONFIGS = {
    # architecture: (transformers config class, config.json keys in the older layouts checkpoints still ship)
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(
        head_dim=16, rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window=512, sliding_window_pattern=6)),
    "Phi3ForCausalLM": ("Phi3Config", dict(
        original_max_position_embeddings=4096, partial_rotary_factor=0.75,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6})),
    "Qwen2ForCausalLM": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=256, max_window_layers=8)),
    "MistralForCausalLM": ("MistralConfig", {}),  # no sliding_window key: transformers assumes 4096
}


@pytest.mark.parametrize("name", OLDER_CONFIGS)
def test_older_config_layouts_read_as_transformers_reads_them(name):
    import transformers

    config_name, keys = OLDER_CONFIGS[name]
    hf_config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=12, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=300, max_position_embeddings=131072, **keys)
    theirs = getattr(transformers, config_name)(**hf_config)
    ours = runtime.ModelRegistry.resolve({"architectures": [name]}).read_config(hf_config, "config.json")
    every_layer = "sliding_attention" if theirs.sliding_window else "full_attention"
    assert ours.layer_types == tuple(getattr(theirs, "layer_types", None) or [every_layer] * 12)
    assert ours.sliding_window == theirs.sliding_window
    rope = theirs.rope_parameters.get("full_attention", theirs.rope_parameters)
    assert (ours.rope.theta, ours.rope.kind) == (rope["rope_theta"], rope["rope_type"])
    assert ours.rope.dim == int(16 * rope.get("partial_rotary_factor", 1.0))
    if "sliding_attention" in theirs.rope_parameters:
        assert ours.local_rope.theta == theirs.rope_parameters["sliding_attention"]["rope_theta"]


def test_inspect_of_an_unknown_architecture_names_every_supported_one(tmp_path, capsys):
    from qrt.cli import main

    make_arch_checkpoint(tmp_path, "mistral")
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "MambaForCausalLM" in err
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                 "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        assert name in err
