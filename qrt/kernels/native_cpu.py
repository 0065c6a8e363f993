"""qrt's own CPU kernels (the C++ sources in csrc/: quantized_cpu.cpp, the quantized GEMVs and
GEMMs, with fp8_codes.h; pair_gemv.h, the GEMV loop on weights packed in pairs, which
dense_bf16_cpu.cpp runs on bf16 weights, int8_pairs_cpu.cpp on int8 codes and fp8_pairs_cpu.cpp on
e4m3 codes; int4_pairs_cpu.cpp, 4-bit codes in groups; superblock_cpu.cpp, 4-, 5- and 6-bit codes with two
levels of scales (llama.cpp's block types); lut4_cpu.cpp, 4-bit codes looked up in a 16-entry table
times block scales (NF4, FP4, NVFP4, MXFP4); int8_groups_cpu.cpp, byte-wide codes in groups on the
pairs' layout; decode_attention_cpu.cpp, attention of one new token per row over the
KV cache; lora_cpu.cpp, each batch row's LoRA product; shm_all_reduce_cpu.cpp, the all-reduce of tensor-parallel ranks on one host): built
together on first use, loaded as `torch.ops.qrt_cpu.*`.

They need AVX-512 with the BF16 and VBMI extensions (vdpbf16ps, vpermi2b), a C++ compiler and
ninja, all of which Inductor's CPU backend wants anyway. Where any is missing, `available()` is
False, says why once, and the kernels declared on top of these ops step aside for the ATen and
Inductor ones (each declaration's `accepts`).

The build is cached by torch's extension builder under $TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions), in a folder named after a hash of the sources and flags, so an edited
source builds afresh and a stale library is never loaded. `make setup` builds it once
(`qrt.kernels.native_cpu.why_unavailable()`); otherwise the first model load does, in about 10 s.

QRT_NATIVE_CPU=0 turns them off, to compare against the kernels they replace.
"""

import functools
import hashlib
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

SOURCES = tuple(sorted((Path(__file__).with_name("csrc")).glob("*.cpp")))
HEADERS = tuple(sorted((Path(__file__).with_name("csrc")).glob("*.h")))  # part of the build's hash
# AMX is never enabled: its tile instructions fault on some machines that report it.
CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vbmi",
          "-mf16c", "-mfma", "-fopenmp")
