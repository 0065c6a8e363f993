"""Teacher-forced top-1 agreement of each online quantization with bf16 on the default model.

    python -m bench.agreement                       # every online quantization, compiled
    python -m bench.agreement --eager               # the same without compiling
    python -m bench.agreement --quant fp8 --weight-only-fp8

For each prompt, bf16 (eager reference ops) greedily continues 64 tokens; bf16 and every variant
then score that whole sequence, and the argmax at each continuation position is compared. The
variants run compiled, with the kernels a user gets.

--weight-only-fp8 adds a diagnostic column: the bf16 model with each linear weight replaced by its
fp8 dequantization, activations left in bf16. If it agrees no better than full fp8, the loss is in
the weights, not in the activation rounding.
"""

import argparse

import torch

from qrt import runtime
from qrt.formats.catalog import online_formats

PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how photosynthesis works.",
    "What are the benefits of regular exercise?",
)
MAX_SEQ_LEN = 256


def weight_only_fp8() -> "runtime.CompiledModel":
    """The bf16 model, eager, with fp8 codes × scales for weights (eager fp8 on the CPU holds the
    codes widened to bf16, exactly)."""
    model = runtime.compile_model(quant="none", compile=False, progress=False, max_seq_len=MAX_SEQ_LEN)
    fp8 = runtime.compile_model(quant="fp8", compile=False, progress=False, max_seq_len=MAX_SEQ_LEN)
    fp8_layers = dict(fp8.model.named_modules())
    with torch.no_grad():
        for name, module in model.model.named_modules():
            source = fp8_layers.get(name)
            if source is not None and hasattr(source, "weight_scale"):
                module.weight.copy_((source.weight.float() * source.weight_scale[:, None]).to(module.weight.dtype))
    return model


def agreement(bf16, variants: dict, prompts=PROMPTS, new_tokens: int = 64) -> dict:
    """{variant name: [agreement per prompt]} over bf16's greedy continuations."""
    scores = {name: [] for name in variants}
    for text in prompts:
        prompt = bf16.encode(text, chat=True)
        ids = torch.tensor([prompt + bf16.generate(prompt, max_new_tokens=new_tokens, stop_at_eos=False)])
        span = slice(len(prompt) - 1, ids.shape[1] - 1)  # positions that predict the continuation
        reference = bf16(ids)[0, span].argmax(-1)
        for name, model in variants.items():
            scores[name].append((model(ids)[0, span].argmax(-1) == reference).float().mean().item())
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quant", default=",".join(online_formats()), help=f"comma-separated subset of {list(online_formats())}")
    parser.add_argument("--weight-only-fp8", action="store_true", help="add the fp8-weights, bf16-activations column")
    parser.add_argument("--eager", action="store_true",
                        help="run the variants eagerly (same quantized weights, reference or direct kernel ops; "
                             "no compile time)")
    args = parser.parse_args()
    bf16 = runtime.compile_model(quant="none", compile=False, progress=False, max_seq_len=MAX_SEQ_LEN)  # the GGUF dequantized
    variants = {q: runtime.compile_model(quant=q, compile=not args.eager, progress=False, max_seq_len=MAX_SEQ_LEN)
                for q in args.quant.split(",")}
    if args.weight_only_fp8:
        variants["weight-only fp8"] = weight_only_fp8()
    scores = agreement(bf16, variants)
    print("| prompt | " + " | ".join(variants) + " |")
    print("|---|" + "---:|" * len(variants))
    for i, text in enumerate(PROMPTS):
        print(f"| {text} | " + " | ".join(f"{scores[name][i]:.3f}" for name in variants) + " |")
    print("| **mean** | " + " | ".join(f"**{sum(s) / len(s):.3f}**" for s in scores.values()) + " |")


if __name__ == "__main__":
    main()
