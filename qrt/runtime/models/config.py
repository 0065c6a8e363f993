"""The subset of a Hugging Face config.json that qrt's decoder models use, validated."""

from dataclasses import dataclass

from qrt.kernels.activation_reference import ACTIVATIONS
from qrt.errors import ConfigError, UnsupportedError
from qrt.layers.tensor_parallel import SINGLE, Parallelism

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
SCALED_ROPES = ("linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class Rope:
    """Rotary embedding of one kind of layer.

    dim: how many dims of each head rotate (the rest pass through); scaling: config.json's
    scaling dict with `rope_type` set and, for yarn and longrope, the `factor` and
    `original_max_position_embeddings` transformers derives when they are absent; None: plain RoPE."""

    theta: float
    dim: int
    scaling: dict | None = None

    @property
    def kind(self) -> str:
        return "default" if self.scaling is None else self.scaling["rope_type"]


@dataclass(frozen=True)
class MoEConfig:
    """The sparse feed-forward blocks of a mixture-of-experts family."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int  # of one routed expert
    sparse_layers: tuple[bool, ...]  # per layer: a sparse block (True) or a dense MLP of intermediate_size
    norm_topk_prob: bool  # renormalize the top-k routing weights to sum to one
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # sigmoid(gate(x)) scales the shared expert (Qwen2-MoE)
    # DeepSeek's routers: experts in n_group groups of which the tokens' best topk_group are open
    # to them, and the routing weights scaled by routed_scaling_factor.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values are expanded from a cached
    latent of kv_lora_rank features, plus one rotary key of qk_rope_head_dim shared by the heads."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state (V2-Lite), else q_a -> norm -> q_b
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool  # the rotary dims are stored as interleaved pairs (x0, x1), (x2, x3), ...
    attention_bias: bool = False  # q_a_proj, kv_a_proj_with_mqa and o_proj have biases

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def cache_features_per_token(self) -> int:
        """Values one layer caches per token: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: Rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    torch_dtype: str | None
    qkv_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE
    sliding_window: int | None = None  # sliding layers attend to keys with position > query - window
    layer_types: tuple[str, ...] = ()  # FULL_ATTENTION or SLIDING_ATTENTION, one per layer
    local_rope: Rope | None = None  # RoPE of sliding layers, where it differs from `rope`
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask
    final_logit_softcap: float | None = None  # the same on the output logits
    moe: "MoEConfig | None" = None  # mixture-of-experts families (models/moe.py)
    mla: "MLAConfig | None" = None  # multi-head latent attention (models/mla.py)
    parallel: Parallelism = SINGLE  # the tensor-parallel group the model is built for (not from config.json)

    @classmethod
    def from_hf(cls, hf: dict, architecture: str, *, source="config.json", partial_rotary=False) -> "ModelConfig":
        """The fields every decoder has; families add theirs with dataclasses.replace.
        partial_rotary: honour `partial_rotary_factor` (only Phi-3's attention applies it)."""
        read = ConfigReader(hf, source)
        hidden, heads = read.positive_int("hidden_size"), read.positive_int("num_attention_heads")
        kv_heads = read.positive_int("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        head_dim = read.positive_int("head_dim", hidden // heads or 1)
        max_positions = read.positive_int("max_position_embeddings", 2048)
        rope, local_rope = read_ropes(read, head_dim, max_positions, partial_rotary)
        torch_dtype = hf.get("torch_dtype") or hf.get("dtype")
        num_layers = read.positive_int("num_hidden_layers")
        return cls(
            architecture=architecture,
            hidden_size=hidden,
            intermediate_size=read.positive_int("intermediate_size"),
            num_layers=num_layers,
            layer_types=(FULL_ATTENTION,) * num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=read.positive_int("vocab_size"),
            rms_norm_eps=read.positive_float("rms_norm_eps", 1e-6),
            rope=rope,
            local_rope=local_rope,
            max_position_embeddings=max_positions,
            tie_word_embeddings=read.boolean("tie_word_embeddings", False),
            hidden_act=read.activation("hidden_act", "silu"),
            torch_dtype=torch_dtype if isinstance(torch_dtype, str) else None,
        )


_REQUIRED = object()


class ConfigReader:
    """Typed reads of config.json values; a wrong type is a ConfigError naming key and value.
    A key that is absent or null takes its default (required keys have none)."""

    def __init__(self, hf: dict, source):
        self.hf, self.source = hf, source

    def _get(self, key, default):
        value = self.hf.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ConfigError(f"{self.source}: missing required key '{key}'")
            return default
        return value

    def positive_int(self, key, default=_REQUIRED) -> int:
        return self.integer(key, default, minimum=1)

    def integer(self, key, default=_REQUIRED, *, minimum: int) -> int:
        value = self._get(key, default)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
            raise ConfigError(f"{self.source}: {key}={value!r}; expected an integer >= {minimum}")
        return value

    def optional_positive_int(self, key) -> int | None:
        return None if self.hf.get(key) is None else self.positive_int(key)

    def positive_float(self, key, default=_REQUIRED) -> float:
        value = self._get(key, default)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")):
            raise ConfigError(f"{self.source}: {key}={value!r}; expected a positive finite number")
        return float(value)

    def optional_positive_float(self, key) -> float | None:
        return None if self.hf.get(key) is None else self.positive_float(key)

    def boolean(self, key, default) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.source}: {key}={value!r}; expected true or false")
        return value

    def activation(self, key, default) -> str:
        value = self._get(key, default)
        if value not in ACTIVATIONS:
            raise UnsupportedError(f"{self.source}: {key}={value!r}; supported: {', '.join(ACTIVATIONS)}")
        return value

    def layer_types(self, num_layers: int, default) -> tuple[str, ...]:
        """`layer_types` (one entry per layer), or `default` where config.json has none."""
        value = self.hf.get("layer_types")
        if value is None:
            return tuple(default)
        if not (isinstance(value, list) and len(value) == num_layers and all(isinstance(v, str) for v in value)):
            raise ConfigError(f"{self.source}: layer_types={value!r}; expected a list of {num_layers} layer types")
        unknown = sorted(set(value) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise UnsupportedError(f"{self.source}: layer_types {unknown} are not supported; "
                                   f"supported: {FULL_ATTENTION}, {SLIDING_ATTENTION}")
        return tuple(value)


def uniform_sliding_window(read: ConfigReader, num_layers: int) -> dict:
    """Mistral and Phi-3: `sliding_window`, when set, applies to every layer."""
    window = read.optional_positive_int("sliding_window")
    return {"sliding_window": window, "layer_types": (SLIDING_ATTENTION if window else FULL_ATTENTION,) * num_layers}


def read_ropes(read: ConfigReader, head_dim: int, max_positions: int, partial_rotary: bool) -> tuple[Rope, Rope | None]:
    """(RoPE of full-attention layers, RoPE of sliding layers if config.json gives them their own).

    Reads the newer `rope_parameters` dict that transformers 5 writes (nested per layer type for
    Gemma 3) or the older `rope_theta`/`rope_scaling` keys."""
    params = read.hf.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(FULL_ATTENTION), dict):
        local = params.get(SLIDING_ATTENTION)
        return (_rope(read, params[FULL_ATTENTION], head_dim, max_positions, partial_rotary),
                _rope(read, local, head_dim, max_positions, partial_rotary) if isinstance(local, dict) else None)
    if isinstance(params, dict):
        return _rope(read, params, head_dim, max_positions, partial_rotary), None
    scaling = read.hf.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(f"{read.source}: rope_scaling={scaling!r}; expected an object or null")
    return _rope(read, scaling or {}, head_dim, max_positions, partial_rotary), None


def _rope(read: ConfigReader, params: dict, head_dim: int, max_positions: int, partial_rotary: bool) -> Rope:
    where = f"{read.source} (rope parameters)"
    own = ConfigReader(params, where)
    theta = own.positive_float("rope_theta", read.positive_float("rope_theta", 10000.0))
    dim = head_dim
    if partial_rotary:
        fraction = own.positive_float("partial_rotary_factor", read.positive_float("partial_rotary_factor", 1.0))
        dim = int(head_dim * fraction)
        if fraction > 1 or dim < 2 or dim % 2:
            raise ConfigError(f"{where}: partial_rotary_factor={fraction} leaves {dim} of {head_dim} dims to rotate; "
                              f"expected an even number of at least 2")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return Rope(theta, dim)
    if kind not in SCALED_ROPES:
        raise UnsupportedError(f"{where}: rope_type {kind!r} is not supported; supported: default, "
                               f"{', '.join(SCALED_ROPES)}")
    scaling = {**params, "rope_type": kind}
    if kind in ("linear", "llama3"):
        own.positive_float("factor")
    else:
        # transformers lets a top-level original_max_position_embeddings win over the dict's.
        original = read.positive_int("original_max_position_embeddings",
                                     own.positive_int("original_max_position_embeddings", max_positions))
        scaling["original_max_position_embeddings"] = original
        scaling["factor"] = own.positive_float("factor", max_positions / original)
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            factors = params.get(key)
            if not (isinstance(factors, list) and len(factors) == dim // 2
                    and all(isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors)):
                raise ConfigError(f"{where}: {key} must list {dim // 2} positive numbers (one per rotated pair)")
    return Rope(theta, dim, scaling)
