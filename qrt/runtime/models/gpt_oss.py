"""gpt-oss (OpenAI's open-weight mixture of experts): grouped-query attention with q/k/v/o biases
and a learned sink logit per head in the softmax's denominator, sliding-window layers alternating
with full ones (`layer_types`), YaRN RoPE, RMSNorms whose weights stay fp32, and in every layer a
router with a bias choosing the top k experts, whose logits alone are softmaxed. The experts have
biases and a clamped SwiGLU, (up + 1) · gate · σ(1.702 · gate), gate clamped at 7 and up to ±7.

Its checkpoints store each projection of all experts of a layer as one tensor: dense ones
`experts.gate_up_proj` [E, D, 2I] (input channels first) with `gate_up_proj_bias` [E, 2I], and
`down_proj` [E, I, D] with `down_proj_bias` [E, D]; MXFP4 ones (formats/mxfp4.py)
`gate_up_proj_blocks` [E, 2I, D / 32, 16] and `gate_up_proj_scales` [E, 2I, D / 32], output
channels first. The gate and up channels alternate along 2I (gate first). Each such tensor is
handed, expert by expert, to the per-expert Linears of layers/experts.py, the gate and up rows
apart as their shards 0 and 1.
"""

from dataclasses import replace

import torch
from torch import nn

from qrt.checkpoint.loader import rank_cuts
from qrt.errors import TensorMismatch, UnsupportedError
from qrt.kernels.activation_reference import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT
from qrt.layers.experts import FusedExperts
from qrt.layers.linear import Linear, make_parameter
from qrt.layers.tensor_parallel import SINGLE, cut_tensor
from qrt.layers.unquantized import UnquantizedLinearMethod

from .config import FULL_ATTENTION, SLIDING_ATTENTION, ConfigReader, ModelConfig, MoEConfig
from .decoder import CausalLM
from .layers import Attention, RMSNorm
from .moe import MoEDecoderLayer, top_k


class GptOssRMSNorm(RMSNorm):
    """The weight is kept in fp32 whatever the model dtype (transformers keeps these norms in fp32)
    and multiplies the fp32 normalised value; the product is rounded once."""

    def __init__(self, size: int, eps: float, dtype):
        super().__init__(size, eps, torch.float32)
        self.dtype = dtype  # the model's: what the layers after the norm take

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.qrt.rms_norm(x.float(), self.weight, self.eps).to(self.dtype)


