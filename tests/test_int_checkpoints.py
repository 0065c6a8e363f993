"""Integer weight-only checkpoints (GPTQ, AWQ, compressed-tensors) and online int4/int8:
detection, logits against the dequantized transformers model, the layout each layer got,
compiled graphs without breaks or decode recompiles, and clear errors for malformed files."""

import json
import shutil

import pytest
import torch

from helpers.checkpoints.integer import ct_config, make_int_checkpoint
from helpers.checkpoints.tiny import edited_copy, random_ids
from helpers.compare import relative_l2
from helpers.graph_checks import decode_without_recompiles
from qrt import runtime
from qrt.checkpoint.config import LoadConfig
from qrt.errors import CheckpointError, UnsupportedError
from qrt.formats.int_online import quantize_int_rows


def gptq(bits=4, group_size=32, desc_act=False, sym=True, fmt="gptq", **extra):
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": fmt, **extra}


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True,
       "modules_to_not_convert": None}

# name -> (builder format, quantization_config, builder options, words describe() shows, CPU layouts)
CASES = {
    "gptq-4bit-sym": ("gptq", gptq(), dict(bits=4, group_size=32, sym=True), "GPTQ 4-bit g32", {"int4pack"}),
    "gptq-4bit-act-order-asym": ("gptq", gptq(desc_act=True, sym=False),
                                 dict(bits=4, group_size=32, sym=False, act_order=True),
                                 "GPTQ 4-bit g32, act-order, asymmetric", {"int4pack"}),
    "gptq-v1-asym-zero-0": ("gptq", gptq(sym=False), dict(bits=4, group_size=32, sym=False, positive_first_group=True),
                            "GPTQ 4-bit g32, asymmetric", {"int4pack"}),
    "gptq-v2-8bit-channel": ("gptq", gptq(bits=8, group_size=-1, fmt="gptq_v2"),
                             dict(bits=8, group_size=-1, sym=True, v2=True), "GPTQ v2 8-bit channel", {"int8pack"}),
    # K = 64 is a single group of 64, which the per-channel int8 kernel runs; K = 160 is not.
    "gptq-8bit-g64-asym": ("gptq", gptq(bits=8, group_size=64, sym=False), dict(bits=8, group_size=64, sym=False),
                           "GPTQ 8-bit g64, asymmetric", {"int8pack", "dense"}),
    "gptq-2bit": ("gptq", gptq(bits=2, sym=False), dict(bits=2, group_size=32, sym=False), "GPTQ 2-bit g32", {"dense"}),
    "awq-gemm": ("awq", AWQ, dict(group_size=32), "AWQ 4-bit g32", {"int4pack"}),
    "ct-w4a16-group": ("ct", ct_config(), dict(), "compressed-tensors W4A16 g64", {"int4pack"}),
    "ct-w4a16-asym-actorder": ("ct", ct_config(sym=False, actorder="group"), dict(sym=False, act_order=True),
                               "compressed-tensors W4A16 g64, asymmetric", {"int4pack"}),
    "ct-w4a16-asym-legacy-zp": ("ct", ct_config(sym=False), dict(sym=False, packed_zero_point=False),
                                "compressed-tensors W4A16 g64, asymmetric", {"int4pack"}),
    "ct-w8a16-channel": ("ct", ct_config(bits=8, group_size=-1), dict(bits=8, group_size=-1),
                         "compressed-tensors W8A16 channel", {"int8pack"}),
    "ct-naive-int8": ("ct", ct_config(fmt="naive-quantized", bits=8, group_size=-1),
                      dict(bits=8, group_size=-1, packed=False), "compressed-tensors W8A16 channel", {"int8pack"}),
    "ct-w4a16-g48-partial": ("ct", ct_config(group_size=48), dict(group_size=48), "compressed-tensors W4A16 g48",
                             {"dense"}),
}
LINEARS = 2 * 4  # tiny model: 2 layers x (qkv, o, gate_up, down)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("int")
    made = {}

    def get(name):
        if name not in made:
            fmt, config, options, _, _ = CASES[name]
            options = dict(options)
            positive = options.pop("positive_first_group", False)
            made[name] = (root / name, make_int_checkpoint(root / name, fmt, config, positive_first_group=positive,
                                                           **options))
        return made[name]

    return get


