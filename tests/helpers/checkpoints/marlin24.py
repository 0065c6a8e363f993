"""compressed-tensors `marlin-24` (2:4-sparse W4A16) checkpoints in their exact on-disk layout.

The packer follows the producer's steps (compressed-tensors' Marlin24Compressor): prune 2 of every
4 weights along K by magnitude, quantize symmetric 4-bit, keep the two entries of each run of 4
with CUTLASS's position encoding, scatter the metadata into CUTLASS's reordered layout, cut the
kept codes + 8 into Marlin tiles, permute and pack them, and permute the scales. It is written
from docs/formats.md §3.8 and the producer's rules, independently of formats/compressed_tensors/marlin24.py (bit
shuffles here, index arithmetic there), so the tests compare two implementations.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from helpers.checkpoints.integer import LINEARS, ct_config, pack_fields
from helpers.checkpoints.tiny import make_checkpoint

# Marlin-24 tiles need output widths in multiples of 64 and inputs in multiples of 32: hidden 128
# (q 128, k/v 2 heads of 32 = 64), intermediate 384 (K / 2 = 192 > 128, so down_proj's group
# scales are permuted; K = 128 has one group).
MARLIN24_TINY = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)

# CUTLASS's choice of the two positions a run of 4 stores, by which entries are non-zero
# (bit i set: entry i non-zero). With fewer than two non-zeros it stores zeros at fixed spots.
_POSITIONS = {0b0011: (0, 1), 0b0101: (0, 2), 0b0110: (1, 2), 0b1001: (0, 3), 0b1010: (1, 3), 0b1100: (2, 3),
              0b0000: (2, 3), 0b1000: (2, 3), 0b0100: (2, 3), 0b0010: (1, 2), 0b0001: (0, 2)}


def prune_24(w: torch.Tensor) -> torch.Tensor:
    """Zero the two smallest-magnitude weights of every run of 4 along K ([N, K])."""
    runs = w.reshape(-1, 4)
    smallest = runs.abs().argsort(dim=1)[:, :2]
    return runs.scatter(1, smallest, 0.0).reshape(w.shape)


def quantize_sym4(w: torch.Tensor, group_size: int):
    """Symmetric 4-bit, amax / 7.5 per group (compressed-tensors' convention), scales in fp16 as
    the compressor casts them. Returns signed codes [N, K] and scales [N, groups]."""
    n, k = w.shape
    group = k if group_size == -1 else group_size
    groups = -(-k // group)
    amax = torch.stack([w[:, g * group:(g + 1) * group].abs().amax(dim=1) for g in range(groups)], dim=1)
    scales = (amax / 7.5).clamp(min=1e-4).half()
    return (w / _per_column(scales, group, k)).round().clamp(-8, 7).to(torch.int64), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    k = q.shape[1]
    return q * _per_column(scales, k if group_size == -1 else group_size, k)


def _per_column(scales: torch.Tensor, group: int, k: int) -> torch.Tensor:
    return scales.float().repeat_interleave(group, dim=1)[:, :k]  # [N, K]


def marlin24_weight_perm() -> list[int]:
    """The producer's 1024-entry run permutation, spelled out: stored slot -> tile-order index."""
    perm = []
    for i in range(32):
        tile, half = (i // 4) // 2, (i // 4) % 2
        firsts = [256 * tile + 16 * row + 8 * half + 4 * block
                  for block in range(2) for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4) + 8, 2 * (i % 4) + 9)]
        perm += [first + step for step in range(4) for first in firsts]
    interleaved = []
    for start in range(0, 1024, 8):
        word = perm[start:start + 8]
        interleaved += word[0::2] + word[1::2]
    return interleaved


