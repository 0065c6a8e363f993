"""A tiny DeepSeek-V3 checkpoint with one multi-token-prediction layer in DeepSeek's on-disk layout
(`model.layers.N.` after the N decoder layers: the layer's own tensors as a decoder layer's, plus
enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding and lm_head), and transformers'
MtpModel read from that file, the reference qrt's draft is held to.

transformers writes no MTP layer (its DeepseekV3ForCausalLM has none), so the layer's decoder part
is written by transformers as layer N of a model one layer deeper, in the hub's layout (one tensor
per expert); the parts around it are added under DeepSeek-V3's names. Reading the file back with
transformers' own MtpModel.from_pretrained checks those names against transformers' conversion."""

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from helpers.checkpoints.moe import make_moe_checkpoint, random_moe_model

ARCH = "deepseek_v3"


def make_mtp_checkpoint(folder: Path, *, seed: int = 0, dtype=torch.float32, **overrides):
    """Write the checkpoint (its tensors in `dtype`); return the float32 transformers model it
    holds (without its MTP layer)."""
    model = make_moe_checkpoint(folder, ARCH, seed=seed, dtype=dtype, **overrides)
    layers = model.config.num_hidden_layers
    deeper = random_moe_model(ARCH, seed=seed + 1, **{**overrides, "num_hidden_layers": layers + 1})
    with tempfile.TemporaryDirectory() as scratch:
        deeper.save_pretrained(scratch, safe_serialization=True)
        written = load_file(str(Path(scratch) / "model.safetensors"))
    prefix = f"model.layers.{layers}."
    state = load_file(str(folder / "model.safetensors"))
    state.update({name: tensor for name, tensor in written.items() if name.startswith(prefix)})
    width = model.config.hidden_size
    generator = torch.Generator().manual_seed(seed + 2)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        state[f"{prefix}{norm}.weight"] = 1.0 + 0.1 * torch.randn(width, generator=generator)
    state[f"{prefix}eh_proj.weight"] = torch.randn(width, 2 * width, generator=generator) * (2 * width) ** -0.5
    state[f"{prefix}embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state[f"{prefix}shared_head.head.weight"] = state["lm_head.weight"].clone()
    state.update({name: tensor.to(dtype) for name, tensor in state.items()
                  if name.startswith(prefix) and tensor.dtype == torch.float32})
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2))
    return model


def set_mtp_tensors(folder: Path, tensors: dict) -> None:
    """Replace the MTP layer's tensors (checkpoint names) in the checkpoint, in its dtypes."""
    state = load_file(str(folder / "model.safetensors"))
    state.update({name: tensor.to(state[name].dtype) for name, tensor in tensors.items()})
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def transformers_mtp(folder: Path):
    """(the checkpoint's model, its MtpModel), both as transformers reads them from the file."""
    import transformers
    from transformers.modeling_layers import MtpModel

    model = transformers.DeepseekV3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    # MtpModel finds the layer by the model's pattern of keys it ignores, which transformers writes
    # for DeepSeek-V3's 61 layers (r"model\.layers\.61.*"); the same pattern at this model's depth.
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{model.config.num_hidden_layers}.*"]
    return model, MtpModel.from_pretrained(model).float().eval()


def _checkpoint_name(name: str, layers: int) -> str | None:
    """The checkpoint name of MtpModel parameter `name` (its one layer), for the parts stored
    under the same names in both (every part but the routed experts, which transformers fuses)."""
    part = name.removeprefix("layers.0.")
    if part == name or ".experts." in part or part.startswith("mtp_block.mlp.gate."):
        return None
    if part.startswith("mtp_block."):
        return f"model.layers.{layers}.{part.removeprefix('mtp_block.')}"
    return f"model.layers.{layers}.{part.replace('post_norm.', 'shared_head.norm.')}"


def training_prompts(vocab_size: int, sequences: int = 8, seed: int = 0) -> list[list[int]]:
    """The random 4-token prompts whose greedy continuations train_mtp_layer trains on."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (sequences, 4), generator=generator).tolist()


def train_mtp_layer(folder: Path, *, sequences: int = 8, length: int = 48, steps: int = 300, seed: int = 0) -> float:
    """Train the checkpoint's MTP layer, as DeepSeek trains it, to predict the token after next on
    the model's own greedy continuations of random prompts (seeded), and write it back: a layer
    whose guesses the model keeps, so that a draft's kept runs, chains and catch-ups are exercised.
    Only the parts stored under transformers' names train (the routed experts and the router stay
    as written). Returns the share of the training sequences' tokens it then predicts."""
    model, mtp = transformers_mtp(folder)
    layers = model.config.num_hidden_layers
    prompts = torch.tensor(training_prompts(model.config.vocab_size, sequences, seed))
    with torch.no_grad():
        ids = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=length - 4, min_new_tokens=length - 4, do_sample=False)
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]  # [S, L, D]
    trained = {name: param for name, param in mtp.named_parameters() if _checkpoint_name(name, layers)}
    for param in mtp.parameters():
        param.requires_grad_(False)
    for param in trained.values():
        param.requires_grad_(True)
    optimizer = torch.optim.Adam(trained.values(), lr=3e-3)
    positions = torch.arange(1, length - 1)[None].expand(sequences, -1)
    targets = ids[:, 2:]  # the token after next of each pair (h_i, t_{i+1})

    def predicted():
        out = mtp.forward_layer(0, hidden[:, :-2], positions, None, input_ids=ids[:, 1:-1])
        return mtp._project_to_logits(out)  # [S, L - 2, V]

    torch.manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(predicted().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        share = float((predicted().argmax(-1) == targets).float().mean())
    set_mtp_tensors(folder, {_checkpoint_name(name, layers): param.detach().clone() for name, param in trained.items()})
    return share
