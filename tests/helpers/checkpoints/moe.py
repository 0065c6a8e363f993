"""Tiny random mixture-of-experts checkpoints made with transformers' own classes (one tensor per
expert, as the hub stores them), and the same checkpoints with their linears written in a
quantized format's exact on-disk layout.

The routers are scaled up so that each token's expert choice is decisive: a near-tie between two
experts would flip with any rounding and make two correct models disagree."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from helpers.checkpoints import fp8
from helpers.checkpoints.integer import awq_tensors, ct_config, ct_tensors, gptq_tensors
from helpers.checkpoints.tiny import TINY
from helpers.checkpoints.w8a8 import _int8_weight, ct_w8a8_config
from helpers.kernel_checks import fp8_cpu_kernel

ROUTER_SCALE = 8.0
# Sigmoid routing (DeepSeek-V3) saturates when its logits are scaled up far, and saturated scores
# tie; a mild scale and a small correction bias keep its choices apart in bf16 (tried: 8x, or 1x
# with a bias of std 0.3, flip choices between bf16 and fp32 runs; 2x with 0.02 does not).
SIGMOID_ROUTER_SCALE, CORRECTION_BIAS_STD = 2.0, 0.02
_MOE_TINY = dict(TINY, initializer_range=0.1)

MOE_ARCHS = {
    # name: (transformers config class, model class, config overrides)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
    # A shared expert with its sigmoid gate, q/k/v biases, unnormalized top-k, and layer 1 dense.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
        mlp_only_layers=[1], norm_topk_prob=False)),
    # q/k norms, renormalized top-k, head_dim unequal to hidden / heads, sparse every layer.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64, norm_topk_prob=True, head_dim=32)),
    # Latent attention without q_lora_rank (V2-Lite's variant), v_head_dim unequal to the q/k heads,
    # group-limited softmax routing scaled by 2, a shared expert, layer 0 dense.
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_hidden_layers=3, intermediate_size=96, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", routed_scaling_factor=2.0, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, num_key_value_heads=4)),
    # q_lora_rank, sigmoid routing with the score correction bias in 4 groups of which 2 open,
    # renormalized and scaled by 2.5, yarn RoPE with mscale_all_dim (the attention scale moves too),
    # interleaved rotary pairs, layer 0 dense.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_hidden_layers=3, intermediate_size=96, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, num_key_value_heads=4, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})),
}


def make_moe_checkpoint(folder: Path, arch: str, *, seed: int = 0, dtype=torch.float32, **overrides):
    """Write a tiny random `arch` checkpoint; return the float32 transformers model it holds."""
    model = random_moe_model(arch, seed=seed, **overrides)
    model.to(dtype).save_pretrained(str(folder), safe_serialization=True)
    return model.float()


def random_moe_model(arch: str, *, seed: int = 0, **overrides):
    """A tiny random float32 transformers `arch` model (routers decisive, norms and biases random)."""
    import transformers

    config_name, model_name, arch_overrides = MOE_ARCHS[arch]
    config = getattr(transformers, config_name)(**{**_MOE_TINY, **arch_overrides, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn_like(param) * 0.1 + 1.0)
            elif name.endswith(".bias"):
                param.copy_(torch.randn_like(param) * 0.1)
            elif is_router(name.removesuffix(".weight")):
                param.mul_(SIGMOID_ROUTER_SCALE if arch == "deepseek_v3" else ROUTER_SCALE)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's: zeros would not test it
                buffer.copy_(torch.randn_like(buffer) * CORRECTION_BIAS_STD)
    return model


def is_router(module: str) -> bool:
    return module.endswith((".gate", "shared_expert_gate"))


def quantized_linears(state: dict) -> list[str]:
    """The decoder linears a quantizer converts: everything in the layers but the routers (which
    quantizers leave out, and qrt keeps as stored)."""
    return [name.removesuffix(".weight") for name, t in state.items()
            if name.startswith("model.layers.") and name.endswith(".weight") and t.dim() == 2
            and not is_router(name.removesuffix(".weight"))]


def _input_seed(module: str) -> int:
    """One act-order permutation per input: GPTQ orders channels by the Hessian of the layer's
    input, which q/k/v share, as do an expert's gate and up."""
    for shard, shared in ((".q_proj", ".qkv"), (".k_proj", ".qkv"), (".v_proj", ".qkv"), (".gate_proj", ".gu"),
                          (".up_proj", ".gu"), (".w1", ".gu"), (".w3", ".gu")):
        module = module.replace(shard, shared)
    return sum(ord(c) * (i + 1) for i, c in enumerate(module)) % 10007


def _fp8(strategy):
    def build(w, **_):
        if strategy == "block":
            q, scale = fp8.quantize_block(w)
            return q, scale, fp8.dequantize_block(q, scale)
        q, scale = fp8.quantize_channel(w) if strategy == "channel" else fp8.quantize_tensor(w)
        return q, scale, q.float() * scale
    return build


def _fp8_tensors(family: str):
    strategy, static = fp8.FAMILIES[family]
    build = _fp8(strategy)

    def tensors(w, seed=0, **_):
        q, scale, dequantized = build(w)
        if family.startswith("ct-"):  # stored in bf16: the reference must use the scale as stored
            scale = scale.to(torch.bfloat16).float()
            dequantized = fp8.dequantize_block(q, scale) if strategy == "block" else q.float() * scale
        out = {"weight": q, fp8._scale_name(family): fp8._stored_scale(family, scale)}
        if static:
            out["input_scale"] = fp8._stored_scale(family, torch.tensor(0.02 + 0.01 * (seed % 3)))
        return out, dequantized
    return tensors, fp8._quant_config(family)


