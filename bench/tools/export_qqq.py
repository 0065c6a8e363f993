"""Write a QQQ (W4A8) copy of a bf16 Hugging Face checkpoint in QQQ's on-disk layout, so the QQQ
loader and the W4A8 path can be benchmarked on a real model next to the other formats:

    python -m bench.tools.export_qqq /tmp/smol-qqq                 # the default model, per channel
    python -m bench.tools.export_qqq DST --src PATH --group-size 128
    python -m bench.decode --quant bf16,int4,w8a8 --checkpoint qqq=/tmp/smol-qqq

Round-to-nearest quantization with QQQ's conventions (docs/formats.md §6.3), not QQQ's own GPTQ and
smoothing, so its quality figures say nothing about QQQ's; the layout and arithmetic are QQQ's.
The default model (hidden 576) needs per-channel scales: QQQ's groups of 128 must divide K.
"""

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from qrt.formats.qqq import channel_scale_permutation, group_scale_permutation, weight_permutation
from qrt.checkpoint.safetensors_files import checkpoint_files, iter_tensors

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def permute_columns(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, perm.numel())[:, perm].reshape(x.shape).contiguous()


def pack(values: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """values [K, N] (unsigned 4-bit, or signed codes per channel) -> B int32 [K / 16, 2N]."""
    k, n = values.shape
    tiles = values.reshape(k // 16, 16, n // 16, 16).permute(0, 2, 1, 3).reshape(k // 16, 16 * n)
    stored = permute_columns(tiles, weight_permutation(per_channel)).to(torch.int64) & 0xF
    words = sum(stored[:, i::8] << (4 * i) for i in range(8))  # [K / 16, 2N]
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize(w: torch.Tensor, group_size: int) -> dict:
    """w [N, K] -> QQQ's B, s_group, s_channel."""
    n, k = w.shape
    w = w.float()
    if group_size == -1:
        s = (w.abs().amax(dim=1) / 7.0).clamp(min=1e-8)  # [N]
        codes = (w / s[:, None]).round().clamp(-7, 7)
        return {"B": pack(codes.t().contiguous(), True), "s_group": torch.empty(0, dtype=torch.float16),
                "s_channel": permute_columns((s / 16.0).reshape(1, n), channel_scale_permutation())}
    groups = w.reshape(n, k // group_size, group_size)
    s_g = (2.0 * groups.abs().amax(dim=2) / 15.0).clamp(min=1e-8)  # [N, groups]
    q = (groups / s_g[..., None]).round().add(8).clamp(0, 15)
    s_extra = (((q - 8) * s_g[..., None]).abs().amax(dim=(1, 2)) / 127.0).clamp(min=1e-8)  # [N]
    s_group = (s_g / s_extra[:, None]).half().t().contiguous()  # [groups, N]
    return {"B": pack(q.reshape(n, k).t().contiguous(), False),
            "s_group": permute_columns(s_group, group_scale_permutation()),
            "s_channel": permute_columns(s_extra.reshape(1, n), channel_scale_permutation())}


def export(src: Path, dst: Path, group_size: int) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for _, name, tensor in iter_tensors(checkpoint_files(src)):
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.endswith(LINEARS):
            tensors.update({f"{module}.{key}": value for key, value in quantize(tensor, group_size).items()})
        else:
            tensors[name] = tensor
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "qqq", "wbits": 4, "group_size": group_size}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra in src.iterdir():  # tokenizer, chat template, generation config
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json",
                                                                                     "model.safetensors.index.json"):
            shutil.copy(extra, dst / extra.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dst", type=Path)
    parser.add_argument("--src", type=Path, help="bf16 checkpoint folder (default: the default model)")
    parser.add_argument("--group-size", type=int, choices=(-1, 128), default=-1)
    args = parser.parse_args()
    if args.src is None:
        from qrt.runtime.default_model import default_model_path
        args.src = default_model_path(progress=True)
    export(args.src, args.dst, args.group_size)
    print(f"wrote {args.dst}")


if __name__ == "__main__":
    main()
