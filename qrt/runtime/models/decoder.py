"""The decoder-only causal LM every family builds on: embeddings, a stack of DecoderLayers, the
final norm and lm_head, the rotary tables and the masks. Families override class attributes,
`read_config`, and the `embed`/`logits` ends."""

from dataclasses import replace

import torch
from torch import nn

from qrt.errors import UnsupportedError
from qrt.layers.linear import KV_SCALE_RENAMES, CheckpointNames, Linear
from qrt.layers.tensor_parallel import SINGLE, Parallelism

from .config import ModelConfig
from .layers import DecoderLayer, Embedding, RotaryEmbedding

# (fused parameter, checkpoint shard name, shard id): checkpoints store q/k/v and gate/up
# separately; qrt runs each group as one matmul.
SEPARATE_PROJECTIONS = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)


# (checkpoint prefix, parameter prefix) of a checkpoint saved as the base model, whose tensor
# names lack the `model.` prefix of the causal LM's (read only by a model without its head).
BASE_MODEL_NAMES = (("embed_tokens.", "model.embed_tokens."), ("layers.", "model.layers."), ("norm.", "model.norm."))


def _run_layer(layer, x, cos, sin, mask, positions, slots):
    return layer(x, cos, sin, mask, positions, slots)


# Under torch.compile, Dynamo traces the body once per distinct kind of layer and Inductor
# compiles it once; every layer of that kind then calls the same compiled code with its own
# weights and KV cache as inputs, so compile time does not grow with depth. Eagerly it is a no-op.
_run_layer_once = torch.compiler.nested_compile_region(_run_layer)


