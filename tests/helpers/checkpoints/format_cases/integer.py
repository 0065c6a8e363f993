"""Stored integer formats: GPTQ, AWQ, compressed-tensors weight-only, W8A8 and marlin-24, QQQ."""

from helpers.checkpoints.integer import ct_config, make_int_checkpoint
from helpers.checkpoints.marlin24 import make_marlin24_checkpoint
from helpers.checkpoints.w8a8 import make_ct_w8a8_checkpoint, make_qqq_checkpoint

from . import INT_CUDA, FormatCase

INT4_CPU = frozenset({"qrt.int4pack_linear"})


def _gptq(folder) -> None:
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
              "checkpoint_format": "gptq"}
    make_int_checkpoint(folder, "gptq", config, bits=4, group_size=32, sym=False, act_order=True)


def _awq(folder) -> None:
    config = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}
    make_int_checkpoint(folder, "awq", config, group_size=32)


def _ct_w4a16(folder) -> None:
    make_int_checkpoint(folder, "ct", ct_config(sym=False, actorder="group"), sym=False, act_order=True)


CASES = {
    "stored:gptq": FormatCase(_gptq, None, INT4_CPU, INT_CUDA),
    "stored:awq": FormatCase(_awq, None, INT4_CPU, INT_CUDA),
    "compressed-tensors:int weight-only": FormatCase(_ct_w4a16, None, INT4_CPU, INT_CUDA),
    "compressed-tensors:marlin-24": FormatCase(lambda folder: make_marlin24_checkpoint(folder, 128), None, INT4_CPU,
                                               INT_CUDA),
    "compressed-tensors:int W8A8": FormatCase(
        lambda folder: make_ct_w8a8_checkpoint(folder, activations="static", symmetric=False), None,
        frozenset({"qrt.int8_linear_cpu"}), frozenset({"qrt.int8_linear_triton"})),
    "stored:qqq": FormatCase(lambda folder: make_qqq_checkpoint(folder, 128), None, frozenset({"qrt.int8_linear_cpu"}),
                             frozenset({"qrt.w4a8_linear_triton"}), fuses_on_cuda=True),
}
