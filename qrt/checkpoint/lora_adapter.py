"""Reading a PEFT LoRA adapter as PEFT writes it (`save_pretrained`): `adapter_config.json` and
`adapter_model.safetensors`.

For each adapted linear module PEFT saves two tensors, named after the module in the base model
behind PEFT's own prefix: `base_model.model.<module>.lora_A.weight` [r, K] and
`base_model.model.<module>.lora_B.weight` [N, r]. The module's output gains
`scaling · B (A x)`, where scaling is `alpha / r` (`alpha / sqrt(r)` with `use_rslora`); `r` and
`alpha` are the config's `r` and `lora_alpha`, or the module's entries in `rank_pattern` and
`alpha_pattern`. The rank is read from the tensors themselves, so `rank_pattern` needs no reading.

What qrt cannot honour is refused by name, before anything is loaded: other PEFT types than LoRA,
DoRA, trained biases, `modules_to_save`, transposed (Conv1D) weights, embedding adapters.
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from qrt.errors import CheckpointError, UnsupportedError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}


@dataclass(frozen=True)
class ModuleAdapter:
    """One adapted module: A [r, K] and B [N, r] as saved (float32), and the factor the product takes."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT LoRA adapter: its base model's module names -> their low-rank pair."""

    path: Path
    modules: dict  # str (the base model's module name, e.g. model.layers.0.self_attn.q_proj) -> ModuleAdapter

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())


def read_adapter(folder) -> LoraAdapter:
    """The adapter saved in `folder`; a CheckpointError or UnsupportedError naming the file, the
    tensor and what was expected where it is not a LoRA adapter qrt can run."""
    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(folder, None, f"no {CONFIG_FILE}: a LoRA adapter is a folder PEFT's save_pretrained "
                                            f"wrote ({CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(config_path, None, f"not readable as JSON: {err}") from None
    if not isinstance(config, dict):
        raise CheckpointError(config_path, None, "expected a JSON object")
    _check_config(config, config_path)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        found = sorted(p.name for p in folder.iterdir())
        raise CheckpointError(folder, None, f"no {WEIGHTS_FILE} (found {found}); save the adapter with "
                                            f"safe_serialization=True, PEFT's default")
    pairs = _read_pairs(weights_path)
    modules = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            missing = ({"A", "B"} - set(pair)).pop()
            raise CheckpointError(weights_path, f"{_PREFIX}{module}.lora_{missing}.weight",
                                  "missing: every adapted module has a lora_A and a lora_B")
        a, b = pair["A"], pair["B"]
        name_a = f"{_PREFIX}{module}.lora_A.weight"
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise CheckpointError(weights_path, name_a, f"lora_A {list(a.shape)} and lora_B {list(b.shape)} do "
                                                        f"not make a low-rank pair ([r, K] and [N, r])")
        rank = a.shape[0]
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules[module] = ModuleAdapter(a.float(), b.float(), float(scaling))
    if not modules:
        raise CheckpointError(weights_path, None, "holds no lora_A/lora_B tensors")
    return LoraAdapter(folder, modules)


def _check_config(config: dict, where: Path) -> None:
    kind = config.get("peft_type")
    if kind != "LORA":
        raise UnsupportedError(f"{where}: peft_type {kind!r}; qrt runs LoRA adapters (peft_type 'LORA') only")
    if config.get("use_dora"):
        raise UnsupportedError(f"{where}: a DoRA adapter (use_dora: true); qrt runs plain LoRA adapters only")
    if config.get("bias", "none") != "none":
        raise UnsupportedError(f"{where}: bias {config['bias']!r}: the adapter trained biases of the base, "
                               f"which qrt does not load; train with bias='none'")
    if config.get("modules_to_save"):
        raise UnsupportedError(f"{where}: modules_to_save {config['modules_to_save']}: the adapter replaces "
                               f"whole modules of the base, which qrt does not do; merge the adapter instead")
    if config.get("fan_in_fan_out"):
        raise UnsupportedError(f"{where}: fan_in_fan_out: true (transposed Conv1D weights, GPT-2 style); "
                               f"qrt's models take [out, in] linear weights")


def _read_pairs(path: Path) -> dict:
    """module name -> {"A": tensor, "B": tensor} of the file."""
    from safetensors import safe_open

    pairs: dict = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                module, which = _split_name(name, path)
                pairs.setdefault(module, {})[which] = f.get_tensor(name)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001  (safetensors' own errors: a truncated or foreign file)
        raise CheckpointError(path, None, f"not a readable safetensors file: {err}") from None
    return pairs


def _split_name(name: str, path: Path) -> tuple[str, str]:
    for suffix, which in _SUFFIXES.items():
        if name.endswith(suffix) and name.startswith(_PREFIX):
            return name[len(_PREFIX):-len(suffix)], which
    if "lora_embedding" in name:
        raise UnsupportedError(f"{path}: tensor '{name}': an adapter on an embedding layer; qrt adapts linear "
                               f"layers only")
    raise CheckpointError(path, name, f"expected {_PREFIX}<module>.lora_A.weight or .lora_B.weight (PEFT's names)")


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rule for `alpha_pattern`: the first key that matches the end of the module's name
    (the whole name or after a dot), read as a regular expression."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default
