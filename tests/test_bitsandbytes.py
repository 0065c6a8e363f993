"""bitsandbytes checkpoints saved by transformers with BitsAndBytesConfig: what the format hands the
kernels equals bitsandbytes' own dequantization (4-bit: bit for bit; 8-bit: within the fp32
rounding bitsandbytes' two multiplications add), and the loaded model's logits equal those of the
transformers model rebuilt from bitsandbytes' dequantized weights."""

import pytest
import torch
from helpers.checkpoints.format_cases.bitsandbytes import INT8, NF4_DOUBLE_QUANT, write_bnb
from helpers.checkpoints.tiny import edited_copy, random_ids
from helpers.compare import relative_l2
from safetensors import safe_open

import qrt.formats.bitsandbytes_4bit as bnb_4bit
import qrt.formats.bitsandbytes_8bit as bnb_8bit
from qrt import runtime
from qrt.checkpoint.config import DeviceConfig, LoadConfig
from qrt.checkpoint.loader import load_model
from qrt.checkpoint.source import SafetensorsCheckpoint
from qrt.errors import CheckpointError, UnsupportedError
from qrt.formats.bitsandbytes import skip_patterns
from qrt.formats.resolve import resolve_scheme
from qrt.formats.scheme import matches
from qrt.layers.tensor_parallel import Parallelism
from qrt.layers.unquantized import UnquantizedLinearMethod
from qrt.runtime.registry import ModelRegistry

bnb_functional = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is the oracle here "
                                     "(pip install '.[test]')")

FOUR_BIT = {
    "nf4-double-quant": NF4_DOUBLE_QUANT,
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "fp4-skip-down": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", llm_int8_skip_modules=["mlp.down_proj"]),
}
# Weight-only: the two models differ in summation order only (fp32).
LOGITS_BOUND = 1e-5
IDS = random_ids(seed=3, shape=(2, 12))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("bnb")
    made = {}

    def get(name):
        if name not in made:
            made[name] = root / name
            write_bnb(made[name], INT8 if name == "int8" else FOUR_BIT[name], dtype=torch.bfloat16)
        return made[name]

    return get


def loaded_with_descriptions(folder, module, monkeypatch, function: str):
    """The qrt model of `folder` (fp32, eager) and what each quantized layer's loader pass handed on
    through `module.<function>` (its weights description), in the order the layers load."""
    seen = []
    original = getattr(module, function)

    def record(*args, **kwargs):
        seen.append(kwargs.get("weights", args[1] if len(args) > 1 else None))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, function, record)
    model = runtime.compile_model(folder, compile=False, progress=False, max_seq_len=64, dtype=torch.float32)
    layers = [m for m in model.model.modules() if not isinstance(getattr(m, "quant_method", None),
                                                                   (type(None), UnquantizedLinearMethod))]
    assert len(layers) == len(seen) > 0
    return model, list(zip(layers, seen))


def checkpoint_tensors(folder, module: str) -> dict:
    """The tensors of checkpoint module `module`, named after its prefix."""
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k[len(module) + 1:]: f.get_tensor(k) for k in f.keys() if k.startswith(module + ".")}


def bnb_dequantized_4bit(folder, module: str, dtype: torch.dtype) -> torch.Tensor:
    """bitsandbytes' `dequantize_4bit` of the saved tensors, [N, K] in `dtype`."""
    tensors = checkpoint_tensors(folder, module)
    state = bnb_functional.QuantState.from_dict({k[len("weight."):]: v for k, v in tensors.items() if k != "weight"},
                                                torch.device("cpu"))
    state.dtype = dtype
    if state.shape[-1] % state.blocksize == 0:
        return bnb_functional.dequantize_4bit(tensors["weight"], state)
    # bitsandbytes 0.50.2's CPU kernel (m rows of n codes) starts a block at each row, where its
    # quantizer, its CUDA kernel and its torch implementation run the blocks along the flattened
    # weight: for K not a multiple of the blocksize it gives other weights (down_proj here: 0.24
    # relative error against the unquantized weight, 0.09 with its torch implementation). That
    # implementation, the quantizer's inverse, is the oracle there (uncompiled: the same products).
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    absmax = state.absmax
    if state.nested:
        absmax = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    code = _get_4bit_code(state.quant_type, torch.device("cpu"))
    return _dequantize_4bit_compute.__wrapped__(tensors["weight"].reshape(-1), absmax, code, state.blocksize,
                                                state.shape, dtype)


def split_rows(layer, weight: torch.Tensor) -> list[torch.Tensor]:
    """A fused layer's [N, K] in its shards' rows, in module_names order."""
    sizes = [weight.shape[0]] if layer.shard_layout is None else layer.shard_layout.sizes
    return list(weight.split(sizes))


