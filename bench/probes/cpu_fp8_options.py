"""Ways to run an fp8 linear on the CPU, timed at decode shape (M=1), to justify the CPU kernel.

    python -m bench.probes.cpu_fp8_options

Prints the median of 200 calls (after 10 warm-up calls) for each option and shape, on a quiet
machine please: bf16 F.linear; fp8 weight converted to bf16 inside each call; an Inductor-fused
dequantizing reduction; torch._scaled_mm; and qrt's choice, the loader-widened exact-bf16 weight
under torch.compile (which also rounds activations to fp8 per token).
"""

import torch
import torch.nn.functional as F

from bench.measure import median_us
import qrt.kernels  # noqa: F401  (registers torch.ops.qrt.*)
from qrt.kernels.fp8_reference import quantize_rows_fp8

SHAPES = ((1536, 576), (576, 1536), (2048, 2048))  # [N, K]: SmolLM2 MLP up/down, a 1B-class square


def options(n: int, k: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)  # [1, K]
    w = torch.randn(n, k, generator=gen)
    w_fp8, scale = quantize_rows_fp8(w)  # [N, K] e4m3, [N, 1] fp32
    scale = scale.squeeze(1)
    w_bf16, w_exact = w.to(torch.bfloat16), w_fp8.to(torch.bfloat16)
    reduction = torch.compile(lambda x, w8, s: (x.float()[:, None, :] * w8.float()[None]).sum(-1) * s)
    one = torch.ones(1)
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        qrt_kernel = torch.compile(lambda x: torch.ops.qrt.fp8_linear_cpu(x, w_exact, scale, None))
        return {
            "bf16 F.linear": median_us(lambda: F.linear(x, w_bf16)),
            "fp8->bf16 per call + F.linear": median_us(lambda: F.linear(x, w_fp8.to(torch.bfloat16)) * scale),
            "Inductor dequantizing reduction": median_us(lambda: reduction(x, w_fp8, scale)),
            "torch._scaled_mm": median_us(lambda: torch._scaled_mm(
                x.to(torch.float8_e4m3fn), w_fp8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), calls=20),
            "qrt fp8_linear_cpu (compiled)": median_us(lambda: qrt_kernel(x)),
        }


def main() -> None:
    print(f"torch threads {torch.get_num_threads()}; median µs per call, M=1")
    for n, k in SHAPES:
        for name, us in options(n, k).items():
            print(f"  {n}x{k:<6} {name:<34} {us:10.1f}")


if __name__ == "__main__":
    main()
