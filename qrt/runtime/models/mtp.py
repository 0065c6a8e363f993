"""A multi-token-prediction layer (DeepSeek-V3's `num_nextn_predict_layers`): trained beside the
model to predict the token after next, it is a draft that costs one decoder layer a guess.

At position i it takes the model's final hidden state h_i (normed, as the model's lm_head reads it)
and the embedding of token i + 1, normalizes each, projects their concatenation back to the model's
width, runs one decoder layer of the model's own kind with a KV cache of its own, and normalizes
the result; the model's lm_head turns that into logits for token i + 2. Fed its own output and its
guess at the next position, it guesses further (as vLLM chains one layer).

The checkpoint stores it as decoder layer `num_hidden_layers` (`model.layers.N.`) with extra parts:
enorm, hnorm, eh_proj, shared_head.norm; and copies of the embedding and lm_head (shared_head.head),
which qrt does not load: the model's own serve instead (transformers' MtpModel ties them the same way).
"""

import torch
from torch import nn

from qrt.layers.linear import Linear


class MultiTokenPredictor(nn.Module):
    def __init__(self, cfg, index: int, scheme, dtype, layer_cls):
        """cfg: the model's config with layer `index` (this one) in its per-layer tables."""
        super().__init__()
        width = cfg.hidden_size
        self.enorm = layer_cls.norm_cls(width, cfg.rms_norm_eps, dtype)
        self.hnorm = layer_cls.norm_cls(width, cfg.rms_norm_eps, dtype)
        self.eh_proj = Linear(2 * width, [width], bias=False, dtype=dtype,
                              method=scheme.method_for(f"model.layers.{index}.eh_proj"))
        self.block = layer_cls(cfg, index, scheme, dtype)
        self.final_norm = layer_cls.norm_cls(width, cfg.rms_norm_eps, dtype)

    @staticmethod
    def checkpoint_moves(index: int) -> tuple:
        """(checkpoint prefix, parameter prefix) of its tensors, the first match applying, when the
        model holds it as `mtp`."""
        stored = f"model.layers.{index}."
        return ((f"{stored}enorm.", "mtp.enorm."), (f"{stored}hnorm.", "mtp.hnorm."),
                (f"{stored}eh_proj.", "mtp.eh_proj."), (f"{stored}shared_head.norm.", "mtp.final_norm."),
                (stored, "mtp.block."))

    @staticmethod
    def shared_copies(index: int) -> tuple:
        """Checkpoint prefixes of its copies of the model's embedding and lm_head."""
        return f"model.layers.{index}.embed_tokens.", f"model.layers.{index}.shared_head.head."

    def forward(self, embedded, hidden, cos, sin, mask, positions, slots):
        """embedded: token i + 1's embedding, hidden: h_i, each [B, T, D] -> [B, T, D], normed."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.final_norm(self.block(x, cos, sin, mask, positions, slots))
