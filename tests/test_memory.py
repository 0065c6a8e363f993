"""Peak resident memory while loading stays near the size of the loaded model."""

import json

import pytest
import torch
from safetensors.torch import save_file

from bench.load_memory import measure_load

CONFIG = dict(architectures=["LlamaForCausalLM"], hidden_size=1024, intermediate_size=2816,
              num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
              max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16")
ALLOWANCE_MB = 64  # allocator slack, the largest in-flight tensor and its fp32 copy while quantizing


@pytest.fixture(scope="module")
def medium_checkpoint(tmp_path_factory):
    """A ~230 MB bf16 Llama checkpoint: large enough that a second copy of it would show."""
    folder = tmp_path_factory.mktemp("medium-llama")
    c = CONFIG
    h, i, kv = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"] * c["num_key_value_heads"]
    gen = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": (c["vocab_size"], h), "lm_head.weight": (c["vocab_size"], h),
               "model.norm.weight": (h,)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        tensors.update({f"{p}.self_attn.q_proj.weight": (h, h), f"{p}.self_attn.k_proj.weight": (kv, h),
                        f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, h),
                        f"{p}.mlp.gate_proj.weight": (i, h), f"{p}.mlp.up_proj.weight": (i, h),
                        f"{p}.mlp.down_proj.weight": (h, i), f"{p}.input_layernorm.weight": (h,),
                        f"{p}.post_attention_layernorm.weight": (h,)})
    save_file({name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16) for name, shape in tensors.items()},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_peak_memory_while_loading_stays_near_the_model_size(medium_checkpoint, quant):
    figures = measure_load(medium_checkpoint, quant)
    print(f"quant={quant}: peak {figures['peak_mib']:.0f} MiB over start for a {figures['model_mib']:.0f} MiB model")
    assert figures["model_mib"] > 120  # bf16 ~220 MiB; fp8 ~137 (its embeddings stay bf16, lm_head int8)
    assert figures["peak_mib"] <= 1.3 * figures["model_mib"] + ALLOWANCE_MB
