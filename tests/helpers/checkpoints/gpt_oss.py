"""A tiny random gpt-oss, written by transformers' own `GptOssForCausalLM`, and the same model with
its experts in MXFP4 as gpt-oss ships them (`quant_method: "mxfp4"`, the experts'
`*_blocks` / `*_scales`).

The sliding window (8) and YaRN's original context (32) are shorter than the tests' sequences,
so both take effect. Routers are scaled up so that each token's expert choice is decisive: a
near-tie would flip with any rounding and make two correct models disagree."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from helpers.checkpoints.tiny import TINY

ROUTER_SCALE = 8.0
SLIDING_WINDOW = 8
GPT_OSS = dict(
    TINY, intermediate_size=64, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
    sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"], initializer_range=0.1,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32},
)
# What gpt-oss's own config.json leaves unquantized.
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def random_gpt_oss(seed: int = 0, **overrides):
    """A tiny random float32 transformers GptOssForCausalLM, its experts run by transformers' eager
    loop (the reference arithmetic), norms, biases and sinks random."""
    import transformers

    config = transformers.GptOssConfig(**{**GPT_OSS, **overrides})
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn_like(param) * 0.1 + 1.0)
            elif name.endswith("bias") or name.endswith("sinks"):
                param.copy_(torch.randn_like(param) * 0.5)
            elif name.endswith("router.weight"):
                param.mul_(ROUTER_SCALE)
    model.set_experts_implementation("eager")
    return model


def make_gpt_oss_checkpoint(folder: Path, *, dtype=torch.float32, seed: int = 0, **overrides):
    """Write a tiny random gpt-oss in `dtype` (dense experts, as transformers saves them); return the
    float32 transformers model."""
    model = random_gpt_oss(seed, **overrides)
    model.to(dtype).save_pretrained(str(folder), safe_serialization=True)
    return model.float()


def load_reference(folder: Path, dtype=torch.float32):
    """transformers' own GptOssForCausalLM read from `folder` in `dtype` (an MXFP4 checkpoint
    dequantized by transformers), with its eager experts loop."""
    import transformers

    quantized = json.loads((folder / "config.json").read_text()).get("quantization_config")
    extra = {"quantization_config": transformers.Mxfp4Config(dequantize=True)} if quantized else {}
    model = transformers.GptOssForCausalLM.from_pretrained(str(folder), dtype=dtype, **extra)
    model.set_experts_implementation("eager")
    return model.eval()


E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the codes 0-7; bit 3 is the sign


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (blocks uint8 [..., N, K / 32, 16], scales uint8 [..., N, K / 32]), from
    the OCP Microscaling definition: each block's scale is 2 ** (floor(log2(amax)) - 2), so that its
    largest value lands in E2M1's top binade (up to 6), and each value rounds to the nearest code."""
    blocks = weight.float().unflatten(-1, (-1, 32))  # [..., N, K / 32, 32]
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -126)
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)  # [..., N, K / 32, 1]
    scaled = (blocks / torch.exp2(exponent)).clamp(-6.0, 6.0)
    magnitude = (scaled.abs()[..., None] - E2M1_GRID).abs().argmin(-1)  # [..., 32] nearest of the 8 magnitudes
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # the even channel in the low nibble
    return packed, (exponent[..., 0] + 127).to(torch.uint8)


def make_gpt_oss_mxfp4_checkpoint(folder: Path, *, dtype=torch.bfloat16, seed: int = 0, **overrides) -> None:
    """Write the tiny gpt-oss with its experts in MXFP4 as gpt-oss ships them: `*_blocks` and
    `*_scales` per expert projection ([E, N, K / 32, 16] and [E, N, K / 32], nn.Linear orientation),
    the rest in `dtype`, and gpt-oss's quantization_config."""
    model = random_gpt_oss(seed, **overrides).to(dtype)
    model.save_pretrained(str(folder), safe_serialization=True)
    state = load_file(folder / "model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # Dense experts are stored [E, K, N]; MXFP4 ones [E, N, ...].
        state[f"{name}_blocks"], state[f"{name}_scales"] = quantize_mxfp4(state.pop(name).transpose(1, 2))
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_TO_NOT_CONVERT}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
