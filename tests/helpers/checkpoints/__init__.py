"""Tiny random checkpoints written in the exact on-disk layouts of the formats qrt loads, each with
the transformers model it should reproduce.

- tiny: the unquantized Llama and Qwen2 every other writer starts from (their sizes, TINY), and
  random_ids, seeded token ids in their vocabulary;
- architectures: the architectures beyond Llama/Qwen2, sharded;
- moe: mixture-of-experts models, plain or with quantized experts;
- fp8: HF fp8, ModelOpt and compressed-tensors float-quantized;
- integer: weight-only GPTQ, AWQ and compressed-tensors pack-quantized;
- w8a8: compressed-tensors int-quantized W8A8 and QQQ W4A8;
- marlin24: compressed-tensors marlin-24 (2:4-sparse W4A16);
- format_cases/: one checkpoint per registered format, for tests/test_format_contract.py.
"""
