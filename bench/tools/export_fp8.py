"""Write an FP8 copy of a bf16 Hugging Face checkpoint in another tool's on-disk layout, so the
pre-quantized loaders can be benchmarked on a real model.

    python -m bench.tools.export_fp8 DST --layout hf-fp8        # per-tensor weights, dynamic activations
    python -m bench.tools.export_fp8 DST --layout hf-fp8-block  # block weights (--block, default 128)
    python -m bench.tools.export_fp8 DST --layout ct-channel    # compressed-tensors, per-channel weights
    python -m bench.tools.export_fp8 DST --layout hf-fp8 --src path/to/bf16-checkpoint  # default: the default model

Only layouts with dynamic activations are offered: static input scales need a calibration run.
Every linear layer of the decoder is quantized; embeddings and lm_head stay as they are.
"""

import argparse
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from qrt.checkpoint.safetensors_files import checkpoint_files, iter_tensors

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8, FP8_MAX = torch.float8_e4m3fn, 448.0


def quantize(w: torch.Tensor, layout: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] -> (e4m3 codes [N, K], scale) with the scale shape the layout stores."""
    w = w.float()
    if layout == "hf-fp8":
        scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)  # [] fp32
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    if layout == "ct-channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # [N, 1]
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.to(torch.bfloat16)
    n, k = w.shape
    rows, cols = math.ceil(n / block), math.ceil(k / block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:n, :k] = w
    tiles = padded.view(rows, block, cols, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [ceil(N/b), ceil(K/b)]
    codes = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(rows * block, cols * block)
    return codes[:n, :k].to(FP8), scale


def quant_config(layout: str, block: int) -> dict:
    if layout == "hf-fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if layout == "hf-fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]}
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**fp8, "strategy": "channel", "dynamic": False},
                                          "input_activations": {**fp8, "strategy": "token", "dynamic": True}}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def export(src: Path, dst: Path, layout: str, block: int) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    scale_name = "weight_scale_inv" if layout == "hf-fp8-block" else "weight_scale"
    tensors = {}
    for _, name, tensor in iter_tensors(checkpoint_files(src)):
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.endswith(LINEARS):
            codes, scale = quantize(tensor, layout, block)
            tensors[name], tensors[f"{module}.{scale_name}"] = codes, scale.contiguous()
        else:
            tensors[name] = tensor
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant_config(layout, block)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra in src.iterdir():  # tokenizer, chat template, generation config
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(extra, dst / extra.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dst", help="folder to write")
    parser.add_argument("--src", help="bf16 checkpoint folder (default: the default model)")
    parser.add_argument("--layout", choices=("hf-fp8", "hf-fp8-block", "ct-channel"), required=True)
    parser.add_argument("--block", type=int, default=128, help="weight block size for hf-fp8-block")
    args = parser.parse_args()
    if args.src is None:
        from qrt.runtime.default_model import default_model_path

        args.src = default_model_path()
    export(Path(args.src), Path(args.dst), args.layout, args.block)
    print(f"wrote {args.layout} checkpoint to {args.dst}")


if __name__ == "__main__":
    main()
