"""qrt: a torch.compile-first runtime for quantized LLM checkpoints.

Installed, qrt is this one top-level package with its four layers beneath it:

- `qrt.runtime`: the public API (`runtime.compile_model`), the models, the CLI;
- `qrt.loaders`: checkpoint reading, the format registry and each format's loader;
- `qrt.kernels`: the `qrt::` torch ops (plain-torch references, CPU and Triton kernels);
- `qrt.passes`: the FX passes and the torch.compile backend.

In the repository the four layers are top-level folders; pyproject.toml maps each beneath `qrt`
(setuptools `package-dir`). One top-level name keeps an install from shadowing other packages:
Hugging Face's `kernels` package is imported by transformers itself.

    from qrt import runtime
    model = runtime.compile_model("path/to/checkpoint", quant="fp8")
"""
