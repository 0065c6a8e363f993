"""`compile_model` and the CompiledModel it returns: forward and generate over compiled graphs."""

import contextlib
import itertools
import os
import sys
import time
import types
from pathlib import Path

import torch
from torch._inductor import config as inductor_config
from torch.compiler._cache import CacheArtifactManager

from qrt.loaders.checkpoint import open_checkpoint
from qrt.loaders.config import DeviceConfig, LoadConfig
from qrt.loaders.loader import load_model
from qrt.loaders.prepack import prepack_cpu_weights
from qrt.loaders.quant import resolve_scheme
from qrt.loaders.tokenizer import eos_token_ids
from qrt.passes.backend import QrtBackend

from .compile_cache import (CompileCache, checkpoint_identity, entry_key, last_cold_compile_seconds,
                            use_qrt_inductor_dir)
from .distributed import broadcast_from_first, rank_device, tensor_parallel
from .malloc import map_large_allocations
from .registry import ModelRegistry
from .sampling import SamplingParams, sample

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
    """
    build = build or os.environ.get("QRT_BUILD") or "regional"
    if build not in BUILDS:
        raise ValueError(f"build={build!r}; choose one of {list(BUILDS)}")
    if autotune and build != "frozen":
        raise ValueError("autotune=True needs build='frozen': Inductor autotunes GEMMs only on frozen "
                         "weights, and the regional build runs the loader's prepacked GEMMs instead")
    if autotune is None:
        autotune = build == "frozen" and os.environ.get("QRT_AUTOTUNE", "1") != "0"
    if path is None:
        from .default_model import default_model_path

        path = default_model_path(progress=progress)
    map_large_allocations()
    parallel = tensor_parallel(tp, torch.device(device_config.device if device_config else device))
    progress = progress and parallel.rank == 0
    if parallel.sharded:
        device = rank_device(torch.device(device), parallel)
    load_config = load_config or LoadConfig(progress=progress)
    device_config = device_config or DeviceConfig(device=device, dtype=dtype)
    checkpoint = open_checkpoint(path, load_config)
    hf_config = checkpoint.hf_config
    model_cls = ModelRegistry.resolve(hf_config, source=checkpoint.config_path)
    scheme = resolve_scheme(hf_config, quant, checkpoint.config_path, checkpoint.folder)
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
        })
        compile_cache = CompileCache(key, parts)
        use_qrt_inductor_dir()
    compiled = CompiledModel(model, tokenizer, scheme, eos_token_ids(checkpoint.folder, hf_config, tokenizer),
                             compile=compile, build=build, autotune=autotune, progress=progress,
                             source=Path(path), compile_cache=compile_cache)
    if compile and warmup:
        compiled.warmup()
    return compiled


def _prefill(model, input_ids, input_pos, cache_positions):
    return model(input_ids, input_pos, cache_positions, last_only=True)


def _decode(model, input_ids, input_pos, cache_positions):
    return model(input_ids, input_pos, cache_positions, last_only=True)


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
                 build: str = "regional", autotune: bool = False, compile_cache: CompileCache | None = None):
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
        self.build = build
        self.compile_cache = compile_cache
        self.cache_hit: bool | None = None  # after warmup: whether the graphs came from qrt's cache
        model.compile_layers_once = compile and build == "regional"
        freeze = build == "frozen" and self.device.type == "cpu"
        # Only decode is autotuned: it is the hot loop and its shapes are fixed; prefill is
        # dynamic in length, where autotuning would pick for one length.
        self.backends = {role: QrtBackend(role, freeze=freeze, autotune=autotune and freeze and role == "decode")
                         for role in ("prefill", "decode", "forward")}
        # Dynamo decides while tracing whether parameters become constants (Inductor freezing),
        # so the flag must be on around every call that may trace, not only inside the backend.
        self._trace_config = {"freezing": True} if freeze and compile else {}
        self.compile_seconds: dict[str, float] = {}
        fns = {"prefill": _prefill, "decode": _decode, "forward": _forward}
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
    def generate(self, prompt, max_new_tokens: int = 64, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 chat: bool = False, stop_at_eos: bool = True, stream=None):
        """str in -> str out (the new text); token ids (list or 1-D tensor) in -> new ids out.

        chat=True wraps a str prompt in the tokenizer's chat template as one user turn.
        stream: optional callable receiving each new token id as it is produced.
        """
        params = SamplingParams(temperature, top_k, top_p, seed)
        if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        text_in = isinstance(prompt, str)
        ids = self.encode(prompt, chat) if text_in else prompt
        ids = self._check_ids(torch.as_tensor(ids, dtype=torch.long).reshape(1, -1), allow_batch=False)
        if ids.shape[1] + max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the KV "
                f"cache of {self.max_seq_len} tokens; shorten the prompt, lower max_new_tokens, or "
                f"pass a larger max_seq_len to compile_model"
            )
        (new_ids,) = self._generate_ids(ids, max_new_tokens, params, stop_at_eos, stream)
        if text_in:
            return self.tokenizer.decode(new_ids, skip_special_tokens=True)
        return new_ids

    def generate_batch(self, prompts, max_new_tokens: int = 64, *, temperature: float = 0.0,
                       top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                       stop_at_eos: bool = True) -> list[list[int]]:
        """Continue several token-id prompts of equal length together: one batched prefill, then
        batched decode steps. Returns each prompt's new ids (a row stops at its EOS).

        At most `max_batch_size` prompts (compile_model's argument: the KV cache holds that many
        sequences). The batch size is part of the compiled graphs' shapes: each new one compiles
        prefill and decode once."""
        params = SamplingParams(temperature, top_k, top_p, seed)
        if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        try:
            ids = torch.as_tensor(prompts, dtype=torch.long)
        except (ValueError, TypeError):
            raise ValueError("generate_batch takes a list of token-id lists of equal length") from None
        ids = self._check_ids(ids, allow_batch=True)
        if ids.shape[0] > self.model.max_batch_size:
            raise ValueError(f"{ids.shape[0]} prompts, but the KV cache holds {self.model.max_batch_size} sequences; "
                             f"pass max_batch_size={ids.shape[0]} to compile_model")
        if ids.shape[1] + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompts ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceed the KV "
                             f"cache of {self.max_seq_len} tokens")
        return self._generate_ids(ids, max_new_tokens, params, stop_at_eos, None)

    def _generate_ids(self, ids, max_new_tokens, params, stop_at_eos, stream) -> list[list[int]]:
        """ids: [B, T]. New ids per row; `stream` (B = 1) receives each as it is sampled."""
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        batch, seq = ids.shape
        rows: list[list[int]] = [[] for _ in range(batch)]
        finished = [False] * batch
        logits = self._prefill(ids)
        # Longrope models (Phi-3) switch to their long factors past the original context; there
        # transformers recomputes the whole sequence with them, so qrt does too. Only they keep
        # the sequence so far: a torch.cat per token is waste on the decode loop's hot path.
        recompute_at = self.model.rotary.long_from
        sequence = ids if recompute_at is not None else None  # [B, seq + step]: what a recompute would run
        for step in range(max_new_tokens):
            tokens = broadcast_from_first(sample(logits[:, -1], params, generator), self.parallel)  # [B]
            for row, token_id in enumerate(tokens.tolist()):
                if not finished[row]:
                    rows[row].append(token_id)
                    finished[row] = stop_at_eos and token_id in self.eos_ids
                    if stream is not None:
                        stream(token_id)
            if all(finished) or step == max_new_tokens - 1:
                break
            if sequence is not None:
                sequence = torch.cat([sequence, tokens.view(-1, 1)], dim=1)
            if seq + step == recompute_at:
                logits = self._prefill(sequence)
            else:
                logits = self._decode(tokens.view(-1, 1), seq + step)
        return rows

    def _prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Run prompts [B, T] from position 0, filling the KV cache; [B, 1, V] logits of their last token."""
        seq = ids.shape[1]
        ids = ids.to(self.device)
        if seq == 1:  # a one-token prompt is a decode step
            return self._decode(ids, 0)
        positions = torch.arange(seq, dtype=torch.long, device=self.device)
        # Prompts vary in length: mark it dynamic so one graph serves them all. Only this dim:
        # `dynamic=True` would also turn Python floats (norm eps, fp8 limits) into graph inputs.
        # A prompt leaves room for at least one new token: its length stays below the cache size.
        torch._dynamo.mark_dynamic(ids, 1, min=2, max=self.max_seq_len - 1)
        torch._dynamo.mark_dynamic(positions, 0, min=2, max=self.max_seq_len - 1)
        return self._run("prefill", ids, positions, positions)

    def _decode(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """One token [1, 1] at `position`; attends over the cache up to it, not the whole cache."""
        input_pos = torch.tensor([position], dtype=torch.long, device=self.device)
        # The attended length grows every step: a dynamic dim keeps it one graph. At least 2,
        # because Dynamo specializes sizes 0 and 1 (the extra entry is masked out); below the
        # cache size, which generation never reaches (the last token is sampled, not decoded),
        # because slicing the whole cache would be traced as a special case.
        cache_positions = torch.arange(max(position + 1, 2), dtype=torch.long, device=self.device)
        torch._dynamo.mark_dynamic(cache_positions, 0, min=2, max=self.max_seq_len - 1)
        return self._run("decode", token.to(self.device), input_pos, cache_positions)

    def _run(self, role: str, *args) -> torch.Tensor:
        with torch.no_grad(), inductor_config.patch(self._trace_config):
            return self._fns[role](self.model, *args)

    def warmup(self) -> None:
        """Compile prefill and decode now (or load them from qrt's compile cache), saying which
        and how long it took."""
        entry = self._load_cached_graphs()
        self.cache_hit = entry is not None
        if entry is not None:
            self._say("qrt: loading compiled graphs from cache …")
        elif self.compile_cache is not None:
            guess = last_cold_compile_seconds(str(self.device)) or _FIRST_COMPILE_GUESS_S
            self._say(f"qrt: compiling (first run for this model, about {guess:.0f} s)")
        started = time.perf_counter()
        # A fresh record of cache artifacts, so that the entry holds this model's graphs only
        # (torch versions without it record the whole process's, which is safe, only larger).
        with getattr(CacheArtifactManager, "with_fresh_cache", contextlib.nullcontext)():
            for role, length in (("prefill", 2), ("decode", 1)):
                role_started = time.perf_counter()
                if entry is None:
                    self._say(f"qrt: compiling {role} …")
                self._prefill(torch.zeros(1, length, dtype=torch.long))
                self.compile_seconds[role] = time.perf_counter() - role_started
                if entry is None:
                    self._say(f"qrt: compiled {role} in {self.compile_seconds[role]:.1f} s")
            total = time.perf_counter() - started
            if entry is not None:
                self._say(f"qrt: loaded compiled graphs from cache in {total:.1f} s")
            elif self.compile_cache is not None:
                self._store_compiled_graphs(total)

    def _say(self, line: str) -> None:
        if self.progress:
            print(line, file=sys.stderr, flush=True)

    def _load_cached_graphs(self) -> dict | None:
        """Hand the cache entry's artifacts to torch's caches; its metadata, or None on a miss."""
        if self.compile_cache is None:
            return None
        found = self.compile_cache.load(report=self._say_always)
        if found is None:
            return None
        meta, payload = found
        try:
            loaded = torch.compiler.load_cache_artifacts(payload)
        except Exception as err:  # noqa: BLE001  (any failure to deserialize means: rebuild it)
            loaded, problem = None, f"{type(err).__name__}: {err}"
        else:
            problem = "torch could not deserialize its artifacts"
        if loaded is None:  # torch logs and returns None for a payload it cannot read
            self.compile_cache.discard(problem, report=self._say_always)
            return None
        return meta

    def _store_compiled_graphs(self, seconds: float) -> None:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        payload, _ = saved
        try:
            self.compile_cache.store(payload, {"device": str(self.device), "compile_seconds": round(seconds, 1),
                                               "source": str(self.source), "quant": self.scheme.describe()})
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
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(f"{self.source}: the tokenizer has no chat template; call without chat=True")
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(text)

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
        """Per role: how many graphs Dynamo produced (1 = no graph breaks, no recompiles)."""
        return {role: len(backend.log.graphs) for role, backend in self.backends.items()}
