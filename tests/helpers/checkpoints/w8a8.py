"""Activation-quantized integer checkpoints written in their exact on-disk layouts, built from a
tiny transformers model: compressed-tensors `int-quantized` W8A8 and QQQ W4A8.

Each builder quantizes every decoder linear the way its producer does, writes the tensors, and
puts the dequantized weights back into the transformers model, which is then the "dequantize,
then run transformers" reference (its activations stay unquantized). The QQQ packer here is
written independently of formats/qqq.py, from docs/formats.md §6.4: it maps each value forward to its
word and nibble, where the loader gathers them back; a test compares the two.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from helpers.checkpoints.integer import LINEARS, to_int32
from helpers.checkpoints.tiny import make_checkpoint, random_ids

# QQQ needs output widths in multiples of 64 and K in multiples of 128 (group 128).
QQQ_TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
HEADROOM = 1.5  # static input ranges are widened by this much beyond the calibration's


def calibrate_inputs(model, seed: int = 7) -> dict:
    """(min, max) of each decoder linear's input over random prompts like the tests' (ids < 300)."""
    ranges, hooks = {}, []
    for name, module in model.named_modules():
        if name.endswith(LINEARS):
            def hook(mod, args, name=name):
                x = args[0].detach().float()
                low, high = ranges.get(name, (0.0, 0.0))
                ranges[name] = (min(low, float(x.min())), max(high, float(x.max())))
            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(random_ids(seed, (4, 32)))
    for hook in hooks:
        hook.remove()
    return ranges


def _int8_weight(w: torch.Tensor, strategy: str):
    """llm-compressor's symmetric int8 weights: (q int8 [N, K], stored bf16 scale, dequantized fp32)."""
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    scale = (amax / 127.0).bfloat16()  # channel [N, 1], tensor [1]
    s = scale.float() if strategy == "channel" else scale.float().reshape(1, 1)
    q = (w.float() / s).round().clamp(-128, 127)
    return q.to(torch.int8), scale, q * s


def _static_input(low: float, high: float, symmetric: bool):
    """Stored (input_scale bf16 [1], input_zero_point int8 [1] or None) for an observed range."""
    low, high = HEADROOM * min(low, 0.0), HEADROOM * max(high, 0.0)
    if symmetric:
        return torch.tensor([max(-low, high) / 127.0]).bfloat16(), None
    scale = torch.tensor([(high - low) / 255.0]).bfloat16()
    zero = torch.round(-128.0 - low / scale.float()).clamp(-128, 127).to(torch.int8)
    return scale, zero


def make_ct_w8a8_checkpoint(folder: Path, *, weights: str = "channel", activations: str = "dynamic",
                            symmetric: bool = True, seed: int = 0):
    """compressed-tensors W8A8: int8 weights (`weights`: "channel" | "tensor"), activations
    "dynamic" (per token) or "static" (per tensor, calibrated); returns the reference model."""
    model = make_checkpoint(folder, "llama", seed=seed)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    with torch.no_grad():
        for name, module in model.named_modules():
            if not name.endswith(LINEARS):
                continue
            q, scale, dequantized = _int8_weight(state.pop(f"{name}.weight"), weights)
            state[f"{name}.weight"], state[f"{name}.weight_scale"] = q, scale
            module.weight.copy_(dequantized)
        if activations == "static":
            for name, (low, high) in calibrate_inputs(model).items():
                scale, zero = _static_input(low, high, symmetric)
                state[f"{name}.input_scale"] = scale
                if zero is not None:
                    state[f"{name}.input_zero_point"] = zero
    _save(folder, state, ct_w8a8_config(weights, activations, symmetric))
    return model


def ct_w8a8_config(weights="channel", activations="dynamic", symmetric=True, ignore=("lm_head",)):
    weight_args = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": weights, "group_size": None,
                   "dynamic": False, "actorder": None}
    dynamic = activations == "dynamic"
    input_args = {"num_bits": 8, "type": "int", "symmetric": symmetric, "strategy": "token" if dynamic else "tensor",
                  "group_size": None, "dynamic": dynamic}
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weight_args,
                                          "input_activations": input_args}},
            "ignore": list(ignore), "kv_cache_scheme": None}


def _save(folder: Path, state: dict, quantization_config: dict) -> None:
    for old in folder.glob("*.safetensors"):
        old.unlink()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))


# ---- QQQ ------------------------------------------------------------------------------------

