"""The subset of a Hugging Face config.json that qrt's decoder models use, validated."""

from dataclasses import dataclass

from loaders.errors import ConfigError, UnsupportedError

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
        read = _Reader(hf, source)
        hidden, heads = read.positive_int("hidden_size"), read.positive_int("num_attention_heads")
        kv_heads = read.positive_int("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedError(f"{source}: hidden_act={act!r}; {architecture} models support 'silu' only")
        rope_theta, rope_scaling = _rope_parameters(hf, read)
        torch_dtype = hf.get("torch_dtype") or hf.get("dtype")
        return cls(
            architecture=architecture,
            hidden_size=hidden,
            intermediate_size=read.positive_int("intermediate_size"),
            num_layers=read.positive_int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=read.positive_int("head_dim", hidden // heads or 1),
            vocab_size=read.positive_int("vocab_size"),
            rms_norm_eps=read.positive_float("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=read.positive_int("max_position_embeddings", 2048),
            tie_word_embeddings=read.boolean("tie_word_embeddings", False),
            qkv_bias=qkv_bias,
            hidden_act=act,
            torch_dtype=torch_dtype if isinstance(torch_dtype, str) else None,
        )


_REQUIRED = object()


class _Reader:
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
        value = self._get(key, default)
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ConfigError(f"{self.source}: {key}={value!r}; expected a positive integer")
        return value

    def positive_float(self, key, default) -> float:
        value = self._get(key, default)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")):
            raise ConfigError(f"{self.source}: {key}={value!r}; expected a positive finite number")
        return float(value)

    def boolean(self, key, default) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.source}: {key}={value!r}; expected true or false")
        return value


def _rope_parameters(hf: dict, read: _Reader) -> tuple[float, dict | None]:
    """(theta, scaling) from either the older `rope_theta`/`rope_scaling` keys or the newer
    `rope_parameters` dict that transformers 5 writes."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta = _Reader(params, f"{read.source} (rope_parameters)").positive_float(
            "rope_theta", read.positive_float("rope_theta", 10000.0))
        scaling = None if params.get("rope_type", "default") == "default" else params
        return theta, scaling
    scaling = hf.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(f"{read.source}: rope_scaling={scaling!r}; expected an object or null")
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return read.positive_float("rope_theta", 10000.0), scaling
