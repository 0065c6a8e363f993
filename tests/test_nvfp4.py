"""NVFP4 checkpoints (compressed-tensors nvfp4-pack-quantized, ModelOpt NVFP4): the weights qrt
describes equal the producers' own dequantization bit for bit, on the producer kit's checkpoints;
the FP4 activation rounding equals the test's own, written from the format's definition
(helpers/activation_rounding.py); each linear of a loaded model computes x' Wᵀ with those weights
and rounded inputs; a checkpoint whose tensors are not NVFP4's is refused by name."""

import json
import os
from pathlib import Path

import pytest
import torch
from helpers.activation_rounding import nvfp4_static_global
from helpers.checkpoints.format_cases.nvfp4 import lut4_kernels, write_nvfp4
from helpers.checkpoints.tiny import edited_copy, random_ids
from helpers.compare import relative_l2
from producers import build as kit_build
from producers.base_models import load_tensors
from safetensors.torch import load_file

from qrt import runtime
from qrt.errors import CheckpointError
from qrt.formats.compressed_tensors.nvfp4 import Nvfp4LinearMethod
from qrt.kernels.fp4_activations_reference import round_activations_reference

# fp32 sums of a few hundred products in another order: about 1e-7 relative.
SUMMATION_ORDER = 1e-5
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def load(folder, dtype=torch.float32):
    return runtime.compile_model(folder, dtype=dtype, compile=False, cache=False, progress=False, max_seq_len=64)


@pytest.fixture
def described(monkeypatch):
    """While a model loads, the Lut4Weights each NVFP4 layer's loader pass describes, by the
    checkpoint modules of the layer (a fused layer's shards, in row order)."""
    seen = {}
    original = Nvfp4LinearMethod._lut4_weights

    def record(self, layer):
        seen[tuple(self.module_names)] = weights = original(self, layer)
        return weights

    monkeypatch.setattr(Nvfp4LinearMethod, "_lut4_weights", record)
    return seen


def producer_variant(name: str) -> Path:
    """The producer kit's variant folder; skips where the kit or the variant was not built."""
    folder = Path(os.environ.get("QRT_PRODUCER_KIT") or kit_build.default_kit_folder())
    summary = folder / "kit.json"
    if not summary.exists() or name not in json.loads(summary.read_text())["built"]:
        pytest.skip(f"the producer kit at {folder} has no {name}: build it with "
                    f"`python tests/producers/build.py --only {name}`")
    return folder / name


def assert_bit_equal(described: dict, expected: dict[str, torch.Tensor]) -> int:
    """Every described layer dequantizes to the expected weights of its modules, bit for bit but
    for the sign of zero (E2M1's code 8 is -0: compressed-tensors decodes it so, ModelOpt's table
    says +0; no sum or product can tell them apart); returns how many modules were compared."""
    compared = 0
    for modules, weights in described.items():
        want = torch.cat([expected[f"{module}.weight"].float() for module in modules])
        got = weights.dequantize()
        both_zero = (got == 0) & (want == 0)
        mismatched = int(((got.view(torch.int32) != want.view(torch.int32)) & ~both_zero).sum())
        assert mismatched == 0, f"{modules}: {mismatched} of {want.numel()} weights differ from the producer's"
        compared += len(modules)
    return compared


@pytest.mark.parametrize("name", ["llmc-nvfp4a16", "llmc-nvfp4", "llmc-nvfp4a16-moe"])
def test_compressed_tensors_weights_equal_its_dequantizer_bit_for_bit(name, described):
    """The kit's reference is compressed-tensors' unpacking and `dequantize` in float32 (its
    decompressor's, checked equal to it once rounded to bfloat16 when the kit was built)."""
    folder = producer_variant(name)
    load(folder)
    reference = load_tensors(folder / "reference")
    quantized = json.loads((folder / "kit.json").read_text())["quantized_modules"]
    assert assert_bit_equal(described, reference) == len(quantized)


