"""What the benchmarks use but do not measure: random-weight models written on first use,
pre-quantized exports of a checkpoint, llama.cpp's GGUF variants of the default model, the suite's
chart."""
