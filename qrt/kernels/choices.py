"""Which kernel runs a quantized layer, declared once, by the kernel modules, with `declare`.

Three parts of qrt read these declarations and nothing else:
- the loader pass asks `choose(logical op, device, **facts)` for the kernel of a layer, has the
  kernel's layout (`Kernel.layout`, layouts.py) pack the layer's weights and call the kernel,
  and records the kernel on the weight (`weight.kernel`);
- the swap pass reads `weight.kernel` from each linear op's real weight and puts that kernel in
  the graph where the layer calls a logical op (`Kernel.replaces`);
- the fusion pass reads `Kernel.fusions`: which producer ops (an RMSNorm, an activation) may
  hand the kernel its input already quantized, and through which ops.

The loader pass decides; the passes carry the decision out, so the two can no longer disagree.
"""

from dataclasses import dataclass, field
from typing import Callable

from .layouts import Layout


@dataclass(frozen=True)
class Fusion:
    """The kernel's input may come from `producer`, computed and quantized by `fused_producer`
    (which returns (q, scale)) and consumed by `gemm`, which takes the activations quantized.

    gemm_args(kernel node args) gives the weight-side arguments of `gemm`, or None when this call
    cannot be fused (for example static activation scales)."""

    producer: str  # e.g. "qrt.rms_norm"
    fused_producer: str  # e.g. "qrt.rms_norm_quant_int8_triton"
    gemm: str  # e.g. "qrt.int8_gemm_triton"
    gemm_args: Callable
    # (producer node args) -> the fused producer's args, or None when this producer call has no
    # fused form (e.g. an activation other than silu)
    producer_args: Callable = tuple


@dataclass(frozen=True)
class Kernel:
    op: str  # the op the compiled graph runs, "ns.name" (aten.linear: the dense GEMM)
    devices: tuple[str, ...]  # device types it runs on
    serves: tuple[str, ...]  # the logical ops whose computation it implements
    layout: Layout  # how the loader pass packs a layer's weights for it, and how the layer calls it
    why: str  # shown by `inspect` and `dump`
    # The op a layer calls that the swap pass replaces by `op`; None: the layer calls `op` itself
    # (an opaque layout that no reference op can read).
    replaces: str | None = None
    accepts: Callable = lambda **facts: True  # can it run these weights? (facts from the loader pass)
    preference: int = 0  # the lowest among the kernels that accept wins
    prepackable: bool = False  # its GEMM goes through dense_linear: a oneDNN-prepacked weight may stand in
    fusions: tuple[Fusion, ...] = field(default=())
    # The attribute of the tensor on which the loader records this choice, and so which swap
    # pass carries it out: a linear's weight ("kernel"), a KV cache ("attention_kernel").
    recorded_as: str = "kernel"


class NoKernelError(LookupError):
    """No declared kernel computes a logical op on a device for the weights at hand."""


_KERNELS: dict[str, Kernel] = {}


def declare(kernel: Kernel) -> Kernel:
    if kernel.op in _KERNELS:
        raise ValueError(f"kernel {kernel.op} is declared twice")
    _KERNELS[kernel.op] = kernel
    return kernel


def kernel_named(op: str) -> Kernel:
    try:
        return _KERNELS[op]
    except KeyError:
        raise KeyError(f"{op} is not a declared kernel; declared: {sorted(_KERNELS)}") from None


def declared() -> dict[str, Kernel]:
    return dict(_KERNELS)


def choose(logical: str, device_type: str, **facts) -> Kernel:
    """The kernel for a layer computing `logical` on `device_type`, given facts about its weights
    (e.g. bits=4, group_size=128, k=576, n=1536)."""
    fitting = [k for k in _KERNELS.values()
               if logical in k.serves and device_type in k.devices and k.accepts(**facts)]
    if not fitting:
        raise NoKernelError(f"no kernel computes {logical} on {device_type} for {facts}; declared: "
                            f"{[k.op for k in _KERNELS.values() if logical in k.serves]}")
    return min(fitting, key=lambda k: k.preference)


def linear_ops() -> frozenset[str]:
    """Ops a layer's graph may call with a weight whose kernel the loader pass recorded."""
    linear = [k for k in _KERNELS.values() if k.recorded_as == "kernel"]
    return frozenset({k.op for k in linear} | {k.replaces for k in linear if k.replaces})