class DecoderModel(nn.Module):
    """The checkpoint's `model.` part."""

    def __init__(self, cfg: ModelConfig, scheme, dtype, layer_cls):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, cfg.parallel)
        self.layers = nn.ModuleList(layer_cls(cfg, i, scheme, dtype) for i in range(cfg.num_layers))
        self.norm = layer_cls.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class CausalLM(nn.Module):
    layer_cls = DecoderLayer
    # How checkpoint names map to parameters, before the ties this instance adds: the separate
    # projections stack, other exporters' names for the KV scales, and a derived buffer some save.
    checkpoint_layout = CheckpointNames(stacked=SEPARATE_PROJECTIONS, renamed=KV_SCALE_RENAMES,
                                        ignored_suffixes=("rotary_emb.inv_freq",))
    # Values the family's transformers config class assumes when config.json leaves a key out.
    config_defaults: dict = {}

    @classmethod
    def read_config(cls, hf_config: dict, source) -> ModelConfig:
        return ModelConfig.from_hf({**cls.config_defaults, **hf_config}, cls.__name__, source=source)

    def __init__(self, hf_config: dict, scheme, dtype, source="config.json", parallel: Parallelism = SINGLE):
        super().__init__()
        self.config = cfg = replace(self.read_config(hf_config, source), parallel=parallel)
        self.dtype = dtype
        self.model = DecoderModel(cfg, scheme, dtype, self.layer_cls)
        # Vocab-parallel: each rank computes the logits of its slice, gathered into the full row.
        self.lm_head = Linear(cfg.hidden_size, [cfg.vocab_size], bias=False, dtype=dtype,
                              method=scheme.method_for("lm_head"), parallel=parallel,
                              n_slices=[parallel.vocab(cfg.vocab_size)], gather_output=True)
        if cfg.tie_word_embeddings and self.lm_head.quant_method.stores_dense_weight:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.rope)
        self.local_rotary = None if cfg.local_rope is None else RotaryEmbedding(cfg.local_rope)
        self.sliding_window = cfg.sliding_window if any(layer.sliding for layer in self.model.layers) else None
        self.max_seq_len = 0
        self.max_batch_size = 0
        # A multi-token-prediction layer (models/mtp.py), where the family has one and a draft of
        # speculative method "mtp" asks for it (keep_prediction_layers).
        self.mtp = None
        # Set by the compiled build that compiles each distinct layer once (runtime/compiled.py);
        # the frozen whole-graph build inlines every layer instead.
        self.compile_layers_once = False

    def checkpoint_names(self) -> CheckpointNames:
        """How this model's checkpoint tensors map to its parameters (read by the loader)."""
        if self.lm_head is None:
            # Without the head (remove_lm_head): any lm_head tensors are not read, and a checkpoint
            # saved as the base model (transformers' `Qwen3Model`, `LlamaModel`) names its tensors
            # without the `model.` prefix.
            return replace(self.checkpoint_layout,
                           ignored_prefixes=(*self.checkpoint_layout.ignored_prefixes, "lm_head."),
                           moved=(*self.checkpoint_layout.moved, *BASE_MODEL_NAMES))
        tied = self.config.tie_word_embeddings
        weight = getattr(self.lm_head, "weight", None)  # stored formats (GPTQ) name theirs otherwise
        # A tied lm_head quantized online has its own weight, quantized from the embeddings as they stream in.
        untied = weight is not None and weight is not getattr(self.model.embed_tokens, "weight", None)
        return replace(self.checkpoint_layout, tied=("lm_head.weight",) if tied else (),
                       copies={"model.embed_tokens.weight": ("lm_head.weight",)} if tied and untied else {})

    def allocate_caches(self, max_batch_size: int, max_seq_len: int, kv_cache: bool = True) -> None:
        """Rotary tables and the static KV cache; called once the weights are materialized.
        kv_cache=False: the rotary tables only, for a model that only runs without the cache
        (an embedding model: hidden_states without positions)."""
        device = self.model.norm.weight.device  # (the embedding may hold no weight of its own: Embedding.share_rows_of)
        for rotary in (self.rotary, self.local_rotary):
            if rotary is not None:
                rotary.allocate(max_seq_len, self.dtype, device)
        layers = [*self.model.layers, *([self.mtp.block] if self.mtp is not None else [])] if kv_cache else []
        for layer in layers:
            layer.self_attn.allocate_cache(max_batch_size, max_seq_len, self.dtype, device)
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size

    def keep_prediction_layers(self) -> None:
        """Build the checkpoint's multi-token-prediction layer into this model (as `mtp`, before
        its weights are loaded), for speculative method "mtp". Families without one refuse."""
        raise UnsupportedError(f"{type(self).__name__} has no multi-token-prediction layers for speculative "
                               f"method 'mtp' (DeepSeek-V3 checkpoints have them); use 'ngram' or 'draft'")

    def remove_lm_head(self) -> None:
        """Drop the lm_head (before the weights are loaded): an embedding model reads only the
        final hidden states, and its checkpoint may have no head at all. `logits` then refuses."""
        self.lm_head = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)  # [B, T, D]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise UnsupportedError(f"{type(self).__name__} was built without its lm_head (an embedding model): "
                                   f"it gives hidden states, not logits")
        return self.lm_head(x).float()  # [B, T, V] fp32

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                keys: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, keep_hidden: bool = False):
        """input_ids: [B, T] int64.

        With positions ([B, T], each row its own) K/V go to the static cache, row b into cache
        row slots[b] ([B]; None: cache row b), and attention covers the cache entries `keys`
        ([S'] = 0..S'-1): attending only over the filled part saves reading the rest every step.
        Without positions, plain causal attention within input_ids (no cache).
        logits_at: [B], the one position of each row whose logits to return ([B, 1, V]);
        None: all of them. Returns float32 logits [B, T, V]; with keep_hidden, also the final
        hidden states of every position ([B, T, D], normed: `logits` turns them into logits), from
        which a prompt's own log-probabilities are scored."""
        hidden = self.hidden_states(input_ids, positions, keys, slots)  # [B, T, D]
        x = hidden
        if logits_at is not None:
            x = hidden.gather(1, logits_at.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1]))  # [B, 1, D]
        return (self.logits(x), hidden) if keep_hidden else self.logits(x)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      keys: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's hidden states [B, T, D] of input_ids [B, T] (the arguments as forward's):
        what the lm_head reads, and what an embedding model pools."""
        cached, mask, sliding_mask, rope, local_rope = self._attention_inputs(input_ids, positions, keys)
        # The residual stream is kept in fp32 whatever the model's dtype, as llama.cpp keeps it: a
        # layer's output (model dtype) is added to it in fp32, and each norm rounds what it hands
        # its layer to the model's dtype. A bf16 stream rounds every add; where a model holds a
        # value of hundreds in one channel and later cancels it (SmolLM2 does, after a lone space
        # token), those roundings (steps of 4 at 512) survive the cancellation and the next MLP
        # amplifies them (docs/quality.md).
        x = self.embed(input_ids).float()  # [B, T, D] fp32
        run_layer = _run_layer_once if self.compile_layers_once else _run_layer
        for layer in self.model.layers:
            cos, sin = local_rope if layer.sliding else rope
            x = run_layer(layer, x, cos, sin, sliding_mask if layer.sliding else mask, cached, slots)
        return self.model.norm(x)  # [B, T, D]

    def _attention_inputs(self, input_ids, positions, keys):
        """What every layer's attention takes (forward's doc): the positions K/V go to (None:
        no cache), the causal mask [B, T, S'] and the sliding one, the rotary tables."""
        seq = input_ids.shape[1]
        if positions is None:
            positions = torch.arange(seq, device=input_ids.device)[None]  # [1, T]
            keys, cached = positions[0], None
        else:
            cached = positions
        mask = keys[None, None, :] <= positions[:, :, None]  # [B, T, S'] causal, per row
        sliding_mask = mask
        if self.sliding_window is not None:
            sliding_mask = mask & (keys[None, None, :] > positions[:, :, None] - self.sliding_window)
        rope = self.rotary(positions)  # cos, sin: [B, 1, T, rot] each
        local_rope = rope if self.local_rotary is None else self.local_rotary(positions)
        return cached, mask, sliding_mask, rope, local_rope

    def predict(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                slots: torch.Tensor | None = None, logits_at: torch.Tensor | None = None):
        """The multi-token-prediction layer (`mtp`) over rows of (h_i, token i + 1): hidden
        [B, T, D] the model's final hidden states at positions [B, T] (each row its own, into its
        own cache row slots[b] as in forward; the layer's cache position i holds that pair),
        input_ids [B, T] the tokens after them. Returns float32 logits [B, T, V] of the token
        after each input token, and the layer's output [B, T, D], which fed back as `hidden` with
        a guess at the next position guesses further; with logits_at ([B]) both only at that
        place ([B, 1, ·])."""
        cached, mask, _, (cos, sin), _ = self._attention_inputs(input_ids, positions, keys)
        x = self.mtp(self.embed(input_ids), hidden, cos, sin, mask, cached, slots)  # [B, T, D]
        if logits_at is not None:
            x = x.gather(1, logits_at.view(-1, 1, 1).expand(-1, 1, x.shape[-1]))  # [B, 1, D]
        return self.logits(x), x
