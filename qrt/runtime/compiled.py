"""`compile_model` and the CompiledModel it returns: forward and generate over compiled graphs."""

import contextlib
import itertools
import os
import pickle
import sys
import time
import types
from pathlib import Path

import torch
from torch._inductor import config as inductor_config
from torch.compiler._cache import CacheArtifactManager

from qrt.checkpoint.config import DeviceConfig, LoadConfig
from qrt.checkpoint.loader import load_model
from qrt.checkpoint.tokenizer import eos_token_ids
from qrt.layers.prepack import prepack_cpu_weights
from qrt.passes.backend import QrtBackend, aot_supported, load_artifact

from . import structured
from .compile_cache import (CompileCache, checkpoint_identity, entry_key, last_cold_compile_seconds,
                            use_qrt_inductor_dir)
from .direct_graph import DirectGraph, GraphSpec
from .distributed import rank_device, tensor_parallel
from .engine import Engine, Request
from .isa_probe import remember_isa_probes
from .logprobs import check_top
from .malloc import map_large_allocations
from .prefix_cache import PrefixCache
from .resolve import resolve
from .sampling import SamplingParams
from .speculative import SpeculativeConfig

DEFAULT_MAX_SEQ_LEN = 2048
# "regional": each distinct decoder layer compiled once, weights as graph inputs (prepacked by
# the loader on the CPU), graphs cached by qrt. "frozen": the earlier whole-model build with
# Inductor freezing (weights as constants, optionally autotuned GEMMs), kept for comparison.
BUILDS = ("regional", "frozen")
# The progress line's estimate of a cold compile when no earlier one on this device is on record.
_FIRST_COMPILE_GUESS_S = 20
_model_numbers = itertools.count()  # names each CompiledModel's functions apart (see own_copy)


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
) -> "CompiledModel":
    """Load a Hugging Face checkpoint folder, quantize or repack it, and compile it.

    path: a checkpoint folder (config.json + safetensors [+ tokenizer]) or a .gguf file;
    None: the default model.
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
    with this model's slots and cache length, and must share its tokenizer. Greedy output is
    unchanged; sampled output keeps its distribution.
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
    resolved = resolve(path, quant, load_config, progress=progress)
    path, checkpoint, hf_config = resolved.path, resolved.checkpoint, resolved.hf_config
    model_cls, scheme = resolved.model_cls, resolved.scheme
    model = load_model(model_cls, checkpoint, scheme, load_config, device_config, parallel)
    if compile and build == "regional":
        prepack_cpu_weights(model)
    limit = model.config.max_position_embeddings
    max_seq_len = min(max_seq_len or DEFAULT_MAX_SEQ_LEN, limit)
    model.allocate_caches(max_batch_size, max_seq_len)
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
        })
        compile_cache = CompileCache(key, parts)
        use_qrt_inductor_dir()
    compiled = CompiledModel(model, tokenizer, scheme, eos_token_ids(checkpoint.folder, hf_config, tokenizer),
                             compile=compile, build=build, autotune=autotune, progress=progress,
                             source=Path(path), compile_cache=compile_cache, speculative=speculative)
    if speculative is not None and speculative.method == "draft":
        if parallel.sharded:
            raise ValueError("speculative method 'draft' does not run under tensor parallelism yet; use 'ngram'")
        compiled.draft = _compile_draft(speculative, compiled, path, quant, compile=compile, warmup=warmup,
                                        build=build, cache=cache, progress=progress)
    if compile and warmup:
        compiled.warmup()
    return compiled


def _compile_draft(spec: SpeculativeConfig, target: "CompiledModel", target_path, target_quant, **kwargs):
    """The draft model of `spec`, with the target's slots and cache length, checked to share its
    tokenizer."""
    if spec.model is None:
        from .default_model import default_model_path

        draft_path = default_model_path(progress=False)
    else:
        draft_path = spec.model
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


def _prefill(model, input_ids, positions, keys, slots, logits_at):
    return model(input_ids, positions, keys, slots, logits_at, keep_hidden=True)


def _decode(model, input_ids, positions, keys):  # also the verify graph: k + 1 tokens per slot
    return model(input_ids, positions, keys)


def _one_slot(model, input_ids, positions, keys, slots):
    return model(input_ids, positions, keys, slots)


# The tensors of each step graph, by name, in the order they are passed.
_GRAPH_INPUTS = {"prefill": ("input_ids", "positions", "keys", "slots", "logits_at"),
                 "decode": ("input_ids", "positions", "keys"), "verify": ("input_ids", "positions", "keys"),
                 "decode_slot": ("input_ids", "positions", "keys", "slots"),
                 "verify_slot": ("input_ids", "positions", "keys", "slots")}
# The dims whose sizes vary between calls of a role's graph (from 2: Dynamo specializes 0 and 1).
_DYNAMIC_DIMS = {"prefill": (("input_ids", 1), ("positions", 1), ("keys", 0)),
                 **{role: (("keys", 0),) for role in ("decode", "decode_slot", "verify", "verify_slot")}}
# The dynamic sizes in words, for a direct call's errors, by where they appear first.
_SIZE_NAMES = {("input_ids", 1): "chunk length", ("keys", 0): "attended length"}


def _forward(model, input_ids):
    return model(input_ids)


def own_copy(fn, name: str):
    """A copy of `fn` with its own code object and name. Dynamo keeps its compiled-graph cache on
    the code object, so each CompiledModel gets a cache of its own: a second model is then neither
    a recompile of the first nor pushes it out of the cache. Its record of which sizes changed
    between calls ("automatic dynamic") is kept per function name, so the name is unique too:
    otherwise a second model with another head size would get that size traced as dynamic."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name)


