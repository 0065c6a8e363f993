"""NVFP4 checkpoints: compressed-tensors nvfp4-pack-quantized and ModelOpt NVFP4, written here from
the formats' definitions (docs/formats.md §15), independently of qrt's loaders.

Each decoder linear W [N, K] gets a global scale from its amax (fused q/k/v and gate/up share the
smallest, as llm-compressor and ModelOpt fuse them), an e4m3 scale per 16 input channels, and the
E2M1 code nearest to each weight over its scale; the codes are packed two a byte, the even channel
in the low nibble. `write_nvfp4` returns the dequantized weights, the reference a loader must
reproduce exactly.
"""

import json

import torch
from safetensors.torch import save_file

from helpers.checkpoints.tiny import make_checkpoint
from qrt.kernels.choices import choose
from qrt.kernels.lut4_reference import Lut4Weights

from . import FormatCase

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
E4M3_MAX, E2M1_MAX = 448.0, 6.0
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def nearest_codes(scaled: torch.Tensor) -> torch.Tensor:
    """uint8 codes of the E2M1 values nearest to `scaled` [N, K] (any of a tie will do for a writer)."""
    return (scaled[..., None] - E2M1).abs().argmin(dim=-1).to(torch.uint8)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes -> [N, K / 2] bytes: channel 2 i in the low nibble of byte i, 2 i + 1 in the high."""
    n, k = codes.shape
    packed = torch.zeros(n, k // 2, dtype=torch.uint8)
    for i in range(k // 2):
        packed[:, i] = codes[:, 2 * i] | (codes[:, 2 * i + 1] << 4)
    return packed


def quantize(w: torch.Tensor, amax: torch.Tensor, producer: str):
    """w [N, K] fp32 and the (fused) tensor amax -> (codes [N, K], e4m3 scales [N, K / 16], the
    stored global scale, the dequantized weight [N, K] fp32)."""
    n, k = w.shape
    groups = w.view(n, k // 16, 16)
    block_amax = groups.abs().amax(dim=-1)  # [N, K / 16]
    if producer == "compressed-tensors":
        stored_global = (E4M3_MAX * E2M1_MAX / amax).float()  # divides the block scale
        block = (stored_global * block_amax / E2M1_MAX).to(torch.float8_e4m3fn)
        step = block.float() / stored_global  # [N, K / 16]
    else:  # ModelOpt: weight_scale_2 = amax / (6 · 448) multiplies it
        stored_global = (amax / (E2M1_MAX * E4M3_MAX)).float()
        block = (block_amax / E2M1_MAX / stored_global).to(torch.float8_e4m3fn)
        step = block.float() * stored_global
    codes = nearest_codes((groups / step[..., None]).clamp(-E2M1_MAX, E2M1_MAX).view(n, k))
    dequantized = (E2M1[codes.long()].view(n, k // 16, 16) * step[..., None]).view(n, k)
    return codes, block, stored_global, dequantized


def write_nvfp4(folder, producer: str = "compressed-tensors", activations: bool = False, fuse_globals: bool = True,
                arch: str = "llama", seed: int = 0, fp8_kv_cache: bool = False) -> dict:
    """Write a tiny `arch` checkpoint in `producer`'s NVFP4 layout into `folder` (ModelOpt's with
    an FP8 KV cache's k_scale / v_scale if asked); return the dequantized weight of every
    quantized linear by checkpoint name."""
    folder.mkdir(parents=True, exist_ok=True)
    hf = make_checkpoint(folder, arch, seed=seed)
    state = {name: value.detach().clone() for name, value in hf.state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 1)
    amax = {name: value.abs().amax() for name, value in state.items()}
    if fuse_globals:
        for name in list(amax):
            module, _, leaf = name.rpartition(".")
            for fused in FUSED:
                if leaf == "weight" and module.endswith(fused):
                    prefix = module.rsplit(".", 1)[0]
                    amax[name] = max(amax[f"{prefix}.{part}.weight"] for part in fused)
    tensors, dequantized = {}, {}
    input_amax = {}  # one calibrated activation range per input, shared by the modules reading it
    for name, value in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or not module.endswith(LINEARS):
            tensors[name] = value
            continue
        codes, block, stored_global, dequantized[name] = quantize(value.float(), amax[name], producer)
        packed = pack_codes(codes)
        if producer == "compressed-tensors":
            tensors.update({f"{module}.weight_packed": packed, f"{module}.weight_scale": block,
                            f"{module}.weight_global_scale": stored_global.reshape(1)})
        else:
            tensors.update({f"{module}.weight": packed, f"{module}.weight_scale": block,
                            f"{module}.weight_scale_2": stored_global.reshape(())})
        if activations:
            reader = next((module.rsplit(".", 1)[0] + "/" + "+".join(fused) for fused in FUSED
                           if module.endswith(fused)), module)
            input_amax.setdefault(reader, torch.rand((), generator=gen) * 4 + 2)
            scale = E4M3_MAX * E2M1_MAX / input_amax[reader]
            if producer == "compressed-tensors":
                tensors[f"{module}.input_global_scale"] = scale.reshape(1).float()
            else:
                tensors[f"{module}.input_scale"] = (1 / scale).reshape(()).float()
        if fp8_kv_cache and module.endswith(("k_proj", "v_proj")):  # amax / 448, as ModelOpt exports them
            leaf_name = "k_scale" if module.endswith("k_proj") else "v_scale"
            tensors[f"{module}.{leaf_name}"] = torch.tensor(0.0125 if leaf_name == "k_scale" else 0.02)
    for path in folder.glob("*.safetensors"):
        path.unlink()
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    if producer == "compressed-tensors":
        config["quantization_config"] = ct_nvfp4_config(activations)
    else:  # ModelOpt: NVFP4 rounds activations, W4A16_NVFP4 leaves them as they are
        config["quantization_config"] = modelopt_nvfp4_config(activations)
        if fp8_kv_cache:
            config["quantization_config"]["kv_cache_scheme"] = {"type": "float", "num_bits": 8, "dynamic": False}
    (folder / "config.json").write_text(json.dumps(config))
    return dequantized


def _fp4_args(dynamic) -> dict:
    return {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
            "dynamic": dynamic, "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": "torch.float8_e4m3fn"}


def ct_nvfp4_config(activations: bool) -> dict:
    inputs = _fp4_args("local") if activations else None
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": _fp4_args(False),
                                          "input_activations": inputs, "format": "nvfp4-pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def modelopt_nvfp4_config(activations: bool = True) -> dict:
    """As ModelOpt 0.47's export_hf_checkpoint writes it into config.json: NVFP4, or W4A16_NVFP4
    (weights only)."""
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    group = {"input_activations": fp4, "weights": fp4} if activations else {"weights": fp4}
    return {"config_groups": {"group_0": {**group, "targets": ["Linear"]}},
            "ignore": ["lm_head", "model.embed_tokens"], "quant_algo": "NVFP4" if activations else "W4A16_NVFP4",
            "producer": {"name": "modelopt", "version": "0.47.0"}, "quant_method": "modelopt"}


def lut4_kernels(device: str, dtype: torch.dtype = torch.float32) -> frozenset:
    """The kernel the loader pass chooses for these layers' weights on `device` in `dtype`."""
    sample = Lut4Weights(torch.zeros(64, 64, dtype=torch.uint8), E2M1, 16, torch.full((64, 4), 0x38, dtype=torch.uint8),
                         "e4m3", torch.tensor(1.0), True)
    return frozenset({choose("qrt.lut4_linear", device, weights=sample, dtype=dtype).op})


CASES = {
    "compressed-tensors:nvfp4-pack-quantized": FormatCase(lambda folder: write_nvfp4(folder), None,
                                                          lut4_kernels("cpu"), lut4_kernels("cuda")),
    "stored:modelopt-nvfp4": FormatCase(lambda folder: write_nvfp4(folder, "modelopt", activations=True), None,
                                        lut4_kernels("cpu"), lut4_kernels("cuda")),
    "stored:modelopt-w4a16_nvfp4": FormatCase(lambda folder: write_nvfp4(folder, "modelopt"), None,
                                              lut4_kernels("cpu"), lut4_kernels("cuda")),
}