def _layouts(model) -> set:
    return {m.quant_method.layout.name for m in model.modules() if getattr(getattr(m, "quant_method", None), "layout", None)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_detected_and_matches_the_dequantized_model(name, checkpoints):
    folder, reference = checkpoints(name)
    _, _, _, described, layout = CASES[name]
    eager = runtime.compile_model(folder, compile=False, progress=False, max_seq_len=128)
    assert described in eager.scheme.describe()
    assert _layouts(eager.model) == layout
    ids = random_ids()
    with torch.no_grad():
        expected = reference(ids).logits
    # Both sides use the same dequantized fp32 weights: only summation order differs.
    assert relative_l2(eager(ids), expected) < 1e-5


@pytest.mark.parametrize("quant,layout", [("int4", "int4pack"), ("int8", "int8pack")])
def test_online_int_quantization_compiles_and_stays_close_to_bf16(quant, layout, llama_dir, hf_model, compiled):
    model = compiled(llama_dir, quant)
    assert _layouts(model.model.model) == {layout}
    assert model.model.lm_head.quant_method.layout.name == "int8pack"  # lm_head: int8 per channel
    assert quant in model.scheme.describe()
    ids = random_ids(1)
    with torch.no_grad():
        expected = hf_model(llama_dir)(ids).logits
    # Round-to-nearest error of random 0.02-scale weights, through 2 layers: int8 per channel
    # keeps about 2**-8 of each weight, int4 in groups about 2**-4.
    assert relative_l2(model(ids), expected) < (0.02 if quant == "int8" else 0.2)
    decode_without_recompiles(model, [3, 1, 4, 1, 5], 8)


def test_dummy_load_quantizes_random_weights_through_the_online_loader(llama_dir):
    model = runtime.compile_model(llama_dir, quant="int4", load_config=LoadConfig(load_format="dummy", progress=False),
                                  compile=False, progress=False, max_seq_len=64)
    assert _layouts(model.model) == {"int4pack", "int8pack"}  # layers, lm_head
    assert torch.isfinite(model(random_ids())).all()


def test_online_int_quantizes_a_tied_lm_head_from_the_embeddings_and_keeps_them(tied_llama_dir, hf_model):
    model = runtime.compile_model(tied_llama_dir, quant="int8", compile=False, progress=False, max_seq_len=64)
    reference = hf_model(tied_llama_dir)
    # The embedding lookup keeps the stored bf16 rows; lm_head gets its own int8 copy of them.
    assert torch.equal(model.model.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    assert model.model.lm_head.quant_method.layout.name == "int8pack"
    assert "lm_head int8 per channel" in model.scheme.describe()
    with torch.no_grad():
        assert relative_l2(model(random_ids()), reference(random_ids()).logits) < 0.02


def test_side_files_are_detected(tmp_path, checkpoints):
    for name, side_file, config in [("gptq-4bit-sym", "quantize_config.json", {k: v for k, v in gptq().items()
                                                                                  if k != "quant_method"}),
                                    ("awq-gemm", "quant_config.json", {"w_bit": 4, "q_group_size": 32,
                                                                       "zero_point": True, "version": "GEMM"})]:
        folder, reference = checkpoints(name)
        copy = tmp_path / name
        shutil.copytree(folder, copy)
        hf_config = json.loads((copy / "config.json").read_text())
        del hf_config["quantization_config"]
        (copy / "config.json").write_text(json.dumps(hf_config))
        (copy / side_file).write_text(json.dumps(config))
        model = runtime.compile_model(copy, compile=False, progress=False, max_seq_len=64)
        assert CASES[name][3] in model.scheme.describe()
        with torch.no_grad():
            assert relative_l2(model(random_ids()), reference(random_ids()).logits) < 1e-5


def _rewrite(folder, tmp_path, *, config=None, tensors=None):
    """A copy of `folder` with its quantization_config updated by the dict `config`."""
    return edited_copy(folder, tmp_path / "edited", config=None if config is None else lambda qc: qc.update(config),
                       tensors=tensors)


def test_gptq_dynamic_skip_rules_keep_matching_modules_dense(tmp_path, checkpoints):
    folder, _ = checkpoints("gptq-4bit-sym")

    def densify(state):  # what GPTQModel writes for a "-:" module: a plain weight
        for suffix in ("qweight", "qzeros", "scales", "g_idx"):
            del state[f"model.layers.1.mlp.down_proj.{suffix}"]
        state["model.layers.1.mlp.down_proj.weight"] = torch.randn(64, 160) * 0.02

    copy = _rewrite(folder, tmp_path, config={"dynamic": {r"-:.*layers\.1\.mlp\.down_proj": {}}}, tensors=densify)
    model = runtime.compile_model(copy, compile=False, progress=False, max_seq_len=64).model
    assert model.model.layers[1].mlp.down_proj.quant_method.name == "bf16"
    assert model.model.layers[0].mlp.down_proj.quant_method.name == "gptq"


def test_awq_modules_to_not_convert_match_by_substring(tmp_path, checkpoints):
    folder, _ = checkpoints("awq-gemm")

    def densify(state):
        for i in range(2):
            for suffix in ("qweight", "qzeros", "scales"):
                del state[f"model.layers.{i}.self_attn.o_proj.{suffix}"]
            state[f"model.layers.{i}.self_attn.o_proj.weight"] = torch.randn(64, 64) * 0.02

    copy = _rewrite(folder, tmp_path, config={"modules_to_not_convert": ["o_proj"]}, tensors=densify)
    model = runtime.compile_model(copy, compile=False, progress=False, max_seq_len=64).model
    assert [layer.self_attn.o_proj.quant_method.name for layer in model.model.layers] == ["bf16", "bf16"]


def test_malformed_integer_checkpoints_get_clear_errors(tmp_path, checkpoints):
    folder, _ = checkpoints("gptq-4bit-act-order-asym")
    # qweight packed for 8 bits while the config says 4: the shape names the mismatch.
    bad_bits = _rewrite(folder, tmp_path / "bits", config={"bits": 8})
    with pytest.raises(CheckpointError, match=r"down_proj\.qweight'.*shape \[20, 64\], expected \[40, 64\]"):
        runtime.compile_model(bad_bits, compile=False, progress=False)
    # desc_act says act-order, but the group indices are gone.
    no_g_idx = _rewrite(folder, tmp_path / "g_idx", tensors=lambda state: [
        state.pop(name) for name in [n for n in state if n.endswith("g_idx")]])
    with pytest.raises(CheckpointError, match=r"g_idx'.*missing, but the quantization config says desc_act=true"):
        runtime.compile_model(no_g_idx, compile=False, progress=False)
    with pytest.raises(UnsupportedError, match=r"bits=3 is not supported; supported: \[2, 4, 8\]"):
        runtime.compile_model(_rewrite(folder, tmp_path / "b3", config={"bits": 3}), compile=False, progress=False)
    # A scale tensor stored as int: dtype named.
    int_scales = _rewrite(folder, tmp_path / "scales", tensors=lambda state: state.update(
        {"model.layers.0.self_attn.k_proj.scales": torch.ones(2, 32, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match=r"k_proj\.scales'.*dtype torch\.int32"):
        runtime.compile_model(int_scales, compile=False, progress=False)
    awq_folder, _ = checkpoints("awq-gemm")
    with pytest.raises(UnsupportedError, match="AWQ version 'gemv' is not supported"):
        runtime.compile_model(_rewrite(awq_folder, tmp_path / "gemv", config={"version": "gemv"}), compile=False,
                              progress=False)


def test_compressed_tensors_weight_shape_must_match_the_layer(tmp_path, checkpoints):
    folder, _ = checkpoints("ct-w4a16-group")
    copy = _rewrite(folder, tmp_path, tensors=lambda state: state.update(
        {"model.layers.0.mlp.up_proj.weight_shape": torch.tensor([160, 63])}))
    with pytest.raises(CheckpointError, match=r"up_proj\.weight_shape'.*holds \[160, 63\].*\[160, 64\]"):
        runtime.compile_model(copy, compile=False, progress=False)


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 48), (8, 80)])
def test_online_quantizer_rounds_to_nearest_within_half_a_step(bits, group_size):
    w = torch.randn(24, 80, generator=torch.Generator().manual_seed(bits)) * 0.05
    w[3, :group_size] = 0.01  # a constant group must not divide by zero
    q, scales, zeros = quantize_int_rows(w, bits, group_size, torch.float32)
    assert q.min() >= 0 and q.max() < 2**bits
    g = torch.arange(80) // group_size  # 80 = 1.67 groups of 48: a partial last group
    dequantized = (q.float() - zeros[:, g]) * scales[:, g]
    assert ((dequantized - w).abs() <= scales[:, g] / 2 + 1e-7).all()
    if bits == 4:  # asymmetric: each group's minimum gets code 0, its maximum the top code
        for group in range(int(g.max()) + 1):
            codes = q[:, g == group]
            assert (codes.amin(dim=1) == 0).all() and (codes.amax(dim=1)[torch.arange(24) != 3] == 15).all()


def test_gptq_with_a_quantized_lm_head(tmp_path):
    folder = tmp_path / "gptq-lm-head"
    reference = make_int_checkpoint(folder, "gptq", gptq(lm_head=True), quantize_lm_head=True, bits=4, group_size=32,
                                    sym=True)
    model = runtime.compile_model(folder, compile=False, progress=False, max_seq_len=64)
    assert model.model.lm_head.quant_method.name == "gptq"
    with torch.no_grad():
        assert relative_l2(model(random_ids()), reference(random_ids()).logits) < 1e-5