class CompiledModel:
    """A loaded model with compiled prefill, decode and full-sequence forward graphs."""

    def __init__(self, model, tokenizer, scheme, eos_ids: set[int], *, compile: bool, progress: bool, source,
                 build: str = "regional", autotune: bool = False, compile_cache: CompileCache | None = None,
                 speculative: SpeculativeConfig | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.scheme = scheme
        self.eos_ids = eos_ids
        self.source = Path(source)
        self.progress = progress
        self.device = next(model.parameters()).device
        self.parallel = model.config.parallel
        self.vocab_size = model.config.vocab_size
        self.max_seq_len = model.max_seq_len
        self.max_batch_size = model.max_batch_size  # KV-cache slots
        self.build = build
        self.compile_cache = compile_cache
        self.speculative = speculative
        self.draft: CompiledModel | None = None  # the draft model of speculative method "draft"
        # Whether the graphs of one slot alone give the same bits as that slot's row of the graphs
        # of every slot (warmup checks it): then the engine may run one decoding request through
        # them without changing its tokens. True with qrt's CPU kernels, whose rows do not depend
        # on how many rows a call has; ATen's float32 matmuls, for one, sum in another order.
        self.one_slot_exact = False
        self.cache_hit: bool | None = None  # after warmup: whether the graphs came from qrt's cache
        self._engine: Engine | None = None
        # What each KV-cache slot holds for prompts that start the same (prefix_cache.py): kept
        # with the cache, since any engine, or a direct prefill_chunk / decode_step, writes it.
        self.prefix_cache = PrefixCache(self.max_batch_size)
        model.compile_layers_once = compile and build == "regional"
        freeze = build == "frozen" and self.device.type == "cpu"
        # Whether the compile cache keeps the step graphs themselves, so that a later start calls
        # them without tracing the model (warmup); otherwise it keeps torch's own caches, which
        # serve a trace's compile. Not for sharded ranks, whose graphs hold their process group.
        self.saves_graphs = compile_cache is not None and not self.parallel.sharded and aot_supported()
        # Only decode is autotuned: it is the hot loop and its shapes are fixed; prefill is
        # dynamic in length, where autotuning would pick for one length.
        self.backends = {role: QrtBackend(role, freeze=freeze, autotune=autotune and freeze and role == "decode",
                                          aot=self.saves_graphs and role in _GRAPH_INPUTS)
                         for role in ("prefill", "decode", "decode_slot", "verify", "verify_slot", "forward")}
        # Dynamo decides while tracing whether parameters become constants (Inductor freezing),
        # so the flag must be on around every call that may trace, not only inside the backend.
        self._trace_config = {"freezing": True} if freeze and compile else {}
        self.compile_seconds: dict[str, float] = {}
        # The step graphs called without Dynamo once compiled or loaded (direct_graph.py), by
        # role; absent until then, or where its inputs cannot be told apart. `guarded()` turns
        # them off for a while.
        self.direct: dict[str, DirectGraph] = {}
        self.loaded_roles: set[str] = set()  # the roles whose graphs came from the compile cache untraced
        self._guarded = False
        # One function may serve two roles: own_copy gives each role its own code object.
        fns = {"prefill": _prefill, "decode": _decode, "decode_slot": _one_slot, "verify": _decode,
               "verify_slot": _one_slot, "forward": _forward}
        if compile:
            number = next(_model_numbers)
            self._fns = {
                role: torch.compile(own_copy(fn, f"qrt_{role}_{number}"), backend=self.backends[role],
                                    fullgraph=True)
                for role, fn in fns.items()
            }
        else:
            self._fns = fns

    # ---- forward -------------------------------------------------------------------------
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: LongTensor [B, T] -> float32 logits [B, T, vocab]. No KV cache involved."""
        input_ids = self._check_ids(input_ids, allow_batch=True)
        if input_ids.shape[1] > self.max_seq_len:
            raise ValueError(f"sequence of {input_ids.shape[1]} tokens exceeds max_seq_len={self.max_seq_len}")
        input_ids = input_ids.to(self.device)
        if input_ids.shape[1] >= 2:  # one graph for every length (Dynamo specializes length 1)
            torch._dynamo.mark_dynamic(input_ids, 1, min=2, max=self.max_seq_len)
        return self._run("forward", input_ids)

    # ---- generation ----------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        """The continuous-batching engine over this model's KV-cache slots (made on first use)."""
        if self._engine is None:
            self._engine = Engine(self)
        return self._engine

    def generate(self, prompt, max_new_tokens: int = 64, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 chat: bool = False, stop_at_eos: bool = True, stop: list[str] | tuple[str, ...] = (), stream=None):
        """str in -> str out (the new text); token ids (list or 1-D tensor) in -> new ids out.

        chat=True wraps a str prompt in the tokenizer's chat template as one user turn.
        stop: strings that end the output where they first appear (not included in the text).
        stream: optional callable receiving each new token id as it is produced.
        One request through the same engine the server batches requests with.
        """
        text_in = isinstance(prompt, str)
        ids = self.encode(prompt, chat) if text_in else prompt
        ids = self._check_ids(torch.as_tensor(ids, dtype=torch.long).reshape(1, -1), allow_batch=False)
        request = self.request(ids[0].tolist(), max_new_tokens, SamplingParams(temperature, top_k, top_p, seed),
                               stop_at_eos=stop_at_eos, stop_strings=tuple(stop), text=text_in)

        def listener(update):
            if stream is not None and update.token is not None:
                stream(update.token)

        seq = self.engine.submit(request, listener)
        self._run_engine([seq])
        return seq.text if text_in else seq.tokens

    def generate_batch(self, prompts, max_new_tokens: int = 64, *, temperature: float = 0.0,
                       top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                       stop_at_eos: bool = True, stream=None) -> list[list[int]]:
        """Continue several token-id prompts (of any lengths) together, batched by the engine.
        Returns each prompt's new ids (a row stops at its EOS).

        At most `max_batch_size` prompts run at once (compile_model's argument: the KV cache
        holds that many sequences); more wait for a free slot.
        stream: optional callable receiving (row, token id) as each row's new token is produced."""
        params = SamplingParams(temperature, top_k, top_p, seed)
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("generate_batch takes a non-empty list of token-id lists")
        requests = []
        for prompt in prompts:
            ids = self._check_ids(torch.as_tensor(prompt, dtype=torch.long).reshape(1, -1), allow_batch=False)
            requests.append(self.request(ids[0].tolist(), max_new_tokens, params, stop_at_eos=stop_at_eos))

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
                prompt_logprobs: int | None = None, grammar: str | None = None) -> Request:
        """An engine Request, checked against this model: ids in the vocabulary, prompt +
        max_tokens within the KV cache, stop strings needing a tokenizer. logprobs /
        prompt_logprobs: score the new tokens / the prompt's, with that many alternatives
        (None: off); only a request that scores its prompt may generate nothing (max_tokens 0).
        grammar: structured output (structured.py), checked here."""
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
                       prompt_logprobs, grammar)

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

    def prefill_chunk(self, tokens: list[int], start: int, slot: int, with_hidden: bool = False):
        """Run prompt tokens at positions start.. into cache slot `slot`, attending over the
        cache up to them; float32 logits [V] of the last one. with_hidden: also the final hidden
        states of every token ([T, D]), for `position_logits`."""
        self.prefix_cache.overwritten(slot, start)
        logits, hidden = self._graph("prefill", self._prefill_inputs(tokens, start, slot))
        return (logits[0, 0], hidden[0, :len(tokens)]) if with_hidden else logits[0, 0]

    def position_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The float32 logits [T, V] of final hidden states [T, D] from `prefill_chunk`: the
        model's own head (its lm_head, and any soft-cap), run outside the compiled graphs."""
        with torch.no_grad():
            return self.model.logits(hidden[None])[0]

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, attended: int) -> torch.Tensor:
        """One token per cache slot: tokens, positions [slots]; attention over the first
        `attended` cache entries (the furthest row's position + 1). float32 logits [slots, V]."""
        return self._step("decode", tokens.view(-1, 1), positions.view(-1, 1), attended)[:, 0]

    def decode_slot(self, slot: int, token: int, position: int) -> torch.Tensor:
        """decode_step for one cache slot alone: its token at `position` -> float32 logits [V], the
        same bits as that slot's row of decode_step. Where one request decodes among many slots,
        this feeds one row through the matmuls instead of one per slot."""
        tokens = torch.tensor([[token]], dtype=torch.long)  # [1, 1]
        positions = torch.tensor([[position]], dtype=torch.long)
        slots = torch.tensor([[slot]], dtype=torch.long)
        return self._step("decode_slot", tokens, positions, position + 1, slots)[0, 0]

    def verify_step(self, tokens: torch.Tensor, positions: torch.Tensor, attended: int) -> torch.Tensor:
        """A speculative check: tokens, positions [slots, k + 1], each slot's next token and its
        guesses at consecutive positions (unused places: token 0 at the cache's last position,
        as idle rows feed); `attended` covers the furthest. float32 logits [slots, k + 1, V]:
        place t's are what a decode step feeding that token would give."""
        if self.speculative is None:
            raise ValueError("verify_step needs a model compiled with speculative=…")
        return self._step("verify", tokens, positions, attended)

    def verify_slot(self, slot: int, tokens: torch.Tensor, positions: torch.Tensor, attended: int) -> torch.Tensor:
        """verify_step for one cache slot alone: tokens, positions [k + 1] -> logits [k + 1, V]
        (the same as verify_step's row of that slot). Where one request decodes among many slots,
        this feeds k + 1 rows through the matmuls instead of slots × (k + 1)."""
        if self.speculative is None:
            raise ValueError("verify_slot needs a model compiled with speculative=…")
        slots = torch.full((1, len(tokens)), slot, dtype=torch.long)  # [1, k + 1]: every place in the slot's row
        return self._step("verify_slot", tokens.view(1, -1), positions.view(1, -1), attended, slots)[0]

    @property
    def direct_decode(self) -> DirectGraph | None:
        """The decode graph as called without Dynamo (None until it is compiled)."""
        return self.direct.get("decode")

    def _step(self, role: str, tokens: torch.Tensor, positions: torch.Tensor, attended: int,
              slots: torch.Tensor | None = None) -> torch.Tensor:
        """Run a step graph on tokens, positions [R, W] (R: every slot, or the rows of `slots`
        [R, W]): logits [R, W, V]."""
        rows = range(len(tokens)) if slots is None else slots[:, 0].tolist()
        for slot, position in zip(rows, positions[:, 0].tolist()):
            self.prefix_cache.overwritten(slot, position)
        return self._graph(role, self._step_tensors(tokens, positions, attended, slots))

    def _graph(self, role: str, inputs: tuple):
        """Run `role`'s graph on its inputs (_GRAPH_INPUTS[role], in order): called directly
        where it can be, else through Dynamo, compiling it on the first call. What the role's
        function returns (logits; prefill: logits and hidden states)."""
        direct = self.direct.get(role)
        if direct is not None and not self._guarded:
            outputs = direct(dict(zip(_GRAPH_INPUTS[role], inputs)))
            return tuple(outputs) if role == "prefill" else outputs[0]
        compiled_before = self.backends[role].last_compiled
        returned = self._run(role, *self._traceable(role, inputs))
        if self.backends[role].last_compiled is not compiled_before:  # this call compiled it
            self._capture_direct(role, inputs)
        return returned

    def _capture_direct(self, role: str, inputs: tuple) -> None:
        """After a call that compiled `role`'s graph: keep it, to be called without Dynamo."""
        compiled = self.backends[role].last_compiled
        state = self._named_state()
        spec = GraphSpec.describe(compiled, dict(zip(_GRAPH_INPUTS[role], inputs)),
                                  {id(tensor): name for name, tensor in reversed(state.items())},
                                  outputs=2 if role == "prefill" else 1)
        if spec is not None:
            self.direct[role] = DirectGraph(compiled.fn, spec, state, role, _SIZE_NAMES)
            self.loaded_roles.discard(role)

    def _named_state(self) -> dict[str, torch.Tensor]:
        """Every weight and buffer of the model by qualified name (a tied one under each name)."""
        return {**dict(self.model.named_parameters(remove_duplicate=False)),
                **dict(self.model.named_buffers(remove_duplicate=False))}

    @contextlib.contextmanager
    def guarded(self):
        """Decode through Dynamo and its guards inside this block, as every step did before the
        direct call: a step that would need another graph then compiles one, or raises under
        `torch.compiler.set_stance("fail_on_recompile")`, which is how the recompile checks run.
        Graphs that came from the compile cache were never traced here: they are traced first
        (warmup's filler tokens in slot 0, so enter this between requests)."""
        previous, self._guarded = self._guarded, True
        try:
            for role in sorted(self.loaded_roles):
                self._warm(role)
            yield self
        finally:
            self._guarded = previous

    def graph_inputs(self, role: str) -> tuple:
        """Arguments of the model's forward as the prefill (a 6-token prompt), decode (slot 0
        at position 2, the others idle) or verify (slot 0 feeding k + 1 tokens from position 2)
        graph gets them, for tools that trace the model."""
        if role == "prefill":
            return self._traceable(role, self._prefill_inputs(list(range(3, 9)), 0, 0))
        if role == "verify":
            tokens, positions, attended = self._slot0_check(3, self.speculative.width if self.speculative else 2)
            return self._traceable(role, self._step_tensors(tokens, positions, attended))
        tokens, positions = self._slot0_step(3, 2)
        return self._traceable(role, self._step_tensors(tokens.view(-1, 1), positions.view(-1, 1), 3))

    def _prefill_inputs(self, tokens: list[int], start: int, slot: int) -> tuple:
        length = len(tokens)
        logits_at = length - 1
        if length == 1:
            # The prefill graph's length is dynamic from 2 (Dynamo specializes 1): a one-token
            # prompt runs with a filler token after it, whose K/V at position 1 the first fed
            # token overwrites before anything attends to it.
            tokens, length = [tokens[0], 0], 2
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, T]
        positions = torch.arange(start, start + length, dtype=torch.long, device=self.device)[None]  # [1, T]
        keys = torch.arange(start + length, dtype=torch.long, device=self.device)  # [S'] = 0..start+T-1
        slots = torch.tensor([slot], dtype=torch.long, device=self.device)  # [1]
        index = torch.tensor([logits_at], dtype=torch.long, device=self.device)  # [1]
        return ids, positions, keys, slots, index

    def _step_tensors(self, tokens: torch.Tensor, positions: torch.Tensor, attended: int,
                      slots: torch.Tensor | None = None) -> tuple:
        """A step graph's inputs (_GRAPH_INPUTS): ids, positions [R, W], keys [S'] (and slots [R, W])."""
        # At least 2 keys, because Dynamo specializes sizes 0 and 1 (the extra entry is masked out).
        keys = torch.arange(max(attended, 2), dtype=torch.long, device=self.device)  # [S']
        inputs = tokens.to(self.device).contiguous(), positions.to(self.device).contiguous(), keys
        return inputs if slots is None else (*inputs, slots.to(self.device).contiguous())

    def _traceable(self, role: str, inputs: tuple) -> tuple:
        """`role`'s inputs marked for a call through Dynamo: the chunk and attended lengths vary
        from call to call, and dynamic dims keep one graph for all (_DYNAMIC_DIMS). Only these
        dims: `dynamic=True` would also turn Python floats (norm eps, fp8 limits) into graph
        inputs. They stay below the cache size (a prompt leaves room for a new token): slicing
        the whole cache would be traced as a special case. A direct call needs no marks."""
        named = dict(zip(_GRAPH_INPUTS[role], inputs))
        for name, dim in _DYNAMIC_DIMS[role]:
            torch._dynamo.mark_dynamic(named[name], dim, min=2, max=self.max_seq_len - 1)
        return inputs

    def idle_decode_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions [slots] of a decode step with every slot idle, for the caller to fill
        in its busy ones. An idle row feeds token 0 at the last cache position, which no request
        reaches (the last token of a request that fills the cache is sampled, never fed) and none
        attends."""
        tokens, positions = self.idle_rows(1)
        return tokens[:, 0], positions[:, 0]

    def idle_rows(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions [slots, width] with every place idle (see idle_decode_rows): the
        verify graph's inputs (width k + 1) before the caller fills in its rows."""
        tokens = torch.zeros(self.max_batch_size, width, dtype=torch.long)
        positions = torch.full((self.max_batch_size, width), self.max_seq_len - 1, dtype=torch.long)
        return tokens, positions

    def _slot0_check(self, token: int, width: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """tokens, positions [slots, width] of a verify call with only slot 0 busy, feeding
        token, token + 1, … from position 2; and the attended length."""
        tokens, positions = self.idle_rows(width)
        tokens[0], positions[0] = torch.arange(token, token + width), torch.arange(2, 2 + width)
        return tokens, positions, 2 + width

    def _slot0_step(self, token: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions [slots] of a decode step with only slot 0 busy."""
        tokens, positions = self.idle_decode_rows()
        tokens[0], positions[0] = token, position
        return tokens, positions

    # Single-sequence steps on slot 0 (tests and profiles drive the graphs with them).
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Prompt [1, T] from position 0 into slot 0; [1, 1, V] logits of its last token. With
        `decode`, one sequence step by step outside the engine, as benchmarks and checks drive it."""
        return self.prefill_chunk(ids[0].tolist(), 0, 0).view(1, 1, -1)

    def decode(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """Token [1, 1] at `position` in slot 0 (other slots idle); [1, 1, V] logits."""
        tokens, positions = self._slot0_step(int(token.reshape(-1)[0]), position)
        return self.decode_step(tokens, positions, position + 1)[:1].view(1, 1, -1)

    def _run(self, role: str, *args) -> torch.Tensor:
        with torch.no_grad(), inductor_config.patch(self._trace_config):
            return self._fns[role](self.model, *args)

    def warmup(self) -> None:
        """Compile the step graphs (`_roles`) now, or load them from qrt's compile cache, saying
        which and how long it took."""
        started = time.perf_counter()
        loaded = self._load_cached_graphs()
        self.cache_hit = loaded is not None
        if loaded is None and self.compile_cache is not None:
            guess = last_cold_compile_seconds(str(self.device)) or _FIRST_COMPILE_GUESS_S
            self._say(f"qrt: compiling (first run for this model, about {guess:.0f} s)")
        # A fresh record of cache artifacts, so that the entry holds this model's graphs only
        # (torch versions without it record the whole process's, which is safe, only larger).
        with getattr(CacheArtifactManager, "with_fresh_cache", contextlib.nullcontext)():
            roles = self._roles()
            for role in roles:
                if role in self.loaded_roles:
                    continue
                role_started = time.perf_counter()
                if loaded is None:
                    self._say(f"qrt: compiling {role} …")
                self._warm(role)
                self.compile_seconds[role] = time.perf_counter() - role_started
                if loaded is None:
                    self._say(f"qrt: compiled {role} in {self.compile_seconds[role]:.1f} s")
            if "decode_slot" in roles:
                self.one_slot_exact = self._one_slot_matches()
            total = time.perf_counter() - started
            if loaded is not None:
                self._say(f"qrt: loaded compiled graphs from cache in {total:.1f} s")
            elif self.compile_cache is not None:
                self._store_compiled_graphs(roles, total)

    def _one_slot_matches(self) -> bool:
        """Whether decode_slot (and verify_slot) give slot 0 the bits that the graphs of every
        slot give it, on one step of filler tokens (written where the engine rewrites them)."""
        tokens, positions = self._slot0_step(7, 2)
        alone_matches = torch.equal(self.decode_step(tokens, positions, 3)[0], self.decode_slot(0, 7, 2))
        if not alone_matches or not self.speculative:
            return alone_matches
        tokens, positions, attended = self._slot0_check(7, self.speculative.width)
        return torch.equal(self.verify_step(tokens, positions, attended)[0],
                           self.verify_slot(0, tokens[0], positions[0], attended))

    def _roles(self) -> tuple[str, ...]:
        """The graphs warmup compiles: prefill and decode; with several slots, decode of one slot
        alone (not for sharded ranks, which would each check it for themselves and must run the
        same graphs); with speculative decoding, the verify graphs."""
        one_slot = self.max_batch_size > 1 and not self.parallel.sharded
        roles = ("prefill", "decode") + (("decode_slot",) if one_slot else ())
        if self.speculative:
            roles += ("verify",) + (("verify_slot",) if one_slot else ())
        return roles

    def _warm(self, role: str) -> None:
        """Trace `role` on filler tokens in slot 0 (the engine rewrites whatever they leave in
        the cache before reading it). Prefill runs a chunk at an offset, so that Dynamo sees the
        chunk length and the attended length as two sizes, not one."""
        if role == "prefill":
            self.prefill_chunk([0, 0], 1, 0)
        elif role == "decode":
            self.decode(torch.zeros(1, 1, dtype=torch.long), 2)
        elif role == "decode_slot":
            self.decode_slot(0, 0, 2)
        else:
            tokens, positions, attended = self._slot0_check(0, self.speculative.width)
            if role == "verify":
                self.verify_step(tokens, positions, attended)
            else:
                self.verify_slot(0, tokens[0], positions[0], attended)

    def _say(self, line: str) -> None:
        if self.progress:
            print(line, file=sys.stderr, flush=True)

    def _load_cached_graphs(self) -> dict | None:
        """Load the cache entry: its step graphs, to be called without tracing the model (those
        roles go to `loaded_roles`), or, for an entry of torch's own caches, hand those to torch.
        The entry's metadata, or None on a miss (an unusable entry is reported and deleted)."""
        if self.compile_cache is None:
            return None
        found = self.compile_cache.load(report=self._say_always)
        if found is None:
            return None
        meta, payload = found
        self._say("qrt: loading compiled graphs from cache …")
        try:
            if meta.get("payload") == "graphs":
                self._adopt_graphs(pickle.loads(payload))
                return meta
            loaded = torch.compiler.load_cache_artifacts(payload)
        except Exception as err:  # noqa: BLE001  (any failure to deserialize means: rebuild it)
            loaded, problem = None, f"{type(err).__name__}: {err}"
        else:
            problem = "torch could not deserialize its artifacts"
        if loaded is None:  # torch logs and returns None for a payload it cannot read
            self._forget_loaded_graphs()
            self.compile_cache.discard(problem, report=self._say_always)
            return None
        return meta

    def _adopt_graphs(self, graphs: dict) -> None:
        """Take an entry's graphs, by role: each artifact called directly on this model's
        weights (checked against what it was compiled for), with its compile report."""
        state = self._named_state()
        for role, saved in graphs.items():
            self.direct[role] = DirectGraph(load_artifact(saved["artifact"]), saved["spec"], state, role, _SIZE_NAMES)
            saved["report"].loaded = True
            self.backends[role].log.graphs[:] = [saved["report"]]
            self.loaded_roles.add(role)

    def _forget_loaded_graphs(self) -> None:
        for role in self.loaded_roles:
            self.direct.pop(role, None)
            self.backends[role].log.graphs.clear()
        self.loaded_roles.clear()

    def _store_compiled_graphs(self, roles: tuple[str, ...], seconds: float) -> None:
        """Write the cache entry: the roles' graphs and how to call them where the backends
        saved them (`saves_graphs`; a role without them is traced again at the next start),
        else torch's own cache artifacts."""
        if self.saves_graphs:
            graphs = {role: {"artifact": self.backends[role].last_compiled.artifact, "spec": self.direct[role].spec,
                             "report": self.backends[role].log.graphs[-1]}
                      for role in roles if role in self.direct and getattr(self.backends[role].last_compiled, "artifact", None)}
            payload, kind = pickle.dumps(graphs), "graphs"
        else:
            saved = torch.compiler.save_cache_artifacts()
            if saved is None:
                return
            payload, kind = saved[0], "torch caches"
        try:
            self.compile_cache.store(payload, {"device": str(self.device), "compile_seconds": round(seconds, 1),
                                               "source": str(self.source), "quant": self.scheme.describe(),
                                               "payload": kind})
        except OSError as err:  # a read-only or full cache folder must not stop the model
            self._say_always(f"qrt: could not write the compile cache entry {self.compile_cache.path}: {err}")

    @staticmethod
    def _say_always(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    # ---- helpers ---------------------------------------------------------------------------
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

    def encode_messages(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation ([{"role", "content"}, …]) in the tokenizer's chat template,
        ending with the prompt for the assistant's turn; `tools` (OpenAI's JSON) as the template
        shows them to the model."""
        if self.tokenizer is None:
            raise ValueError(f"{self.source} has no usable tokenizer, so chat messages cannot be encoded")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.source}: the tokenizer has no chat template; use the completions "
                             f"endpoint (or generate without chat=True)")
        text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
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

    def compile_report(self) -> dict:
        """Per role: how many graphs Dynamo produced (1 = no graph breaks, no recompiles); the
        one-slot and verify graphs only where they were compiled."""
        return {role: len(backend.log.graphs) for role, backend in self.backends.items()
                if role in ("prefill", "decode", "forward") or backend.log.graphs}
