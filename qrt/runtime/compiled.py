"""`compile_model` and the CompiledModel it returns: a graph runner (graph_runner.py) with a
tokenizer, request checks and generate through the engine."""

import os
from pathlib import Path

import torch

from qrt.checkpoint.config import DeviceConfig, LoadConfig
from qrt.checkpoint.hub import locate
from qrt.checkpoint.loader import load_model
from qrt.checkpoint.tokenizer import eos_token_ids
from qrt.layers.prepack import prepack_cpu_weights

from . import embedding, reasoning, structured
from .chat_template import max_render_chars, render_chat
from .compile_cache import CompileCache, checkpoint_identity, entry_key, use_qrt_inductor_dir
from .distributed import rank_device, tensor_parallel
from .engine import Engine, Request
from .graph_runner import GraphRunner
from .huge_pages import place_weights_in_huge_pages
from .isa_probe import remember_isa_probes
from .logprobs import check_top
from .lora import (DEFAULT_MAX_LORA_RANK, LoraSet, UnknownAdapter, check_unsupported_build, lora_adapters,
                   targets_of)
from .malloc import map_large_allocations
from .mtp_graphs import PredictionGraphs
from .pooling import Pooling, choose_pooling
from .registry import ModelRegistry
from .resolve import resolve
from .sampling import SamplingParams
from .speculative import SpeculativeConfig

DEFAULT_MAX_SEQ_LEN = 2048
# "regional": each distinct decoder layer compiled once, weights as graph inputs (prepacked by
# the loader on the CPU), graphs cached by qrt. "frozen": the earlier whole-model build with
# Inductor freezing (weights as constants, optionally autotuned GEMMs), kept for comparison.
BUILDS = ("regional", "frozen")


