"""One tiny checkpoint per registered format, in its exact on-disk form, for the format contract
test (test_format_contract.py): a format is tested the moment it registers, because the contract
test fails for any registry entry without a case here.

Registry ids: "stored:<quant_method>", "compressed-tensors:<sub-format>", "side-file:<file name>",
"online:<quant= value>", and "none" (an unquantized checkpoint, the baseline). A stored format that
has registered sub-formats (compressed-tensors) is covered by its sub-formats' cases.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fp8_checkpoints import make_fp8_checkpoint
from int_checkpoints import ct_config, make_int_checkpoint
from marlin24_checkpoints import make_marlin24_checkpoint
from tiny_checkpoints import make_checkpoint
from w8a8_checkpoints import make_ct_w8a8_checkpoint, make_qqq_checkpoint

from qrt.loaders.registry import compressed_tensors_formats, online_formats, side_file_formats, stored_formats

INT4_CPU = frozenset({"qrt.int4pack_linear"})
INT_CUDA = frozenset({"qrt.int_linear_triton"})


@dataclass(frozen=True)
class FormatCase:
    write: Callable  # (folder) -> None: writes the checkpoint
    quant: str | None  # the quant= argument it loads with
    cpu_kernels: frozenset  # the kernels its quantized layers run, after the swap pass
    cuda_kernels: frozenset
    fuses_on_cuda: bool = False  # the fusion pass hands its GEMMs int8 activations (dynamic symmetric ones)


def _bf16(folder: Path) -> None:
    make_checkpoint(folder, "llama")


def _gptq(folder: Path) -> None:
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
              "checkpoint_format": "gptq"}
    make_int_checkpoint(folder, "gptq", config, bits=4, group_size=32, sym=False, act_order=True)


def _awq(folder: Path) -> None:
    config = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}
    make_int_checkpoint(folder, "awq", config, group_size=32)


def _online(name: str, cpu: set, cuda: set) -> FormatCase:
    return FormatCase(_bf16, name, frozenset(cpu), frozenset(cuda))


CASES = {
    "none": FormatCase(_bf16, None, frozenset(), frozenset()),
    "online:fp8": _online("fp8", {"qrt.fp8_linear_cpu"}, {"qrt.fp8_linear_triton"}),
    # The weight-only integer formats quantize lm_head to int8 per channel too.
    "online:int4": _online("int4", {"qrt.int4pack_linear", "qrt.int8pack_linear"}, INT_CUDA),
    "online:int4-g128": _online("int4-g128", {"qrt.int4pack_linear", "qrt.int8pack_linear"}, INT_CUDA),
    "online:int8": _online("int8", {"qrt.int8pack_linear"}, INT_CUDA),
    "online:w8a8": FormatCase(_bf16, "w8a8", frozenset({"qrt.int8_linear_cpu"}), frozenset({"qrt.int8_linear_triton"}),
                              fuses_on_cuda=True),
    "stored:fp8": FormatCase(lambda f: make_fp8_checkpoint(f, "hf-fp8-dynamic"), None,
                             frozenset({"qrt.fp8_linear_cpu"}), frozenset({"qrt.fp8_linear_triton"})),
    "stored:modelopt": FormatCase(lambda f: make_fp8_checkpoint(f, "modelopt-fp8-kv-cache"), None,
                                  frozenset({"qrt.fp8_static_linear_cpu"}),
                                  frozenset({"qrt.fp8_static_linear_triton"})),
    "side-file:hf_quant_config.json": FormatCase(lambda f: make_fp8_checkpoint(f, "modelopt-fp8-side-file"), None,
                                                 frozenset({"qrt.fp8_static_linear_cpu"}),
                                                 frozenset({"qrt.fp8_static_linear_triton"})),
    "compressed-tensors:float-quantized": FormatCase(lambda f: make_fp8_checkpoint(f, "ct-fp8-block"), None,
                                                     frozenset({"qrt.fp8_block_linear_cpu"}),
                                                     frozenset({"qrt.fp8_block_linear_triton"})),
    "compressed-tensors:int weight-only": FormatCase(
        lambda f: make_int_checkpoint(f, "ct", ct_config(sym=False, actorder="group"), sym=False, act_order=True),
        None, INT4_CPU, INT_CUDA),
    "compressed-tensors:int W8A8": FormatCase(
        lambda f: make_ct_w8a8_checkpoint(f, activations="static", symmetric=False), None,
        frozenset({"qrt.int8_linear_cpu"}), frozenset({"qrt.int8_linear_triton"})),
    "compressed-tensors:marlin-24": FormatCase(lambda f: make_marlin24_checkpoint(f, 128), None, INT4_CPU, INT_CUDA),
    "stored:gptq": FormatCase(_gptq, None, INT4_CPU, INT_CUDA),
    "stored:awq": FormatCase(_awq, None, INT4_CPU, INT_CUDA),
    "stored:qqq": FormatCase(lambda f: make_qqq_checkpoint(f, 128), None, frozenset({"qrt.int8_linear_cpu"}),
                             frozenset({"qrt.w4a8_linear_triton"}), fuses_on_cuda=True),
}


def registry_ids() -> set[str]:
    """Every entry of the format registry, as CASES names them."""
    sub_formats = compressed_tensors_formats()
    ids = {f"stored:{name}" for name in stored_formats() if not (name == "compressed-tensors" and sub_formats)}
    ids |= {f"compressed-tensors:{name}" for name in sub_formats}
    ids |= {f"side-file:{name}" for name in side_file_formats()}
    ids |= {f"online:{name}" for name in online_formats()}
    return ids