def dense_reference(folder, dequantized: dict):
    """transformers' model of the unquantized base in fp32 with each quantized linear's weight
    replaced by bitsandbytes' dequantization (the other tensors are the checkpoint's, which kept
    the base's bf16 values)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder.with_name(folder.name + ".base"), dtype=torch.float32).eval()
    with torch.no_grad():
        for module, weight in dequantized.items():
            model.get_submodule(module).weight.copy_(weight)
    return model


@pytest.mark.parametrize("name", sorted(FOUR_BIT))
def test_4bit_weights_equal_dequantize_4bit_bit_for_bit_and_logits_match(name, folders, monkeypatch):
    folder = folders(name)
    model, described = loaded_with_descriptions(folder, bnb_4bit, monkeypatch, "choose")
    dequantized = {}
    for layer, weights in described:
        ours = weights.dequantize()  # [N, K] fp32
        for module, rows in zip(layer.quant_method.module_names, split_rows(layer, ours), strict=True):
            expected = bnb_dequantized_4bit(folder, module, torch.float32)
            assert torch.equal(rows, expected), module
            # In the checkpoint's dtype bitsandbytes rounds the same fp32 product once.
            assert torch.equal(rows.bfloat16(), bnb_dequantized_4bit(folder, module, torch.bfloat16)), module
            dequantized[module] = expected
    with torch.no_grad():
        error = relative_l2(model(IDS), dense_reference(folder, dequantized)(IDS).logits)
    assert error < LOGITS_BOUND, error


def test_blocks_that_cross_rows_get_groups_of_the_common_divisor(folders, monkeypatch):
    """down_proj's K = 160 is not a multiple of the blocks of 64: groups of 32, each inside a block."""
    _, described = loaded_with_descriptions(folders("nf4-double-quant"), bnb_4bit, monkeypatch, "choose")
    groups = {layer.quant_method.module_names[0].rsplit(".", 1)[1]: weights.group_size for layer, weights in described}
    assert groups["down_proj"] == 32 and groups["q_proj"] == 64 and groups["gate_proj"] == 64


def test_skipped_modules_stay_dense_as_transformers_leaves_them(folders):
    model = runtime.compile_model(folders("fp4-skip-down"), compile=False, progress=False, max_seq_len=64)
    layer = model.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj.quant_method, UnquantizedLinearMethod)
    assert layer.mlp.gate_up_proj.quant_method.name == "bitsandbytes-fp4"
    # The list replaces transformers' default skips, which held lm_head: it is quantized here.
    assert model.model.lm_head.quant_method.name == "bitsandbytes-fp4"


def test_skip_patterns_match_the_modules_transformers_skips():
    from transformers.quantizers.quantizers_utils import should_convert_module

    config = {"llm_int8_skip_modules": ["mlp.down_proj", "layers.1", "o_proj", "lm_head", "model.layers.*.gate"]}
    names = [f"model.layers.{i}.{m}" for i in (0, 1, 11) for m in
             ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.gate", "mlp.down_proj", "mlp.up_proj")]
    names += ["lm_head", "model.layers.0.mlp.down_proj_extra"]
    patterns = skip_patterns(config)
    for name in names:
        skipped = any(matches(name, p) for p in patterns)
        assert skipped == (not should_convert_module(name, config["llm_int8_skip_modules"])), name


def test_int8_weights_equal_int8_vectorwise_dequant_within_its_rounding_and_logits_match(folders, monkeypatch):
    folder = folders("int8")
    model, described = loaded_with_descriptions(folder, bnb_8bit, monkeypatch, "install_int_weights")
    dequantized, exact, total = {}, 0, 0
    for layer, weights in described:
        ours = weights.dequantize()  # [N, K] fp32
        for module, rows in zip(layer.quant_method.module_names, split_rows(layer, ours), strict=True):
            tensors = checkpoint_tensors(folder, module)
            expected = bnb_functional.int8_vectorwise_dequant(tensors["weight"], tensors["SCB"])
            # bitsandbytes rounds (q · SCB) and then its product with 1/127; qrt rounds q · (SCB / 127)
            # once: each result within 2 rounding steps of fp32 (an ulp is at most eps · |value|).
            assert ((rows - expected).abs() <= 2 * torch.finfo(torch.float32).eps * expected.abs()).all(), module
            exact += int((rows == expected).sum())
            total += rows.numel()
            dequantized[module] = expected
    assert exact > total // 2  # most products round alike
    with torch.no_grad():
        error = relative_l2(model(IDS), dense_reference(folder, dequantized)(IDS).logits)
    assert error < LOGITS_BOUND, error


def test_a_wrong_code_table_is_named_with_its_file(folders, tmp_path):
    folder = folders("nf4")
    tensor = "model.layers.1.mlp.up_proj.weight.quant_map"
    broken = edited_copy(folder, tmp_path / "broken", tensors=lambda state: state[tensor].mul_(0.5))
    with pytest.raises(CheckpointError) as err:
        runtime.compile_model(broken, compile=False, progress=False, max_seq_len=64)
    assert f"tensor '{tensor}'" in str(err.value) and "NF4 table" in str(err.value)
    assert str(broken / "model.safetensors") in str(err.value)


def test_a_row_parallel_split_that_cuts_blocks_is_refused_with_the_largest_tp(folders):
    """down_proj's 160 input channels hold groups of 32 (blocks of 64 crossing rows): at tp=2 a
    rank's 80 are not whole groups."""
    checkpoint = SafetensorsCheckpoint(folders("nf4"))
    scheme = resolve_scheme(checkpoint.hf_config, None, checkpoint.config_path, checkpoint.folder)
    model_cls = ModelRegistry.resolve(checkpoint.hf_config, source=checkpoint.config_path)
    with pytest.raises(UnsupportedError, match=r"mlp.down_proj: with tp=2 a rank holds 80 input channels, which "
                                               r"split bitsandbytes' blocks of 64 \(groups of 32.*largest tp this "
                                               r"layer allows is 1"):
        load_model(model_cls, checkpoint, scheme, LoadConfig(progress=False), DeviceConfig(), Parallelism(2, 1, None))
