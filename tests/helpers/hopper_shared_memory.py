"""The shared memory each Triton GEMM of qrt asks for on a Hopper GPU (sm_90), for every tile
configuration its launcher picks, compiled ahead of time by Triton's own compiler and ptxas: no
GPU needed. Prints one JSON object, {"kernel, tiles": bytes}.

Run by tests/test_triton_shared_memory.py in a process without TRITON_INTERPRET: kernels
decorated under the interpreter cannot be compiled. The operand dtypes are the widest each
kernel is handed (fp32 scales and zero points, as the loaders keep them), so the figures are the
most a launch can ask for.
"""

import json
import os

assert not os.environ.get("TRITON_INTERPRET"), "compile the kernels, do not interpret them"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qrt.kernels.decode_attention_triton import BLOCK_S, decode_attention_kernel  # noqa: E402
from qrt.kernels.experts_triton import experts_gemm_kernel, experts_tiles  # noqa: E402
from qrt.kernels.fp8_block_triton import fp8_block_gemm_kernel  # noqa: E402
from qrt.kernels.fp8_triton import fp8_gemm_kernel  # noqa: E402
from qrt.kernels.int8_triton import int8_gemm_kernel  # noqa: E402
from qrt.kernels.int_triton import gemm_tiles, int_gemm_kernel  # noqa: E402
from qrt.kernels.lut4_reference import SCALE_FORMATS  # noqa: E402
from qrt.kernels.lut4_triton import lut4_gemm_kernel  # noqa: E402
from qrt.kernels.triton_tiles import gemm_config  # noqa: E402
from qrt.kernels.w4a8_triton import w4a8_gemm_kernel, w4a8_tiles  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
ROWS = (1, 64, 4096)  # one M from each of the launchers' ranges: decode, small batches, prefill
N = K = 4096
LAUNCH_OPTIONS = ("num_warps", "num_stages")


def shared_bytes(kernel, pointers: dict, constexprs: dict, tiles: dict) -> int:
    """Bytes of shared memory `kernel` asks for with these pointer dtypes, constexprs and tiles;
    every other argument is an int32 scalar."""
    consts = {**constexprs, **{k: v for k, v in tiles.items() if k not in LAUNCH_OPTIONS}}
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in names}
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in consts.items()})
    options = {k: tiles[k] for k in LAUNCH_OPTIONS}
    return triton.compile(source, target=HOPPER, options=options).metadata.shared


def main() -> None:
    scales = {"s_ptr": "*fp32", "z_ptr": "*fp32"}
    fp8 = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "a_scale_ptr": "*fp32",
           "b_scale_ptr": "*fp32", "bias_ptr": "*bf16"}
    cases = []
    for m in ROWS:
        for x in ("bf16", "fp32"):
            cases.append((f"int_gemm_kernel x {x}, M={m}", int_gemm_kernel,
                          {"x_ptr": f"*{x}", "qw_ptr": "*i32", "out_ptr": "*fp32", **scales},
                          {"BITS": 4, "FP32_DOT": x == "fp32"}, gemm_tiles(m, N, K, fp32=x == "fp32")))
            cases.append((f"lut4_gemm_kernel x {x}, M={m}", lut4_gemm_kernel,
                          {"x_ptr": f"*{x}", "codes_ptr": "*u8", "s_ptr": "*u8", "table_ptr": "*fp32",
                           "global_ptr": "*fp32", "out_ptr": "*fp32"},
                          {"SCALE_FORMAT": SCALE_FORMATS["e4m3"], "HAS_GLOBAL": True, "GLOBAL_DIVIDES": True, "FP32_DOT": x == "fp32"},
                          gemm_tiles(m, N, K, fp32=x == "fp32")))
        cases.append((f"fp8_gemm_kernel M={m}", fp8_gemm_kernel, fp8, {"HAS_BIAS": True}, gemm_config(m)))
        cases.append((f"fp8_block_gemm_kernel M={m}", fp8_block_gemm_kernel, fp8,
                      {"HAS_BIAS": True, "SCALE_BLOCK_N": 128, "SCALE_BLOCK_K": 128}, gemm_config(m)))
        cases.append((f"int8_gemm_kernel M={m}", int8_gemm_kernel,
                      {"a_ptr": "*i8", "b_ptr": "*i8", "c_ptr": "*bf16", "a_scale_ptr": "*fp32",
                       "a_zero_ptr": "*i32", "b_scale_ptr": "*fp32", "b_sums_ptr": "*i32", "bias_ptr": "*bf16"},
                      {"ASYMMETRIC": True, "HAS_BIAS": True}, gemm_config(m)))
        cases.append((f"w4a8_gemm_kernel M={m}", w4a8_gemm_kernel,
                      {"a_ptr": "*i8", "qw_ptr": "*i32", "gs_ptr": "*fp32", "c_ptr": "*bf16", "a_scale_ptr": "*fp32",
                       "cs_ptr": "*fp32", "bias_ptr": "*bf16"}, {"HAS_BIAS": True}, w4a8_tiles(m)))
    for pairs in (8, 4096):  # decode (a few rows per expert) and prefill, over 8 experts
        for x in ("bf16", "fp32"):
            cases.append((f"experts_gemm_kernel x {x}, pairs={pairs}", experts_gemm_kernel,
                          {"a_ptr": f"*{x}", "w_ptr": "*i32", "perm_ptr": "*i32", "routing_ptr": "*fp32",
                           "pairs_ptr": "*i64", "block_experts_ptr": "*i32", "out_ptr": f"*{x}", **scales},
                          {"ROWS_PER_TOKEN": True, "SCALE_BY_ROUTING": False, "PACKED_CODES": True, "HAS_PERM": True,
                           "BITS": 4, "FP32_DOT": x == "fp32"}, experts_tiles(pairs, 8)))
    for cache in ("bf16", "fp32"):  # decode attention over 256-wide heads (Gemma 2), launched with Triton's defaults
        cases.append((f"decode_attention_kernel {cache} cache", decode_attention_kernel,
                      {"q_ptr": f"*{cache}", "k_ptr": f"*{cache}", "v_ptr": f"*{cache}", "slots_ptr": "*i64",
                       "first_ptr": "*i64", "last_ptr": "*i64", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
                       "sinks_ptr": "*fp32", "out_ptr": f"*{cache}", "scale": "fp32", "softcap": "fp32"},
                      {"GROUP": 2, "HEAD_DIM": 256, "BLOCK_D": 256, "BLOCK_S": BLOCK_S, "FP8_CACHE": False,
                       "SOFTCAP": True, "SINKS": True}, {"num_warps": 4, "num_stages": 3}))
    sizes = {}
    for name, kernel, pointers, constexprs, tiles in cases:
        sizes[f"{name}, {tiles}"] = shared_bytes(kernel, pointers, constexprs, tiles)
    print(json.dumps(sizes))


if __name__ == "__main__":
    main()
