"""Inductor's one-time work on a new machine, done by `make setup` rather than by the first model
compile: the check of the CPU's vector instruction sets (a test library compiled and loaded per
instruction set, about 7 s on 2 cores; isa_probe.py) and the precompiled header of ATen's vector
types that every generated C++ kernel includes. Both are kept on disk (qrt's Inductor folder and
Inductor's own temporary folder) and serve every later compile of any model.

`python -m qrt.runtime.machine_warmup` compiles one small function to do it and says how long
that took."""

import sys
import time

import torch

from .compile_cache import use_qrt_inductor_dir
from .isa_probe import remember_isa_probes


def warm_up() -> float:
    """Compile and run a small reduction through Inductor on the CPU; the seconds it took."""
    use_qrt_inductor_dir()
    remember_isa_probes()
    started = time.perf_counter()

    def scaled_norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)

    x = torch.randn(4, 256)  # [rows, features]: a shape that vectorizes
    torch.testing.assert_close(torch.compile(scaled_norm, backend="inductor")(x), scaled_norm(x))
    return time.perf_counter() - started


def main() -> int:
    print(f"qrt: Inductor's one-time CPU checks and headers ready in {warm_up():.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
