"""QQQ checkpoints (W4A8: 4-bit weights, int8 per-token activations), `quant_method: "qqq"`.

Tensors per linear (docs/formats.md §6), stored in QQQ's Marlin-style kernel layout:
- `B`: int32 [K / 16, 2N], eight 4-bit values per word in a permuted tile order (below);
- `s_channel`: fp32 [1, N], permuted within runs of 32 channels;
- `s_group`: fp16 [K / 128, N] permuted within runs of 64 channels for group_size 128, or an
  empty tensor for per-channel files;
- `bias`: fp16 [N], optional.

The layout, as QQQ's packer writes it: the [K, N] integer matrix is cut into 16x16 tiles, and
each row of tiles becomes one row of 16N values (tile after tile, each tile row-major); every run
of 1024 values (4 tiles, 64 output channels) is reordered by a fixed permutation, and every 8
consecutive values are packed into one int32, value i at bits 4i. Per-group files store unsigned
values q (code q - 8) and reorder each 8 with the interleave [0, 2, 4, 6, 1, 3, 5, 7];
per-channel files store signed codes in two's complement and use [4, 0, 5, 1, 6, 2, 7, 3].
The loader pass inverts all of this exactly (`unpack_qqq_weight`, a round-trip test holds it to
an independent packer), then writes the canonical W4A8 layout of kernels/w4a8_reference.py.

Semantics (kernels/w4a8_reference.py): int8 weight = round((q - 8) * s_group), rescaled after the
int8 GEMM by s_tok * s_channel; per-channel: code * 16 rescaled by s_tok * s_channel.

Layouts after the loader pass:
- CUDA: the canonical packed int4 layout, `qrt::w4a8_linear` → Triton W4A8 GEMM (int4 unpacked
  and turned into int8 in registers);
- CPU: the int8 weights those codes stand for, int8 [N, K] with fp32 channel scales, exactly the
  W8A8 layout, run by `qrt::int8_linear` → the CPU int8 kernel (no CPU kernel reads 4-bit codes
  into an int8 GEMM).

Because permutation runs never cross a multiple of 64 output channels, the shards of a fused
q/k/v or gate/up layer (each a multiple of 64 wide, as QQQ requires) are stacked column-wise as
stored and unpacked together.
"""

from dataclasses import dataclass
from functools import partial

import torch

import qrt.kernels  # noqa: F401  (registers torch.ops.qrt.*)
from qrt.kernels.int8_reference import INT8_MAX, INT8_MIN
from qrt.kernels.int_reference import pack_rows, unpack_rows
from qrt.kernels.w4a8_reference import W4A8Weights

from qrt.formats.compressed_tensors.int_w8a8 import check_scale, install_int8_weights
from qrt.errors import CheckpointError, ConfigError, TensorMismatch, UnsupportedError
from qrt.formats.int_weights import copy_ints, remove_parameters
from qrt.layers.linear import LinearMethod, ShardLayout, copy_rows, make_parameter
from qrt.layers.tensor_parallel import WHOLE, TensorSplit
from qrt.formats.scheme import QuantScheme
from qrt.formats.registry import stored_format

TILE = 16  # QQQ's tiles are 16x16
CHUNK = 1024  # values per permutation run: 4 tiles, 64 output channels
GROUP_INTERLEAVE = (0, 2, 4, 6, 1, 3, 5, 7)
CHANNEL_INTERLEAVE = (4, 0, 5, 1, 6, 2, 7, 3)


@dataclass(frozen=True)
class QqqConfig:
    group_size: int  # 128, or -1 for one group per output channel
    source: str = "config.json"

    @property
    def per_channel(self) -> bool:
        return self.group_size == -1

    def describe(self) -> str:
        return f"QQQ W4A8 {'channel' if self.per_channel else f'g{self.group_size}'} (int8 per-token activations)"


