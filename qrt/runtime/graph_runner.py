"""The graph runner: a loaded model's compiled step graphs (prefill, decode, the one-slot and
speculative graphs, the full-sequence forward), their inputs, their warm-up and qrt's compile
cache. The engine drives a model through it, one step at a time; `CompiledModel` (compiled.py)
adds the tokenizer, the request checks and `generate` on top."""

import contextlib
import functools
import itertools
import pickle
import sys
import time
import types
from pathlib import Path

import torch
from torch._inductor import config as inductor_config
from torch.compiler._cache import CacheArtifactManager

from qrt.kernels.widened_cpu import widened_products
from qrt.passes.backend import QrtBackend, aot_supported, load_artifact

from .compile_cache import CompileCache, last_cold_compile_seconds
from .direct_graph import DirectGraph, GraphSpec
from .prefix_cache import PrefixCache
from .speculative import SpeculativeConfig

# The progress line's estimate of a cold compile when no earlier one on this device is on record.
_FIRST_COMPILE_GUESS_S = 20
_model_numbers = itertools.count()  # names each runner's functions apart (see own_copy)


def _prefill(model, input_ids, positions, keys, slots, logits_at):
    return model(input_ids, positions, keys, slots, logits_at, keep_hidden=True)


def _decode(model, input_ids, positions, keys):  # also the verify graph: k + 1 tokens per slot
    return model(input_ids, positions, keys)


def _one_slot(model, input_ids, positions, keys, slots):
    return model(input_ids, positions, keys, slots)


# The same with the final hidden states beside the logits, for a draft that reads them (MTP).
def _decode_keeping_hidden(model, input_ids, positions, keys):
    return model(input_ids, positions, keys, keep_hidden=True)


def _one_slot_keeping_hidden(model, input_ids, positions, keys, slots):
    return model(input_ids, positions, keys, slots, keep_hidden=True)


# The tensors of each step graph, by name, in the order they are passed.
_GRAPH_INPUTS = {"prefill": ("input_ids", "positions", "keys", "slots", "logits_at"),
                 "decode": ("input_ids", "positions", "keys"), "verify": ("input_ids", "positions", "keys"),
                 "decode_slot": ("input_ids", "positions", "keys", "slots"),
                 "verify_slot": ("input_ids", "positions", "keys", "slots"),
                 "encode": ("input_ids",), "encode_one": ("input_ids",)}
# The graphs of prompts, whose GEMMs may widen (widened_cpu.py).
_PROMPT_ROLES = ("prefill", "encode", "encode_one")
# The dims whose sizes vary between calls of a role's graph (from 2: Dynamo specializes 0 and 1).
_DYNAMIC_DIMS = {"prefill": (("input_ids", 1), ("positions", 1), ("keys", 0)),
                 **{role: (("keys", 0),) for role in ("decode", "decode_slot", "verify", "verify_slot")},
                 "encode": (("input_ids", 0), ("input_ids", 1)), "encode_one": (("input_ids", 1),)}
# The dynamic sizes in words, for a direct call's errors, by where they appear first.
_SIZE_NAMES = {("input_ids", 1): "chunk length", ("keys", 0): "attended length", ("input_ids", 0): "rows"}
# The most texts one call of the encode graph takes (an embedding model's batches are cut to it).
ENCODE_ROWS = 64


def _forward(model, input_ids):
    return model(input_ids)


def _encode(model, input_ids):  # an embedding model's texts, right-padded: causal attention, no KV cache
    return model.hidden_states(input_ids)


