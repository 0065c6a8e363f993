"""A random-weight Llama of about 1B parameters (0.85B: hidden 2048, 16 layers, intermediate 5632,
32 heads, 8 KV heads, vocab 32000, untied lm_head) as a bf16 safetensors checkpoint, made on first
use in the qrt cache (bench/llama-1b-random) and reused afterwards. It shows how the cost of each
engine grows with size; its outputs mean nothing.

    python -m bench.tools.random_llama          # make it (if absent) and print its folder

The tensor names and shapes come from transformers' LlamaForCausalLM built on the meta device (no
memory), and the file is written one tensor at a time, so beyond the imports the peak memory is one
tensor, not the model's 1.7 GB: the largest, the embedding, is 262 MB in fp32 as it is drawn, then
131 MB in bf16.
"""

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from qrt.cache_dir import cache_root  # qrt's cache folder, QRT_CACHE_DIR aware

LLAMA_1B = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    intermediate_size=5632,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
FOLDER = "llama-1b-random"
# Written last, with what was written: a folder without it (an interrupted write) or with another
# content (an older writer, other sizes) is written again.
MARKER = ".complete"
WRITER_VERSION = 2
SEED = 0
INIT_STD = 0.02  # transformers' initializer_range for Llama: activations stay in a sane range


def random_llama_path(progress: bool = True) -> Path:
    return cached_random_checkpoint(FOLDER, LLAMA_1B, write_random_llama, WRITER_VERSION,
                                    "a random-weight Llama (0.85B parameters, bf16)" if progress else None)


def cached_random_checkpoint(name: str, shape: dict, write, writer_version: int, what: str | None) -> Path:
    """The folder bench/<name> of qrt's cache holding `write(folder, shape)`'s checkpoint, written
    on first use (saying `what` it writes, unless None)."""
    final = cache_root() / "bench" / name
    marker = json.dumps({"config": shape, "writer_version": writer_version, "seed": SEED})
    if (final / MARKER).is_file() and (final / MARKER).read_text() == marker:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(final, ignore_errors=True)
    # Written beside the final folder and renamed into place, so a killed run leaves no half model there.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
    try:
        if what:
            print(f"writing {what} into {final} (first use only)", file=sys.stderr, flush=True)
        write(tmp, shape)
        (tmp / MARKER).write_text(marker)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def write_random_llama(folder: Path, shape: dict) -> None:
    """config.json and model.safetensors of a random bf16 Llama with the given config values."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, dtype="bfloat16", architectures=["LlamaForCausalLM"])  # qrt picks the model by it
    config.save_pretrained(folder)
    with torch.device("meta"):
        names_shapes = {name: tuple(t.shape) for name, t in LlamaForCausalLM(config).state_dict().items()}
    write_random_weights(folder / "model.safetensors", names_shapes)


def write_random_weights(path: Path, names_shapes: dict) -> None:
    """Random bf16 weights of those names and shapes: norms 1, everything else N(0, INIT_STD²)."""
    generator = torch.Generator().manual_seed(SEED)

    def tensor(name: str, shape: tuple) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.bfloat16)
        return torch.randn(shape, generator=generator).mul_(INIT_STD).to(torch.bfloat16)

    write_safetensors(path, names_shapes, tensor)


def write_safetensors(path: Path, names_shapes: dict, make_tensor) -> None:
    """A bf16 safetensors file whose tensors `make_tensor(name, shape)` creates one at a time, in
    the format's layout: 8-byte little-endian header length, JSON header, then the raw data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in names_shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for name, shape in names_shapes.items():
            f.write(make_tensor(name, shape).contiguous().view(torch.uint8).numpy())


if __name__ == "__main__":
    print(random_llama_path())
