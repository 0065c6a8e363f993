"""Every format module, imported so that it registers itself (registry.py). A new format is a new
module and one line here."""

# Stored formats, detected from a checkpoint.
from . import fp8_checkpoint  # noqa: F401  HF fp8, ModelOpt FP8, compressed-tensors float-quantized
from . import compressed_tensors  # noqa: F401  the compressed-tensors config; its sub-formats follow
from . import ct_int  # noqa: F401
from . import ct_w8a8  # noqa: F401
from . import ct_marlin24  # noqa: F401
from . import gptq  # noqa: F401
from . import awq  # noqa: F401
from . import qqq  # noqa: F401

# Online formats, applied to an unquantized checkpoint while it loads.
from . import fp8  # noqa: F401
from . import int_online  # noqa: F401
from . import w8a8_online  # noqa: F401
