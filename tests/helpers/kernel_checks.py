"""What the kernel tests share: the device and dtypes they run on, the error allowed on fp32 sums and
bf16 outputs and the check against it, and the random inputs more than one of them draws.

Triton's interpreter, which runs the Triton kernels on CPU tensors, is switched on in conftest.py
before anything imports triton.
"""

import torch

from qrt.kernels.fp8_reference import quantize_rows_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Relative error allowed on fp32 sums, measured against sum(|terms|) so cancellation is covered:
# where only the summation order differs from the reference, that is worth at most K * 2**-24,
# about 4e-5 for the K of a few hundred the tests use.
SUM_RTOL = 1e-4
# One bf16 step relative to the value. The GPU rounds fp32 -> bf16 to nearest (half a step off at
# most) but Triton's interpreter truncates (up to a whole step).
BF16_RTOL = 2.0**-7
# Relative error allowed on sums added by fp8 tensor cores, measured against sum(|terms|) as
# SUM_RTOL is: Hopper's fp8 MMA adds its products in an accumulator of about 14 significant bits
# before each promotion to fp32 (DeepSeek-V3's technical report, section 3.3.2), which the kernels
# make after every K block. Measured on an H200: up to 1.5e-4. The interpreter sums in fp32.
FP8_MMA_RTOL = 2.0**-12 if DEVICE == "cuda" else SUM_RTOL


def assert_within(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor) -> None:
    """|actual - expected| <= tol everywhere; the message names the worst output."""
    err = (actual.float() - expected.float()).abs()
    excess = err - tol
    worst = int(excess.argmax())
    assert (excess <= 0).all(), (
        f"{int((excess > 0).sum())} of {err.numel()} outputs out of tolerance; worst at flat index "
        f"{worst}: got {actual.flatten()[worst].item()}, expected {expected.flatten()[worst].item()}, "
        f"tolerance {tol.flatten()[worst].item()}"
    )


def fp8_weights(gen: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random fp8 weight quantized per output channel: ([N, K] float8_e4m3fn, [N] fp32) on DEVICE."""
    wq, ws = quantize_rows_fp8(torch.randn(n, k, generator=gen) * 0.05)  # [N, K] fp8, [N, 1] fp32
    return wq.to(DEVICE), ws.view(-1).to(DEVICE)


def random_bias(gen: torch.Generator, n: int, dtype: torch.dtype) -> torch.Tensor:
    """[N] standard-normal values in dtype, on DEVICE."""
    return torch.randn(n, generator=gen).to(dtype).to(DEVICE)


def fp8_sum_bound(xq, x_scale, wq, w_scale, bias) -> torch.Tensor:
    """sum(|terms|) of each output of the scaled fp8 GEMM (xq @ wq.T) * x_scale * w_scale + bias:
    [M, N] fp32. xq: [M, K] fp8; x_scale: [M, 1] or [1]; wq: [N, K] fp8; w_scale: [N]."""
    bound = (xq.float().abs() @ wq.float().abs().t()) * x_scale * w_scale[None, :]
    return bound if bias is None else bound + bias.float().abs()


def random_rows(m: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 1, shift: float = 0.0) -> torch.Tensor:
    """[M, K] standard-normal activations plus shift (off-centre rows, for asymmetric
    quantization), in dtype on the CPU."""
    return (torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) + shift).to(dtype)


def fp8_cpu_kernel(logical: str) -> str:
    """The CPU kernel the loader pass chooses for an fp8 logical op ("qrt.fp8_linear"): qrt's own,
    on fp8 weights, where it builds here; otherwise the one on weights widened to the model dtype."""
    from qrt.kernels import native_cpu

    return f"{logical}_native_cpu" if native_cpu.available() else f"{logical}_cpu"


def on_device(op):
    """`op` called with its tensor arguments moved to DEVICE and its result brought back to the
    CPU: for tests that draw their inputs on the CPU (seeded CPU generators) and compare with
    reference ops run there. Where DEVICE is the CPU, the moves do nothing."""

    def call(*args):
        out = op(*(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args))
        if isinstance(out, tuple):  # some results may be None (no zero point)
            return tuple(None if o is None else o.cpu() for o in out)
        return out.cpu()

    return call