def weight_permutation(per_channel: bool) -> torch.Tensor:
    """int64 [1024]: position j of a stored run holds value perm[j] of the tile-ordered run."""
    perm = []
    for i in range(32):
        col = i // 4
        # Rows 4(i % 4) .. 4(i % 4) + 3 of columns col and col + 8, one 16x16 tile; QQQ's int8 MMA
        # fragments take 4 consecutive k per thread (standard Marlin takes 2 + 2).
        run = [TILE * row + col + 8 * block for block in (0, 1) for row in range(4 * (i % 4), 4 * (i % 4) + 4)]
        for tile in range(4):
            perm.extend(p + 256 * tile for p in run)
    interleave = CHANNEL_INTERLEAVE if per_channel else GROUP_INTERLEAVE
    return torch.tensor(perm).view(-1, 8)[:, list(interleave)].reshape(-1)


def group_scale_permutation() -> torch.Tensor:
    """int64 [64]: an 8x8 transpose within each run of 64 channels."""
    return torch.tensor([i + 8 * j for i in range(8) for j in range(8)])


def channel_scale_permutation() -> torch.Tensor:
    """int64 [32]."""
    return torch.tensor([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)])


def unpermute_columns(stored: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Inverse of `stored = x.reshape(-1, len(perm))[:, perm].reshape(x.shape)`."""
    runs = stored.reshape(-1, perm.numel())
    perm = perm.to(stored.device)
    original = torch.empty_like(runs)
    original[:, perm] = runs
    return original.reshape(stored.shape)


def unpack_qqq_weight(b: torch.Tensor, k: int, n: int, per_channel: bool) -> torch.Tensor:
    """QQQ's `B` int32 [K / 16, 2N] -> unsigned 4-bit values q int32 [K, N], code = q - 8."""
    words = b.to(torch.int64) & 0xFFFFFFFF  # [K / 16, 2N], read as unsigned
    shifts = torch.arange(8, dtype=torch.int64, device=b.device) * 4
    nibbles = ((words[:, :, None] >> shifts) & 0xF).reshape(k // TILE, TILE * n)  # [K / 16, 16N] stored order
    tiles = unpermute_columns(nibbles, weight_permutation(per_channel))  # [K / 16, 16N] tile order
    values = tiles.reshape(k // TILE, n // TILE, TILE, TILE).permute(0, 2, 1, 3).reshape(k, n)  # [K, N]
    if per_channel:
        values = torch.where(values >= 8, values - 16, values) + 8  # two's-complement code -> code + 8
    return values.to(torch.int32)


def _load_empty_group_scales(param, loaded, shard_id):
    """Per-channel files store `s_group` as an empty tensor; anything else is a different format."""
    if loaded.numel() != 0:
        raise TensorMismatch(f"shape {list(loaded.shape)}; a per-channel (group_size -1) QQQ file stores s_group "
                             f"as an empty tensor")


def _load_scales(param, loaded, shard_id, *, layout):
    check_scale(loaded)
    copy_rows(param, loaded, shard_id, layout=layout)


class QqqLinearMethod(LinearMethod):
    name = "qqq"

    def tensor_split(self, layer, param_name: str):
        # B's rows are rows of 16x16 tiles along K and its permutation runs cover 64 output
        # channels (two int32 columns each): a rank's part of B is a plain slice on those runs.
        along_both = TensorSplit(1, 0, n_align=64)
        group_scales = WHOLE if self.cfg.per_channel else along_both  # per-channel files store it empty
        return {"B": along_both, "s_channel": TensorSplit(1, None, n_align=64), "s_group": group_scales}.get(param_name)

    def __init__(self, cfg: QqqConfig, module_names):
        super().__init__(cfg, module_names)  # layout: "packed" (CUDA) or "int8" (CPU), chosen by the loader pass

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        cfg, n, k = self.cfg, layer.output_size, layer.input_size
        shards = layer.shard_layout
        widths = [n] if shards is None else [size for _, size in shards.offsets.values()]
        step = TILE if cfg.per_channel else cfg.group_size
        if any(width % 64 for width in widths) or k % step:
            raise UnsupportedError(f"{self.module_names[0]}: QQQ needs output widths that are multiples of 64 and "
                                   f"an input width that is a multiple of {step}; this layer has outputs {widths} "
                                   f"and {k} inputs")
        common = dict(quant_format=self.name)
        b_columns = None if shards is None else ShardLayout.stacked(shards.shard_ids, [2 * w for w in widths])
        layer.B = make_parameter(
            torch.empty(k // TILE, 2 * n, dtype=torch.int32),  # [K / 16, 2N]: 16x16 tiles, 8 values per word
            weight_loader=partial(copy_ints, layout=b_columns, dtype=torch.int32), output_dim=1, **common,
        )
        layer.s_channel = make_parameter(
            torch.empty(1, n, dtype=torch.float32),  # [1, N], permuted in runs of 32
            weight_loader=partial(_load_scales, layout=shards), output_dim=1, **common,
        )
        if cfg.per_channel:
            group_scales, loader = torch.empty(0), _load_empty_group_scales
        else:
            group_scales = torch.empty(k // cfg.group_size, n, dtype=torch.float32)  # [K / G, N]; fp16 on disk
            loader = partial(_load_scales, layout=shards)
        layer.s_group = make_parameter(group_scales, weight_loader=loader, output_dim=1, **common)

    def canonical(self, layer):
        """(qweight int32 [K / 8, N], group_scales fp32 [K / G, N], channel_scales fp32 [N], G) from the
        loaded QQQ tensors."""
        cfg, n, k = self.cfg, layer.output_size, layer.input_size
        q = unpack_qqq_weight(layer.B.data, k, n, cfg.per_channel)  # [K, N]
        channel = unpermute_columns(layer.s_channel.data, channel_scale_permutation()).reshape(n)  # [N]
        if cfg.per_channel:
            # The kernel's code * 16 with s / 16 as channel scale: code * (16 * s_channel), exactly.
            return pack_rows(q, 4), torch.ones(1, n, device=q.device), 16.0 * channel, k
        groups = unpermute_columns(layer.s_group.data, group_scale_permutation())  # [K / G, N]
        return pack_rows(q, 4), groups, channel, cfg.group_size

    def process_after_loading(self, layer, device: torch.device) -> None:
        qweight, group_scales, channel_scales, group_size = self.canonical(layer)
        self._check_int8_range(qweight, group_scales, group_size, layer.input_size)
        remove_parameters(layer, "B", "s_channel", "s_group")
        weights = W4A8Weights(qweight, group_scales.to(qweight.device), channel_scales.to(qweight.device), group_size)
        self.layout = install_int8_weights(layer, weights, device, self.cfg.describe(), logical="qrt.w4a8_linear")

    def _check_int8_range(self, qweight, group_scales, group_size: int, k: int) -> None:
        """QQQ's kernel wraps an int8 weight outside [-128, 127] around; a valid file has none."""
        codes = unpack_rows(qweight, 4, k).float() - 8.0  # [K, N]
        products = (codes * group_scales[torch.arange(k, device=codes.device) // group_size]).round()
        worst = float(products.abs().max())
        if bool(((products < INT8_MIN) | (products > INT8_MAX)).any()):
            raise CheckpointError(self.cfg.source, f"{self.module_names[0]}.s_group",
                                  f"a 4-bit code times its group scale rounds to {worst:g}, outside the int8 range "
                                  f"QQQ's kernel computes in; not a valid QQQ export")

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.layout.linear(layer, x)


def qqq_config(config: dict, source) -> QqqConfig:
    bits = config.get("wbits", config.get("bits"))
    if bits != 4:
        raise UnsupportedError(f"{source}: QQQ wbits={bits!r} is not supported; QQQ stores 4-bit weights")
    group = config.get("group_size", -1)
    if group not in (-1, 128):
        raise ConfigError(f"{source}: QQQ group_size={group!r}; QQQ files use 128 or -1 (per channel)")
    return QqqConfig(group, str(source))


@stored_format("qqq", computes=("qrt.w4a8_linear",),
               summary="QQQ W4A8: 4-bit weights in QQQ's Marlin layout, int8 per-token activations")
def qqq_scheme(config: dict, source) -> QuantScheme:
    cfg = qqq_config(config, source)
    return QuantScheme("qqq", lambda names: QqqLinearMethod(cfg, names), (), cfg.describe())
