"""Real PEFT LoRA adapters for the LoRA tests, and PEFT's own model as their reference.

The adapters are written by the real producer, PEFT (pinned to 0.21.2 in pyproject.toml), over
the tiny random bases of `helpers.checkpoints.tiny`, trained for a few steps so that lora_B is
not the zero PEFT initialises it to (an untrained adapter changes nothing, and a test over it
would pass whatever qrt did with it), and saved with `save_pretrained`: adapter_config.json and
adapter_model.safetensors, the files users download.

Facts about those files that qrt's loader relies on (PEFT 0.21.2, checked by
tests/test_lora_adapters_helper.py):

- Tensor names are the module's path in the PEFT-wrapped model with the adapter name removed:
  `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` ([r, in_features]) and
  `base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight` ([out_features, r]); MLP
  modules are `base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight` and so on. DoRA
  adds `...q_proj.lora_magnitude_vector` ([out_features]; no `.weight`), and a module in
  modules_to_save is saved whole, as `base_model.model.lm_head.weight`.
- The scale applied to B @ A is lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
  (peft/tuners/lora/layer.py, LoraLayer.update_layer), where r and lora_alpha are those of
  rank_pattern / alpha_pattern when one of their keys matches the module, else the config's.
- target_modules is saved as given (in no fixed order); "all-linear" is saved resolved, as the
  full module names `model.layers.0.self_attn.q_proj`, ... (every Linear but lm_head). PEFT
  adapts a module when its name equals an entry or ends with "." + the entry, or, when
  target_modules is one string, when `re.fullmatch(target_modules, name)` does
  (peft/tuners/tuners_utils.py, check_target_module_exists).
- A rank_pattern / alpha_pattern key matches a module when
  `re.match(rf"(.*\\.)?({key})$", module_name)` does (peft/utils/other.py, get_pattern_key):
  the key is a regex that must match the whole module name or a suffix of it starting right
  after a "."; "q_proj" matches "model.layers.0.self_attn.q_proj", "layers.0.self_attn.q_proj"
  matches only layer 0 (its unescaped "." matches any character), "proj" matches nothing. The
  first matching key, in the saved dict's order, wins.
"""

import json
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file

from helpers.checkpoints.tiny import random_ids

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@contextmanager
def _quiet_peft():
    # PeftModel's constructor reads transformers' `is_gradient_checkpointing`, which transformers 5
    # deprecates with a FutureWarning on every adapter made or loaded: PEFT's business, not the tests'.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def make_peft_adapter(base_folder, adapter_folder, *, target_modules=ALL_PROJECTIONS, r=8, lora_alpha=16,
                      use_rslora=False, rank_pattern=None, alpha_pattern=None, seed=0, steps=4, lr=5e-2,
                      modules_to_save=None, use_dora=False) -> Path:
    """Train a PEFT LoRA adapter over the checkpoint in `base_folder` for `steps` AdamW steps and
    save it into `adapter_folder`; return that folder. `target_modules` is a sequence of module
    names or PEFT's "all-linear"."""
    import transformers
    from peft import LoraConfig, get_peft_model

    adapter_folder = Path(adapter_folder)
    # The weights are trained in float32 whatever the base's dtype, as PEFT users usually do;
    # PEFT saves them in the dtype they were trained in.
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_folder), dtype=torch.float32)
    config = LoraConfig(
        task_type="CAUSAL_LM",
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        r=r,
        lora_alpha=lora_alpha,
        # Dropout would make training nondeterministic and is no part of the saved adapter.
        lora_dropout=0.0,
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        modules_to_save=list(modules_to_save) if modules_to_save else None,
        use_dora=use_dora,
    )
    # lora_A's random init happens in get_peft_model: seed before it, so that the same arguments
    # give the same adapter.
    torch.manual_seed(seed)
    with _quiet_peft():
        model = get_peft_model(model, config)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for step in range(steps):
        ids = random_ids(seed * 1000 + step, (2, 24))
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(str(adapter_folder), safe_serialization=True)

    # Read back what was saved, not the live model: the file is what qrt loads.
    saved = adapter_tensors(adapter_folder)
    lora_b = {name: t for name, t in saved.items() if ".lora_B." in name}
    assert lora_b, f"no lora_B tensors saved in {adapter_folder}: {sorted(saved)}"
    zero = [name for name, t in lora_b.items() if not t.abs().amax() > 0]
    assert not zero, f"lora_B still zero after {steps} steps: {zero}"
    return adapter_folder


def peft_reference(base_folder, adapter_folder, dtype=torch.float32):
    """PEFT's model of the checkpoint in `base_folder` with the adapter in `adapter_folder`, in eval mode."""
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_folder), dtype=dtype)
    return peft_over_model(base, adapter_folder)


def peft_over_model(model, adapter_folder):
    """The adapter in `adapter_folder` put by PEFT over the already built transformers `model`
    (e.g. one over a quantized base's dequantized weights), in eval mode. PEFT wraps `model`'s
    modules in place."""
    from peft import PeftModel

    with _quiet_peft():
        return PeftModel.from_pretrained(model, str(adapter_folder)).eval()


def peft_logits(model, ids) -> torch.Tensor:
    """`model`'s float32 logits [B, T, V] for the token ids `ids` [B, T]."""
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def adapter_tensors(adapter_folder) -> dict[str, torch.Tensor]:
    """The tensors of `adapter_folder`'s adapter_model.safetensors, by name."""
    return load_file(str(Path(adapter_folder) / "adapter_model.safetensors"))


def adapter_config(adapter_folder) -> dict:
    """`adapter_folder`'s adapter_config.json."""
    return json.loads((Path(adapter_folder) / "adapter_config.json").read_text())


def random_peft_adapter(config, adapter_folder, *, r=8, lora_alpha=16, seed=0) -> Path:
    """A PEFT adapter on every projection of a Llama with the shapes of qrt's ModelConfig
    `config`, whose lora_B is PEFT's random start instead of zeros (`init_lora_weights=False`),
    saved into `adapter_folder`: an adapter for any tiny base, whatever its sizes, without training."""
    import transformers
    from peft import LoraConfig, get_peft_model

    shape = transformers.LlamaConfig(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, vocab_size=config.vocab_size)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(shape)
    lora = LoraConfig(task_type="CAUSAL_LM", target_modules=list(ALL_PROJECTIONS), r=r, lora_alpha=lora_alpha,
                      lora_dropout=0.0, init_lora_weights=False)
    with _quiet_peft():
        get_peft_model(model, lora).save_pretrained(str(adapter_folder), safe_serialization=True)
    return Path(adapter_folder)
