"""Integer weight-only checkpoints (GPTQ, AWQ, compressed-tensors) written in their exact on-disk
layouts, built from a tiny transformers model.

Each builder quantizes every decoder linear the way its producer does, writes the packed tensors,
and puts the dequantized weights back into the transformers model, so that model is the
"dequantize, then run transformers" reference. Packing here is written independently of qrt's
loaders (plain per-field loops over the rules of docs/formats.md), so a test compares two
implementations.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from helpers.checkpoints.tiny import make_checkpoint

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field i of a word holds channel 8j + AWQ_ORDER[i]


def pack_fields(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """LSB-first: element i of each run of 32 // bits along `dim` at bits [bits*i, bits*i + bits)."""
    pf = 32 // bits
    values = values.movedim(dim, 0).to(torch.int64)
    words = torch.zeros((-(-values.shape[0] // pf),) + values.shape[1:], dtype=torch.int64)
    for i in range(values.shape[0]):
        words[i // pf] |= values[i] << (bits * (i % pf))
    return to_int32(words).movedim(0, dim)


def to_int32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _group_ranges(w: torch.Tensor, group_size: int, order: torch.Tensor):
    """(min, max) of each group of `group_size` columns taken in `order`: [N, groups] each."""
    cols = w[:, order]
    groups = -(-w.shape[1] // group_size)
    lows, highs = [], []
    for g in range(groups):
        block = cols[:, g * group_size:(g + 1) * group_size]
        lows.append(block.amin(dim=1))
        highs.append(block.amax(dim=1))
    return torch.stack(lows, 1), torch.stack(highs, 1)


def quantize_gptq(w, bits, group_size, sym, act_order, seed):
    """AutoGPTQ's quantizer conventions (docs/formats.md §1.4). Returns q [K, N], scales [groups, N]
    (fp16), zeros [groups, N] (unsigned, true zeros), g_idx [K]."""
    n, k = w.shape
    group_size = k if group_size == -1 else group_size
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
    low, high = _group_ranges(w.float(), group_size, order)
    low, high = low.clamp(max=0), high.clamp(min=0)
    maxq = 2**bits - 1
    if sym:
        amax = torch.maximum(low.abs(), high)
        scales = (2 * amax / maxq).clamp(min=1e-6).half()
        zeros = torch.full_like(scales, (maxq + 1) // 2, dtype=torch.float32)
    else:
        scales = ((high - low) / maxq).clamp(min=1e-6).half()
        zeros = (-low / scales.float()).round().clamp(0, maxq)
    s, z = scales.float()[:, g_idx.long()], zeros[:, g_idx.long()]  # [N, K]
    q = (w.float() / s).round().add(z).clamp(0, maxq)
    return q.t().to(torch.int64), scales.t().contiguous(), zeros.t().contiguous(), g_idx


def _dequantize(q_kn, scales, zeros, g_idx):
    """W [N, K] from q [K, N] and per-group scales/zeros [groups, N]."""
    g = g_idx.long()
    return ((q_kn.float() - zeros.float()[g]) * scales.float()[g]).t()


def gptq_tensors(w, bits=4, group_size=32, sym=True, act_order=False, v2=False, seed=0):
    q, scales, zeros, g_idx = quantize_gptq(w, bits, group_size, sym, act_order, seed)
    packed_zeros = pack_fields(zeros.to(torch.int64), bits, dim=1)  # [groups, N / pf] true zeros
    if not v2:
        # GPTQModel's v1 export: zero - 1 in every field, by word-wide subtraction (borrows included).
        one_per_field = sum(1 << (bits * i) for i in range(32 // bits))
        packed_zeros = to_int32((packed_zeros.to(torch.int64) & 0xFFFFFFFF) - one_per_field)
    tensors = {"qweight": pack_fields(q, bits, dim=0), "qzeros": packed_zeros, "scales": scales, "g_idx": g_idx}
    return tensors, _dequantize(q, scales, zeros, g_idx)


def awq_tensors(w, group_size=32, **_):
    """AutoAWQ GEMM: asymmetric 4-bit, packed along N in the interleaved order."""
    n, k = w.shape
    low, high = _group_ranges(w.float(), group_size, torch.arange(k))
    scales = ((high - low).clamp(min=1e-5) / 15).half()  # [N, groups]
    zeros = (-(low / scales.float()).round()).clamp(0, 15)
    g = torch.arange(k) // group_size
    q = ((w.float() / scales.float()[:, g]).round() + zeros[:, g]).clamp(0, 15)  # [N, K]

    def pack_awq(values_kn):  # [R, N] -> [R, N / 8]
        interleaved = values_kn.reshape(values_kn.shape[0], -1, 8)[:, :, list(AWQ_ORDER)].reshape(values_kn.shape)
        return pack_fields(interleaved.to(torch.int64), 4, dim=1)

    tensors = {"qweight": pack_awq(q.t()), "qzeros": pack_awq(zeros.t()), "scales": scales.t().contiguous()}
    return tensors, _dequantize(q.t(), scales.t(), zeros.t(), g)


def ct_tensors(w, bits=4, group_size=64, sym=True, packed=True, packed_zero_point=True, act_order=False, seed=0):
    """compressed-tensors int weights: signed values, +2**(bits-1) before packing (docs/formats.md §3.4)."""
    n, k = w.shape
    group = k if group_size == -1 else group_size
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    low, high = _group_ranges(w.float(), group, order)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if sym:
        scales = (torch.maximum(low.abs(), high.abs()) / ((qmax - qmin) / 2)).clamp(min=1e-6).bfloat16()
        zp = torch.zeros_like(scales, dtype=torch.float32)
    else:
        low, high = low.clamp(max=0), high.clamp(min=0)
        scales = ((high - low) / (qmax - qmin)).clamp(min=1e-6).bfloat16()
        zp = (qmin - low / scales.float()).round().clamp(qmin, qmax)
    s, z = scales.float()[:, g_idx.long()], zp[:, g_idx.long()]
    q = ((w.float() / s).round() + z).clamp(qmin, qmax)  # [N, K] signed
    offset = 2 ** (bits - 1)
    if packed:
        tensors = {"weight_packed": pack_fields((q + offset).to(torch.int64), bits, dim=1),
                   "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    else:
        tensors = {"weight": q.to(torch.int8)}
    tensors["weight_scale"] = scales
    if not sym:
        tensors["weight_zero_point"] = (pack_fields((zp + offset).to(torch.int64), bits, dim=0) if packed_zero_point
                                        else zp.to(torch.int8))
    if act_order:
        tensors["weight_g_idx"] = g_idx
    return tensors, ((q - z) * s)


BUILDERS = {"gptq": gptq_tensors, "awq": awq_tensors, "ct": ct_tensors}


def make_int_checkpoint(folder: Path, fmt: str, quantization_config: dict, *, arch="llama", seed=0,
                        positive_first_group=False, side_file: str | None = None, quantize_lm_head=False,
                        **options):
    """Write a tiny `arch` checkpoint whose decoder linears are stored in format `fmt`
    ("gptq" | "awq" | "ct") with `options`; returns the transformers model holding the
    dequantized weights (the reference).

    positive_first_group: make the first input group of layer 0's q_proj all-positive, so that
    asymmetric quantizers give it a zero point of 0 (the case GPTQ v1 cannot store plainly).
    quantize_lm_head: store lm_head in the format too (GPTQ's `lm_head: true`)."""
    # A quantized lm_head packs the vocabulary 8 to a word: make it a multiple of 8.
    model = make_checkpoint(folder, arch, seed=seed, **({"vocab_size": 320} if quantize_lm_head else {}))
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    prefixes = [f"model.layers.{i}.{linear}" for i in range(model.config.num_hidden_layers) for linear in LINEARS]
    with torch.no_grad():
        for prefix in prefixes + (["lm_head"] if quantize_lm_head else []):
            # One act-order permutation per layer: q/k/v (and gate/up) share their input.
            layer_seed = int(prefix.split(".")[2]) if prefix.startswith("model.layers.") else 1000
            w = state.pop(f"{prefix}.weight")
            if positive_first_group and prefix == "model.layers.0.self_attn.q_proj":
                w = w.clone()
                w[:, :32] = w[:, :32].abs()
            tensors, dequantized = BUILDERS[fmt](w, seed=seed + layer_seed, **options)
            state.update({f"{prefix}.{name}": t.contiguous() for name, t in tensors.items()})
            model.get_submodule(prefix).weight.copy_(dequantized)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    if side_file is None:
        config["quantization_config"] = quantization_config
    else:
        (folder / side_file).write_text(json.dumps(quantization_config))
    (folder / "config.json").write_text(json.dumps(config))
    return model


def ct_config(fmt="pack-quantized", bits=4, group_size=64, sym=True, actorder=None, ignore=("lm_head",)):
    strategy = "channel" if group_size == -1 else "group"
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy,
               "group_size": None if group_size == -1 else group_size, "actorder": actorder, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": list(ignore), "kv_cache_scheme": None}
