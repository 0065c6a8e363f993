"""One tiny checkpoint per registered format, in its exact on-disk form, for the format contract
test (test_format_contract.py). Each module of this package holds the cases of some formats in a
`CASES` dict; a new format adds a module. A format is tested the moment it registers, because
the contract test fails for any registry entry without a case.

Case names are registry ids: "stored:<quant_method>", "compressed-tensors:<sub-format>",
"side-file:<file name>", "online:<quant= value>", and "none" (an unquantized checkpoint, the
baseline). A stored format that has registered sub-formats (compressed-tensors) is covered by its
sub-formats' cases.
"""

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

from qrt.formats.catalog import compressed_tensors_formats, online_formats, side_file_formats, stored_formats


INT_CUDA = frozenset({"qrt.int_linear_triton"})  # every integer weight-only layout on CUDA


@dataclass(frozen=True)
class FormatCase:
    write: Callable | None  # (folder) -> None: writes the checkpoint; None: the suite's tiny bf16 llama
    quant: str | None  # the quant= argument it loads with
    cpu_kernels: frozenset  # the kernels its quantized layers run, after the swap pass
    cuda_kernels: frozenset
    fuses_on_cuda: bool = False  # the fusion pass hands its GEMMs int8 activations (dynamic symmetric ones)
    dtype: str | None = None  # the model dtype it is loaded in (None: the checkpoint's)


def registry_ids() -> set[str]:
    """Every entry of the format registry, as the cases name them."""
    sub_formats = compressed_tensors_formats()
    ids = {f"stored:{name}" for name in stored_formats() if not (name == "compressed-tensors" and sub_formats)}
    ids |= {f"compressed-tensors:{name}" for name in sub_formats}
    ids |= {f"side-file:{name}" for name in side_file_formats()}
    ids |= {f"online:{name}" for name in online_formats()}
    return ids


def _all_cases() -> dict[str, FormatCase]:
    cases: dict[str, FormatCase] = {}
    for module in pkgutil.iter_modules(__path__):
        for name, case in importlib.import_module(f"{__name__}.{module.name}").CASES.items():
            if name in cases:
                raise ValueError(f"format case {name!r} is defined twice")
            cases[name] = case
    return cases


CASES = _all_cases()
