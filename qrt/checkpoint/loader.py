"""Build a model on the meta device, stream a checkpoint into it, then run the loader pass."""

import re
import sys
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from qrt.kernels.choices import NoKernelError

from qrt.checkpoint.config import DeviceConfig, LoadConfig, parse_dtype
from qrt.errors import CheckpointError, ConfigError, TensorMismatch, UnsupportedError
from qrt.layers.linear import Linear, attributes_of, make_parameter
from qrt.layers.tensor_parallel import SINGLE, Parallelism, axis_cut


def choose_dtype(device_config: DeviceConfig, hf_config: dict, source) -> torch.dtype:
    if device_config.dtype is not None:
        return device_config.dtype
    stored = hf_config.get("torch_dtype") or hf_config.get("dtype")
    if stored is None:
        return torch.bfloat16
    try:
        return parse_dtype(stored) if isinstance(stored, str) else parse_dtype(repr(stored))
    except ValueError as err:
        raise ConfigError(f"{source}: torch_dtype: {err}; or pass dtype= to compile_model") from None


def load_model(model_cls, checkpoint, scheme, load_config: LoadConfig, device_config: DeviceConfig,
               parallel: Parallelism = SINGLE, prediction_layers: bool = False, lm_head: bool = True) -> nn.Module:
    """A model of `model_cls` with every weight of `checkpoint` (see source.py) loaded and
    repacked for `device_config.device`; in a sharded model (`parallel`), this rank's part of them.
    prediction_layers: with the checkpoint's multi-token-prediction layer (CausalLM.keep_prediction_layers).
    lm_head=False: without the output layer (CausalLM.remove_lm_head), for an embedding model.

    Nothing half-loaded escapes: any error propagates before the model is returned."""
    dtype = choose_dtype(device_config, checkpoint.hf_config, checkpoint.config_path)
    with torch.device("meta"):
        model = model_cls(checkpoint.hf_config, scheme, dtype, source=checkpoint.config_path, parallel=parallel)
        if prediction_layers:
            model.keep_prediction_layers()
        if not lm_head:
            model.remove_lm_head()
    materialize(model, device_config.device)
    started = time.perf_counter()
    later = []  # tensors read only if the loader pass leaves a place for them
    if load_config.load_format == "dummy":
        fill_random(model, load_config.seed)
    else:
        tensors = checkpoint.tensors(dtype)
        if getattr(checkpoint, "output_is_embedding", False):
            # The output layer holds the embedding's values: the embedding is read only if that
            # layer cannot give rows back once packed (share_embedding_rows).
            later = [t for t in tensors if t[1] == EMBEDDING]
            tensors = [t for t in tensors if t[1] != EMBEDDING]
        stream_tensors(model, tensors, where=checkpoint.folder, progress=load_config.progress,
                       later={EMBEDDING} if later else frozenset())
    run_loader_pass(model, device_config.kernel_device)
    if getattr(checkpoint, "output_is_embedding", False) and not share_embedding_rows(model) and later:
        stream_tensors(model, later, where=checkpoint.folder, progress=False, only={EMBEDDING})
    if load_config.progress:
        print(f"qrt: loaded weights in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return model.eval()


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give every meta parameter real (uninitialized) storage, keeping its attributes and ties."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced:
                data = torch.empty(param.shape, dtype=param.dtype, device=device)
                replaced[id(param)] = make_parameter(data, **attributes_of(param))
            setattr(module, name, replaced[id(param)])


def stream_tensors(model: nn.Module, tensors: list, where: Path, progress: bool, later=frozenset(),
                   only=None) -> None:
    """Feed each checkpoint tensor ((file, name, StoredTensor)) to its parameter's weight_loader,
    then check nothing is missing: of every parameter but those named in `later`, or of those in
    `only` where given. Empties `tensors`.

    Every tensor is first matched to its parameter and, in a sharded model, to this rank's part of
    it, from the headers alone: a checkpoint that does not fit the model, or a format that cannot
    be split this way, is refused before any weight is read. Each rank then reads only its part."""
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {name: set() for name in params}
    names = model.checkpoint_names()
    plan, seen = [], set()
    for path, name, stored in tensors:
        if names.skipped(name):
            continue
        param_name, shard_id = names.parameter_of(name)
        if param_name not in params:
            param_name = _format_leaf(model, param_name)
        param = params.get(param_name)
        if param is None or getattr(param, "weight_loader", None) is None:
            raise CheckpointError(path, name, f"unexpected tensor: {type(model).__name__} has no "
                                  f"parameter it loads into (looked for '{param_name}')"
                                  f"{_expected_here(model, param_name)}")
        if (param_name, shard_id) in seen:
            raise CheckpointError(path, name, "appears more than once in the checkpoint")
        seen.add((param_name, shard_id))
        targets = [(target, rank_cuts(model, target, shard_id, stored.shape, name))
                   for target in (param_name, *names.copies.get(param_name, ()))]
        plan.append((path, name, stored, shard_id, targets))
    bar = tqdm(total=len(plan), desc="qrt: loading", unit="tensor", disable=not progress, file=sys.stderr,
               leave=False)
    # Consumed as it streams: a tensor already in memory (GGUF) is freed once its parameter has it.
    tensors.clear()
    plan.reverse()
    with bar:
        while plan:
            path, name, stored, shard_id, targets = plan.pop()
            bar.update(1)
            read: dict = {}  # cuts -> tensor: a copy with the same cuts reads once
            for target, cuts in targets:
                try:
                    if cuts not in read:
                        read[cuts] = stored.read(cuts)
                    params[target].weight_loader(params[target], read[cuts], shard_id)
                except TensorMismatch as err:
                    raise CheckpointError(path, name, f"{err} (loading into '{target}')") from None
                loaded[target].add(shard_id)
    expected = {name: param for name, param in params.items()
                if name not in later and (only is None or name in only)}
    _check_complete(model, expected, loaded, where)


def _format_leaf(model: nn.Module, param_name: str) -> str:
    """The parameter a quantized layer loads a tensor into whose name goes on past the layer's with
    more dots than a parameter name may hold (LinearMethod.checkpoint_leaves); else `param_name`."""
    parts = param_name.split(".")
    for cut in range(len(parts) - 2, 0, -1):
        try:
            module = model.get_submodule(".".join(parts[:cut]))
        except AttributeError:
            continue
        leaves = getattr(getattr(module, "quant_method", None), "checkpoint_leaves", {})
        leaf = leaves.get(".".join(parts[cut:]))
        return param_name if leaf is None else ".".join(parts[:cut] + [leaf])
    return param_name


def rank_cuts(model: nn.Module, param_name: str, shard_id, shape, tensor_name: str) -> tuple:
    """This rank's cuts (tensor_parallel.DimCut) of a checkpoint tensor of `shape` that loads into
    `param_name`; () for a tensor every rank loads whole.

    A sharded module (a Linear, the vocab-parallel embedding) has `n_slices` / `k_slice` and
    says through `tensor_split` how each of its tensors follows those axes."""
    module_name, _, leaf = param_name.rpartition(".")
    module = model.get_submodule(module_name)
    n_slices, k_slice = getattr(module, "n_slices", None), getattr(module, "k_slice", None)
    if n_slices is None and k_slice is None:
        return ()
    split = module.tensor_split(leaf)
    if split is None:
        method = getattr(module, "quant_method", None)
        what = f"the {method.name!r} format" if method is not None else type(module).__name__
        raise UnsupportedError(f"{module_name}: {what} declares no tensor-parallel rule for '{leaf}' "
                               f"(checkpoint tensor '{tensor_name}'); it can only run with tp=1")
    cuts = []
    if n_slices is not None and split.n_dim is not None:
        covered = n_slices if shard_id is None else (n_slices[module.shard_layout.shard_ids.index(shard_id)],)
        cuts.append(axis_cut(tensor_name, module_name, shape, split.n_dim, covered, "output", split.n_align))
    if k_slice is not None and split.k_dim is not None:
        cuts.append(axis_cut(tensor_name, module_name, shape, split.k_dim, (k_slice,), "input", split.k_align))
    return tuple(cuts)


def _expected_here(model, param_name: str) -> str:
    """For an unexpected tensor of a quantized layer: which tensors that layer's format loads."""
    module_name = param_name.rpartition(".")[0]
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return ""
    method = getattr(module, "quant_method", None)
    if method is None:
        return ""
    names = [name for name, p in module.named_parameters(recurse=False) if getattr(p, "weight_loader", None)]
    return f"; the quantization config makes '{module_name}' a {method.name!r}-format layer, which loads {names}"


def _expected_shards(model, param_name: str) -> set:
    module = model.get_submodule(param_name.rpartition(".")[0])
    layout = getattr(module, "shard_layout", None)
    return {None} if layout is None else set(layout.shard_ids)


def _check_complete(model, params: dict, loaded: dict, where: Path) -> None:
    missing = []
    for name, param in params.items():
        if getattr(param, "weight_loader", None) is None or getattr(param, "optional", False):
            continue  # derived while loading (e.g. online fp8 scales), or checked by the loader pass
        for shard_id in sorted(_expected_shards(model, name) - loaded[name], key=str):
            missing.append(name if shard_id is None else f"{name} (shard {shard_id!r})")
            if match := _EXPERT_NAME.search(name):
                missing[-1] += f" (layer {match['layer']}, expert {match['expert']})"
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(where, None, f"missing tensor(s) for {shown}")


_EXPERT_NAME = re.compile(r"layers\.(?P<layer>\d+)\..*\.experts\.(?P<expert>\d+)\.")


def fill_random(model: nn.Module, seed: int) -> None:
    """load_format="dummy": random weights of the right shapes, fed through the weight loaders
    so quantized layers quantize them exactly as they would a checkpoint."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            continue
        shape = getattr(param, "loaded_shape", param.shape)
        if name.endswith("norm.weight"):
            values = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        else:
            values = 0.02 * torch.randn(shape, generator=generator)
        loader(param, values.to(param.device), None)


EMBEDDING = "model.embed_tokens.weight"


def share_embedding_rows(model: nn.Module) -> bool:
    """The checkpoint's output layer was read from its embedding's stored values (a GGUF with a
    tied, quantized embedding): where the output layer's layout reads rows back, the embedding
    looks its rows up there and holds no copy, so the model holds those values once. Returns
    whether it does."""
    output, embedding = model.lm_head, model.model.embed_tokens
    if output is None:  # a model without its head (an embedding model) reads the embedding itself
        return False
    layout = getattr(output.quant_method, "layout", None)
    if layout is None or not layout.gathers_rows or getattr(output, "perm", None) is not None:
        return False
    embedding.share_rows_of(output)
    return True


def run_loader_pass(model: nn.Module, device: torch.device) -> None:
    """Repack every quantized layer once into the layout its kernel on `device` wants; the tensors
    stay where they were loaded."""
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not isinstance(module, Linear):
            continue
        try:
            method.process_after_loading(module, device)
        except NoKernelError as err:
            raise UnsupportedError(f"{name}: {method.name} weights cannot run on {device.type}: {err}") from None
    # Modules made of several layers regroup theirs once each is in its kernel's layout (the
    # experts of a mixture-of-experts block stack theirs, experts.py).
    for module in list(model.modules()):
        if hasattr(module, "finish_loading"):
            module.finish_loading(device)