@pytest.mark.parametrize("name", ["modelopt-nvfp4", "modelopt-w4a16-nvfp4"])
def test_modelopt_weights_equal_its_dequantizer_bit_for_bit(name, described):
    """The kit's reference is ModelOpt's NVFP4QTensor.dequantize in float32 of the export."""
    folder = producer_variant(name)
    load(folder)
    reference = load_tensors(folder / "reference")
    assert assert_bit_equal(described, reference) == len(json.loads((folder / "kit.json").read_text())["quantized_modules"])


def test_written_checkpoint_with_a_global_scale_per_shard_loads_exactly(tmp_path, described):
    """Fused shards whose global scales differ (llm-compressor fuses them; other writers need not)
    keep each shard's scales: the weights stay the checkpoint's, bit for bit."""
    expected = write_nvfp4(tmp_path / "ct", fuse_globals=False)
    model = load(tmp_path / "ct")
    assert assert_bit_equal(described, expected) == len(expected)
    with torch.no_grad():
        assert torch.isfinite(model(random_ids())).all()


# Groups of 16 with every E2M1 tie and both signs, a zero group, and random non-zero groups of
# three orders of magnitude.
def activation_samples(dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 6.0])
    random = torch.randn(5, 3, 64, generator=gen) * torch.tensor([1e-3, 1.0, 30.0])[:, None]  # [5, 3, 64]
    rows = torch.cat([ties.repeat(3, 4)[None], torch.zeros(1, 3, 64), random])  # [7, 3, 64]
    return rows.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("global_scale", [1.0, 448.0 * 6 / 7.3, 3.0e4])
def test_fp4_activation_rounding_equals_the_definition(dtype, global_scale):
    x = activation_samples(dtype)
    g = torch.tensor([global_scale])
    got = torch.ops.qrt.nvfp4_round_activations(x, g)
    expected = nvfp4_static_global(global_scale)(x).to(dtype)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, expected)
    assert torch.equal(got, round_activations_reference(x, g))  # the op's implementation, uncompiled
    # Not the identity: the rounding moves the random groups, as 3 significant bits must.
    assert relative_l2(got[2:].float(), x[2:].float()) > 1e-2


def test_fp4_activations_compile_whole():
    x, g = activation_samples(torch.float32), torch.tensor([100.0])
    compiled = torch.compile(lambda v: torch.ops.qrt.nvfp4_round_activations(v, g) * 2, fullgraph=True)
    assert torch.equal(compiled(x), nvfp4_static_global(100.0)(x) * 2)


def linear_errors(model, reference_weight, rounding, bound: float = SUMMATION_ORDER) -> list[str]:
    """Each of qrt's attention and MLP linears against F.linear of its own input (rounded by
    `rounding(weight name)`, or not) with the reference weights, in float32; the layers over `bound`."""
    seen = {}
    for module_name, module in model.model.named_modules():
        if module_name.rpartition(".")[2] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            module.register_forward_hook(lambda m, args, out, key=module_name: seen.__setitem__(key, (args[0], out)))
    with torch.no_grad():
        model(random_ids())
    assert len(seen) == 4 * model.model.config.num_layers
    failures = []
    for module_name, (x, y) in seen.items():
        parent, _, leaf = module_name.rpartition(".")
        parent = parent.removeprefix("model.")
        parts = []
        for part in FUSED.get(leaf, (leaf,)):
            weight = f"model.{parent}.{part}.weight"
            round_input = rounding(weight)
            x_in = (round_input(x) if round_input else x).float()
            parts.append(torch.nn.functional.linear(x_in, reference_weight[weight]))
        if (error := relative_l2(y, torch.cat(parts, dim=-1))) > bound:
            failures.append(f"{module_name}: off by {error:.2e}")
    return failures


