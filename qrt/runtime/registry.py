"""Hugging Face `architectures` name -> qrt model class."""

from qrt.errors import ConfigError, UnsupportedError

from .models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from .models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from .models.gpt_oss import GptOssForCausalLM
from .models.llama import LlamaForCausalLM
from .models.mistral import MistralForCausalLM
from .models.mixtral import MixtralForCausalLM
from .models.phi3 import Phi3ForCausalLM
from .models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from .models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM


class ModelRegistry:
    _models = {
        cls.__name__: cls
        for cls in (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, Phi3ForCausalLM,
                    Gemma2ForCausalLM, Gemma3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM,
                    DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, GptOssForCausalLM)
    }

    # transformers' base models (the decoder without its lm_head), as embedding checkpoints are
    # saved: the causal LM's class, built without the head (CausalLM.remove_lm_head).
    _base_models = {
        "LlamaModel": LlamaForCausalLM, "MistralModel": MistralForCausalLM, "Qwen2Model": Qwen2ForCausalLM,
        "Qwen3Model": Qwen3ForCausalLM, "Phi3Model": Phi3ForCausalLM, "Gemma2Model": Gemma2ForCausalLM,
        "MixtralModel": MixtralForCausalLM, "Qwen2MoeModel": Qwen2MoeForCausalLM, "Qwen3MoeModel": Qwen3MoeForCausalLM,
    }

    @classmethod
    def is_base_model(cls, hf_config: dict) -> bool:
        """Whether config.json names a base model (no lm_head) rather than a causal LM."""
        archs = hf_config.get("architectures") or []
        return not any(arch in cls._models for arch in archs) and any(arch in cls._base_models for arch in archs)

    @classmethod
    def supported(cls) -> list[str]:
        """Architecture names in the order they were added (most established first)."""
        return list(cls._models)

    @classmethod
    def resolve(cls, hf_config: dict, source="config.json"):
        archs = hf_config.get("architectures")
        if not archs or not isinstance(archs, list):
            raise ConfigError(f"{source}: no 'architectures' list; cannot tell which model this is")
        for arch in archs:
            if arch in cls._models:
                return cls._models[arch]
        for arch in archs:
            if arch in cls._base_models:
                return cls._base_models[arch]
        raise UnsupportedError(
            f"{source}: architecture {archs} is not supported; supported: {', '.join(cls.supported())}"
        )
