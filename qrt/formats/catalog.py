"""Every format module, imported so that it registers itself (registry.py), and the registries
they filled. A new format is a new module and one line here.

Whatever lists or looks up formats (resolve.py, the command line, `qrt formats`, the tests)
imports this module; the registry itself imports no format, so no import runs in a circle.
"""

# Stored formats, detected from a checkpoint.
from . import fp8_checkpoint  # noqa: F401  HF fp8, ModelOpt FP8, compressed-tensors float-quantized
from . import modelopt_nvfp4  # noqa: F401  ModelOpt NVFP4, handed its configs by fp8_checkpoint
from .compressed_tensors import config  # noqa: F401  the compressed-tensors config; its sub-formats follow
from .compressed_tensors import int_weight_only  # noqa: F401
from .compressed_tensors import int_w8a8  # noqa: F401
from .compressed_tensors import marlin24  # noqa: F401
from .compressed_tensors import nvfp4  # noqa: F401  NVFP4 (and the method ModelOpt NVFP4 shares)
from .compressed_tensors import mxfp4 as ct_mxfp4  # noqa: F401  MXFP4A16
from . import gptq  # noqa: F401
from . import awq  # noqa: F401
from . import qqq  # noqa: F401
from . import gguf  # noqa: F401  llama.cpp GGUF files loaded as stored
from . import mxfp4  # noqa: F401  MXFP4, as gpt-oss ships its experts
from . import bitsandbytes  # noqa: F401  4-bit NF4/FP4 and 8-bit, as transformers saves them

# Online formats, applied to an unquantized checkpoint while it loads.
from . import fp8_online  # noqa: F401
from . import int_online  # noqa: F401
from . import w8a8_online  # noqa: F401

from qrt.kernels.choices import declared  # noqa: E402  (every kernel module is imported by qrt.kernels)

from .registry import (COMPRESSED_TENSORS, LEGACY_SIDE_FILES, ONLINE, SIDE_FILES, STORED,  # noqa: E402
                       CompressedTensorsFormat, OnlineFormat, SideFileFormat, StoredFormat)


def stored_formats() -> dict[str, StoredFormat]:
    return dict(STORED)


def side_file_formats() -> dict[str, SideFileFormat]:
    return dict(SIDE_FILES)


def compressed_tensors_formats() -> dict[str, CompressedTensorsFormat]:
    return dict(COMPRESSED_TENSORS)


def online_formats() -> dict[str, OnlineFormat]:
    return dict(ONLINE)


def side_file_names() -> tuple[str, ...]:
    """Every side file that can say how a checkpoint is quantized (part of its identity)."""
    return (*side_file_formats(), *LEGACY_SIDE_FILES)


def kernels_of(computes: tuple[str, ...]) -> str:
    """The kernels declared for these logical ops, per device, the preferred first (each runs where
    it accepts a layer's weights; the last is the reference or the fallback): "CPU: a, b; GPU: c"."""
    kernels = sorted((k for k in declared().values() if set(k.serves) & set(computes)),
                     key=lambda k: (k.preference, k.op))
    per_device = [(label, [k.op.removeprefix("qrt.") for k in kernels if device in k.devices])
                  for device, label in (("cpu", "CPU"), ("cuda", "GPU"))]
    text = "; ".join(f"{label}: {', '.join(f'`{op}`' for op in ops)}" for label, ops in per_device if ops)
    return text or "those of its sub-format"


def formats_markdown() -> str:
    """The format list as `qrt formats --markdown` prints it and the README shows it: each kind's
    formats by name, since the registries' order is the order their modules happened to be imported."""
    lines = ["| format | detected from | what qrt reads or makes | kernels |", "|---|---|---|---|"]

    def by_name(formats: dict) -> list:
        return [formats[name] for name in sorted(formats)]

    for fmt in by_name(stored_formats()):
        lines.append(f"| `{fmt.quant_method}` | {fmt.detected_from} | {fmt.summary} | {kernels_of(fmt.computes)} |")
    for ct in by_name(compressed_tensors_formats()):
        lines.append(f"| compressed-tensors `{ct.name}` | its config group | {ct.summary} | {kernels_of(ct.computes)} |")
    for side in by_name(side_file_formats()):
        lines.append(f"| {side.name} | `{side.file_name}` (when config.json says nothing) | {side.summary} | "
                     f"{kernels_of(side.computes)} |")
    for online in by_name(online_formats()):
        lm_head = online.lm_head_summary or "lm_head kept as stored"
        lines.append(f"| `quant=\"{online.name}\"` | asked for (unquantized checkpoint) | {online.summary}; {lm_head} | "
                     f"{kernels_of(online.computes)} |")
    return "\n".join(lines)