def test_fp4_activations_round_each_linears_input(tmp_path):
    """A written NVFP4 (W4A4) checkpoint: each linear rounds its input under its module's
    input_global_scale before the matmul with the dequantized weights."""
    expected = write_nvfp4(tmp_path / "ct", activations=True)
    saved = load_file(str(tmp_path / "ct" / "model.safetensors"))
    model = load(tmp_path / "ct")

    def rounding(weight: str):
        return nvfp4_static_global(saved[weight.removesuffix("weight") + "input_global_scale"].item())

    assert not linear_errors(model, expected, rounding)
    # Left unrounded, the inputs give other outputs: the rounding is not a no-op here.
    assert linear_errors(model, expected, lambda weight: None)


def test_modelopt_weight_only_nvfp4_leaves_the_activations_as_they_are(tmp_path):
    """ModelOpt's W4A16_NVFP4 (no input_scale): each linear multiplies its input, unrounded, by the
    exact weights; NVFP4's rounding of the same inputs would give other outputs."""
    expected = write_nvfp4(tmp_path / "w4a16", "modelopt")
    assert not any(name.endswith("input_scale") for name in load_file(str(tmp_path / "w4a16" / "model.safetensors")))
    model = load(tmp_path / "w4a16")
    assert not linear_errors(model, expected, lambda weight: None)
    assert linear_errors(model, expected, lambda weight: nvfp4_static_global(448.0 * 6 / 4.0))


@pytest.mark.parametrize("producer", ["compressed-tensors", "modelopt"])
def test_bfloat16_models_run_the_weights_on_the_kernel_chosen_for_them(producer, tmp_path):
    """In bfloat16 the loader pass may choose another kernel than the reference (qrt's CPU kernel for
    4-bit table codes, where it builds), which gets the same description of the weights: each linear
    is within bfloat16's rounding of its input and output (2**-8 relative) of the exact weights."""
    expected = write_nvfp4(tmp_path / producer, producer, activations=producer == "modelopt")
    saved = load_file(str(tmp_path / producer / "model.safetensors"))
    model = load(tmp_path / producer, torch.bfloat16)

    def rounding(weight: str):
        scale = saved.get(weight.removesuffix("weight") + "input_scale")
        return None if scale is None else nvfp4_static_global(1 / scale.item())

    assert not linear_errors(model, expected, rounding, bound=1e-2)
    kernels = {p.kernel for m in model.model.modules() if getattr(m, "quant_method", None) is not None
               for p in m.parameters(recurse=False) if getattr(p, "kernel", "aten.linear") != "aten.linear"}
    assert kernels == lut4_kernels("cpu", torch.bfloat16)


def test_modelopt_nvfp4_with_an_fp8_kv_cache_keeps_its_scales(tmp_path):
    write_nvfp4(tmp_path / "modelopt", "modelopt", activations=True, fp8_kv_cache=True)
    model = load(tmp_path / "modelopt")
    attention = model.model.model.layers[1].self_attn
    assert attention.k_cache.dtype == torch.float8_e4m3fn
    assert float(attention.k_scale) == torch.tensor(0.0125).item()
    assert float(attention.v_scale) == torch.tensor(0.02).item()


def test_a_checkpoint_with_other_tensors_is_refused_by_name(tmp_path):
    write_nvfp4(tmp_path / "ct")
    tensor = "model.layers.0.mlp.down_proj.weight_scale"
    wrong = edited_copy(tmp_path / "ct", tmp_path / "fp32-scales", tensors=lambda state: state.__setitem__(
        tensor, state[tensor].float()))
    with pytest.raises(CheckpointError) as err:
        load(wrong)
    assert str(wrong) in str(err.value) and tensor in str(err.value) and "float8_e4m3fn" in str(err.value)
    scale = "model.layers.1.self_attn.k_proj.weight_global_scale"
    negative = edited_copy(tmp_path / "ct", tmp_path / "negative", tensors=lambda state: state.__setitem__(
        scale, -state[scale]))
    with pytest.raises(CheckpointError, match="positive finite") as err:
        load(negative)
    assert scale in str(err.value)