_NEEDED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512vbmi", "f16c", "fma")


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def why_not_wanted() -> str | None:
    """Why the kernels are not to be built here at all (switched off, or the CPU lacks their
    instructions), or None when they should build and load."""
    if os.environ.get("QRT_NATIVE_CPU", "1") == "0":
        return "QRT_NATIVE_CPU=0"
    missing = [flag for flag in _NEEDED_CPU_FLAGS if flag not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return None


def why_unavailable() -> str | None:
    """None when the kernels can be built and loaded here; otherwise the reason."""
    return why_not_wanted() or _load()


def main() -> int:
    """Build the kernels now (make setup calls this). A build that fails on a CPU that has their
    instructions is an error (exit 1, the compiler's output shown), not a quiet fallback;
    QRT_NATIVE_CPU=0 chooses the fallback on purpose."""
    reason = why_not_wanted()
    if reason is not None:
        print(f"qrt CPU kernels: not built ({reason}); ATen's kernels run instead")
        return 0
    failure = _load()
    if failure is not None:
        print(_build_log(), file=sys.stderr)
        print(f"qrt CPU kernels: {failure}", file=sys.stderr)
        print("This CPU has the instructions the kernels need, so the build should succeed; set QRT_NATIVE_CPU=0 "
              "to run without them on purpose.", file=sys.stderr)
        return 1
    print("qrt CPU kernels: built")
    return 0


def available() -> bool:
    reason = why_unavailable()
    if reason is not None:
        _warn_once(reason)
    return reason is None


@functools.cache
def _warn_once(reason: str) -> None:
    if reason != "QRT_NATIVE_CPU=0":
        warnings.warn(f"qrt's own CPU kernels are off ({reason}); quantized layers use ATen's kernels and "
                      f"fp8 weights are widened to bf16", stacklevel=3)


def _load() -> str | None:
    """Build (or find built) and load the library; None on success, else why it failed (the
    first error line of the build)."""
    log = _build_log()
    if log is None:
        return None
    first_error = next((line for line in log.splitlines() if "error:" in line), log.splitlines()[-1])
    return f"building {', '.join(s.name for s in SOURCES)} failed: {first_error.strip()}"


@functools.cache
def _build_log() -> str | None:
    """Build (or find built) and load the library; None on success, else the build's whole message."""
    from torch.utils import cpp_extension

    sources = [source.read_text() for source in (*SOURCES, *HEADERS)]
    digest = hashlib.sha256("\n".join((*sources, *CFLAGS, torch.__version__)).encode()).hexdigest()[:12]
    name = f"qrt_quantized_cpu_{digest}"
    if shutil.which("ninja") is None:  # the ninja wheel installs beside this interpreter
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    _remove_stale_lock(build_dir / "lock")
    if not any(build_dir.glob(f"{name}*.so")):
        print("qrt: building its CPU kernels (first use with this torch, about 30 s)", file=sys.stderr, flush=True)
    try:
        cpp_extension.load(name=name, sources=[str(source) for source in SOURCES], extra_cflags=list(CFLAGS),
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as error:  # a missing compiler or ninja, a failed build: fall back, say why
        return str(error).strip() or repr(error)
    _register_fakes()
    return None


# A build takes well under a minute; a lock older than this was left by a build that was killed.
STALE_LOCK_SECONDS = 600


def _remove_stale_lock(lock: Path) -> None:
    """torch's extension builder waits, silently and forever, for the lock file a build creates
    and removes; a build killed midway (Ctrl-C, a timeout) leaves it behind."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        print(f"qrt: removing {lock}, left {age / 60:.0f} min ago by a build of its CPU kernels that did not finish",
              file=sys.stderr, flush=True)
        lock.unlink(missing_ok=True)


def _register_fakes() -> None:
    """Shapes for tracing: every linear op returns [M, N], decode attention q's shape, the
    shared-memory all-reduce its input's."""

    @torch.library.register_fake("qrt_cpu::fp8_linear")
    def _(x, weight, weight_scale, bias, block_n, block_k, input_scale, min_rows_dequantized):
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("qrt_cpu::int4pack_mm")
    def _(x, packed, group_size, scale_offsets, min_rows_dequantized):
        return x.new_empty(x.shape[0], packed.shape[0])

    @torch.library.register_fake("qrt_cpu::int4_pairs_linear")
    def _(x, packed, scale_offsets, group_size, bias, min_rows_dequantized):
        return x.new_empty(x.shape[0], packed.shape[0] * packed.shape[2])

    @torch.library.register_fake("qrt_cpu::int8_groups_linear")
    def _(x, packed, scale_offsets, bias, min_rows_dequantized):
        return x.new_empty(x.shape[0], packed.shape[0] * packed.shape[2])

    @torch.library.register_fake("qrt_cpu::superblock_linear")
    def _(x, codes, bits, zero, sub_scales, sub_offsets, super_scales, super_offsets, group_size, bias,
          min_rows_dequantized):
        return x.new_empty(x.shape[0], codes.shape[0] * 64)

    @torch.library.register_fake("qrt_cpu::lut4_linear")
    def _(x, codes, table, scales, scale_format, global_multiplier, group_size, bias, min_rows_dequantized):
        return x.new_empty(x.shape[0], codes.shape[0] * 64)

    @torch.library.register_fake("qrt_cpu::int8pack_mm")
    def _(x, weight, scales, min_rows_dequantized):
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("qrt_cpu::bf16_linear")
    def _(x, packed, bias):
        return x.new_empty(x.shape[0], packed.shape[0] * packed.shape[2])

    @torch.library.register_fake("qrt_cpu::int8_pairs_linear")
    def _(x, packed, scales, bias):
        return x.new_empty(x.shape[0], packed.shape[0] * packed.shape[2])

    @torch.library.register_fake("qrt_cpu::fp8_pairs_linear")
    def _(x, packed, weight_scale, bias, input_scale):
        return x.new_empty(x.shape[0], packed.shape[0] * packed.shape[2])

    @torch.library.register_fake("qrt_cpu::decode_attention")
    def _(q, k_cache, v_cache, slots, first, last, scale, softcap, k_scale, v_scale, sinks=None):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("qrt_cpu::lora_add")
    def _(y, x, a, b, rows):
        return torch.empty_like(y, memory_format=torch.contiguous_format)

    @torch.library.register_fake("qrt_cpu::shm_all_reduce")
    def _(x, handle):
        return torch.empty_like(x, memory_format=torch.contiguous_format)
