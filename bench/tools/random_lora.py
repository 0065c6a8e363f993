"""PEFT LoRA adapters with random weights for a checkpoint folder, for the LoRA benchmark: PEFT
itself writes them (`init_lora_weights=False` starts lora_B random instead of zero, so the adapter
changes the output as a trained one does), over a transformers model built from the folder's
config.json, and they are cached by config, rank and seed.

    python -m bench.tools.random_lora FOLDER --rank 16 --seed 0     # prints the adapter's folder
"""

import argparse
import hashlib
from pathlib import Path

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CACHE = Path.home() / ".cache" / "qrt" / "bench" / "lora"


def random_adapter(folder, rank: int = 16, seed: int = 0, targets=PROJECTIONS) -> Path:
    """The folder of a rank-`rank` PEFT adapter on `targets` of the model in `folder` (made once)."""
    config_text = (Path(folder) / "config.json").read_text()
    key = hashlib.sha256(f"{config_text}|{rank}|{seed}|{sorted(targets)}".encode()).hexdigest()[:12]
    out = CACHE / f"r{rank}-s{seed}-{key}"
    if (out / "adapter_model.safetensors").is_file():
        return out
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):  # the adapter's shapes are the unquantized model's
        del config.quantization_config
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    lora = LoraConfig(task_type="CAUSAL_LM", target_modules=list(targets), r=rank, lora_alpha=2 * rank,
                      lora_dropout=0.0, init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(random_adapter(args.folder, args.rank, args.seed))


if __name__ == "__main__":
    main()