def qqq_weight_perm(per_channel: bool) -> list[int]:
    """docs/formats.md §6.4 step 2 and 3: stored position -> tile-order position within a run of 1024."""
    perm = []
    for i in range(32):
        one = []
        for block in (0, 1):
            for row in range(4 * (i % 4), 4 * (i % 4) + 4):
                one.append(16 * row + i // 4 + 8 * block)
        for j in range(4):
            perm += [p + 256 * j for p in one]
    interleave = [4, 0, 5, 1, 6, 2, 7, 3] if per_channel else [0, 2, 4, 6, 1, 3, 5, 7]
    return [perm[8 * (p // 8) + interleave[p % 8]] for p in range(1024)]


def qqq_pack(values: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """values [K, N]: unsigned 4-bit (per group) or signed codes in [-8, 7] (per channel).
    Returns B, int32 [K / 16, 2N]."""
    k, n = values.shape
    position_of = torch.empty(1024, dtype=torch.int64)
    position_of[torch.tensor(qqq_weight_perm(per_channel))] = torch.arange(1024)  # tile order -> stored
    kk, nn = torch.meshgrid(torch.arange(k), torch.arange(n), indexing="ij")
    tile_order = (nn // 16) * 256 + (kk % 16) * 16 + nn % 16  # position in its row of 16N values
    stored = (tile_order // 1024) * 1024 + position_of[tile_order % 1024]
    words = torch.zeros(k // 16, 2 * n, dtype=torch.int64)
    fields = (values.to(torch.int64) & 0xF) << (4 * (stored % 8))
    words.index_put_((kk // 16, stored // 8), fields, accumulate=True)  # fields never overlap
    return to_int32(words)


def qqq_permute_scales(s: torch.Tensor, grouped: bool) -> torch.Tensor:
    """docs/formats.md §6.4: s_group in runs of 64 (an 8x8 transpose), s_channel in runs of 32."""
    if grouped:
        perm = [i + 8 * j for i in range(8) for j in range(8)]
    else:
        perm = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    return s.reshape(-1, len(perm))[:, perm].reshape(s.shape).contiguous()


def qqq_tensors(w: torch.Tensor, group_size: int):
    """QQQ's quantizer (docs/formats.md §6.3) for one weight w [N, K]: (tensors, dequantized [N, K])."""
    n, k = w.shape
    w = w.float()
    if group_size == -1:
        s = w.abs().amax(dim=1) / 7.0  # [N]
        codes = (w / s[:, None]).round().clamp(-7, 7)  # [N, K] signed
        s_channel = (s / 16.0).reshape(1, n)
        tensors = {"B": qqq_pack(codes.t(), per_channel=True), "s_group": torch.empty(0, dtype=torch.float16),
                   "s_channel": qqq_permute_scales(s_channel, grouped=False)}
        return tensors, codes * 16.0 * s_channel.reshape(n, 1)
    groups = w.reshape(n, k // group_size, group_size)
    s_g = 2.0 * groups.abs().amax(dim=2) / 15.0  # [N, groups], GPTQ's symmetric 4-bit scale
    q = (groups / s_g[..., None]).round().add(8).clamp(0, 15)  # [N, groups, G] unsigned
    fake = ((q - 8) * s_g[..., None]).reshape(n, k)
    s_extra = fake.abs().amax(dim=1) / 127.0  # [N], the second, per-channel int8 quantization
    s_group = (s_g / s_extra[:, None]).half()  # [N, groups]
    int8_weight = ((q - 8) * s_group.float()[..., None]).round().clamp(-128, 127).reshape(n, k)
    tensors = {"B": qqq_pack(q.reshape(n, k).t(), per_channel=False),
               "s_group": qqq_permute_scales(s_group.t().contiguous(), grouped=True),
               "s_channel": qqq_permute_scales(s_extra.reshape(1, n), grouped=False)}
    return tensors, int8_weight * s_extra[:, None]


def make_qqq_checkpoint(folder: Path, group_size: int = 128, seed: int = 0):
    """A tiny Llama (QQQ_TINY shapes) with every decoder linear in QQQ's layout; returns the
    reference model holding the weights QQQ's kernel computes with."""
    model = make_checkpoint(folder, "llama", seed=seed, **QQQ_TINY)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(LINEARS):
                tensors, dequantized = qqq_tensors(state.pop(f"{name}.weight"), group_size)
                state.update({f"{name}.{leaf}": t for leaf, t in tensors.items()})
                module.weight.copy_(dequantized)
    _save(folder, state, {"quant_method": "qqq", "wbits": 4, "group_size": group_size})
    return model
