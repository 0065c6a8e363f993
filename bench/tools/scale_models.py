"""Random-weight checkpoints with the shapes of the 1-8B models people run, and the GGUF files
llama.cpp's own tools make of them, for `bench.suite --model <shape>`.

Each shape is a bf16 safetensors folder (the config values of the named model, random weights,
the default model's tokenizer: a real BPE vocabulary, padded to the shape's vocab size by the
converter), written tensor by tensor into qrt's cache (bench/<shape>/). The GGUF files come from
llama.cpp itself, as a user would make them:
- BF16 by llama.cpp's `convert_hf_to_gguf.py`, with the gguf-py beside it, both from the
  llama.cpp source inside llama-cpp-python's source distribution (the version the Makefile builds),
  fetched once with `pip download`;
- Q8_0, Q4_0, Q4_K_M, Q5_K_M and Q6_K from that BF16 file by llama.cpp's quantizer
  (`llama_model_quantize`, llama-cpp-python's binding).

    python -m bench.tools.scale_models llama-3.2-1b      # write it (first use only) and print its files
    python -m bench.tools.scale_models --list

The outputs of these models mean nothing; their sizes and shapes are what a decode step reads.
"""

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

from bench.tools.random_llama import cached_random_checkpoint, write_random_weights
from qrt.cache_dir import cache_root

# The config values of the models whose shapes are measured (their config.json on the hub).
LLAMA3 = dict(max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, vocab_size=128256)
SHAPES = {
    "llama-3.2-1b": ("llama", dict(LLAMA3, hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)),
    "llama-3.2-3b": ("llama", dict(LLAMA3, hidden_size=3072, num_hidden_layers=28, intermediate_size=8192,
                                   num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944, num_attention_heads=28,
                                 num_key_value_heads=4, vocab_size=152064, max_position_embeddings=8192,
                                 rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)),
    "llama-3.1-8b": ("llama", dict(LLAMA3, hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)),
}
QUANTIZED = ("Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")  # llama.cpp's LLAMA_FTYPE_MOSTLY_<name>
WRITER_VERSION = 1
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"  # the Makefile's llama-cpp target builds this version
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def checkpoint(shape: str) -> Path:
    """The bf16 folder of `shape`, written on first use."""
    arch, config = SHAPES[shape]
    return cached_random_checkpoint(shape, config, lambda folder, values: write_random(folder, arch, values),
                                    WRITER_VERSION, f"a random-weight {shape} (bf16)")


def ggufs(shape: str) -> list[Path]:
    """[BF16, Q8_0, Q4_0, Q4_K_M, Q5_K_M, Q6_K] GGUF files of `shape`, made on first use."""
    folder = checkpoint(shape)
    bf16 = _converted(folder, shape)
    return [bf16] + [_quantized(bf16, shape, variant) for variant in QUANTIZED]


def write_random(folder: Path, arch: str, values: dict) -> None:
    """config.json, model.safetensors (random bf16, norms 1) and the default model's tokenizer."""
    import transformers

    from qrt.runtime.default_model import default_model_path

    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[arch]
    config = getattr(transformers, config_cls)(**values, dtype="bfloat16", architectures=[model_cls])
    config.save_pretrained(folder)
    with torch.device("meta"):
        names_shapes = {name: tuple(t.shape) for name, t in getattr(transformers, model_cls)(config).state_dict().items()
                        if not (values.get("tie_word_embeddings") and name == "lm_head.weight")}
    write_random_weights(folder / "model.safetensors", names_shapes)
    for name in TOKENIZER_FILES:
        source = default_model_path() / name
        if source.is_file():
            shutil.copy(source, folder / name)


def llama_cpp_source() -> Path:
    """llama.cpp's source folder (its converter, gguf-py, and the chat templates it keeps in
    models/templates), from llama-cpp-python's source distribution (fetched once)."""
    root = cache_root() / "bench" / "llama.cpp-source"
    source = root / "llama.cpp"
    if (source / "convert_hf_to_gguf.py").is_file():
        return source
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as download:
        print(f"fetching {LLAMA_CPP_SDIST}'s source distribution for llama.cpp's converter (first use only)",
              file=sys.stderr, flush=True)
        # llama-cpp-python is published as source only: this fetches the sdist, whose metadata pip
        # prepares in a build environment of its own (nothing is compiled).
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", LLAMA_CPP_SDIST, "-d", download],
                       check=True)
        (archive,) = Path(download).glob("*.tar.gz")
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
            tar.extractall(download, members=members, filter="data")
        (vendored,) = Path(download).glob("*/vendor/llama.cpp")
        os.replace(vendored, source)
    return source


def _converted(folder: Path, shape: str) -> Path:
    path = cache_root() / "bench" / "gguf" / f"{shape}.BF16.gguf"
    if not path.is_file():
        print(f"converting {shape} to {path.name} with llama.cpp's convert_hf_to_gguf.py", file=sys.stderr, flush=True)
        convert(folder, path)
    return path


def _quantized(bf16: Path, shape: str, variant: str) -> Path:
    path = bf16.with_name(f"{shape}.{variant}.gguf")
    if not path.is_file():
        print(f"quantizing {shape} to {variant} with llama.cpp's quantizer", file=sys.stderr, flush=True)
        quantize(bf16, path, variant)
    return path


def convert(folder: Path, path: Path, outtype: str = "bf16") -> None:
    """A Hugging Face checkpoint folder -> a GGUF file at `path`, by llama.cpp's convert_hf_to_gguf.py."""
    source = llama_cpp_source()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")  # never a half-written file under the final name
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(source / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
                    "--outfile", str(partial)], check=True, env=env, stdout=sys.stderr)
    os.replace(partial, path)


def quantize(source: Path, path: Path, variant: str) -> None:
    """A GGUF file -> `variant` (Q4_K_M, ...: llama.cpp's LLAMA_FTYPE_MOSTLY_<variant>) at `path`, by llama.cpp's quantizer."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{variant}")
    partial = path.with_suffix(".partial")
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
    if status != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp's quantizer failed on {source} -> {variant} (status {status})")
    os.replace(partial, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("--list", action="store_true", help="list the shapes")
    args = parser.parse_args(argv)
    if args.list or not args.shape:
        for name, (arch, values) in SHAPES.items():
            print(f"{name}: {arch}, hidden {values['hidden_size']}, {values['num_hidden_layers']} layers, "
                  f"vocab {values['vocab_size']}, tied {values['tie_word_embeddings']}")
        return 0
    print(checkpoint(args.shape))
    for path in ggufs(args.shape):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
