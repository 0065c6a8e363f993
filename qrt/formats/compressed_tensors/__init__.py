"""compressed-tensors (llm-compressor): the config (config.py) and its sub-formats, one module each.
FP8 (`float-quantized`) lives with the other fp8 checkpoints in ../fp8_checkpoint.py."""
