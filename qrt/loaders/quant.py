"""Which quantization a model gets: detected from the checkpoint, or asked for with `quant=`.

A QuantScheme answers, per linear layer, which LinearMethod creates, loads and runs its weights.
Layers are named by their checkpoint module names (a fused layer by all of its shards').
"""

import fnmatch
import json
import re
from pathlib import Path

from .awq import AwqLinearMethod, awq_config
from .ct_int import CtIntLinearMethod, ct_int_config
from .ct_marlin24 import CtMarlin24LinearMethod, ct_marlin24_config
from .ct_w8a8 import CtW8A8LinearMethod, ct_w8a8_config
from .errors import ConfigError, UnsupportedError
from .fp8 import Fp8OnlineLinearMethod
from .fp8_checkpoint import DYNAMIC_GROUP, DYNAMIC_TOKEN, STATIC_TENSOR, Fp8CheckpointLinearMethod, Fp8Layout
from .gptq import GptqLinearMethod, dynamic_rules, gptq_config
from .int_online import OnlineIntLinearMethod
from .qqq import QqqLinearMethod, qqq_config
from .unquantized import UnquantizedLinearMethod
from .w8a8_online import W8A8OnlineLinearMethod

# quant= values qrt applies to an unquantized checkpoint while loading it:
# name -> (method factory taking the layer's checkpoint module names, description).
ONLINE_METHODS = {
    "fp8": (lambda names: Fp8OnlineLinearMethod(), "e4m3 weights per channel, activations per token"),
    "int4": (lambda names: OnlineIntLinearMethod(4, max_group=32),
             "4-bit weights, asymmetric groups of 32, bf16 activations"),
    "int4-g128": (lambda names: OnlineIntLinearMethod(4, max_group=128),
                  "4-bit weights, asymmetric groups of 128 (64 or 32 where 128 does not divide K), bf16 activations"),
    "int8": (lambda names: OnlineIntLinearMethod(8), "8-bit weights per channel, bf16 activations"),
    "w8a8": (lambda names: W8A8OnlineLinearMethod(), "int8 weights per channel, int8 activations per token"),
}
# Weight-only integer formats also quantize lm_head, to int8 per channel: with 4-bit layers, a bf16
# lm_head is about half the bytes read per decoded token (SmolLM2: 57 of ~130 MB), and int8 costs
# it +0.3% perplexity there. The embeddings stay as stored (a lookup reads one row per token).
INT8_LM_HEAD = ("int4", "int4-g128", "int8")
# Side files older GPTQ and AWQ exports carry instead of a quantization_config in config.json.
QUANT_SIDE_FILES = ("quantize_config.json", "quant_config.json")
MODELOPT_SIDE_FILE = "hf_quant_config.json"


class QuantScheme:
    """name: "none", an online format, or a stored format; `make_method(module_names)`: the
    LinearMethod of a quantized layer; `skip`: module patterns kept dense."""

    def __init__(self, name: str, make_method=None, skip=(), description: str = "", kv_cache_fp8: str | None = None,
                 quantized_lm_head: bool = False, make_lm_head_method=None):
        self.name = name
        self.make_method = make_method
        self.skip = tuple(skip)
        self.description = description
        self.kv_cache_fp8 = kv_cache_fp8  # None, or the family whose k_scale/v_scale convention applies
        self.quantized_lm_head = quantized_lm_head  # the checkpoint stores lm_head quantized too
        self.make_lm_head_method = make_lm_head_method  # online: lm_head's own format, or None (kept dense)

    def method_for(self, module_names):
        """The LinearMethod for a layer made of the checkpoint modules `module_names`."""
        if isinstance(module_names, str):
            module_names = [module_names]
        if self.make_lm_head_method is not None and module_names == ["lm_head"]:
            return self.make_lm_head_method()
        dense = ("embed_tokens",) if self.quantized_lm_head else ("lm_head", "embed_tokens")
        if self.make_method is None or any(n.endswith(dense) for n in module_names):
            return UnquantizedLinearMethod()
        skipped = {any(_matches(name, pattern) for pattern in self.skip) for name in module_names}
        if len(skipped) > 1:
            raise UnsupportedError(f"the shards {module_names} are quantized differently (some are in the ignore "
                                   f"list, some not); qrt runs them as one fused layer and cannot mix them")
        return UnquantizedLinearMethod() if skipped.pop() else self.make_method(list(module_names))

    def describe(self) -> str:
        return self.description or self.name


