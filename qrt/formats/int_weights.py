"""The loader pass shared by every integer weight-only format (GPTQ, AWQ, compressed-tensors,
online int4/int8): from a layer's integer weights in the neutral form (`IntWeights`) to the layout
of its kernel.

Each format's loader pass only has to say what its tensors mean, as `IntWeights`; this module
reorders act-order groups, asks for the kernel of `qrt::int_linear` on the device (the kernels
declare which weights they accept, kernels/choices.py) and lets that kernel's layout pack the
weights (kernels/layouts.py). Today's kernels and layouts:

| kernel (device)                | accepts                                     | layout after the pass               |
|--------------------------------|---------------------------------------------|-------------------------------------|
| `int_linear_triton` (CUDA)     | 2/4/8-bit, contiguous groups                | "packed": int32 words along K + group scales |
| `int4pack_linear` (CPU)        | 4-bit, groups a multiple of 32, N % 16 == 0 | "int4pack": qrt's or ATen's int4 pack + scale/offset pairs |
| `int8pack_linear` (CPU)        | 8-bit, one group per channel, K % 16 == 0   | "int8pack": int8 [N, K] or in pairs + channel scales |
| `int8_groups_linear` (CPU)     | 8-bit, even groups of 16+ dividing K, N % 64 == 0 | "int8groups": centred int8 codes in pairs + scale/offset pairs |
| `aten.linear` (any)            | anything else                               | "dense": dequantized to the model dtype |

The CPU layouts are opaque (the int4 one is tiled for AVX-512), so unlike the canonical layout
no reference can read them: on the CPU the layout's `linear` calls the kernel op directly. On
CUDA it calls the logical op and the swap pass puts the Triton kernel in its place. Either way the
layout is recorded on the weight and shown by `inspect` and `dump`.
"""

from functools import partial

import torch

import qrt.kernels  # noqa: F401  (registers torch.ops.qrt.*)
from qrt.kernels.choices import choose
from qrt.kernels.int_reference import IntWeights
from qrt.kernels.layouts import Layout

from qrt.errors import CheckpointError, TensorMismatch, UnsupportedError
from qrt.layers.linear import ShardLayout, check_shape, install_packed, make_parameter

def _groups_in_use(w: IntWeights) -> IntWeights:
    """Only the groups the layer's input channels use, renumbered in order: a row-parallel
    act-order layer holds every group's scales but a part of the channels."""
    used, g_idx = torch.unique(w.g_idx.long(), return_inverse=True)
    if used.numel() == w.scales.shape[0]:
        return w
    return IntWeights(w.q, w.scales[used], w.zeros[used], w.bits, w.group_size, g_idx.to(torch.int32))


def _contiguous_groups(w: IntWeights) -> tuple[IntWeights, torch.Tensor | None] | None:
    """Reorder an act-order weight so each group's input channels are contiguous.

    Returns the reordered weights and the activation permutation (None when already in order),
    or None when the groups are not all of size G (then no grouped kernel can run it)."""
    k = w.q.shape[0]
    in_order = torch.arange(k, device=w.q.device) // w.group_size  # [K]
    if w.g_idx is None or torch.equal(w.g_idx.long(), in_order):
        return IntWeights(w.q, w.scales, w.zeros, w.bits, w.group_size), None
    g_idx = w.g_idx.long()
    if g_idx.min() < 0 or g_idx.max() >= w.scales.shape[0]:
        return None
    if not torch.equal(torch.bincount(g_idx, minlength=w.scales.shape[0]), torch.bincount(in_order)):
        return None
    perm = torch.argsort(g_idx, stable=True)  # [K]: sorted position -> original input channel
    return IntWeights(w.q[perm], w.scales, w.zeros, w.bits, w.group_size), perm


def install_int_weights(layer, w: IntWeights, device: torch.device, what: str) -> Layout:
    """Give `layer` the parameters of the best layout for `w` on `device`; returns the layout,
    whose `linear(layer, x, bits, group_size)` runs the layer from then on.

    `what` names the format for `inspect` (e.g. "GPTQ 4-bit g128")."""
    home = w.q.device  # where the layer was loaded; `device` names the kernel's device
    k, n = w.q.shape
    if w.g_idx is not None:
        w = _groups_in_use(w)
    grouped = _contiguous_groups(w)
    layer.register_parameter("perm", None)
    kernel = choose("qrt.int_linear", device.type, bits=w.bits, group_size=w.group_size, k=k, n=n,
                    contiguous_groups=grouped is not None)
    if grouped is not None:
        w, perm = grouped
        if perm is not None:
            layer.perm = make_parameter(perm.to(home))  # [K] int64
    install_packed(layer, kernel.layout.pack(w, layer.params_dtype), kernel.op, what)
    return kernel.layout