class GptOssAttention(Attention):
    """Attention with biases on all four projections and a sink logit per query head."""

    def __init__(self, cfg: ModelConfig, prefix: str, scheme, dtype, *, norm_cls, fused_checkpoint: bool):
        super().__init__(cfg, prefix, scheme, dtype, norm_cls=norm_cls, fused_checkpoint=fused_checkpoint)
        tp, hd = cfg.parallel, cfg.head_dim
        q_part = tp.heads(cfg.num_heads, hd, f"{prefix}: num_attention_heads", replicate=False)
        # The base class's o_proj has no bias; gpt-oss's has one.
        self.o_proj = Linear(cfg.num_heads * hd, [cfg.hidden_size], bias=True, dtype=dtype,
                             method=scheme.method_for(f"{prefix}.o_proj"), parallel=tp, k_slice=q_part)
        heads = slice(q_part.start // hd, (q_part.start + q_part.length) // hd)  # this rank's query heads

        def load_sinks(param, loaded, shard_id):
            if tuple(loaded.shape) != (cfg.num_heads,) or not loaded.dtype.is_floating_point:
                raise TensorMismatch(f"shape {list(loaded.shape)} {loaded.dtype}, expected one float per "
                                     f"attention head [{cfg.num_heads}]")
            param.data.copy_(loaded[heads])

        self.sinks = make_parameter(torch.empty(self.num_heads, dtype=dtype), weight_loader=load_sinks)  # [H]


class GptOssExperts(FusedExperts):
    """The experts, loaded from the checkpoint's one tensor per projection and parameter.

    Each parameter P of the per-expert Linears (the format's: `weight`, or `weight_blocks` and
    `weight_scales`; and `bias`) gets a stand-in parameter named as the checkpoint's tensor
    (`gate_up_proj`, `gate_up_proj_blocks`, ..., `gate_up_proj_bias`), whose loader hands each
    expert its slice; the per-expert parameters themselves load from nothing else."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stored_names = []
        first = self._modules["0"]
        for projection in ("gate_up_proj", "down_proj"):
            for name, param in getattr(first, projection).named_parameters(recurse=False):
                stored = projection if name == "weight" else f"{projection}_{name.removeprefix('weight_')}"
                loaders = [getattr(getattr(self._modules[str(e)], projection), name).weight_loader
                           for e in range(self.num_experts)]
                for e in range(self.num_experts):  # loaded through the stand-in only
                    getattr(getattr(self._modules[str(e)], projection), name).weight_loader = None
                shape = (self.num_experts, *_stored_shape(name, _whole_shape(getattr(first, projection), param)))
                setattr(self, stored, make_parameter(
                    torch.empty(0, dtype=torch.uint8),  # a stand-in: the values go to the experts' own parameters
                    weight_loader=self._hand_out(projection, name, stored, loaders, shape), loaded_shape=shape))
                self.stored_names.append(stored)

    def _hand_out(self, projection: str, name: str, stored: str, loaders: list, shape: tuple):
        def load(_, loaded: torch.Tensor, shard_id):
            if tuple(loaded.shape) != shape:
                raise TensorMismatch(f"shape {list(loaded.shape)}, expected {list(shape)} "
                                     f"(one [{', '.join(map(str, shape[1:]))}] per expert)")
            for expert, loader in enumerate(loaders):
                param_name = f"{expert}.{projection}.{name}"
                rows = loaded[expert]
                if name == "weight":  # dense weights are stored [K, N]; a Linear holds [N, K]
                    rows = rows.t()
                # Gate and up channels alternate: shards 0 and 1.
                shards = ((0, rows[0::2]), (1, rows[1::2])) if projection == "gate_up_proj" else ((None, rows),)
                for shard_id, part in shards:
                    # Under tensor parallelism, this rank's part, as the loader cuts a tensor of its own.
                    cuts = rank_cuts(self, param_name, shard_id, part.shape, f"{self.checkpoint_prefix}.{stored}")
                    loader(self.get_parameter(param_name), cut_tensor(part, cuts) if cuts else part, shard_id)
        return load

    def finish_loading(self, device: torch.device) -> None:
        for stored in self.stored_names:
            del self._parameters[stored]
        super().finish_loading(device)


def _whole_shape(linear: Linear, param) -> tuple:
    """The shape of `param` for the whole layer: under tensor parallelism a rank holds a part of
    its output rows or input channels."""
    shape = list(param.shape)
    output_dim, input_dim = getattr(param, "output_dim", None), getattr(param, "input_dim", None)
    if output_dim is not None:
        shape[output_dim] = shape[output_dim] * linear.full_output_size // linear.output_size
    if input_dim is not None:
        shape[input_dim] = shape[input_dim] * linear.full_input_size // linear.input_size
    return tuple(shape)


def _stored_shape(name: str, held: tuple) -> tuple:
    """One expert's stored shape of parameter `name` held as `held` ([N, ...]): dense weights
    are stored transposed."""
    return (held[1], held[0]) if name == "weight" else held


class GptOssMoeBlock(nn.Module):
    """router (with a bias) -> the top k logits, softmaxed among themselves -> the experts."""

    def __init__(self, cfg: ModelConfig, prefix: str, scheme, dtype):
        super().__init__()
        moe = cfg.moe
        self.top_k = moe.top_k
        # Kept as stored and whole on every rank, as every family's router (models/moe.py).
        self.router = Linear(cfg.hidden_size, [moe.num_experts], bias=True, dtype=dtype,
                             method=UnquantizedLinearMethod(), parallel=SINGLE)
        self.experts = GptOssExperts(moe.num_experts, cfg.hidden_size, moe.expert_intermediate_size,
                                     checkpoint_prefix=f"{prefix}.experts",
                                     names=("gate_up_proj", "gate_up_proj", "down_proj"), scheme=scheme, dtype=dtype,
                                     activation="clamped_swiglu", parallel=cfg.parallel, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, D]
        logits, ids = torch.topk(self.router(x), self.top_k, dim=-1)  # [T, k] each
        # In the logits' dtype, as transformers computes these weights.
        weights = logits.softmax(dim=-1)
        return self.experts(x, ids, weights).view(shape)


class GptOssDecoderLayer(MoEDecoderLayer):
    norm_cls = GptOssRMSNorm
    attention_cls = GptOssAttention
    moe_block = GptOssMoeBlock


class GptOssForCausalLM(CausalLM):
    layer_cls = GptOssDecoderLayer
    # What GptOssConfig assumes where config.json is silent.
    config_defaults = {"sliding_window": 128, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
                       "num_experts_per_tok": 4, "attention_bias": True, "head_dim": 64,
                       "max_position_embeddings": 131072,
                       "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "truncate": False, "original_max_position_embeddings": 4096}}

    @classmethod
    def read_config(cls, hf_config, source) -> ModelConfig:
        hf = {**cls.config_defaults, **hf_config}
        read = ConfigReader(hf, source)
        for key, expected in (("swiglu_limit", CLAMPED_SWIGLU_LIMIT), ("swiglu_alpha", CLAMPED_SWIGLU_ALPHA)):
            if read.positive_float(key, expected) != expected:
                raise UnsupportedError(f"{source}: {key}={hf[key]}; qrt runs gpt-oss's experts with {expected} only")
        if not read.boolean("attention_bias", True):
            raise UnsupportedError(f"{source}: attention_bias=false; {cls.__name__} is supported with biases only")
        cfg = ModelConfig.from_hf(hf, cls.__name__, source=source)
        experts = read.positive_int("num_local_experts")
        moe = MoEConfig(num_experts=experts, top_k=top_k(read, experts), expert_intermediate_size=cfg.intermediate_size,
                        sparse_layers=(True,) * cfg.num_layers, norm_topk_prob=False)
        # Without layer_types, even layers slide and odd ones attend to everything.
        default_types = [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(cfg.num_layers)]
        return replace(cfg, moe=moe, qkv_bias=True, sliding_window=read.positive_int("sliding_window"),
                       layer_types=read.layer_types(cfg.num_layers, default_types))
