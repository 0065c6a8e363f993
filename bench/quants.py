"""The --quant names the speed benchmarks take, and the `compile_model` quant each one stands for.

Kept apart from bench/measure.py, which must not import torch (bench/engines.py measures
llama.cpp's memory in a process without it); formats.scheme does.
"""

from qrt.formats.catalog import online_formats

# "bf16": the checkpoint's weights as stored (the default model's are bf16); the rest are quantized
# online while loading.
QUANTS = {"bf16": None, **{name: name for name in online_formats()}}