def _reordered_meta_offset(r: int, c: int, m: int) -> int:
    """Flat offset CUTLASS's ColumnMajorInterleaved<2> metadata puts word c of row r at."""
    w = r % 64
    d = r - w + (((w >> 2) & 1) | ((w & 1) << 1) | ((w >> 3) << 2) | (((w >> 1) & 1) << 5))
    if d % 2 == 0 and c % 2 == 1:
        d, c = d + 1, c - 1
    elif d % 2 == 1 and c % 2 == 0:
        d, c = d - 1, c + 1
    return (c // 2) * 2 * m + 2 * d + c % 2


def marlin24_tensors(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> dict:
    """On-disk tensors of one linear from signed codes [N, K] with at most two non-zeros per run
    of 4 along K, and scales [N, groups] fp16."""
    n, k = q.shape
    nonzero = (q != 0).reshape(n, k // 4, 4).to(torch.int64)
    mask = (nonzero * torch.tensor([1, 2, 4, 8])).sum(-1)  # [N, K / 4]
    assert (nonzero.sum(-1) <= 2).all(), "not 2:4 sparse"
    first = mask.clone().apply_(lambda v: _POSITIONS[v][0])
    second = mask.clone().apply_(lambda v: _POSITIONS[v][1])
    runs = (q + 8).reshape(n, k // 4, 4)
    kept = torch.stack((runs.gather(2, first[..., None]), runs.gather(2, second[..., None])), 2).reshape(n, k // 2)

    nibbles = (first | (second << 2)).reshape(n, k // 16, 4)  # run 4c + t in nibble t of word c
    words = sum(nibbles[:, :, t] << (4 * t) for t in range(4))  # [N, K / 16] 16-bit patterns
    flat = torch.empty(n * (k // 16), dtype=torch.int64)
    for r in range(n):
        for c in range(k // 16):
            flat[_reordered_meta_offset(r, c, n)] = words[r, c]
    meta = torch.where(flat >= 2**15, flat - 2**16, flat).to(torch.int16).reshape(k // 32, 2 * n)

    # Kept codes as [K / 2, N], cut into 16x16 tiles: row t of tiles holds tile after tile.
    tiles = kept.t().reshape(k // 32, 16, n // 16, 16).permute(0, 2, 1, 3).reshape(k // 32, 16 * n)
    stored = tiles.reshape(-1, 1024)[:, marlin24_weight_perm()].reshape(k // 32, 16 * n)
    weight_packed = pack_fields(stored, 4, dim=1).contiguous()  # [K / 32, 2N]

    scale_packed = scales.t().contiguous()  # [groups, N]
    if group_size != -1 and group_size < k // 2:
        order = [8 * i + j for i in range(8) for j in (0, 4, 1, 5, 2, 6, 3, 7)]
        scale_packed = scale_packed.reshape(-1, 64)[:, order].reshape(scale_packed.shape)
    return {"weight_packed": weight_packed, "meta": meta, "scale_packed": scale_packed.contiguous()}


def dense_codes(q: torch.Tensor) -> torch.Tensor:
    """The unsigned [K, N] codes a loader should rebuild from signed [N, K] codes."""
    return (q + 8).t().to(torch.int32)


def marlin24_config(group_size: int = 128) -> dict:
    """quantization_config as llm-compressor writes it for a 2:4-sparse W4A16 model."""
    config = ct_config(fmt="marlin-24", bits=4, group_size=group_size)
    config["sparsity_config"] = {"format": "dense", "sparsity_structure": "2:4", "global_sparsity": 0.45,
                                 "targets": ["Linear"], "ignore": ["lm_head"]}
    return config


def make_marlin24_checkpoint(folder: Path, group_size: int = 128, seed: int = 0):
    """A tiny llama whose decoder linears are 2:4-sparse W4A16 in marlin-24 layout; returns the
    transformers model holding the dequantized weights (the reference)."""
    model = make_checkpoint(folder, "llama", seed=seed, **MARLIN24_TINY)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    with torch.no_grad():
        for i in range(model.config.num_hidden_layers):
            for linear in LINEARS:
                prefix = f"model.layers.{i}.{linear}"
                q, scales = quantize_sym4(prune_24(state.pop(f"{prefix}.weight")), group_size)
                state.update({f"{prefix}.{name}": t for name, t in marlin24_tensors(q, scales, group_size).items()})
                model.get_submodule(prefix).weight.copy_(dequantize(q, scales, group_size))
    for old in folder.glob("*.safetensors"):
        old.unlink()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = marlin24_config(group_size)
    (folder / "config.json").write_text(json.dumps(config))
    return model

