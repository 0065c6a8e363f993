"""The subset of a Hugging Face config.json that qrt's decoder models use, validated."""

from dataclasses import dataclass

from loaders.errors import ConfigError, UnsupportedError

_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


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
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    hidden_act: str
    torch_dtype: str | None

    @classmethod
    def from_hf(cls, hf: dict, architecture: str, *, qkv_bias: bool, source="config.json") -> "ModelConfig":
        missing = [key for key in _REQUIRED if key not in hf]
        if missing:
            raise ConfigError(f"{source}: missing required key(s) {missing} for {architecture}")
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedError(f"{source}: hidden_act={act!r}; {architecture} models support 'silu' only")
        rope_theta, rope_scaling = _rope_parameters(hf)
        return cls(
            architecture=architecture,
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(hf.get("head_dim") or hidden // heads),
            vocab_size=int(hf["vocab_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            hidden_act=act,
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
        )


def _rope_parameters(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either the older `rope_theta`/`rope_scaling` keys or the newer
    `rope_parameters` dict that transformers 5 writes."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = None if params.get("rope_type", "default") == "default" else params
        return theta, scaling
    scaling = hf.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(hf.get("rope_theta", 10000.0)), scaling
