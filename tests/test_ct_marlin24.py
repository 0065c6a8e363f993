"""compressed-tensors 2:4-sparse W4A16 (`marlin-24`): the loader's decompression inverts an
independent packer exactly, fused shards included; tiny checkpoints are detected, run through the
dense W4A16 layouts and match the dequantized transformers model; one compiled model has no
breaks or recompiles; malformed files and configs get clear errors."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.checkpoints.marlin24 import dense_codes, make_marlin24_checkpoint, marlin24_tensors, marlin24_weight_perm
from helpers.checkpoints.tiny import edited_copy, random_ids
from helpers.compare import relative_l2
from qrt import runtime
from qrt.errors import CheckpointError, UnsupportedError
from qrt.formats.compressed_tensors.marlin24 import (CtMarlin24Config, CtMarlin24LinearMethod,
                                                     group_scale_permutation, meta_positions, unpack_marlin24,
                                                     unpermute_scales, weight_permutation)

LINEARS = 2 * 4  # 2 layers x (qkv, o, gate_up, down)
DESCRIBED = {128: "compressed-tensors W4A16 2:4 sparse (marlin-24) g128",
             -1: "compressed-tensors W4A16 2:4 sparse (marlin-24) channel"}


def test_permutations_are_permutations():
    assert torch.equal(weight_permutation().sort().values, torch.arange(1024))
    assert weight_permutation().tolist() == marlin24_weight_perm()
    assert torch.equal(group_scale_permutation().sort().values, torch.arange(64))
    rows, cols = meta_positions(192, 96)  # every stored metadata word read exactly once
    assert torch.equal((rows * 2 * 192 + cols).flatten().sort().values, torch.arange(192 * 96 // 16))


def _sparse_codes(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Signed 4-bit codes [N, K] with at most two non-zeros in every run of 4 along K (some kept
    entries are zero too, as rounding makes them)."""
    codes = torch.randint(-8, 8, (n, k), generator=gen)
    pruned = torch.rand(n * k // 4, 4, generator=gen).argsort(dim=1)[:, :2]
    return codes.reshape(-1, 4).scatter(1, pruned, 0).reshape(n, k)


@settings(max_examples=25, deadline=None)
@given(widths=st.lists(st.sampled_from([64, 128, 192]), min_size=1, max_size=3), k_units=st.integers(1, 12),
       group_size=st.sampled_from([128, -1]), seed=st.integers(0, 2**16))
def test_unpacking_inverts_the_packer_for_stacked_shards(widths, k_units, group_size, seed):
    """Shards packed one by one and stacked along the output dim, as a fused layer loads them,
    decode to the stacked codes and scales."""
    k = 32 * k_units
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if group_size == -1 else -(-k // group_size)
    shards = [(_sparse_codes(n, k, gen), torch.rand(n, groups, generator=gen).half() + 0.01) for n in widths]
    packed = [marlin24_tensors(q, s, group_size) for q, s in shards]
    fused = {name: torch.cat([p[name] for p in packed], dim=1) for name in packed[0]}
    assert fused["weight_packed"].shape == (k // 32, 2 * sum(widths)) and fused["weight_packed"].dtype == torch.int32
    assert fused["meta"].shape == (k // 32, 2 * sum(widths)) and fused["meta"].dtype == torch.int16
    codes = unpack_marlin24(fused["weight_packed"], fused["meta"], k, sum(widths))
    assert torch.equal(codes, torch.cat([dense_codes(q) for q, _ in shards], dim=1))
    scales = unpermute_scales(fused["scale_packed"].float(), group_size, k)
    assert torch.equal(scales, torch.cat([s.t().float() for _, s in shards], dim=1))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(group_size):
        if group_size not in made:
            folder = tmp_path_factory.mktemp(f"marlin24-g{group_size}")
            made[group_size] = (folder, make_marlin24_checkpoint(folder, group_size))
        return made[group_size]

    return get


@pytest.mark.parametrize("group_size", [128, -1])
def test_detected_and_matches_the_dequantized_model(group_size, checkpoints):
    folder, reference = checkpoints(group_size)
    eager = runtime.compile_model(folder, compile=False, progress=False, max_seq_len=128)
    assert DESCRIBED[group_size] in eager.scheme.describe()
    methods = [m.quant_method for m in eager.model.modules() if isinstance(getattr(m, "quant_method", None),
                                                                          CtMarlin24LinearMethod)]
    assert len(methods) == LINEARS and {m.layout.name for m in methods} == {"int4pack"}
    with torch.no_grad():
        expected = reference(random_ids()).logits
    # Both sides use the same dequantized fp32 weights: only summation order differs.
    assert relative_l2(eager(random_ids()), expected) < 1e-5


def _weights(**changes):
    return lambda qc: qc["config_groups"]["group_0"]["weights"].update(changes)


def test_malformed_files_and_configs_get_clear_errors(tmp_path, checkpoints):
    folder, _ = checkpoints(128)

    def load(copy):
        return runtime.compile_model(copy, compile=False, progress=False, max_seq_len=64)

    k_meta = "model.layers.0.self_attn.k_proj.meta"
    narrow = edited_copy(folder, tmp_path / "meta-shape",
                         tensors=lambda s: s.update({k_meta: s[k_meta][:, :64].clone()}))
    with pytest.raises(CheckpointError, match=r"k_proj\.meta'.*shape \[4, 64\], expected \[4, 128\]"):
        load(narrow)
    int32_meta = edited_copy(folder, tmp_path / "meta-dtype", tensors=lambda s: s.update({k_meta: s[k_meta].int()}))
    with pytest.raises(CheckpointError, match=r"k_proj\.meta'.*dtype torch\.int32, expected torch\.int16"):
        load(int32_meta)
    # All-zero metadata names position 0 twice in every run: no producer writes that.
    zero_meta = edited_copy(folder, tmp_path / "meta-zero",
                            tensors=lambda s: s.update({k_meta: torch.zeros_like(s[k_meta])}))
    with pytest.raises(CheckpointError, match=r"k_proj\.meta'.*output channel 0 has a run of 4 whose metadata"):
        load(zero_meta)
    with pytest.raises(UnsupportedError, match=r"marlin-24 stores 4-bit int weights; the config says 'int' num_bits=8"):
        load(edited_copy(folder, tmp_path / "bits", config=_weights(num_bits=8)))
    with pytest.raises(UnsupportedError, match=r"marlin-24 stores symmetric weights only"):
        load(edited_copy(folder, tmp_path / "asym", config=_weights(symmetric=False)))
    with pytest.raises(UnsupportedError, match=r"group_size 128 or channel.*group_size=64"):
        load(edited_copy(folder, tmp_path / "g64", config=_weights(group_size=64)))
    with pytest.raises(UnsupportedError, match=r"sparsity format 'sparse-24-bitmask' is not supported"):
        load(edited_copy(folder, tmp_path / "bitmask",
                   config=lambda qc: qc["sparsity_config"].update({"format": "sparse-24-bitmask"})))
    up_shape = "model.layers.0.mlp.up_proj.weight_shape"
    with pytest.raises(CheckpointError, match=r"up_proj\.weight_shape'.*holds \[384, 127\].*\[384, 128\]"):
        load(edited_copy(folder, tmp_path / "shape", tensors=lambda s: s.update({up_shape: torch.tensor([384, 127])})))


def test_a_correct_weight_shape_is_accepted(tmp_path, checkpoints):
    """The producer writes no weight_shape, but vLLM declares one: a file that has it still loads."""
    folder, reference = checkpoints(128)
    copy = edited_copy(folder, tmp_path / "with-shape", tensors=lambda s: s.update(
        {"model.layers.1.mlp.down_proj.weight_shape": torch.tensor([128, 384])}))
    model = runtime.compile_model(copy, compile=False, progress=False, max_seq_len=64)
    with torch.no_grad():
        assert relative_l2(model(random_ids()), reference(random_ids()).logits) < 1e-5


def test_layers_off_the_marlin_tiles_are_refused():
    layer = SimpleNamespace(output_size=96, input_size=128, shard_layout=None, has_bias=False)
    method = CtMarlin24LinearMethod(CtMarlin24Config(128), ["model.layers.0.self_attn.o_proj"])
    with pytest.raises(UnsupportedError, match=r"o_proj: marlin-24 needs output widths.*outputs \[96\] and 128"):
        method.create_weights(layer, torch.float32)
