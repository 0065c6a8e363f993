"""The --quant names the speed benchmarks take, and the `compile_model` quant each one stands for.

Kept apart from bench/measure.py, which must not import torch (bench/engines.py measures
llama.cpp's memory in a process without it); formats.scheme does.
"""

from qrt.formats.catalog import online_formats

# "bf16": no quantization of qrt's own: the weights as stored, or dequantized to bf16 where the file
# is a GGUF (the default model's is: "none" runs it dense, None would run it in its Q4_1). The rest
# are quantized online while loading.
QUANTS = {"bf16": "none", **{name: name for name in online_formats()}}
