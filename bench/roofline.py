"""The decode roofline: this machine's memory read bandwidth, and the weight bytes a model reads per
decode step. One decode step reads every weight once (the embedding only a row per token), so a
batch of B tokens can come no faster than B × bandwidth ÷ weight bytes per step.

    python -m bench.roofline              # print the bandwidth (measured once, then cached)
    python -m bench.roofline --remeasure  # measure again

The bandwidth is the median of several sums of a 1 GiB fp32 tensor (read once, nothing written)
with torch's threads, cached in the qrt cache under bench/bandwidth.json per thread count.
"""

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch

from bench.measure import wall_time
from qrt.cache_dir import cache_root  # qrt's cache folder, QRT_CACHE_DIR aware

BANDWIDTH_BYTES = 2**30
BANDWIDTH_RUNS = 7


def cache_file() -> Path:
    return cache_root() / "bench" / "bandwidth.json"


def read_bandwidth(nbytes: int = BANDWIDTH_BYTES, runs: int = BANDWIDTH_RUNS) -> dict:
    """{"gb_s": median read bandwidth in 1e9 bytes/s, "runs_gb_s": each run, ...}."""
    data = torch.ones(nbytes // 4, dtype=torch.float32)  # ones: every page really allocated
    data.sum()  # untimed: first touch of the result, thread pool start-up
    seconds = [wall_time(data.sum) for _ in range(runs)]
    runs_gb_s = [nbytes / s / 1e9 for s in seconds]
    return {"gb_s": statistics.median(runs_gb_s), "runs_gb_s": runs_gb_s, "bytes": nbytes,
            "threads": torch.get_num_threads(), "cpu": _cpu_name()}


def cached_bandwidth(remeasure: bool = False) -> dict:
    """The bandwidth of this CPU at torch's current thread count, measured on first use."""
    path = cache_file()
    key = f"{_cpu_name()} / {torch.get_num_threads()} threads"
    cached = json.loads(path.read_text()) if path.is_file() else {}
    if remeasure or key not in cached:
        cached[key] = read_bandwidth()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=2))
    return cached[key]


def _cpu_name() -> str:
    # The cached figure belongs to this CPU: a home folder shared between machines must not mix them.
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def weight_bytes_per_token(model: torch.nn.Module, embedding: torch.Tensor | None) -> int:
    """Bytes of weights one decode step reads: every parameter as stored (packed int4 is half a
    byte a weight because its storage is), except the input embedding, of which one row, unless
    the lm_head shares it and so reads it whole. An embedding of None holds no weight of its own
    (it looks its rows up in the lm_head's, which the step reads whole)."""
    unique = {id(p): p for p in model.parameters()}.values()
    if embedding is None:
        return sum(_nbytes(p) for p in unique)
    shared = sum(p is embedding for _, p in model.named_parameters(remove_duplicate=False)) > 1
    others = sum(_nbytes(p) for p in unique if p is not embedding)
    row = _nbytes(embedding) // embedding.shape[0]
    return others + row + (_nbytes(embedding) if shared else 0)


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter and buffer of the model but its caches (the KV cache's
    `k_cache`, `v_cache` and their kin, which grow with the context, not the weights), as held."""
    buffers = [t for name, t in model.named_buffers() if not name.endswith("cache")]
    tensors = {id(t): t for t in (*model.parameters(), *buffers)}.values()
    return sum(_nbytes(t) for t in tensors)


def kv_bytes_per_step(model: torch.nn.Module, attended: float) -> float:
    """Bytes of K and V one decode step of one row reads when its token attends over `attended`
    cache entries: every layer's K and V rows of that many entries (a sliding-window layer's at
    most its window), as the cache stores them."""
    total = 0.0
    for module in model.modules():
        cache = getattr(module, "k_cache", None)
        if not isinstance(cache, torch.Tensor):
            continue
        _, kv_heads, _, head_dim = cache.shape  # [slots, KVH, S, hd]
        window = getattr(module, "sliding_window", None)
        entries = attended if window is None else min(attended, window)
        total += 2 * kv_heads * entries * head_dim * cache.element_size()
    return total


def expert_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a mixture-of-experts model's routed experts (parameters under `.experts.`, as qrt
    and transformers name them), of which a decode step reads only the experts its tokens pick."""
    return sum(_nbytes(p) for name, p in model.named_parameters() if ".experts." in name)


def experts_read_fraction(num_experts: int, top_k: int, batch: int) -> float:
    """The share of the experts a decode step of `batch` tokens reads, each token picking top_k of
    num_experts: exactly top_k / num_experts for one token; for a batch, the expectation under
    uniform, independent routing (a random-weight router's), 1 - (1 - k/E)^batch."""
    return 1.0 - (1.0 - top_k / num_experts) ** batch


def gguf_weight_bytes_per_token(path: Path) -> int:
    """The same count for a llama.cpp GGUF file: its tensors as stored (quantized blocks with their
    scales), the token embedding (token_embd) one row, unless there is no output tensor, when the
    output layer reads the embedding whole."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    embedding = tensors["token_embd.weight"]
    rows = int(embedding.shape[-1])  # GGUF lists dims innermost first: [hidden, vocab]
    others = sum(int(t.n_bytes) for name, t in tensors.items() if name != "token_embd.weight")
    shared = "output.weight" not in tensors
    return others + int(embedding.n_bytes) // rows + (int(embedding.n_bytes) if shared else 0)


def roofline_tok_s(bandwidth_gb_s: float, weight_bytes: int, batch: int) -> float:
    return batch * bandwidth_gb_s * 1e9 / weight_bytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--remeasure", action="store_true", help="measure even if a cached figure exists")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    figures = cached_bandwidth(args.remeasure)
    runs = ", ".join(f"{x:.1f}" for x in figures["runs_gb_s"])
    print(f"read bandwidth {figures['gb_s']:.1f} GB/s ({figures['threads']} threads, {figures['cpu']}; "
          f"runs {runs}); cached in {cache_file()}")


if __name__ == "__main__":
    main()