def _matches(name: str, pattern: str) -> bool:
    """Ignore-list matching: `re:` regexes (compressed-tensors), wildcards (ModelOpt), else a
    module name or a dotted suffix/prefix of one ("lm_head", "mlp.gate", "model.layers.0")."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern.rstrip("*").rstrip("."))
    return name == pattern or name.endswith("." + pattern) or name.startswith(pattern + ".")


def resolve_scheme(hf_config: dict, quant: str | None, config_path, folder=None) -> QuantScheme:
    """The scheme for this checkpoint and `quant=` argument, or a clear error."""
    stored = detect_stored_scheme(hf_config, config_path, folder)
    if stored is not None:
        if quant not in (None, "none", stored.name):
            raise UnsupportedError(
                f"quant={quant!r} was asked for, but {config_path} is a pre-quantized {stored.describe()} "
                f"checkpoint; load it as stored (quant=None or quant={stored.name!r}) or start from an "
                f"unquantized checkpoint"
            )
        return stored
    if quant is None or quant == "none":
        return QuantScheme("none", description="none (weights as stored)")
    if quant not in ONLINE_METHODS:
        raise UnsupportedError(
            f"quant={quant!r} is not supported; choose None (as stored) or one of {sorted(ONLINE_METHODS)}"
        )
    make_method, what = ONLINE_METHODS[quant]
    int8_lm_head = quant in INT8_LM_HEAD
    kept = "lm_head int8 per channel, embeddings kept" if int8_lm_head else "lm_head and embeddings kept"
    return QuantScheme(quant, make_method, description=f"{quant} (online: {what}; quantized while loading; {kept})",
                       make_lm_head_method=(lambda: OnlineIntLinearMethod(8)) if int8_lm_head else None)


def detect_stored_scheme(hf_config: dict, config_path, folder=None) -> QuantScheme | None:
    stored = hf_config.get("quantization_config")
    if stored is None and folder is not None:
        return _side_file_scheme(Path(folder))
    if stored is None:
        return None
    if not isinstance(stored, dict) or "quant_method" not in stored:
        raise ConfigError(f"{config_path}: quantization_config has no 'quant_method'")
    return _read_quant_config(stored, str(stored["quant_method"]).lower(), config_path)


def _read_quant_config(config: dict, method: str, source) -> QuantScheme:
    readers = {"fp8": _hf_fp8, "modelopt": _modelopt_config, "compressed-tensors": _compressed_tensors,
               "gptq": _gptq, "awq": _awq, "qqq": _qqq}
    if method not in readers:
        raise UnsupportedError(
            f"{source}: the checkpoint is pre-quantized with quant_method={method!r}, which this version "
            f"of qrt cannot load yet; supported: {sorted(readers)}, and unquantized checkpoints"
        )
    return readers[method](config, source)


def _side_file_scheme(folder: Path) -> QuantScheme | None:
    modelopt = folder / MODELOPT_SIDE_FILE
    if modelopt.is_file():
        return _modelopt_side_file(modelopt)
    for name in QUANT_SIDE_FILES:
        path = folder / name
        if path.is_file():
            config = _read_json(path)
            # AutoAWQ's side file says zero_point/version; AutoGPTQ's says neither.
            awq = "zero_point" in config or "version" in config
            return _read_quant_config(config, str(config.get("quant_method", "awq" if awq else "gptq")).lower(), path)
    return None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return value


def _gptq(config: dict, source) -> QuantScheme:
    base = gptq_config(config, source)
    skip, overrides = dynamic_rules(config, base, source)
    blocks = config.get("modules_in_block_to_quantize")
    if blocks:
        names = "|".join(re.escape(name) for group in blocks for name in group)
        skip.append(rf"re:.*\.layers\.\d+\.(?!(?:{names})$)")  # layer modules not listed stay dense

    def make(module_names):
        chosen = {next((cfg for pattern, cfg in overrides if re.match(pattern, name)), base) for name in module_names}
        if len(chosen) > 1:
            raise UnsupportedError(f"{source}: GPTQ dynamic rules give the fused shards {module_names} different "
                                   f"settings; qrt runs them as one matmul")
        return GptqLinearMethod(chosen.pop(), module_names)

    return QuantScheme("gptq", make, skip, base.describe(), quantized_lm_head=bool(config.get("lm_head", False)))


def _qqq(config: dict, source) -> QuantScheme:
    cfg = qqq_config(config, source)
    return QuantScheme("qqq", lambda names: QqqLinearMethod(cfg, names), (), cfg.describe())


def _awq(config: dict, source) -> QuantScheme:
    cfg = awq_config(config, source)
    # modules_to_not_convert entries match as substrings of module names.
    skip = ["re:.*" + re.escape(name) for name in config.get("modules_to_not_convert") or ()]
    return QuantScheme("awq", lambda names: AwqLinearMethod(cfg, names), skip, cfg.describe())


def _fp8_scheme(layout: Fp8Layout, family: str, skip, kv_cache_fp8=None) -> QuantScheme:
    block = f" {layout.block[0]}x{layout.block[1]}" if layout.block else ""
    description = f"fp8 ({family}: {layout.weight}{block} weight scales, {layout.activation} activations"
    description += ", fp8 KV cache)" if kv_cache_fp8 else ")"
    return QuantScheme("fp8", lambda names: Fp8CheckpointLinearMethod(layout, family), skip, description, kv_cache_fp8)


def _hf_fp8(config: dict, config_path) -> QuantScheme:
    activation = config.get("activation_scheme", "dynamic")
    block = config.get("weight_block_size")
    skip = config.get("ignored_layers") or config.get("modules_to_not_convert") or ()
    if block is not None:
        if activation != "dynamic" or len(block) != 2:
            raise ConfigError(f"{config_path}: fp8 weight_block_size={block} needs activation_scheme 'dynamic' "
                              f"and two block sizes")
        layout = Fp8Layout("block", DYNAMIC_GROUP, tuple(int(b) for b in block), "weight_scale_inv")
    elif activation in ("dynamic", "static"):
        layout = Fp8Layout("tensor", STATIC_TENSOR if activation == "static" else DYNAMIC_TOKEN)
    else:
        raise ConfigError(f"{config_path}: activation_scheme={activation!r}; expected 'static' or 'dynamic'")
    return _fp8_scheme(layout, "HF fp8", skip)


_MODELOPT_FP8 = {
    "FP8": Fp8Layout("tensor", STATIC_TENSOR),
    "FP8_PER_CHANNEL_PER_TOKEN": Fp8Layout("channel", DYNAMIC_TOKEN),
}


def _modelopt(algo, kv_algo, skip, source) -> QuantScheme:
    algo = str(algo).upper()
    if algo not in _MODELOPT_FP8:
        raise UnsupportedError(f"{source}: ModelOpt quant_algo={algo!r} is not supported yet; supported: "
                               f"{sorted(_MODELOPT_FP8)}")
    kv = "modelopt" if kv_algo is not None and str(kv_algo).upper() == "FP8" else None
    if kv_algo is not None and kv is None:
        raise UnsupportedError(f"{source}: ModelOpt kv_cache_quant_algo={kv_algo!r} is not supported; only FP8")
    return _fp8_scheme(_MODELOPT_FP8[algo], "ModelOpt", skip, kv)


def _modelopt_side_file(path: Path) -> QuantScheme | None:
    side = _read_json(path)
    if side.get("producer", {}).get("name") != "modelopt":
        return None
    q = side.get("quantization") or {}
    return _modelopt(q.get("quant_algo"), q.get("kv_cache_quant_algo"), q.get("exclude_modules") or (), path)


def _modelopt_config(config: dict, config_path) -> QuantScheme:
    kv = config.get("kv_cache_scheme")
    kv_algo = "FP8" if isinstance(kv, dict) and kv.get("type") == "float" and kv.get("num_bits") == 8 else kv
    return _modelopt(config.get("quant_algo"), kv_algo, config.get("ignore") or (), config_path)


def _compressed_tensors(config: dict, config_path) -> QuantScheme:
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise UnsupportedError(f"{config_path}: compressed-tensors with {len(groups)} config groups is not supported "
                               f"yet; supported: one group")
    (group,) = groups.values()
    fmt = group.get("format") or config.get("format")
    sparsity = (config.get("sparsity_config") or {}).get("format", "dense")
    if sparsity != "dense":
        raise UnsupportedError(f"{config_path}: compressed-tensors sparsity format {sparsity!r} is not supported yet")
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    skip = list(config.get("ignore") or ())
    targets = group.get("targets") or []
    if any(t != "Linear" for t in targets):
        # Anything not targeted stays dense: express "not matched by a target" as a skip rule.
        skip.append("re:^(?!" + "|".join(_target_regex(t) for t in targets) + ").*$")
    if fmt == "marlin-24":  # 2:4 sparsity lives in the weight layout; sparsity_config says "dense"
        marlin24 = ct_marlin24_config(weights, inputs, config_path)
        return QuantScheme("compressed-tensors", lambda names: CtMarlin24LinearMethod(marlin24, names), skip,
                           marlin24.describe())
    if weights.get("type") == "int":
        if inputs is not None:
            w8a8 = ct_w8a8_config(fmt, weights, inputs, config_path)
            return QuantScheme("compressed-tensors", lambda names: CtW8A8LinearMethod(w8a8, names), skip,
                               w8a8.describe())
        if fmt not in ("pack-quantized", "naive-quantized", "int-quantized"):
            raise UnsupportedError(f"{config_path}: compressed-tensors format {fmt!r} with int weights is not "
                                   f"supported; supported: pack-quantized, naive-quantized, int-quantized")
        cfg = ct_int_config(fmt, weights, config_path)
        return QuantScheme("compressed-tensors", lambda names: CtIntLinearMethod(cfg, names), skip, cfg.describe())
    if fmt != "float-quantized":
        raise UnsupportedError(f"{config_path}: compressed-tensors format={fmt!r} is not supported yet; supported: "
                               f"'float-quantized' (FP8), 'pack-quantized' and 'naive-quantized' (int weight-only)")
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise UnsupportedError(f"{config_path}: compressed-tensors weights {weights} are not 8-bit float")
    if inputs is None:
        raise UnsupportedError(f"{config_path}: fp8 weights with unquantized activations (W8A16) are not supported yet")
    strategy = weights.get("strategy") or "tensor"
    activation = _ct_activation(inputs, config_path)
    if strategy == "block":
        block = tuple(int(b) for b in weights.get("block_structure") or (128, 128))
        layout = Fp8Layout("block", activation, block)
    elif strategy in ("tensor", "channel"):
        layout = Fp8Layout(strategy, activation)
    else:
        raise UnsupportedError(f"{config_path}: compressed-tensors fp8 weight strategy {strategy!r} is not supported")
    kv = config.get("kv_cache_scheme")
    return _fp8_scheme(layout, "compressed-tensors", skip, "compressed-tensors" if kv else None)


def _target_regex(target: str) -> str:
    if target == "Linear":
        return ".*"
    return target[3:] if target.startswith("re:") else re.escape(target) + "$"


def _ct_activation(inputs: dict, config_path) -> str:
    strategy, dynamic = inputs.get("strategy") or "tensor", inputs.get("dynamic")
    if dynamic is True and strategy == "token":
        return DYNAMIC_TOKEN
    if dynamic is False and strategy == "tensor":
        return STATIC_TENSOR
    if dynamic is True and strategy == "group":
        return DYNAMIC_GROUP
    raise UnsupportedError(f"{config_path}: compressed-tensors input activations {inputs} are not supported; "
                           f"supported: dynamic token, static tensor, dynamic group")
