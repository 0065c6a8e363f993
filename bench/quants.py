"""The --quant names the speed benchmarks take, and the `compile_model` quant each one stands for.

Kept apart from bench/measure.py, which must not import torch (bench/engines.py measures
llama.cpp's memory in a process without it); formats.scheme does.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from qrt.formats.catalog import online_formats  # noqa: E402

# "bf16": the checkpoint's weights as stored (the default model's are bf16); the rest are quantized
# online while loading.
QUANTS = {"bf16": None, **{name: name for name in online_formats()}}