def compile_model(
    path=None,
    quant: str | None = None,
    *,
    device: str = "cpu",
    dtype: torch.dtype | str | None = None,
    max_seq_len: int | None = None,
    max_batch_size: int = 1,
    load_config: LoadConfig | None = None,
    device_config: DeviceConfig | None = None,
    compile: bool = True,
    warmup: bool = True,
    build: str | None = None,
    autotune: bool | None = None,
    cache: bool = True,
    progress: bool = True,
    tp: int = 1,
    speculative: dict | SpeculativeConfig | None = None,
    revision: str | None = None,
    lazy_prefill: int = 0,
    pooling: str | Pooling | None = None,
    lora: dict | None = None,
    max_loras: int | None = None,
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
    lora_targets=None,
) -> "CompiledModel":
    """Load a Hugging Face checkpoint, quantize or repack it, and compile it.

    path: a checkpoint folder (config.json + safetensors [+ tokenizer]), a .gguf file, or a Hugging
    Face Hub id ("ORG/NAME", or "ORG/NAME:FILE.gguf" / "ORG/NAME:Q4_K_M" for a GGUF repository)
    fetched into the Hugging Face cache (HF_HOME, HF_HUB_OFFLINE, HF_TOKEN apply); None: the
    default model. A local path that exists always wins over a hub id.
    revision: the hub id's branch, tag or commit (default: main).
    quant: None to run weights as stored, or an online format ("fp8") for a bf16/fp16 checkpoint.
    compile=False runs eagerly with the reference ops (the numerical oracle).
    warmup compiles prefill and decode now (and says how long it took) instead of on first use.
    build: "regional" (default, or $QRT_BUILD): each distinct decoder layer is compiled once and
    the graphs are cached by qrt (`cache`), so a second start loads them instead of compiling;
    "frozen": the older whole-model build with Inductor freezing, slower to start, not cached.
    autotune (frozen build, CPU): let Inductor time its GEMM implementations for each matmul of
    the decode graph while compiling. None: on for the frozen build unless QRT_AUTOTUNE=0.
    cache: look up and store the compiled graphs in qrt's compile cache ($QRT_CACHE_DIR/compiled).
    tp: tensor parallelism over that many ranks, one process each (started by torchrun; call
    compile_model in every one). Each rank loads only its part of the weights; only rank 0 reports
    progress; every rank returns the same tokens.
    speculative: speculative decoding for every request of `generate`, `generate_batch` and the
    engine, e.g. {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
    "prompt_lookup_min": 2}, or {"method": "draft", "model": PATH, "quant": "int4",
    "num_speculative_tokens": 3} (vLLM's names; runtime/speculative.py). A draft is compiled here
    with this model's slots and cache length, and must share its tokenizer. {"method": "mtp"}
    guesses with the checkpoint's own multi-token-prediction layer (DeepSeek-V3). Greedy output
    is unchanged; sampled output keeps its distribution.
    lazy_prefill: prompts (and prompt chunks) of up to this many tokens run through the decode
    graph, a token a step, and the prefill graph is compiled only when a longer one comes: a
    one-off generate of a short prompt then compiles one graph instead of two (`qrt generate`
    uses 64). 0: prefill graph for every prompt, compiled by warmup.
    pooling: make it an embedding model (`CompiledModel.embed`): "last" (the last token's final
    hidden state) or "mean" (the mean over the tokens), L2-normalized, or a
    `qrt.runtime.pooling.Pooling(kind, normalize)`. None: as the checkpoint folder's
    sentence-transformers files say (modules.json, 1_Pooling/config.json), else not an embedding
    model. An embedding model is built without its lm_head (its checkpoint may have none, as a
    base model saved as `Qwen3Model` has not) and compiles only its encode graphs (a batch, and
    a lone text): it embeds, it does not generate.
    lora: LoRA adapters to serve beside the model, {name: folder or hub id} of PEFT adapters
    (runtime/lora.py); a request picks one by name (`generate(..., lora=name)`), rows with
    different adapters share a step, and adapters load and unload later (`load_lora`,
    `unload_lora`) without recompiling. max_loras: adapters resident at once (default: as many as
    `lora` names, at least 1; a model with no adapters yet gets slots with max_loras=N).
    max_lora_rank: the largest rank an adapter may have. lora_targets: the module names
    (transformers', e.g. ["q_proj", "v_proj"], or "all-linear") that hold adapter slots; default:
    those the given adapters adapt, else the attention and MLP projections.
    """
    build = build or os.environ.get("QRT_BUILD") or "regional"
    if build not in BUILDS:
        raise ValueError(f"build={build!r}; choose one of {list(BUILDS)}")
    if autotune and build != "frozen":
        raise ValueError("autotune=True needs build='frozen': Inductor autotunes GEMMs only on frozen "
                         "weights, and the regional build runs the loader's prepacked GEMMs instead")
    if autotune is None:
        autotune = build == "frozen" and os.environ.get("QRT_AUTOTUNE", "1") != "0"
    speculative = SpeculativeConfig.parse(speculative)
    map_large_allocations()
    if compile:
        remember_isa_probes()
    parallel = tensor_parallel(tp, torch.device(device_config.device if device_config else device))
    progress = progress and parallel.rank == 0
    if parallel.sharded:
        device = rank_device(torch.device(device), parallel)
    load_config = load_config or LoadConfig(progress=progress)
    device_config = device_config or DeviceConfig(device=device, dtype=dtype)
    resolved = resolve(path, quant, load_config, revision=revision, progress=progress)
    path, checkpoint, hf_config = resolved.path, resolved.checkpoint, resolved.hf_config
    model_cls, scheme = resolved.model_cls, resolved.scheme
    # sentence-transformers files are read from a checkpoint folder only (a GGUF's folder is anyone's).
    folder = checkpoint.folder if Path(checkpoint.config_path).name == "config.json" else None
    pooling = choose_pooling(pooling, folder, ModelRegistry.is_base_model(hf_config), checkpoint.config_path)
    if pooling is not None and speculative is not None:
        raise ValueError("an embedding model does not generate, so it takes no speculative decoding")
    mtp = speculative is not None and speculative.method == "mtp"
    if mtp and compile and build != "regional":
        raise ValueError("speculative method 'mtp' needs build='regional'")
    model = load_model(model_cls, checkpoint, scheme, load_config, device_config, parallel, prediction_layers=mtp,
                       lm_head=pooling is None)
    if compile and build == "regional":
        prepack_cpu_weights(model)
    place_weights_in_huge_pages(model)
    limit = model.config.max_position_embeddings
    max_seq_len = min(max_seq_len or DEFAULT_MAX_SEQ_LEN, limit)
    model.allocate_caches(max_batch_size, max_seq_len, kv_cache=pooling is None)
    adapters = lora_adapters(lora, progress)
    lora_set = None
    if adapters or max_loras:
        if pooling is not None:
            raise ValueError("an embedding model takes no LoRA adapters")
        if compile:
            check_unsupported_build(build)
        lora_set = LoraSet.attach(model, max_loras or max(len(adapters), 1), max_lora_rank,
                                  lora_targets or targets_of(adapters.values(), model))
        for name, adapter in adapters.items():
            lora_set.add(name, adapter)
    tokenizer = checkpoint.load_tokenizer()
    compile_cache = None
    if compile and cache and build == "regional":
        weights = load_config.load_format != "dummy"
        key, parts = entry_key({
            "checkpoint": checkpoint_identity(checkpoint.identity_files(with_weights=weights)),
            "load_format": load_config.load_format, "quant": scheme.describe(), "device": str(device_config.device),
            "kernel_device": str(device_config.kernel_device), "dtype": str(next(model.parameters()).dtype), "max_seq_len": max_seq_len,
            "max_batch_size": max_batch_size, "build": build, "model": model_cls.__name__,
            "tp": parallel.size, "rank": parallel.rank,
            "verify_width": speculative.width if speculative else None,
            # Method "mtp" loads the prediction layer, and the step graphs return hidden states too.
            **({"prediction_layer": True} if mtp else {}),
            # An embedding model has no lm_head, and its graphs are the encode ones.
            **({"embedding": True} if pooling is not None else {}),
            # Adapter slots are buffers the graphs read (their contents are not part of the key).
            **({"lora": lora_set.describe()} if lora_set is not None else {}),
        })
        compile_cache = CompileCache(key, parts)
        use_qrt_inductor_dir()
    compiled = CompiledModel(model, tokenizer, scheme, eos_token_ids(checkpoint.folder, hf_config, tokenizer),
                             compile=compile, build=build, autotune=autotune, progress=progress,
                             source=Path(path), compile_cache=compile_cache, speculative=speculative,
                             lazy_prefill=lazy_prefill, pooling=pooling)
    compiled.lora = lora_set
    if speculative is not None and speculative.method == "draft":
        if parallel.sharded:
            raise ValueError("speculative method 'draft' does not run under tensor parallelism yet; use 'ngram'")
        compiled.draft = _compile_draft(speculative, compiled, path, quant, compile=compile, warmup=warmup,
                                        build=build, cache=cache, progress=progress, lazy_prefill=lazy_prefill)
    if mtp:
        compiled.mtp = PredictionGraphs(compiled)
    if compile and warmup:
        compiled.warmup()
        if mtp:
            compiled.mtp.warmup()
    return compiled


