"""Reading a checkpoint: safetensors files (or a GGUF), config.json, the tokenizer, and the pass
that loads the tensors into a model's layers (loader.py)."""
