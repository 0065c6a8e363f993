"""Mixtral: Mistral's attention with a sparse block of `num_local_experts` experts in every layer,
softmax top-k routing renormalized over the chosen experts. Its checkpoints name the block
`block_sparse_moe` and an expert's projections w1 (gate), w3 (up) and w2 (down)."""

from dataclasses import replace

from .config import ConfigReader, ModelConfig, MoEConfig, uniform_sliding_window
from .decoder import SEPARATE_PROJECTIONS, CausalLM
from .moe import MoEDecoderLayer, SparseMoeBlock, top_k


class MixtralMoeBlock(SparseMoeBlock):
    expert_names = ("w1", "w3", "w2")


class MixtralDecoderLayer(MoEDecoderLayer):
    mlp_name = "block_sparse_moe"
    moe_block = MixtralMoeBlock


class MixtralForCausalLM(CausalLM):
    layer_cls = MixtralDecoderLayer
    checkpoint_layout = replace(CausalLM.checkpoint_layout, stacked=SEPARATE_PROJECTIONS + (
        (".gate_up_proj.", ".w1.", 0),
        (".gate_up_proj.", ".w3.", 1),
        (".down_proj.", ".w2.", None),
    ))
    config_defaults = {"sliding_window": None}

    @classmethod
    def read_config(cls, hf_config, source) -> ModelConfig:
        hf = {**cls.config_defaults, **hf_config}
        cfg = ModelConfig.from_hf(hf, cls.__name__, source=source)
        read = ConfigReader(hf, source)
        experts = read.positive_int("num_local_experts")
        moe = MoEConfig(num_experts=experts, top_k=top_k(read, experts), expert_intermediate_size=cfg.intermediate_size,
                        sparse_layers=(True,) * cfg.num_layers, norm_topk_prob=True)
        return replace(cfg, moe=moe, **uniform_sliding_window(read, cfg.num_layers))
