"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (models/mla.py) and, from layer
`first_k_dense_replace` on, sparse blocks of routed experts plus `n_shared_experts` always-on ones.

- V2 routes by softmax: the top-k experts ("greedy"), or the top-k within the `topk_group` groups
  whose best expert scores highest ("group_limited_greedy"); weights scaled by routed_scaling_factor
  (renormalized first when norm_topk_prob, as DeepSeek's own code does; transformers' port skips it).
- V3 routes by sigmoid: experts are chosen on score + e_score_correction_bias within the
  `topk_group` groups whose two best experts sum highest; their weights are the scores without the
  bias, renormalized (norm_topk_prob) and scaled by routed_scaling_factor.

Routers run in fp32 on fp32 weights, as transformers does; like every router they stay as stored.
The checkpoints of V3 also carry the multi-token-prediction layers after the last decoder layer
(`num_nextn_predict_layers`): skipped, unless speculative method "mtp" keeps the first as its draft
(models/mtp.py).
"""

import math
from dataclasses import replace
from functools import partial

import torch
from torch import nn

from qrt.errors import UnsupportedError
from qrt.layers.experts import FusedExperts
from qrt.layers.linear import copy_rows, make_parameter
from qrt.layers.tensor_parallel import SINGLE

from .config import ConfigReader, MLAConfig, ModelConfig, MoEConfig, read_ropes
from .decoder import SEPARATE_PROJECTIONS, CausalLM
from .layers import DecoderLayer, GatedMLP
from .mla import LatentAttention
from .moe import top_k
from .mtp import MultiTokenPredictor


class DeepseekRouter(nn.Module):
    """The gate: fp32 weights [E, D] (and V3's score correction bias [E])."""

    def __init__(self, cfg: ModelConfig, correction_bias: bool):
        super().__init__()
        experts, load = cfg.moe.num_experts, partial(copy_rows, layout=None)
        self.weight = make_parameter(torch.empty(experts, cfg.hidden_size, dtype=torch.float32), weight_loader=load)
        self.e_score_correction_bias = None
        if correction_bias:
            self.e_score_correction_bias = make_parameter(torch.empty(experts, dtype=torch.float32), weight_loader=load)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ self.weight.t()  # [T, E] fp32


def group_mask(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int) -> torch.Tensor:
    """[T, E] bool: the experts in each token's `topk_group` best groups (group_scores: [T, G])."""
    tokens, groups = group_scores.shape
    best = group_scores.topk(topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    chosen = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)  # [T, G]
    return chosen.unsqueeze(-1).expand(tokens, groups, scores.shape[-1] // groups).reshape(scores.shape)


def v2_routing(logits: torch.Tensor, moe: MoEConfig, group_limited: bool, renormalize: bool):
    scores = logits.softmax(dim=-1)  # [T, E] fp32
    if group_limited:
        grouped = scores.view(scores.shape[0], moe.n_group, -1)
        scores = scores.masked_fill(~group_mask(scores, grouped.amax(dim=-1), moe.topk_group), 0.0)
    weights, ids = torch.topk(scores, moe.top_k, dim=-1, sorted=False)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * moe.routed_scaling_factor


def v3_routing(logits: torch.Tensor, bias: torch.Tensor, moe: MoEConfig):
    scores = logits.sigmoid()  # [T, E] fp32
    choice = scores + bias
    grouped = choice.view(choice.shape[0], moe.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    choice = choice.masked_fill(~group_mask(choice, grouped, moe.topk_group), float("-inf"))
    ids = torch.topk(choice, moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * moe.routed_scaling_factor


class DeepseekMoeBlock(nn.Module):
    """gate -> routed experts, plus the shared experts on every token."""

    v3 = False

    def __init__(self, cfg: ModelConfig, prefix: str, scheme, dtype, *, group_limited: bool):
        super().__init__()
        moe = self.moe = cfg.moe
        self.group_limited = group_limited
        self.gate = DeepseekRouter(cfg, correction_bias=self.v3)
        self.experts = FusedExperts(moe.num_experts, cfg.hidden_size, moe.expert_intermediate_size,
                                    checkpoint_prefix=f"{prefix}.experts", names=("gate_proj", "up_proj", "down_proj"),
                                    scheme=scheme, dtype=dtype, activation=cfg.hidden_act, parallel=cfg.parallel)
        self.shared_experts = None
        if moe.shared_expert_intermediate_size:
            self.shared_experts = GatedMLP(cfg, f"{prefix}.shared_experts", scheme, dtype, fused_checkpoint=False,
                                           intermediate_size=moe.shared_expert_intermediate_size)

    def route(self, x: torch.Tensor):
        logits = self.gate(x)
        if self.v3:
            return v3_routing(logits, self.gate.e_score_correction_bias, self.moe)
        return v2_routing(logits, self.moe, self.group_limited, self.moe.norm_topk_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, D]
        ids, weights = self.route(x)
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)


class DeepseekV3MoeBlock(DeepseekMoeBlock):
    v3 = True


class DeepseekDecoderLayer(DecoderLayer):
    attention_cls = LatentAttention
    moe_block = DeepseekMoeBlock

    def make_mlp(self, cfg: ModelConfig, index: int, prefix: str, scheme, dtype) -> nn.Module:
        if cfg.moe.sparse_layers[index]:
            return self.moe_block(cfg, prefix, scheme, dtype, group_limited=self.group_limited(cfg))
        return super().make_mlp(cfg, index, prefix, scheme, dtype)

    @staticmethod
    def group_limited(cfg: ModelConfig) -> bool:
        return cfg.moe.n_group > 1


class DeepseekV3DecoderLayer(DeepseekDecoderLayer):
    moe_block = DeepseekV3MoeBlock


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def read_deepseek_config(cls, hf_config: dict, source, *, rope_interleaved_default: bool,
                         topk_methods: tuple[str, ...]) -> ModelConfig:
    read = ConfigReader(hf_config, source)
    cfg = ModelConfig.from_hf(hf_config, cls.__name__, source=source)
    for key in ("mlp_bias",):
        if read.boolean(key, False):
            raise UnsupportedError(f"{source}: {key}=true is not supported for {cls.__name__}")
    method = hf_config.get("topk_method") or topk_methods[0]
    if method not in topk_methods:
        raise UnsupportedError(f"{source}: topk_method={method!r}; {cls.__name__} supports {', '.join(topk_methods)}")
    mla = MLAConfig(
        q_lora_rank=read.optional_positive_int("q_lora_rank"), kv_lora_rank=read.positive_int("kv_lora_rank"),
        qk_nope_head_dim=read.positive_int("qk_nope_head_dim"), qk_rope_head_dim=read.positive_int("qk_rope_head_dim"),
        v_head_dim=read.positive_int("v_head_dim"),
        rope_interleaved=read.boolean("rope_interleave", rope_interleaved_default),
        attention_bias=read.boolean("attention_bias", False))
    rope, _ = read_ropes(read, mla.qk_rope_head_dim, cfg.max_position_embeddings, partial_rotary=False)
    scale = mla.qk_head_dim ** -0.5
    if rope.scaling is not None and rope.scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(rope.scaling["factor"]), float(rope.scaling["mscale_all_dim"])) ** 2
    experts = read.positive_int("n_routed_experts")
    dense_first = read.integer("first_k_dense_replace", 0, minimum=0)
    every = read.positive_int("moe_layer_freq", 1)
    n_group = read.positive_int("n_group", 1)
    if experts % n_group:
        raise UnsupportedError(f"{source}: n_routed_experts={experts} does not split into n_group={n_group} groups")
    moe = MoEConfig(
        num_experts=experts, top_k=top_k(read, experts),
        expert_intermediate_size=read.positive_int("moe_intermediate_size"),
        sparse_layers=tuple(i >= dense_first and i % every == 0 for i in range(cfg.num_layers)),
        norm_topk_prob=read.boolean("norm_topk_prob", False),
        shared_expert_intermediate_size=read.positive_int("moe_intermediate_size") * read.integer(
            "n_shared_experts", 0, minimum=0),
        n_group=n_group if method != "greedy" else 1, topk_group=read.positive_int("topk_group", 1),
        routed_scaling_factor=read.positive_float("routed_scaling_factor", 1.0))
    return replace(cfg, mla=mla, moe=moe, rope=rope, attention_scale=scale, head_dim=mla.qk_head_dim)


# Latent attention has no q/k/v to fuse; the MLPs' and experts' gate and up still stack.
_LAYOUT = replace(CausalLM.checkpoint_layout,
                  stacked=tuple(entry for entry in SEPARATE_PROJECTIONS if entry[0] == ".gate_up_proj."))


class DeepseekV2ForCausalLM(CausalLM):
    layer_cls = DeepseekDecoderLayer
    checkpoint_layout = _LAYOUT

    @classmethod
    def read_config(cls, hf_config, source) -> ModelConfig:
        # DeepSeek-V2 rotates interleaved pairs (its rotary embedding multiplies complex numbers).
        return read_deepseek_config(cls, hf_config, source, rope_interleaved_default=True,
                                    topk_methods=("greedy", "group_limited_greedy"))


class DeepseekV3ForCausalLM(CausalLM):
    layer_cls = DeepseekV3DecoderLayer
    checkpoint_layout = _LAYOUT

    @classmethod
    def read_config(cls, hf_config, source) -> ModelConfig:
        return read_deepseek_config(cls, hf_config, source, rope_interleaved_default=True, topk_methods=("noaux_tc",))

    def __init__(self, hf_config: dict, scheme, dtype, source="config.json", parallel=SINGLE):
        super().__init__(hf_config, scheme, dtype, source, parallel)
        self.prediction_layers = ConfigReader(hf_config, source).integer("num_nextn_predict_layers", 0, minimum=0)
        self.scheme, self.source = scheme, source  # what keep_prediction_layers builds with

    def keep_prediction_layers(self) -> None:
        """Its first multi-token-prediction layer as `mtp`: a layer of experts whatever
        first_k_dense_replace says (as DeepSeek trained it, and transformers builds it). Further
        layers (none in DeepSeek-V3's own checkpoints) stay skipped: the first, chained, guesses
        every depth, as vLLM runs it."""
        if not self.prediction_layers:
            raise UnsupportedError(f"{self.source}: num_nextn_predict_layers is 0: this DeepSeek-V3 "
                                   f"checkpoint has no multi-token-prediction layer for speculative method 'mtp'")
        if self.config.parallel.sharded:
            raise UnsupportedError("speculative method 'mtp' does not run under tensor parallelism yet; use 'ngram'")
        cfg, index = self.config, self.config.num_layers
        cfg = replace(cfg, layer_types=cfg.layer_types + cfg.layer_types[-1:],
                      moe=replace(cfg.moe, sparse_layers=cfg.moe.sparse_layers + (True,)))
        self.mtp = MultiTokenPredictor(cfg, index, self.scheme, self.dtype, self.layer_cls)

    def checkpoint_names(self):
        # The multi-token-prediction layers follow the decoder layers in the checkpoint.
        names = super().checkpoint_names()
        first = self.config.num_layers
        skipped = tuple(f"model.layers.{first + i}." for i in range(self.prediction_layers))
        if self.mtp is None:
            return replace(names, ignored_prefixes=names.ignored_prefixes + skipped)
        return replace(names, ignored_prefixes=names.ignored_prefixes + skipped[1:]
                       + MultiTokenPredictor.shared_copies(first), moved=MultiTokenPredictor.checkpoint_moves(first))
