"""qrt: a torch.compile-first runtime for quantized LLM checkpoints.

One top-level package with these layers beneath it (docs/architecture.md draws the arrows):

- `qrt.runtime`: the public API (`runtime.compile_model`), the models, the command line;
- `qrt.server`: the OpenAI-compatible server;
- `qrt.checkpoint`: reading a checkpoint (safetensors, GGUF, config, tokenizer) into a model;
- `qrt.formats`: the format registry and one module per quantization format;
- `qrt.layers`: the contract models and formats share (`Linear`, `LinearMethod`, tensor-parallel
  layouts, experts, the repacking pass);
- `qrt.kernels`: the `qrt::` torch ops (plain-torch references, CPU and Triton kernels);
- `qrt.passes`: the FX passes and the torch.compile backend;
- `qrt.errors`: the errors every layer raises and users catch.

The layers are subpackages, not top-level packages of their own, because a top-level `kernels`
shadows Hugging Face's `kernels` distribution, which transformers probes for on import; the same
holds for a checkout whose root is on sys.path (`python -m qrt` run from it, or pytest).

    from qrt import runtime
    model = runtime.compile_model("path/to/checkpoint", quant="fp8")
"""
