"""The LoRA tests' adapter producer (tests/helpers/lora_adapters.py) writes what it is asked for,
in the layout qrt's loader reads, and its adapters change the model."""

import pytest
import torch

from helpers.checkpoints.tiny import make_checkpoint, random_ids
from helpers.lora_adapters import (ALL_PROJECTIONS, adapter_config, adapter_tensors, make_peft_adapter,
                                   peft_logits, peft_over_model, peft_reference)

# The adapters' producer checked against PEFT's own files; the LoRA tests use it in the quick loop.
pytestmark = pytest.mark.slow

LAYERS = 2


def _module(layer, proj):
    return f"model.layers.{layer}.{'mlp' if proj in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{proj}"


# Every projection of every layer: the modules both the default targets and "all-linear" adapt.
MODULES = {_module(layer, proj) for layer in range(LAYERS) for proj in ALL_PROJECTIONS}
LORA_NAMES = {f"base_model.model.{m}.lora_{ab}.weight" for m in MODULES for ab in "AB"}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-helper")
    base = root / "base"
    make_checkpoint(base, "llama")
    return base, {
        "default": make_peft_adapter(base, root / "default"),
        "patterns": make_peft_adapter(base, root / "patterns", use_rslora=True, rank_pattern={"q_proj": 4},
                                      alpha_pattern={"v_proj": 32}, seed=1),
        "all-linear": make_peft_adapter(base, root / "all-linear", target_modules="all-linear", seed=2),
    }


def test_saved_config(adapters):
    _, folders = adapters
    for name, folder in folders.items():
        config = adapter_config(folder)
        assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16
        assert config["lora_dropout"] == 0.0 and config["use_dora"] is False
        assert config["modules_to_save"] is None and config["bias"] == "none"
        assert config["use_rslora"] is (name == "patterns")
    assert set(adapter_config(folders["default"])["target_modules"]) == set(ALL_PROJECTIONS)
    # PEFT saves "all-linear" resolved into the full names of the modules it adapted.
    assert set(adapter_config(folders["all-linear"])["target_modules"]) == MODULES
    patterns = adapter_config(folders["patterns"])
    assert patterns["rank_pattern"] == {"q_proj": 4} and patterns["alpha_pattern"] == {"v_proj": 32}
    assert adapter_config(folders["default"])["rank_pattern"] == {}


def test_saved_tensors(adapters):
    _, folders = adapters
    for name, folder in folders.items():
        tensors = adapter_tensors(folder)
        assert set(tensors) == LORA_NAMES, name
        for key, tensor in tensors.items():
            assert tensor.dtype == torch.float32
            rows = 4 if name == "patterns" and ".q_proj." in key else 8
            if ".lora_A." in key:
                assert tensor.shape[0] == rows, (name, key)
            else:
                assert tensor.shape[1] == rows and tensor.abs().amax() > 0, (name, key)
    q = adapter_tensors(folders["patterns"])["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert q.shape == (4, 64)


def test_scaling(adapters):
    # The scales PEFT applies, which qrt must reproduce: alpha / sqrt(r) with rslora, alpha / r without.
    base, folders = adapters
    attn = peft_reference(base, folders["patterns"]).base_model.model.model.layers[1].self_attn
    assert attn.q_proj.scaling["default"] == pytest.approx(16 / 4 ** 0.5)
    assert attn.v_proj.scaling["default"] == pytest.approx(32 / 8 ** 0.5)
    assert attn.k_proj.scaling["default"] == pytest.approx(16 / 8 ** 0.5)
    attn = peft_reference(base, folders["default"]).base_model.model.model.layers[1].self_attn
    assert attn.q_proj.scaling["default"] == pytest.approx(16 / 8)


def test_adapters_change_logits(adapters):
    import transformers

    base, folders = adapters
    ids = random_ids(7, (2, 12))
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    base_logits = peft_logits(plain, ids)
    assert base_logits.shape == (2, 12, 300) and base_logits.dtype == torch.float32
    for name, folder in folders.items():
        logits = peft_logits(peft_reference(base, folder), ids)
        assert (logits - base_logits).abs().amax() > 1e-2, name
    # peft_over_model over a model built separately gives the same logits as peft_reference.
    over = peft_over_model(transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                           folders["patterns"])
    assert not over.training
    torch.testing.assert_close(peft_logits(over, ids), peft_logits(peft_reference(base, folders["patterns"]), ids))
