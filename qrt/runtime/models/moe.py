"""Mixture-of-experts blocks: a router picks k of E experts per token, the experts run as one op
(qrt::fused_experts, whose weights layers/experts.py builds in the checkpoint's format), and an
optional shared expert runs on every token.

The router stays in the model dtype whatever the format: checkpoints keep their gates as stored
(quantizers leave them out, they are [E, D] and read once per token), and a quantized router would
change which experts run. Routing is computed in fp32, as transformers does.
"""

import torch
from torch import nn

from qrt.errors import ConfigError
from qrt.layers.experts import FusedExperts
from qrt.layers.linear import Linear
from qrt.layers.tensor_parallel import SINGLE
from qrt.layers.unquantized import UnquantizedLinearMethod

from .config import ConfigReader, ModelConfig, MoEConfig
from .layers import DecoderLayer, GatedMLP


def dense_router(cfg: ModelConfig, outputs: int, dtype) -> Linear:
    """A gate kept as stored and whole on every rank: each rank routes every token itself."""
    return Linear(cfg.hidden_size, [outputs], bias=False, dtype=dtype, method=UnquantizedLinearMethod(), parallel=SINGLE)


def softmax_top_k(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral and Qwen-MoE routing: softmax over the experts, the k largest, optionally
    renormalized. logits: [T, E] -> (ids [T, k] int64, weights [T, k] fp32)."""
    probs = logits.float().softmax(dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


class SparseMoeBlock(nn.Module):
    """gate -> top-k experts (+ a shared expert, optionally scaled by its own sigmoid gate)."""

    expert_names = ("gate_proj", "up_proj", "down_proj")  # the checkpoint's names of an expert's projections

    def __init__(self, cfg: ModelConfig, prefix: str, scheme, dtype):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.renormalize = moe.top_k, moe.norm_topk_prob
        self.gate = dense_router(cfg, moe.num_experts, dtype)
        self.experts = FusedExperts(moe.num_experts, cfg.hidden_size, moe.expert_intermediate_size,
                                    checkpoint_prefix=f"{prefix}.experts", names=self.expert_names, scheme=scheme,
                                    dtype=dtype, activation=cfg.hidden_act, parallel=cfg.parallel)
        self.shared_expert = None
        self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(cfg, f"{prefix}.shared_expert", scheme, dtype, fused_checkpoint=False,
                                          intermediate_size=moe.shared_expert_intermediate_size)
            if moe.shared_expert_gate:
                self.shared_expert_gate = dense_router(cfg, 1, dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_top_k(self.gate(x), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, D]
        ids, weights = self.route(x)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out.view(shape)


class MoEDecoderLayer(DecoderLayer):
    """A decoder layer whose feed-forward block is sparse where `cfg.moe.sparse_layers` says so."""

    moe_block = SparseMoeBlock

    def make_mlp(self, cfg: ModelConfig, index: int, prefix: str, scheme, dtype) -> nn.Module:
        if cfg.moe.sparse_layers[index]:
            return self.moe_block(cfg, prefix, scheme, dtype)
        return super().make_mlp(cfg, index, prefix, scheme, dtype)


def qwen_moe_config(read: ConfigReader, num_layers: int) -> MoEConfig:
    """Qwen2-MoE and Qwen3-MoE: every `decoder_sparse_step`-th layer is sparse, except those in
    `mlp_only_layers`, which keep a dense MLP."""
    step = read.positive_int("decoder_sparse_step", 1)
    dense = read.hf.get("mlp_only_layers") or []
    if not (isinstance(dense, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in dense)):
        raise_config(read, "mlp_only_layers", dense, "a list of layer indices")
    # Hub configs say num_experts; transformers 5 writes the same value as num_local_experts.
    experts = read.integer("num_experts" if "num_experts" in read.hf else "num_local_experts", minimum=0)
    sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return MoEConfig(
        # num_experts 0 makes every layer dense; the block's sizes then describe nothing that is built.
        num_experts=max(experts, 1), top_k=top_k(read, experts), sparse_layers=sparse,
        expert_intermediate_size=read.positive_int("moe_intermediate_size"),
        norm_topk_prob=read.boolean("norm_topk_prob", False),
        shared_expert_intermediate_size=read.integer("shared_expert_intermediate_size", 0, minimum=0),
    )


def top_k(read: ConfigReader, num_experts: int) -> int:
    k = read.positive_int("num_experts_per_tok")
    if num_experts and k > num_experts:
        raise_config(read, "num_experts_per_tok", k, f"at most the {num_experts} experts")
    return k


def raise_config(read: ConfigReader, key: str, value, expected: str):
    raise ConfigError(f"{read.source}: {key}={value!r}; expected {expected}")