def _gptq(bits, group_size, sym, act_order):
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": sym,
              "checkpoint_format": "gptq"}
    return (lambda w, seed=0: gptq_tensors(w, bits=bits, group_size=group_size, sym=sym, act_order=act_order,
                                           seed=seed)), config


AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True,
              "modules_to_not_convert": None}
_ROUTERS_IGNORED = ("lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$")

def _ct_w8a8(w, seed=0):
    q, scale, dequantized = _int8_weight(w, "channel")
    return {"weight": q, "weight_scale": scale}, dequantized


# name -> (tensors(w, seed) -> ({suffix: tensor}, dequantized [N, K]), quantization_config, CPU kernel of the experts)
QUANTIZED = {
    "gptq-4bit-act-order-asym": (*_gptq(4, 32, False, True), "qrt.int4pack_linear"),
    "gptq-8bit-channel": (*_gptq(8, -1, True, False), "qrt.int8pack_linear"),
    "awq": (lambda w, seed=0: awq_tensors(w, group_size=32), AWQ_CONFIG, "qrt.int4pack_linear"),
    "ct-w4a16": (lambda w, seed=0: ct_tensors(w, group_size=32), ct_config(group_size=32, ignore=_ROUTERS_IGNORED),
                 "qrt.int4pack_linear"),
    "ct-w8a16": (lambda w, seed=0: ct_tensors(w, bits=8, group_size=-1),
                 ct_config(bits=8, group_size=-1, ignore=_ROUTERS_IGNORED), "qrt.int8pack_linear"),
    "ct-w8a8": (_ct_w8a8, ct_w8a8_config(ignore=_ROUTERS_IGNORED), "qrt.int8_linear_cpu"),
    "fp8-block": (*_fp8_tensors("hf-fp8-block"), fp8_cpu_kernel("qrt.fp8_block_linear")),
    "ct-fp8-channel": (*_fp8_tensors("ct-fp8-channel-dynamic"), fp8_cpu_kernel("qrt.fp8_linear")),
    "modelopt-fp8-tensor": (*_fp8_tensors("modelopt-fp8"), fp8_cpu_kernel("qrt.fp8_static_linear")),
}


def make_quantized_moe_checkpoint(folder: Path, arch: str, fmt: str, *, seed: int = 0):
    """`arch`'s tiny checkpoint with every decoder linear but the routers stored in format `fmt`;
    returns the transformers model holding the dequantized weights (the reference).

    transformers holds experts fused ([E, ...] per projection) and converts to and from the hub's
    one-tensor-per-expert layout when it saves and loads, so the quantizer works on the saved
    file and the reference is loaded back from a dequantized copy of it."""
    import transformers

    make_moe_checkpoint(folder, arch, seed=seed)
    (path,) = folder.glob("*.safetensors")
    state = load_file(str(path))
    tensors_of, quantization_config, _ = QUANTIZED[fmt]
    reference = dict(state)
    for module in quantized_linears(state):
        w = state.pop(f"{module}.weight")
        tensors, dequantized = tensors_of(w, seed=seed + _input_seed(module))
        state.update({f"{module}.{suffix}": t.contiguous() for suffix, t in tensors.items()})
        reference[f"{module}.weight"] = dequantized.float().contiguous()
    reference_folder = folder.parent / f"{folder.name}-dequantized"
    reference_folder.mkdir(exist_ok=True)
    shutil.copy(folder / "config.json", reference_folder / "config.json")
    save_file(reference, str(reference_folder / "model.safetensors"), metadata={"format": "pt"})
    save_file(state, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    return transformers.AutoModelForCausalLM.from_pretrained(str(reference_folder), dtype=torch.float32).eval()


def online_int_reference(folder: Path, bits: int):
    """The transformers model of `folder`'s checkpoint with the weights qrt's online int`bits`
    stands for (int4 in groups of 32 along K, asymmetric with a float zero point that puts code 0
    on the group's minimum; int8 symmetric per output channel; lm_head int8 per channel), rounded
    here from that definition, not by qrt's quantizer: what quant="int4"/"int8" should compute,
    activations unquantized."""
    import transformers

    (path,) = folder.glob("*.safetensors")
    state = load_file(str(path))
    for module in [*quantized_linears(state), "lm_head"]:
        w = state[f"{module}.weight"].float()
        rows = _int8_rows if module == "lm_head" or bits == 8 else _int4_groups_of_32
        state[f"{module}.weight"] = rows(w).contiguous()
    reference_folder = folder.parent / f"{folder.name}-int{bits}-dequantized"
    reference_folder.mkdir(exist_ok=True)
    shutil.copy(folder / "config.json", reference_folder / "config.json")
    save_file(state, str(reference_folder / "model.safetensors"), metadata={"format": "pt"})
    return transformers.AutoModelForCausalLM.from_pretrained(str(reference_folder), dtype=torch.float32).eval()


def _int8_rows(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per row: codes round(w / s) in [-127, 127] with s = amax / 127, dequantized."""
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    return (w / scale).round().clamp(-127, 127) * scale


def _int4_groups_of_32(w: torch.Tensor) -> torch.Tensor:
    """Asymmetric 4-bit in groups of 32 along K: 15 steps from the group's minimum to its maximum."""
    n, k = w.shape
    groups = w.view(n, k // 32, 32)
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    step = (high - low) / 15
    return (((groups - low) / step).round().clamp(0, 15) * step + low).view(n, k)