def _compile_draft(spec: SpeculativeConfig, target: "CompiledModel", target_path, target_quant, **kwargs):
    """The draft model of `spec`, with the target's slots and cache length, checked to share its
    tokenizer."""
    if spec.model is None:
        from .default_model import default_model_path

        draft_path = default_model_path(progress=False)
    else:
        draft_path = locate(spec.model, progress=False)
    if Path(draft_path).resolve() == Path(target_path).resolve() and spec.quant == target_quant:
        raise ValueError("speculative draft: the draft is the model's own checkpoint with the same quant, so it "
                         "would be the model again; give it a 'quant' (such as 'int4') or another 'model'")
    draft = compile_model(draft_path, quant=spec.quant, device=str(target.device), max_seq_len=target.max_seq_len,
                          max_batch_size=target.max_batch_size, **kwargs)
    where = f"speculative draft {spec.model or 'default model'}"
    if draft.max_seq_len < target.max_seq_len:
        raise ValueError(f"{where}: it holds {draft.max_seq_len} positions, the model {target.max_seq_len}; "
                         f"pass a smaller max_seq_len")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{where}: its vocabulary has {draft.vocab_size} tokens, the model's {target.vocab_size}; "
                         f"a draft must share the model's tokenizer")
    if (draft.tokenizer is not None and target.tokenizer is not None
            and draft.tokenizer.get_vocab() != target.tokenizer.get_vocab()):
        raise ValueError(f"{where}: its tokenizer maps tokens to other ids than the model's; a draft must share "
                         f"the model's tokenizer")
    return draft


