"""What the producer scripts share: the seeded random base models, the calibration data, and the
writers of a variant's reference folder and kit.json.

Runs inside any producer venv (torch, transformers and safetensors only). The bases are made once
per kit, in the base venv (`python base_models.py ROOT` writes ROOT/<arch>/ for every arch), so
that every producer quantizes the very same checkpoint bytes."""

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the byte tokenizer
from tiny_tokenizer import BOS, IM_END, write_tokenizer  # noqa: E402

# The sizes every dense base shares; vocab 1024 pads the tokenizer's 259 ids.
_DENSE = dict(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=512,
              tie_word_embeddings=False, rms_norm_eps=1e-6, initializer_range=0.02,
              bos_token_id=BOS, eos_token_id=IM_END)

# name: (transformers config class, model class, config overrides, dtype on disk)
BASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_DENSE), torch.float16),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_DENSE), torch.float16),
    # Qwen3-MoE as the hub stores it: one tensor per expert, q/k norms, renormalized top-2.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _DENSE, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
        norm_topk_prob=True), torch.bfloat16),
}

# Routers are scaled up so that each token's expert choice is decisive: a near-tie would flip with
# any rounding, and a quantized model would then disagree with its reference for no fault of either.
ROUTER_SCALE = 8.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

CALIBRATION_TEXT = (
    "The river town woke slowly that autumn. Before the sun had cleared the hills, the baker had "
    "already pulled the first loaves from the oven, and the smell of warm bread drifted down to the "
    "docks where the fishermen were mending their nets. Nobody hurried. The ferry left at seven, as it "
    "had every morning for forty years, and the schoolchildren waved to the pilot from the bridge. In "
    "the library, the old clock above the reading room struck the hour a minute late, which everyone "
    "agreed was part of its charm. Measurements taken by the weather station showed a light wind from "
    "the north-west, a pressure of 1016 hectopascals and a temperature of 9.5 degrees. By noon the "
    "market square was full: apples, pears and quinces in wooden crates, cheeses wrapped in cloth, jars "
    "of honey that glowed amber in the light. A violinist played near the fountain, and a small crowd "
    "gathered to listen, dropping coins into the open case at her feet. Later, clouds rolled in from the "
    "sea, the first drops of rain darkened the cobblestones, and the stall keepers pulled their awnings "
    "tight. In the evening the lamps along the embankment came on one by one, reflected in the slow "
    "brown water, and the town settled into the quiet rhythm of another night: dishes washed, stories "
    "read aloud, windows glowing yellow until, one after another, they went dark. Questions remained, "
    "of course. Would the new bridge be finished before winter? Could the mill be repaired, or should it "
    "be sold? The council would meet on Thursday at 18:30 to decide, and the minutes would be posted, as "
    "always, on the board outside the post office for anyone who cared to read them."
)


def make_base(folder: Path, arch: str, seed: int = 0) -> None:
    """Write the random `arch` base checkpoint into `folder`: config, safetensors, byte tokenizer.

    transformers' own init (normal, std 0.02) is kept but reshaped so that quantizers have real work:
    each linear's input channels get a log-normal scale (groups of 128 columns then need different
    scales, and act-order has a column order to choose), and the norms get a few outlier channels
    (activation-aware methods then have salient channels to protect)."""
    import transformers

    config_name, model_name, overrides, dtype = BASES[arch]
    config = getattr(transformers, config_name)(**overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)  # the hub's on-disk tensor names
    del model

    tensors = load_tensors(folder)
    generator = torch.Generator().manual_seed(seed + 1)
    for name in sorted(tensors):
        tensor = tensors[name].float()
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * torch.randn(tensor.shape, generator=generator)
            if tensor.numel() == config.hidden_size:
                outliers = torch.randperm(tensor.numel(), generator=generator)[:4]
                tensor[outliers] *= 6.0
        elif name.endswith(".bias"):
            tensor = 0.1 * torch.randn(tensor.shape, generator=generator)
        elif name.endswith("mlp.gate.weight"):  # a MoE router
            tensor = tensor * ROUTER_SCALE
        elif ".layers." in name and name.endswith("_proj.weight"):
            column_scale = torch.exp(0.5 * torch.randn(tensor.shape[1], generator=generator))
            tensor = tensor * column_scale
        tensors[name] = tensor.to(dtype).contiguous()
    for path in folder.glob("*.safetensors"):
        path.unlink()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config_path = folder / "config.json"
    saved = json.loads(config_path.read_text())
    saved["dtype"] = str(dtype).removeprefix("torch.")
    config_path.write_text(json.dumps(saved, indent=2))
    write_tokenizer(folder)


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in `folder`, as stored."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as file:
            for name in file.keys():
                tensors[name] = file.get_tensor(name)
    return tensors


def calibration_ids(samples: int = 8, length: int = 128) -> torch.Tensor:
    """`samples` windows of `length` byte tokens from CALIBRATION_TEXT, spread over it evenly."""
    data = torch.tensor(list(CALIBRATION_TEXT.encode()), dtype=torch.long)
    stride = (data.numel() - length) // max(samples - 1, 1)
    return torch.stack([data[i * stride:i * stride + length] for i in range(samples)])


def calibration_texts(samples: int = 8, length: int = 128) -> list[str]:
    """The same windows as calibration_ids, as text (for producers that tokenize themselves)."""
    return [bytes(row.tolist()).decode(errors="ignore") for row in calibration_ids(samples, length)]


def copy_tokenizer(base: Path, folder: Path) -> None:
    """The base's tokenizer files into `folder` (producers do not all save the tokenizer)."""
    for name in TOKENIZER_FILES:
        shutil.copy2(base / name, folder / name)


def write_reference(variant: Path, base: Path, tensors: dict[str, torch.Tensor]) -> None:
    """variant/reference/: the base architecture's config (no quantization_config) with float32
    weights `tensors`, which must hold exactly the base checkpoint's tensor names and shapes."""
    base_tensors = load_tensors(base)
    missing, extra = base_tensors.keys() - tensors.keys(), tensors.keys() - base_tensors.keys()
    assert not missing and not extra, f"reference names differ from the base: missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]}"
    for name, tensor in tensors.items():
        assert tuple(tensor.shape) == tuple(base_tensors[name].shape), f"{name}: {tuple(tensor.shape)} vs {tuple(base_tensors[name].shape)}"
        assert torch.isfinite(tensor).all(), f"{name} is not finite"
    folder = variant / "reference"
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.float().contiguous() for name, tensor in tensors.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    config["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(base, folder)


def write_kit(variant: Path, **fields) -> None:
    """variant/kit.json: what the variant is (producer, version, scheme, quantized modules...)."""
    (variant / "kit.json").write_text(json.dumps(fields, indent=2))



def cli(variants: dict, build) -> None:
    """A producer script's command line: `--list` prints its variant names, one a line;
    `VARIANT BASE_ROOT OUT` runs build(VARIANT, BASE_ROOT, OUT)."""
    if sys.argv[1:] == ["--list"]:
        print("\n".join(variants))
        return
    variant, base_root, out = sys.argv[1:]
    build(variant, Path(base_root), Path(out))


if __name__ == "__main__":
    for name in BASES:
        make_base(Path(sys.argv[1]) / name, name)
        print(f"base model {name} written")
