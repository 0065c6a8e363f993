"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama): the plain CausalLM."""

from .decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    pass