class CompiledModel(GraphRunner):
    """A loaded model with compiled graphs (its GraphRunner), its tokenizer, and `generate` through
    the continuous-batching engine."""

    def __init__(self, model, tokenizer, scheme, eos_ids: set[int], pooling: Pooling | None = None,
                 **runner_options):
        """runner_options: GraphRunner's (compile, progress, source, build, the compile cache, ...).
        pooling: an embedding model's (pooling.py); None: a model that generates."""
        super().__init__(model, quant_description=scheme.describe(), encoder=pooling is not None, **runner_options)
        self.pooling = pooling
        self.tokenizer = tokenizer
        self.scheme = scheme
        self.eos_ids = eos_ids
        self._engine: Engine | None = None

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: LongTensor [B, T] -> float32 logits [B, T, vocab]. No KV cache involved."""
        self._check_generates()
        input_ids = self._check_ids(input_ids, allow_batch=True)
        if input_ids.shape[1] > self.max_seq_len:
            raise ValueError(f"sequence of {input_ids.shape[1]} tokens exceeds max_seq_len={self.max_seq_len}")
        input_ids = input_ids.to(self.device)
        if self.lora is not None:  # the full-sequence forward runs the base alone
            if input_ids.shape[0] > len(self.lora.rows):
                raise ValueError(f"a model with LoRA slots runs at most max_batch_size={len(self.lora.rows)} rows "
                                 f"in one call, got {input_ids.shape[0]}")
            self.lora.route("forward", {})
        if input_ids.shape[1] >= 2:  # one graph for every length (Dynamo specializes length 1)
            torch._dynamo.mark_dynamic(input_ids, 1, min=2, max=self.max_seq_len)
        return self._run("forward", input_ids)

    def embed(self, inputs, *, dimensions: int | None = None) -> torch.Tensor:
        """An embedding model's vectors: float32 [N, D] (D: hidden size, or `dimensions`) of a
        string, a list of strings, a list of token ids or a list of token-id lists (N inputs;
        a single string or id list gives N = 1), each pooled from its own final hidden states
        (causal attention over its own tokens; batched with the others). dimensions: keep the
        first d values, normalized again (Matryoshka), where the pooling normalizes."""
        if self.pooling is None:
            raise ValueError(f"{self.source} is not an embedding model: its folder has no sentence-transformers "
                             f"pooling (modules.json); pass pooling='last' or 'mean' to compile_model")
        self.pooling.check_dimensions(dimensions, self.model.config.hidden_size)
        vectors = embedding.embed_rows(self, embedding.token_rows(self, inputs))
        return self.pooling.shorten(vectors, dimensions)

    def _check_generates(self) -> None:
        if self.pooling is not None:
            raise ValueError(f"{self.source} is an embedding model, built without its lm_head: it embeds (embed, "
                             f"POST /v1/embeddings) and does not generate")

    @property
    def engine(self) -> Engine:
        """The continuous-batching engine over this model's KV-cache slots (made on first use)."""
        if self._engine is None:
            self._engine = Engine(self)
        return self._engine

    def generate(self, prompt, max_new_tokens: int = 64, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 chat: bool = False, stop_at_eos: bool = True, stop: list[str] | tuple[str, ...] = (), stream=None,
                 lora: str | None = None):
        """str in -> str out (the new text); token ids (list or 1-D tensor) in -> new ids out.

        chat=True wraps a str prompt in the tokenizer's chat template as one user turn, and returns
        the answer's text whole (a reasoning model's reasoning in it; `chat` gives it apart).
        stop: strings that end the output where they first appear (not included in the text).
        stream: optional callable receiving each new token id as it is produced.
        lora: the name of a loaded LoRA adapter to run with (None: the base model).
        One request through the same engine the server batches requests with.
        """
        text_in = isinstance(prompt, str)
        ids = self.encode(prompt, chat) if text_in else prompt
        seq = self._run_one(ids, max_new_tokens, SamplingParams(temperature, top_k, top_p, seed), text_in,
                            stop_at_eos=stop_at_eos, stop=stop, stream=stream, lora=lora)
        return seq.text if text_in else seq.tokens

    def chat(self, conversation, max_new_tokens: int = 256, *, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, stop: list[str] | tuple[str, ...] = (),
             stream=None, lora: str | None = None, template_variables: dict | None = None) -> reasoning.ChatAnswer:
        """The assistant's answer to a conversation in the chat template: a str (one user turn) or
        messages ([{"role", "content"}, …]). A reasoning model's reasoning (<think> blocks,
        gpt-oss's analysis channel) comes back apart from its content, as `qrt serve` returns them;
        template_variables: what the template reads beside the messages (reasoning_effort, …).
        stream: optional callable receiving each new token id."""
        messages = [{"role": "user", "content": conversation}] if isinstance(conversation, str) else list(conversation)
        ids = self.encode_messages(messages, template_variables=template_variables)
        seq = self._run_one(ids, max_new_tokens, SamplingParams(temperature, top_k, top_p, seed), True, stop=stop,
                            stream=stream, lora=lora)
        split = reasoning.split_for(reasoning.parser_for(self.tokenizer.chat_template), self.tokenizer, ids)
        thought, content = split.whole(seq.tokens, seq.text)
        return reasoning.ChatAnswer(content, thought, seq.tokens)

    def _run_one(self, ids, max_new_tokens: int, sampling: SamplingParams, text: bool, *, stop_at_eos: bool = True,
                 stop=(), stream=None, lora=None):
        """One request through the engine, run to its end: its finished sequence."""
        ids = self._check_ids(torch.as_tensor(ids, dtype=torch.long).reshape(1, -1), allow_batch=False)
        request = self.request(ids[0].tolist(), max_new_tokens, sampling, stop_at_eos=stop_at_eos,
                               stop_strings=tuple(stop), text=text, lora=lora)

        def listener(update):
            if stream is not None and update.token is not None:
                stream(update.token)

        seq = self.engine.submit(request, listener)
        self._run_engine([seq])
        return seq

    def generate_batch(self, prompts, max_new_tokens: int = 64, *, temperature: float = 0.0,
                       top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                       stop_at_eos: bool = True, stream=None, lora=None) -> list[list[int]]:
        """Continue several token-id prompts (of any lengths) together, batched by the engine.
        Returns each prompt's new ids (a row stops at its EOS).
        lora: one LoRA adapter's name for every prompt, or a list of one per prompt (None: the base).

        At most `max_batch_size` prompts run at once (compile_model's argument: the KV cache
        holds that many sequences); more wait for a free slot.
        stream: optional callable receiving (row, token id) as each row's new token is produced."""
        params = SamplingParams(temperature, top_k, top_p, seed)
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("generate_batch takes a non-empty list of token-id lists")
        adapters = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"lora= lists {len(adapters)} adapters for {len(prompts)} prompts")
        requests = []
        for prompt, adapter in zip(prompts, adapters):
            ids = self._check_ids(torch.as_tensor(prompt, dtype=torch.long).reshape(1, -1), allow_batch=False)
            requests.append(self.request(ids[0].tolist(), max_new_tokens, params, stop_at_eos=stop_at_eos,
                                         lora=adapter))

        def listener(row: int):
            def on_update(update):
                if update.token is not None:
                    stream(row, update.token)
            return on_update

        sequences = [self.engine.submit(r, listener(row) if stream else None) for row, r in enumerate(requests)]
        self._run_engine(sequences)
        return [seq.tokens for seq in sequences]

    def request(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams, *, stop_at_eos: bool = True,
                stop_ids=(), stop_strings: tuple[str, ...] = (), text: bool = False, logprobs: int | None = None,
                prompt_logprobs: int | None = None, grammar: str | None = None, lora: str | None = None) -> Request:
        """An engine Request, checked against this model: ids in the vocabulary, prompt +
        max_tokens within the KV cache, stop strings needing a tokenizer. logprobs /
        prompt_logprobs: score the new tokens / the prompt's, with that many alternatives
        (None: off); only a request that scores its prompt may generate nothing (max_tokens 0).
        grammar: structured output (structured.py), checked here. lora: a loaded adapter's name."""
        self._check_generates()
        if lora is not None:
            self.check_lora(lora)
        check_top(logprobs, "logprobs")
        check_top(prompt_logprobs, "prompt_logprobs")
        least = 0 if prompt_logprobs is not None else 1
        if not (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= least):
            raise ValueError(f"max_new_tokens must be an integer >= {least}, got {max_tokens!r}"
                             + (" (0 only when the prompt is scored)" if least else ""))
        if not prompt_ids:
            raise ValueError("the prompt is empty; give at least one token")
        if len(prompt_ids) + max_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_tokens}) exceeds the KV "
                f"cache of {self.max_seq_len} tokens; shorten the prompt, lower max_new_tokens, or "
                f"pass a larger max_seq_len to compile_model"
            )
        if (stop_strings or text) and self.tokenizer is None:
            raise ValueError(f"{self.source} has no usable tokenizer, so stop strings and text output cannot be used")
        stops = frozenset(stop_ids) | (frozenset(self.eos_ids) if stop_at_eos else frozenset())
        if grammar is not None:
            structured.check(grammar)
        return Request(tuple(prompt_ids), max_tokens, sampling, stops, tuple(stop_strings), text, logprobs,
                       prompt_logprobs, grammar, lora)

    # ---- LoRA adapters (lora.py) -------------------------------------------------------------------
    def check_lora(self, name: str) -> None:
        """Raise lora.UnknownAdapter (or a ValueError without LoRA slots) unless `name` is loaded."""
        if self.lora is None:
            raise ValueError(f"LoRA adapter {name!r} asked of a model compiled without LoRA slots; pass "
                             f"lora={{name: path}} or max_loras=N to compile_model")
        if name not in self.lora.residents:
            raise UnknownAdapter(name, sorted(self.lora.residents))

    def load_lora(self, name: str, path) -> None:
        """Load the PEFT adapter at `path` (a folder or hub id) into a free slot as `name`; no recompile."""
        if self.lora is None:
            raise ValueError("this model was compiled without LoRA slots; pass max_loras=N to compile_model")
        self.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Drop adapter `name`; requests running with it finish with it."""
        if self.lora is None:
            raise UnknownAdapter(name, [])
        self.lora.unload(name)

    @property
    def lora_names(self) -> list[str]:
        return [] if self.lora is None else sorted(self.lora.residents)

    def _run_engine(self, sequences) -> None:
        """Step the engine until `sequences` are done; raise the first one's error, if any."""
        try:
            self.engine.run(sequences)
        except BaseException:
            for seq in sequences:  # e.g. KeyboardInterrupt: leave no request holding a slot
                seq.cancel()
            self.engine.step()
            raise
        for seq in sequences:
            if seq.error is not None:
                raise seq.error

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of `text`; chat=True wraps it in the chat template as one user turn."""
        if self.tokenizer is None:
            raise ValueError(
                f"{self.source} has no usable tokenizer (tokenizer.json / tokenizer_config.json), "
                f"so text prompts cannot be encoded; pass token ids instead"
            )
        if not text:
            raise ValueError("the prompt is empty; give at least one token of text")
        if chat:
            return self.encode_messages([{"role": "user", "content": text}])
        return self.tokenizer.encode(text)

    def encode_messages(self, messages: list[dict], tools: list[dict] | None = None,
                        template_variables: dict | None = None) -> list[int]:
        """Token ids of a conversation ([{"role", "content"}, …]) in the tokenizer's chat template,
        ending with the prompt for the assistant's turn; `tools` (OpenAI's JSON) as the template
        shows them to the model; `template_variables` (such as reasoning_effort) for templates that
        read them."""
        if self.tokenizer is None:
            raise ValueError(f"{self.source} has no usable tokenizer, so chat messages cannot be encoded")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.source}: the tokenizer has no chat template; use the completions "
                             f"endpoint (or generate without chat=True)")
        # The template is the checkpoint's code: rendered in a sandbox with limits on its size, its
        # output and its time (chat_template.py), as transformers' apply_chat_template would render it.
        text = render_chat(self.tokenizer, messages, tools, max_render_chars(self.max_seq_len), self.source,
                           template_variables)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _check_ids(self, ids: torch.Tensor, allow_batch: bool) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError("input_ids must be an integer tensor of token ids")
        if ids.dim() != 2 or ids.shape[1] == 0 or ids.shape[0] == 0:
            raise ValueError(f"input_ids must be [batch, tokens] with at least one token, got shape {list(ids.shape)}")
        if not allow_batch and ids.shape[0] != 1:
            raise ValueError("generate takes one prompt at a time")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}); got values from {low} to {high}")
        return ids.long()