def copy_ints(param, loaded: torch.Tensor, shard_id, *, layout: ShardLayout | None, dtype: torch.dtype) -> None:
    """weight_loader for integer tensors: exact dtype, then copied into the shard's slice along
    the parameter's output dim."""
    if loaded.dtype != dtype:
        raise TensorMismatch(f"dtype {loaded.dtype}, expected {dtype}")
    dst = param.data if layout is None else layout.rows(param.data, shard_id, param.output_dim)
    check_shape(loaded, dst.shape)
    dst.copy_(loaded)


def shard_slot(layer, shard_id) -> int:
    """Index of a fused layer's shard among its shards (0 for an unfused layer)."""
    return 0 if layer.shard_layout is None else layer.shard_layout.shard_ids.index(shard_id)


def whole_shard_shape(layer, shard_id) -> list[int]:
    """[N, K] of one shard of the whole layer, as a checkpoint's `weight_shape` records it (in a
    sharded model too, where the layer holds a rank's part)."""
    return [layer.full_shard_sizes[shard_slot(layer, shard_id)], layer.full_input_size]


def g_idx_parameter(layer, **attributes):
    """Act-order group indices, loaded when the checkpoint has them: [shards, K] int32, one row
    per fused shard, the shards that arrived recorded in `layer.loaded_g_idx`."""
    slots = 1 if layer.shard_layout is None else len(layer.shard_layout.shard_ids)
    layer.loaded_g_idx = set()
    return make_parameter(torch.empty(slots, layer.input_size, dtype=torch.int32),  # [shards, K]
                          weight_loader=partial(_load_g_idx, layer=layer), optional=True, **attributes)


def _load_g_idx(param, loaded, shard_id, *, layer):
    if loaded.dtype not in (torch.int32, torch.int64):
        raise TensorMismatch(f"dtype {loaded.dtype}, expected int32 group indices")
    check_shape(loaded, param.shape[1:], "group indices")
    param.data[shard_slot(layer, shard_id)] = loaded
    layer.loaded_g_idx.add(shard_id)


def loaded_g_idx(layer, param, *, required: str | None, source, tensor: str, module_names) -> torch.Tensor | None:
    """The layer's group indices [K], or None when the checkpoint has none. `required`: why they
    must be there (raises CheckpointError naming `tensor` if absent). Fused shards, quantized from
    one input, must agree: the layer runs them as one matmul with one input-channel order."""
    expected = {None} if layer.shard_layout is None else set(layer.shard_layout.shard_ids)
    if layer.loaded_g_idx != expected:
        if required:
            raise CheckpointError(source, tensor, f"missing, but {required}")
        return None
    rows = param.data  # [shards, K]
    if not (rows == rows[0]).all():
        raise UnsupportedError(f"{module_names}: the fused shards have different group indices ({tensor}); qrt runs "
                               f"them as one matmul and needs one input-channel order")
    return rows[0]


def groups_split_along_k(layer, group_size: int, act_order: bool) -> bool:
    """Whether group scales and zeros divide along K with the layer's input channels. Not for one
    group per channel (no K), nor for a row-parallel act-order layer: its channels pick groups
    anywhere, so every rank holds all groups (vLLM's rule)."""
    return group_size != -1 and not (act_order and layer.splits_input)


def rank_group_indices(layer, g_idx: torch.Tensor | None, group_size: int, act_order: bool, tensor: str):
    """`g_idx` [K] numbered for this rank's groups. A row-parallel rank whose groups were split
    along K holds only the groups of its own input channels, from 0, while the checkpoint numbers
    them from the layer's first group. GPTQModel writes a g_idx (k // G) for every layer, act-order
    or not."""
    if g_idx is None or not layer.splits_input or not groups_split_along_k(layer, group_size, act_order):
        return g_idx
    local = g_idx.long() - layer.k_slice.start // group_size
    groups = group_count(layer.input_size, group_size)
    if local.min() < 0 or local.max() >= groups:
        raise UnsupportedError(f"{tensor}: the group indices reorder input channels across groups, but the "
                               f"quantization config says the layer has no act-order, so with "
                               f"tp={layer.parallel.size} each rank holds only the groups of its own input channels "
                               f"and this rank's channels point to groups outside them; set desc_act/actorder in "
                               f"the config to match the tensors, or run with tp=1")
    return local.to(g_idx.dtype)


def remove_parameters(layer, *names: str) -> None:
    """Free the checkpoint-layout tensors once the kernel layout is built."""
    for name in names:
        if name in layer._parameters:
            del layer._parameters[name]


def scaled_shards(layer, divisor: int, what: str) -> ShardLayout | None:
    """The layer's shard layout counted in units of `divisor` output channels (for tensors packed
    along N), or an error when a shard does not fill whole units."""
    shards = layer.shard_layout
    if shards is None:
        return None
    sizes = [size for _, size in shards.offsets.values()]
    if any(size % divisor for size in sizes):
        raise UnsupportedError(f"{what} packs {divisor} output channels per element, but the fused shards have "
                               f"{sizes} channels; they cannot be split")
    return ShardLayout.stacked(shards.shard_ids, [size // divisor for size in sizes])


def group_count(k: int, group_size: int) -> int:
    return -(-k // group_size)
