"""compressed-tensors checkpoints (llm-compressor, `quant_method: "compressed-tensors"`): the
config-level rules (one config group, targets, ignore list, sparsity, transforms), then the
registered sub-format whose `matches` accepts the group (docs/formats.md §3).

Each sub-format lives with its loader: int_weight_only.py, int_w8a8.py (int8 weights and
activations), marlin24.py (2:4 sparse 4-bit) beside this file, and ../fp8_checkpoint.py
(float-quantized FP8). They register themselves when catalog.py imports them, before any
config is read.
"""

import re

from qrt.errors import UnsupportedError
from qrt.formats.scheme import QuantScheme
from qrt.formats.registry import COMPRESSED_TENSORS, CompressedTensorsGroup, stored_format


@stored_format("compressed-tensors", computes=(), summary="compressed-tensors (llm-compressor): one config group of a "
               "registered sub-format, targets and ignore list")
def compressed_tensors_scheme(config: dict, config_path) -> QuantScheme:
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise UnsupportedError(f"{config_path}: compressed-tensors with {len(groups)} config groups is not supported "
                               f"yet; supported: one group")
    (group,) = groups.values()
    if not isinstance(group, dict):
        raise UnsupportedError(f"{config_path}: compressed-tensors config group {group!r} is a preset name; qrt "
                               f"reads groups that spell out their weights and input_activations")
    if config.get("transform_config"):
        # Rotations (SpinQuant, QuIP) must be applied to the weights and activations; loading without them would
        # run a model that silently computes something else.
        raise UnsupportedError(f"{config_path}: compressed-tensors transform_config (weight rotations) is not "
                               f"supported")
    sparsity = (config.get("sparsity_config") or {}).get("format", "dense")
    if sparsity != "dense":
        raise UnsupportedError(f"{config_path}: compressed-tensors sparsity format {sparsity!r} is not supported yet")
    skip = list(config.get("ignore") or ())
    targets = group.get("targets") or []
    if any(t != "Linear" for t in targets):
        # Anything not targeted stays dense: express "not matched by a target" as a skip rule.
        skip.append("re:^(?!" + "|".join(_target_regex(t) for t in targets) + ").*$")
    parsed = CompressedTensorsGroup(group.get("format") or config.get("format"), group.get("weights") or {},
                                    group.get("input_activations"), config)
    formats = COMPRESSED_TENSORS
    matching = [fmt for fmt in formats.values() if fmt.matches(parsed)]
    if len(matching) != 1:
        supported = "; ".join(f"{fmt.name}: {fmt.summary}" for fmt in formats.values())
        raise UnsupportedError(f"{config_path}: compressed-tensors format {parsed.fmt!r} with weights {parsed.weights} "
                               f"and input activations {parsed.inputs} is not supported; supported: {supported}")
    return matching[0].read(parsed, skip, config_path)


def _target_regex(target: str) -> str:
    if target == "Linear":
        return ".*"
    return target[3:] if target.startswith("re:") else re.escape(target) + "$"
