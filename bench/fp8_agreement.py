"""Teacher-forced top-1 agreement of fp8 with bf16 on the default model, and where the loss is.

    python bench/fp8_agreement.py

For each prompt, bf16 (eager reference ops) greedily continues 64 tokens; bf16 and the variants
below then score that whole sequence and the argmax at each continuation position is compared:
- online fp8 (weights and activations in e4m3; the compiled CPU kernels);
- weight-only fp8: the bf16 model with each linear weight replaced by its fp8 dequantization, so
  activations stay in bf16. If it agrees no better than full fp8, the loss is in the weights.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import torch  # noqa: E402

import runtime  # noqa: E402

PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how photosynthesis works.",
    "What are the benefits of regular exercise?",
)


def weight_only_fp8(bf16_model, fp8_eager) -> None:
    """Overwrite the bf16 model's linear weights with fp8 codes × scales (eager fp8 on the CPU
    holds the codes widened to bf16, exactly)."""
    fp8_layers = dict(fp8_eager.model.named_modules())
    with torch.no_grad():
        for name, module in bf16_model.model.named_modules():
            source = fp8_layers.get(name)
            if source is not None and hasattr(source, "weight_scale"):
                module.weight.copy_((source.weight.float() * source.weight_scale[:, None]).to(module.weight.dtype))


def main() -> None:
    bf16 = runtime.compile_model(compile=False, progress=False, max_seq_len=256)
    fp8 = runtime.compile_model(quant="fp8", progress=False, max_seq_len=256)
    weight_only = runtime.compile_model(compile=False, progress=False, max_seq_len=256)
    weight_only_fp8(weight_only, runtime.compile_model(quant="fp8", compile=False, progress=False, max_seq_len=256))
    print(f"{'prompt':<50} {'fp8':>6} {'weight-only fp8':>16}")
    totals = [0.0, 0.0]
    for text in PROMPTS:
        prompt = bf16.encode(text, chat=True)
        ids = torch.tensor([prompt + bf16.generate(prompt, max_new_tokens=64, stop_at_eos=False)])
        span = slice(len(prompt) - 1, ids.shape[1] - 1)
        reference = bf16(ids)[0, span].argmax(-1)
        scores = [(m(ids)[0, span].argmax(-1) == reference).float().mean().item() for m in (fp8, weight_only)]
        totals = [t + s for t, s in zip(totals, scores)]
        print(f"{text:<50} {scores[0]:>6.3f} {scores[1]:>16.3f}")
    print(f"{'mean':<50} {totals[0] / len(PROMPTS):>6.3f} {totals[1] / len(PROMPTS):>16.3f}")


if __name__ == "__main__":
    main()