def own_copy(fn, name: str):
    """A copy of `fn` with its own code object and name. Dynamo keeps its compiled-graph cache on
    the code object, so each runner gets a cache of its own: a second model is then neither
    a recompile of the first nor pushes it out of the cache. Its record of which sizes changed
    between calls ("automatic dynamic") is kept per function name, so the name is unique too:
    otherwise a second model with another head size would get that size traced as dynamic."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name)


class GraphRunner:
    """A loaded model's compiled step graphs over its KV-cache slots, called directly once compiled
    (direct_graph.py) or through Dynamo."""

    def __init__(self, model, *, compile: bool, progress: bool, source, build: str = "regional",
                 autotune: bool = False, compile_cache: CompileCache | None = None,
                 speculative: SpeculativeConfig | None = None, quant_description: str = "",
                 lazy_prefill: int = 0, encoder: bool = False):
        """encoder: an embedding model, built without its lm_head: its graphs are encode and
        encode_one (hidden_states of several rows, of one), and it has no KV cache to step."""
        self.model = model
        self.encoder = encoder
        self.source = Path(source)
        self.quant_description = quant_description  # the scheme's, recorded with the compile cache entry
        self.progress = progress
        self.device = next(model.parameters()).device
        self.parallel = model.config.parallel
        self.vocab_size = model.config.vocab_size
        self.max_seq_len = model.max_seq_len
        self.max_batch_size = model.max_batch_size  # KV-cache slots
        # Longrope models (Phi-3) switch to long factors past the original context (None: never).
        self.long_from = model.rotary.long_from
        self.build = build
        self.compile_cache = compile_cache
        self.speculative = speculative
        # Prompt chunks of up to this many tokens run through the decode graph, a token a step,
        # and the prefill graph is compiled when a longer one first comes (compile_model's doc).
        self.lazy_prefill = lazy_prefill
        self.draft: GraphRunner | None = None  # the draft model of speculative method "draft"
        # The LoRA adapters served beside the model (lora.py), where it was compiled with slots for them.
        self.lora = None
        self.mtp = None  # the multi-token-prediction graphs of method "mtp" (mtp_graphs.py)
        # Method "mtp" reads the model's final hidden states of every fed token: the step graphs
        # return them beside the logits, and each step leaves its rows' in `last_hidden`.
        self.step_hidden = speculative is not None and speculative.method == "mtp"
        self.last_hidden: torch.Tensor | None = None  # [rows, W, D] of the last step graph's call
        # Whether the graphs of one slot alone give the same bits as that slot's row of the graphs
        # of every slot (warmup checks it): then the engine may run one decoding request through
        # them without changing its tokens. True with qrt's CPU kernels, whose rows do not depend
        # on how many rows a call has; ATen's float32 matmuls, for one, sum in another order.
        self.one_slot_exact = False
        self.cache_hit: bool | None = None  # after warmup: whether the graphs came from qrt's cache
        # What each KV-cache slot holds for prompts that start the same (prefix_cache.py): kept
        # with the cache, since any engine, or a direct prefill_chunk / decode_step, writes it.
        self.prefix_cache = PrefixCache(self.max_batch_size)
        self.compiles = compile
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
                         for role in ("prefill", "decode", "decode_slot", "verify", "verify_slot", "forward", "encode",
                                      "encode_one")}
        # Dynamo decides while tracing whether parameters become constants (Inductor freezing),
        # so the flag must be on around every call that may trace, not only inside the backend.
        self._trace_config = {"freezing": True} if freeze and compile else {}
        self.compile_seconds: dict[str, float] = {}
        # The step graphs called without Dynamo once compiled or loaded (direct_graph.py), by
        # role; absent until then, or where its inputs cannot be told apart. `guarded()` turns
        # them off for a while.
        self.direct: dict[str, DirectGraph] = {}
        self.loaded_roles: set[str] = set()  # the roles whose graphs came from the compile cache untraced
        # What the compile cache entry holds or will hold, by role (_store_compiled_graphs): the
        # graphs it came with and those compiled since, so that an entry grows by a late graph.
        self._saved_graphs: dict[str, dict] = {}
        self._guarded = False
        # One function may serve two roles: own_copy gives each role its own code object.
        decode, one_slot = (_decode_keeping_hidden, _one_slot_keeping_hidden) if self.step_hidden else (_decode, _one_slot)
        fns = {"prefill": _prefill, "decode": decode, "decode_slot": one_slot, "verify": decode,
               "verify_slot": one_slot, "forward": _forward, "encode": _encode,
               "encode_one": _encode}
        if compile:
            number = next(_model_numbers)
            self.graph_functions = {
                role: torch.compile(own_copy(fn, f"qrt_{role}_{number}"), backend=self.backends[role],
                                    fullgraph=True)
                for role, fn in fns.items()
            }
        else:
            self.graph_functions = fns


    def prefill_chunk(self, tokens: list[int], start: int, slot: int, with_hidden: bool = False):
        """Run prompt tokens at positions start.. into cache slot `slot`, attending over the
        cache up to them; float32 logits [V] of the last one. with_hidden: also the final hidden
        states of every token ([T, D]), for `position_logits`."""
        if not with_hidden and len(tokens) <= self.lazy_prefill:
            return self._prefill_by_decode(tokens, start, slot)
        if self.lazy_prefill and self._never_compiled("prefill"):
            self._compile_prefill_in_place(start, slot)
        return self._prefill(tokens, start, slot, with_hidden)

    def _prefill(self, tokens: list[int], start: int, slot: int, with_hidden: bool):
        self.prefix_cache.overwritten(slot, start)
        logits, hidden = self._graph("prefill", self.prefill_inputs(tokens, start, slot))
        return (logits[0, 0], hidden[0, :len(tokens)]) if with_hidden else logits[0, 0]

    def _prefill_by_decode(self, tokens: list[int], start: int, slot: int) -> torch.Tensor:
        """prefill_chunk through the decode graph, one token a step (the other slots idle, or the
        one-slot graph where it gives the same bits); float32 logits [V] of the last token."""
        for position, token in enumerate(tokens, start):
            if self.one_slot_exact:
                logits = self.decode_slot(slot, token, position)
            else:
                rows, positions = self.idle_decode_rows()
                rows[slot], positions[slot] = token, position
                logits = self.decode_step(rows, positions, position + 1)[slot]
        return logits

    def _never_compiled(self, role: str) -> bool:
        return self.compiles and role not in self.direct and self.backends[role].last_compiled is None

    def _compile_prefill_in_place(self, start: int, slot: int) -> None:
        """Compile the prefill graph before the first chunk longer than `lazy_prefill` runs, as
        warmup would: on two filler tokens, here at positions start + 1 and start + 2 of the
        chunk's own slot, which the chunk (of more tokens) overwrites next. The offset keeps the
        chunk and attended lengths apart (see _warm). The compile cache entry then gains it."""
        self.compile_timed("prefill", lambda: self._prefill([0, 0], start + 1, slot, with_hidden=False), say=True,
                           why=f" (the first prompt longer than {self.lazy_prefill} tokens)")
        if self.compile_cache is not None and self.saves_graphs:
            self._store_compiled_graphs(("prefill",), self.compile_seconds["prefill"])

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        """The final hidden states [R, T, D] (model dtype) of rows of token ids [R, T] (R <=
        ENCODE_ROWS, 2 <= T <= max_seq_len), each attending causally over its own tokens only,
        without the KV cache: nothing the engine's requests hold there is touched. One row runs
        through a graph of its own (Dynamo specializes a size of 1), not padded to two."""
        return self._graph("encode_one" if ids.shape[0] == 1 else "encode", (ids.to(self.device).contiguous(),))

    def position_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The float32 logits [T, V] of final hidden states [T, D] from `prefill_chunk`: the
        model's own head (its lm_head, and any soft-cap), run outside the compiled graphs."""
        with torch.no_grad(), widened_products():
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
        returned = self._graph(role, self.step_tensors(tokens, positions, attended, slots))
        if not self.step_hidden:
            return returned
        logits, self.last_hidden = returned
        return logits

    def _graph(self, role: str, inputs: tuple):
        """Run `role`'s graph on its inputs (_GRAPH_INPUTS[role], in order): called directly
        where it can be, else through Dynamo, compiling it on the first call. What the role's
        function returns (logits; prefill: logits and hidden states)."""
        if self.lora is not None:
            self.lora.route(role, dict(zip(_GRAPH_INPUTS[role], inputs)))
        direct = self.direct.get(role)
        if direct is not None and not self._guarded:
            outputs = direct(dict(zip(_GRAPH_INPUTS[role], inputs)))
            return tuple(outputs) if self._outputs(role) == 2 else outputs[0]
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
                                  outputs=self._outputs(role))
        if spec is not None:
            self.direct[role] = DirectGraph(compiled.fn, spec, state, role, _SIZE_NAMES)
            self.loaded_roles.discard(role)

    def _outputs(self, role: str) -> int:
        """How many tensors `role`'s graph returns: logits, and for prefill (and every step graph
        under step_hidden) the final hidden states."""
        return 2 if role == "prefill" or (self.step_hidden and role not in ("forward", "encode", "encode_one")) else 1

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
            return self._traceable(role, self.prefill_inputs(list(range(3, 9)), 0, 0))
        if role == "verify":
            tokens, positions, attended = self._slot0_check(3, self.speculative.width if self.speculative else 2)
            return self._traceable(role, self.step_tensors(tokens, positions, attended))
        tokens, positions = self._slot0_step(3, 2)
        return self._traceable(role, self.step_tensors(tokens.view(-1, 1), positions.view(-1, 1), 3))

    def prefill_inputs(self, tokens: list[int], start: int, slot: int) -> tuple:
        """The prefill graph's inputs for `tokens` at positions start.. of cache slot `slot`:
        ids, positions [1, T], keys [S'], slots [1], the last token's place [1]."""
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

    def step_tensors(self, tokens: torch.Tensor, positions: torch.Tensor, attended: int,
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
            # Without the cache (encode), a text may fill every position the rotary tables hold.
            encode = role in ("encode", "encode_one")
            high = (ENCODE_ROWS if dim == 0 else self.max_seq_len) if encode else self.max_seq_len - 1
            torch._dynamo.mark_dynamic(named[name], dim, min=2, max=high)
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
        # A prompt graph traced (on its first call) to widen its GEMMs of many rows to float32
        # where the CPU lacks bf16 arithmetic (widened_cpu.py); decode and verify graphs never do.
        widening = widened_products() if role in _PROMPT_ROLES else contextlib.nullcontext()
        with torch.no_grad(), inductor_config.patch(self._trace_config), widening:
            return self.graph_functions[role](self.model, *args)

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
            compiled_now = tuple(role for role in roles if role not in self.loaded_roles)
            # An entry of graphs that lacks one (made with lazy_prefill, say) gains it now.
            grows = loaded is not None and self.saves_graphs and bool(compiled_now)
            for role in compiled_now:
                self.compile_timed(role, functools.partial(self._warm, role), say=loaded is None or grows)
            if "decode_slot" in roles:
                self.one_slot_exact = self._one_slot_matches()
            total = time.perf_counter() - started
            if loaded is not None and not grows:
                self._say(f"qrt: loaded compiled graphs from cache in {total:.1f} s")
            elif self.compile_cache is not None:
                self._store_compiled_graphs(compiled_now, total)

    def compile_timed(self, role: str, trace, say: bool, why: str = "") -> None:
        """Run `trace()`, the call that compiles `role`'s graph (or loads it from torch's own
        caches), timing it into compile_seconds; with `say`, on the progress lines."""
        if say:
            self._say(f"qrt: compiling {role}{why} …")
        started = time.perf_counter()
        trace()
        self.compile_seconds[role] = time.perf_counter() - started
        if say:
            self._say(f"qrt: compiled {role} in {self.compile_seconds[role]:.1f} s")

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
        """The graphs warmup compiles: prefill (unless lazy_prefill) and decode; with several
        slots, decode of one slot alone (not for sharded ranks, which would each check it for
        themselves and must run the same graphs); with speculative decoding, the verify graphs."""
        if self.encoder:
            return ("encode", "encode_one")
        one_slot = self.max_batch_size > 1 and not self.parallel.sharded
        roles = (() if self.lazy_prefill else ("prefill",)) + ("decode",) + (("decode_slot",) if one_slot else ())
        if self.speculative:
            roles += ("verify",) + (("verify_slot",) if one_slot else ())
        return roles

    def _warm(self, role: str) -> None:
        """Trace `role` on filler tokens in slot 0 (the engine rewrites whatever they leave in
        the cache before reading it). Prefill runs a chunk at an offset, so that Dynamo sees the
        chunk length and the attended length as two sizes, not one."""
        if role == "prefill":
            self._prefill([0, 0], 1, 0, with_hidden=False)
        elif role == "decode":
            self.decode(torch.zeros(1, 1, dtype=torch.long), 2)
        elif role == "decode_slot":
            self.decode_slot(0, 0, 2)
        elif role == "encode":  # two sizes apart, so that rows and length stay two symbols
            self.hidden_states(torch.zeros(2, 3, dtype=torch.long))
        elif role == "encode_one":
            self.hidden_states(torch.zeros(1, 3, dtype=torch.long))
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
            self._saved_graphs[role] = saved

    def _forget_loaded_graphs(self) -> None:
        for role in self.loaded_roles:
            self.direct.pop(role, None)
            self.backends[role].log.graphs.clear()
        self.loaded_roles.clear()
        self._saved_graphs.clear()

    def _store_compiled_graphs(self, roles: tuple[str, ...], seconds: float) -> None:
        """Write the cache entry: the graphs of `roles`, just compiled, beside those it held, and
        how to call them where the backends saved them (`saves_graphs`; a role without them is
        traced again at the next start), else torch's own cache artifacts."""
        if self.saves_graphs:
            self._saved_graphs.update(
                {role: {"artifact": self.backends[role].last_compiled.artifact, "spec": self.direct[role].spec,
                        "report": self.backends[role].log.graphs[-1]}
                 for role in roles if role in self.direct and getattr(self.backends[role].last_compiled, "artifact", None)})
            payload, kind = pickle.dumps(self._saved_graphs), "graphs"
        else:
            saved = torch.compiler.save_cache_artifacts()
            if saved is None:
                return
            payload, kind = saved[0], "torch caches"
        try:
            self.compile_cache.store(payload, {"device": str(self.device), "compile_seconds": round(seconds, 1),
                                               "source": str(self.source), "quant": self.quant_description,
                                               "payload": kind})
        except OSError as err:  # a read-only or full cache folder must not stop the model
            self._say_always(f"qrt: could not write the compile cache entry {self.compile_cache.path}: {err}")

    @staticmethod
    def _say_always(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def compile_report(self) -> dict:
        """Per role: how many graphs Dynamo produced (1 = no graph breaks, no recompiles); the
        one-slot and verify graphs only where they were compiled."""
        return {role: len(backend.log.graphs) for role, backend in self.backends.items()
                if role in ("prefill", "decode", "forward") or backend.log.graphs}
