"""`python -m qrt` / `qrt`: generate, chat, serve, eval, inspect, dump, formats, cache."""

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from qrt.chat_terminal import MAX_NEW_TOKENS as CHAT_MAX_NEW_TOKENS, add_chat_args, run_chat
from qrt.checkpoint.hub import is_hub_id
from qrt.errors import QrtError
from qrt.formats.catalog import (compressed_tensors_formats, formats_markdown, kernels_of, online_formats,
                                 side_file_formats, stored_formats)

from qrt.runtime.compiled import BUILDS
from qrt.runtime.distributed import leave_process_group
from qrt.runtime.evaluate import DEFAULT_WINDOW
from qrt.runtime.lora import DEFAULT_MAX_LORA_RANK, check_name
from qrt.runtime.reasoning import PARSERS as REASONING_PARSERS
from qrt.runtime.speculative import METHODS as SPECULATIVE_METHODS, SpeculativeConfig
from qrt.server.affinity import DEFAULT_PREFIX_CHARS
from qrt.server.tools import READERS as TOOL_CALL_READERS

DEMO_PROMPT = "What is the capital of France? Answer in one sentence."
# Free adapter slots `qrt serve --allow-runtime-lora` keeps beside those of --lora, unless --max-loras says.
RUNTIME_LORA_SLOTS = 4


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # Under torchrun every rank runs this; each names itself in its errors.
    who = f" (rank {os.environ['RANK']})" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    try:
        return args.handler(args)
    except QrtError as err:  # one write per line: several ranks share the terminal
        sys.stderr.write(f"qrt: error{who}: {err}\n")
        return 2
    except ValueError as err:
        sys.stderr.write(f"qrt: invalid input{who}: {err}\n")
        return 2
    finally:
        leave_process_group()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qrt", description="torch.compile-first runtime for quantized LLM checkpoints")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    commands = parser.add_subparsers(dest="command", required=True)

    def add_model_args(sub):
        sub.add_argument("path", nargs="?", default=None, type=_model_path,
                         help="a checkpoint folder, a .gguf file, a Hugging Face Hub id (ORG/NAME, or "
                              "ORG/NAME:FILE.gguf or ORG/NAME:Q4_K_M for a GGUF repository), or `default` (the "
                              "default: the embedded SmolLM2-135M-Instruct)")
        sub.add_argument("--revision", default=None,
                         help="a hub id's branch, tag or commit (default: main)")
        sub.add_argument("--quant", default=None,
                         help=f"online quantization for a bf16 checkpoint: {', '.join(online_formats())} "
                              f"(default: as stored; `qrt formats` lists every format)")
        sub.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default: the checkpoint's)")
        sub.add_argument("--device", default="cpu")
        sub.add_argument("--build", choices=BUILDS, default=None,
                         help="regional (default): each distinct layer compiled once, graphs cached; "
                              "frozen: the older whole-model build with Inductor freezing")
        sub.add_argument("--no-autotune", action="store_true",
                         help="frozen build: skip timing GEMM implementations for decode (CPU)")
        sub.add_argument("--no-cache", action="store_true", help="neither load nor store qrt's compiled graphs")
        sub.add_argument("--tp", type=int, default=1,
                         help="tensor parallelism over this many ranks, one process each: run under "
                              "`torchrun --nproc-per-node N -m qrt …` (default: 1)")

    def add_speculative_args(sub):
        sub.add_argument("--speculative", choices=SPECULATIVE_METHODS, default=None,
                         help="speculative decoding: guess the next tokens and check them in one call (greedy "
                              "output unchanged). ngram looks the last few tokens up earlier in the prompt and "
                              "output (pays where answers repeat their input); draft asks a draft model (--draft); "
                              "mtp uses the checkpoint's multi-token-prediction layer (DeepSeek-V3)")
        defaults = SpeculativeConfig()
        sub.add_argument("--num-speculative-tokens", type=int, default=defaults.num_speculative_tokens,
                         help="guesses checked per step (default: %(default)s)")
        sub.add_argument("--prompt-lookup-max", type=int, default=defaults.prompt_lookup_max,
                         help="ngram: the longest tail looked up (default: %(default)s)")
        sub.add_argument("--prompt-lookup-min", type=int, default=defaults.prompt_lookup_min,
                         help="ngram: the shortest (default: %(default)s)")
        sub.add_argument("--draft", default=None,
                         help="draft: the draft model's checkpoint, sharing the model's tokenizer (default: the "
                              "model's own, which then needs --draft-quant)")
        sub.add_argument("--draft-quant", default=None, help="draft: quantize the draft online (such as int4)")

    def add_lora_args(sub, spare: str):
        sub.add_argument("--lora", action="append", type=_lora_flag, default=None, metavar="NAME=PATH",
                         help="a PEFT LoRA adapter (its folder or hub id) loaded beside the model under NAME; "
                              "repeat for several")
        sub.add_argument("--max-loras", type=int, default=None,
                         help=f"LoRA adapters loaded at once (default: as many as --lora gives{spare})")
        sub.add_argument("--max-lora-rank", type=int, default=DEFAULT_MAX_LORA_RANK,
                         help="the largest rank an adapter may have (default: %(default)s)")
        sub.add_argument("--lora-target-modules", default=None, metavar="NAMES",
                         help="the modules that hold adapter slots, comma-separated as transformers names them "
                              "(q_proj,v_proj,...) or all-linear (default: those the --lora adapters adapt, else "
                              "the attention and MLP projections)")

    def add_sampling_args(sub, max_new_tokens: int):
        sub.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                         help="the longest answer, in tokens (default: %(default)s)")
        sub.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
        sub.add_argument("--top-k", type=int, default=None)
        sub.add_argument("--top-p", type=float, default=None)
        sub.add_argument("--seed", type=int, default=None)

    gen = commands.add_parser("generate", help="generate text from a prompt")
    add_model_args(gen)
    add_speculative_args(gen)
    gen.add_argument("--prompt", default=DEMO_PROMPT)
    add_sampling_args(gen, max_new_tokens=64)
    gen.add_argument("--no-chat", action="store_true", help="do not wrap the prompt in the chat template")
    gen.add_argument("--eager", action="store_true", help="skip torch.compile (reference ops)")
    add_lora_args(gen, spare="")
    gen.add_argument("--use-lora", default=None, metavar="NAME",
                     help="run the prompt with the --lora adapter NAME (default: the one --lora adapter where "
                          "one is given; with several, the model alone)")
    gen.set_defaults(handler=_generate)

    chat = commands.add_parser("chat", help="a conversation in the terminal, in the model's chat template")
    add_model_args(chat)
    add_sampling_args(chat, max_new_tokens=CHAT_MAX_NEW_TOKENS)
    add_chat_args(chat)
    chat.set_defaults(handler=_chat)

    srv = commands.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching")
    add_model_args(srv)
    add_speculative_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--max-batch", type=int, default=8, help="KV-cache slots: requests decoded together (default: 8)")
    srv.add_argument("--max-seq-len", type=int, default=None,
                     help="tokens per slot, prompt + output (default: 2048, or the model's context if shorter)")
    srv.add_argument("--api-key", default=os.environ.get("QRT_API_KEY"),
                     help="require `Authorization: Bearer KEY` on /v1 (default: $QRT_API_KEY, else none)")
    srv.add_argument("--max-queue", type=int, default=64,
                     help="requests that may wait for a slot; more get 503 with Retry-After (default: 64)")
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default: 1 MiB)")
    srv.add_argument("--shutdown-timeout", type=float, default=600,
                     help="on SIGTERM or Ctrl-C, seconds the requests in hand may take to finish while new ones "
                          "get 503; a second signal stops at once (default: 600)")
    srv.add_argument("--prefill-chunk", type=int, default=None,
                     help="prompt tokens prefilled per engine step: a long prompt stalls running streams by "
                          "one chunk at most (default: 256)")
    srv.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                     help="prefill every prompt whole, even where a free KV-cache slot holds its first chunks "
                          "(reuse never changes a result; it only saves time)")
    srv.add_argument("--tool-call-parser", choices=("auto", *TOOL_CALL_READERS), default="auto",
                     help="how tool_choice \"auto\" reads the model's calls (default: from the chat template)")
    srv.add_argument("--reasoning-parser", choices=("auto", "none", *REASONING_PARSERS), default="auto",
                     help="how a chat answer's reasoning is told from its content and sent apart as "
                          "reasoning_content: \"think\" (<think> tags), \"harmony\" (gpt-oss's channels), "
                          "\"none\" (all of it is content) (default: from the chat template)")
    srv.add_argument("--served-model-name", default=None,
                     help="the `model` clients send (default: the checkpoint folder's name, or 'default')")
    srv.add_argument("--replicas", type=int, default=1,
                     help="engine processes, each a server with its own copy of the model on a port of "
                          "127.0.0.1, behind one front on --host/--port that routes requests to them; on the CPU "
                          "they share --threads (default: 1, one process serving by itself)")
    srv.add_argument("--affinity-prefix-chars", type=int, default=DEFAULT_PREFIX_CHARS,
                     help="with --replicas: requests whose prompts start with the same this many characters go "
                          "to the replica that served the last of them, whose KV cache may still hold them "
                          "(default: %(default)s)")
    add_lora_args(srv, spare=f", plus {RUNTIME_LORA_SLOTS} with --allow-runtime-lora")
    srv.add_argument("--allow-runtime-lora", action="store_true",
                     help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which load and drop "
                          "adapters while the server runs (not with --tp or --replicas yet)")
    srv.set_defaults(handler=_serve, serve_parser=srv)

    ev = commands.add_parser("eval", help="perplexity and bits per byte of a text, scored with a sliding window")
    add_model_args(ev)
    ev.add_argument("--text", default=None,
                    help="UTF-8 text file (default: the public-domain text shipped in runtime/data/eval_text.txt)")
    ev.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                    help=f"tokens per forward pass, at most the model's context (default: {DEFAULT_WINDOW})")
    ev.add_argument("--stride", type=int, default=None,
                    help="tokens each window moves on; each scored token sees at least window - stride tokens "
                         "before it (default: window // 2)")
    ev.add_argument("--eager", action="store_true", help="skip torch.compile (reference ops)")
    ev.add_argument("--json", action="store_true", help="print the result as JSON")
    ev.set_defaults(handler=_eval)

    ins = commands.add_parser("inspect", help="show the checkpoint's format, layers and tensors")
    add_model_args(ins)
    ins.add_argument("--tensors", type=int, default=20, help="how many checkpoint tensors to list (-1: all)")
    ins.set_defaults(handler=_inspect)

    dump = commands.add_parser("dump", help="write graphs before/after each pass, kernel choices, break reports")
    add_model_args(dump)
    dump.add_argument("--out", default="dump", help="output folder (default: ./dump)")
    dump.add_argument("--decode-steps", type=int, default=8, help="decode steps checked for recompiles")
    dump.set_defaults(handler=_dump)

    formats = commands.add_parser("formats", help="list the quantization formats qrt reads or applies")
    formats.add_argument("--markdown", action="store_true", help="as the README's table")
    formats.set_defaults(handler=_formats)

    cache = commands.add_parser("cache", help="list or clear qrt's compile cache ($QRT_CACHE_DIR/compiled)")
    cache.add_argument("action", choices=("list", "clear"))
    cache.set_defaults(handler=_cache)
    return parser


def _model_path(text: str) -> str | None:
    """The word `default` names the embedded model (None to compile_model); a folder called
    default is still reachable as ./default."""
    return None if text == "default" else text


class LoraFlag(NamedTuple):
    """One --lora NAME=PATH."""

    name: str
    path: str

    def __str__(self) -> str:  # as given: a replica's command line repeats it
        return f"{self.name}={self.path}"


def _lora_flag(text: str) -> LoraFlag:
    name, equals, path = text.partition("=")
    if not equals or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a name for the adapter, then its folder or hub id), "
                                         f"got {text!r}")
    try:
        check_name(name)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return LoraFlag(name, path)


def _lora(args, spare: int = 0) -> dict:
    """compile_model's LoRA arguments from the command line ({}: no adapter slots). spare: free
    slots beside those of --lora, where --max-loras does not say."""
    adapters = {}
    for flag in args.lora or ():
        if flag.name in adapters:
            raise ValueError(f"--lora gives two adapters named {flag.name!r}")
        adapters[flag.name] = flag.path
    if args.max_loras is not None and args.max_loras < 1:
        raise ValueError(f"--max-loras must be at least 1, got {args.max_loras}")
    if args.max_loras is not None and args.max_loras < len(adapters):
        raise ValueError(f"--max-loras {args.max_loras} holds fewer than the {len(adapters)} adapters --lora gives")
    if args.max_lora_rank < 1:
        raise ValueError(f"--max-lora-rank must be at least 1, got {args.max_lora_rank}")
    max_loras = args.max_loras or len(adapters) + spare
    if not max_loras:
        return {}
    targets = args.lora_target_modules
    if targets is not None and targets != "all-linear":
        targets = [name.strip() for name in targets.split(",") if name.strip()]
    return {"lora": adapters or None, "max_loras": max_loras, "max_lora_rank": args.max_lora_rank,
            "lora_targets": targets or None}


def _compile(args, path=None, **kwargs):
    from qrt import runtime

    return runtime.compile_model(path or args.path, quant=args.quant, device=args.device, dtype=args.dtype,
                                 build=args.build, autotune=False if args.no_autotune else None,
                                 cache=not args.no_cache, tp=args.tp, revision=None if path else args.revision,
                                 **kwargs)


def _speculative(args) -> dict | None:
    """compile_model's `speculative` from the command line's flags (None: off)."""
    if args.speculative is None:
        if args.draft is not None or args.draft_quant is not None:
            raise ValueError("--draft and --draft-quant need --speculative draft")
        return None
    spec = {"method": args.speculative, "num_speculative_tokens": args.num_speculative_tokens}
    if args.speculative != "draft" and (args.draft is not None or args.draft_quant is not None):
        raise ValueError("--draft and --draft-quant need --speculative draft")
    if args.speculative == "ngram":
        return spec | {"prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    if args.speculative == "mtp":
        return spec
    # The model's own checkpoint by default (with a --draft-quant); `default` names the embedded model.
    draft = _model_path(args.draft) if args.draft is not None else args.path
    return spec | {"model": None if draft is None else str(draft), "quant": args.draft_quant}


# `generate` serves one request: a prompt this short runs through the decode graph (under half a
# second), so a first run compiles that graph alone, not the prefill graph too (about 14 s of 22
# for the default model on 2 cores).
GENERATE_LAZY_PREFILL = 64


def _generate(args) -> int:
    lora = _lora(args)
    if args.use_lora is None and len(lora.get("lora") or {}) == 1:  # one adapter given: it is the one to run
        args.use_lora = next(iter(lora["lora"]))
    if args.use_lora is not None and args.use_lora not in (lora.get("lora") or {}):
        raise ValueError(f"--use-lora {args.use_lora!r} names none of the --lora adapters "
                         f"({', '.join(lora.get('lora') or {}) or 'none given'})")
    model = _compile(args, compile=not args.eager, speculative=_speculative(args),
                     lazy_prefill=GENERATE_LAZY_PREFILL, **lora)
    chat = not args.no_chat and model.tokenizer is not None and bool(getattr(model.tokenizer, "chat_template", None))
    if model.parallel.rank != 0:  # every rank decodes the same tokens; rank 0 shows them
        model.generate(args.prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, seed=args.seed, chat=chat, lora=args.use_lora)
        return 0
    print(f"> {args.prompt}", file=sys.stderr)
    started = time.perf_counter()
    tokens = []

    def stream(token_id):
        tokens.append(token_id)

    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
                "stream": stream, "lora": args.use_lora}
    if chat:
        answer = model.chat(args.prompt, args.max_new_tokens, **sampling)
        thought, text = answer.reasoning, answer.content
    else:
        thought, text = None, model.generate(args.prompt, args.max_new_tokens, **sampling)
    elapsed = time.perf_counter() - started
    if thought is not None:  # a reasoning model's reasoning goes with qrt's notes: stdout is the answer
        print(f"thinking: {thought}", file=sys.stderr)
    print(text)
    print(f"qrt: {len(tokens)} tokens in {elapsed:.2f} s ({len(tokens) / elapsed:.1f} tok/s incl. prefill)", file=sys.stderr)
    speculator = model.engine.speculator
    if speculator is not None:
        print(f"qrt: speculative decoding kept {speculator.accepted} of {speculator.proposed} guesses in "
              f"{speculator.checks} checks", file=sys.stderr)
    return 0


def _chat(args) -> int:
    return run_chat(args, lambda **options: _compile(args, **options))


def _serve(args) -> int:
    from qrt.runtime.engine import DEFAULT_CHUNK
    from qrt.server.serve import serve

    for flag, value, least in (("--max-batch", args.max_batch, 1), ("--max-queue", args.max_queue, 0),
                               ("--max-body-bytes", args.max_body_bytes, 1024), ("--prefill-chunk", args.prefill_chunk, 3)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    chunk_size = args.prefill_chunk or DEFAULT_CHUNK
    lora = _lora(args, spare=RUNTIME_LORA_SLOTS if args.allow_runtime_lora else 0)
    name = args.served_model_name or ("default" if args.path is None
                                      else args.path if is_hub_id(args.path) else Path(args.path).name)
    if name in (lora.get("lora") or {}):
        raise ValueError(f"--lora names an adapter {name!r}, the served model's own name (--served-model-name)")
    if args.replicas != 1:
        return _serve_replicas(args)
    if os.environ.get("RANK", "0") != "0":  # under torchrun with --tp: rank 0 serves, the others follow it
        from qrt.server.lockstep import follow

        model = _compile(args, max_batch_size=args.max_batch, max_seq_len=args.max_seq_len,
                         speculative=_speculative(args), **lora)
        return follow(model, chunk_size=chunk_size, prefix_caching=args.prefix_caching)
    return serve(lambda: _compile(args, max_batch_size=args.max_batch, max_seq_len=args.max_seq_len,
                                  speculative=_speculative(args), **lora),
                 model_name=name, host=args.host, port=args.port, api_key=args.api_key, max_queue=args.max_queue,
                 max_body_bytes=args.max_body_bytes, chunk_size=chunk_size,
                 max_batch=args.max_batch, prefix_caching=args.prefix_caching, tool_call_parser=args.tool_call_parser,
                 reasoning_parser=args.reasoning_parser, drain_timeout_s=args.shutdown_timeout, allow_runtime_lora=args.allow_runtime_lora)


# What the front alone uses: each replica serves on a port of its own on 127.0.0.1, with its share
# of the threads, and reads the API key from its environment rather than its command line. The
# front refuses runtime LoRA loading, so that no replica holds adapters the others lack.
_FRONT_ONLY = {"host", "port", "replicas", "affinity_prefix_chars", "api_key", "allow_runtime_lora"}


def _serve_replicas(args) -> int:
    from qrt.server.replicas import replica_env
    from qrt.server.serve import serve_replicas

    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.tp != 1 or "RANK" in os.environ:
        raise ValueError("--replicas runs whole models, one per process; it does not combine with --tp or torchrun")
    if args.affinity_prefix_chars < 1:
        raise ValueError(f"--affinity-prefix-chars must be at least 1, got {args.affinity_prefix_chars}")
    total = args.threads or len(os.sched_getaffinity(0))
    threads = max(1, total // args.replicas)
    arguments = replica_arguments(args.serve_parser, args)

    def replica_command(port: int) -> list[str]:
        return [sys.executable, "-m", "qrt", "--threads", str(threads), "serve", *arguments,
                "--host", "127.0.0.1", "--port", str(port)]

    env = replica_env(threads)
    env.pop("QRT_API_KEY", None)
    if args.api_key is not None:
        env["QRT_API_KEY"] = args.api_key
    return serve_replicas(replica_command, env, args.replicas, host=args.host, port=args.port,
                          max_batch=args.max_batch, max_body_bytes=args.max_body_bytes,
                          prefix_chars=args.affinity_prefix_chars, drain_timeout_s=args.shutdown_timeout)


def replica_arguments(serve_parser, args) -> list[str]:
    """The `qrt serve` arguments of a replica: the front's own, less those of the front alone."""
    arguments = []
    for action in serve_parser._actions:
        if action.dest in _FRONT_ONLY or action.dest == argparse.SUPPRESS or action.dest == "help":
            continue
        value = getattr(args, action.dest)
        if not action.option_strings:  # the checkpoint
            arguments.insert(0, "default" if value is None else str(value))
        elif isinstance(value, list):  # a repeated flag (--lora)
            arguments += [part for item in value for part in (action.option_strings[0], str(item))]
        elif value != action.default:
            arguments += [action.option_strings[0]] if action.nargs == 0 else [action.option_strings[0], str(value)]
    return arguments


def _eval(args) -> int:
    from qrt.runtime.evaluate import DEFAULT_TEXT, check_window, perplexity_of_text, read_text

    text_path = Path(args.text) if args.text is not None else DEFAULT_TEXT
    text = read_text(text_path)
    stride = args.window // 2 if args.stride is None else args.stride
    check_window(args.window, stride)  # before loading: a typo should not cost a model load
    # The full forward uses no KV cache; sizing it to the window instead of 2048 saves its memory.
    model = _compile(args, compile=not args.eager, warmup=False, max_seq_len=args.window)
    result = perplexity_of_text(model, text, window=args.window, stride=stride)
    if model.parallel.rank != 0:  # every rank computed the same logits; rank 0 reports
        return 0
    if args.json:
        report = {"model": str(model.source), "quant": args.quant, "quantization": model.scheme.describe(),
                  "text": str(text_path), "compiled": not args.eager, **result.as_dict()}
        print(json.dumps(report, indent=2))
        return 0
    special = "BOS prepended" if result.bos_added else "no special tokens added"
    compiled = "eager" if args.eager else "includes compiling the forward graph"
    print(f"model:          {model.source}")
    print(f"quantization:   {model.scheme.describe()}")
    print(f"text:           {text_path} ({result.text_bytes} bytes, {result.tokens} tokens, {special})")
    print(f"window:         {result.window} tokens, stride {result.stride} ({result.windows} forward passes)")
    print(f"scored tokens:  {result.scored_tokens}")
    print(f"perplexity:     {result.perplexity:.4f}")
    print(f"bits per byte:  {result.bits_per_byte:.4f}")
    print(f"time:           {result.seconds:.1f} s ({compiled})")
    return 0


def _inspect(args) -> int:
    from qrt.checkpoint.source import SafetensorsCheckpoint
    from qrt.checkpoint.config import LoadConfig
    from qrt.checkpoint.safetensors_files import checkpoint_files
    from qrt.runtime.registry import ModelRegistry
    from qrt.runtime.resolve import resolve

    resolved = resolve(args.path, args.quant, LoadConfig(), revision=args.revision)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 describes the checkpoint
        print(f"checkpoint:    {resolved.path}")
        print(f"architectures: {resolved.hf_config.get('architectures')}  "
              f"(supported: {', '.join(ModelRegistry.supported())})")
        if isinstance(resolved.checkpoint, SafetensorsCheckpoint):
            _print_tensors(checkpoint_files(resolved.checkpoint.folder), args.tensors)
        print(f"quantization:  {resolved.scheme.describe()}")
    model = _compile(args, compile=False, progress=False, path=resolved.path).model
    in_rank_order(model.config.parallel, lambda: _print_layers(model, args.device, model.config.parallel))
    return 0


def _print_layers(model, device: str, parallel) -> None:
    sharded = f", rank {parallel.rank} of {parallel.size}" if parallel.sharded else ""
    print(f"\nlinear layers on {device} after the loader pass{sharded}:")
    print(f"  {'layer':<40} {'format':<6} {'weight':<14} {'split':<8} {'storage layout':<44} kernel")
    for name, module in model.named_modules():
        if hasattr(module, "quant_method"):
            weight = module.weight
            split = "column" if module.n_slices is not None else "row" if module.k_slice is not None else "-"
            shape = "x".join(str(d) for d in weight.shape)
            print(f"  {name:<40} {module.quant_method.name:<6} {shape:<14} {split:<8} "
                  f"{getattr(weight, 'storage_layout', '?'):<44} {getattr(weight, 'kernel', '?')}")
    sys.stdout.flush()


def in_rank_order(parallel, show) -> None:
    """Call `show` on every rank, one rank after the other (their output would interleave)."""
    for rank in range(parallel.size):
        if rank == parallel.rank:
            show()
        if parallel.sharded:
            torch.distributed.barrier(group=parallel.group)


def _print_tensors(files, limit: int) -> None:
    from qrt.checkpoint.safetensors_files import read_header

    total = 0
    print(f"weight files:  {', '.join(f.name for f in files)}")
    print("tensors:")
    for path in files:
        for entry in read_header(path):
            if limit < 0 or total < limit:
                print(f"  {entry.name:<56} {entry.dtype_name:<8} {list(entry.shape)}")
            total += 1
    if 0 <= limit < total:
        print(f"  … {total - limit} more (--tensors -1 lists all)")


def _dump(args) -> int:
    from qrt.passes.dump import write_dump

    model = _compile(args, warmup=False)
    ids = torch.randint(0, model.vocab_size, (1, 8))
    explain = {}
    with torch.no_grad():
        for role in ("prefill", "decode"):
            explain[role] = torch._dynamo.explain(model.model)(*model.graph_inputs(role))
        model.generate(ids[0].tolist(), max_new_tokens=2, stop_at_eos=False)
        model(ids)
        recompile_check = _check_no_recompiles(model, args.decode_steps)
    header = [f"- checkpoint: `{model.source}`", f"- quantization: {model.scheme.describe()}",
              f"- device: {args.device}", f"- graphs compiled: {model.compile_report()}"]
    out = Path(args.out)
    parallel = model.parallel
    if parallel.sharded:  # each rank compiles its own graphs: one folder per rank
        header.append(f"- tensor parallel: rank {parallel.rank} of {parallel.size}")
        out = out / f"rank{parallel.rank}"
    index = write_dump(out, [b.log for b in model.backends.values()], explain, recompile_check, header)
    print(f"qrt: wrote {index}")
    return 0


def _check_no_recompiles(model, steps: int) -> str:
    """Run `steps` decode steps with recompiles forbidden; say what happened."""
    try:
        with model.guarded(), torch.compiler.set_stance("fail_on_recompile"):
            model.generate([1, 2, 3], max_new_tokens=steps, stop_at_eos=False)
    except Exception as err:  # the stance raises a plain RuntimeError naming the guard that failed
        return f"FAILED: decode recompiled within {steps} steps: {err}"
    return f"ok: {steps} decode steps under torch.compiler.set_stance('fail_on_recompile'), no recompiles"


def _formats(args) -> int:
    if args.markdown:
        print(formats_markdown())
        return 0
    def kernels(entry) -> str:
        return "\n" + " " * 25 + "kernels: " + kernels_of(entry.computes).replace("`", "")

    print("stored (detected from the checkpoint):")
    for fmt in stored_formats().values():
        print(f"  {fmt.quant_method:20s} {fmt.summary}{kernels(fmt)}")
    for ct in compressed_tensors_formats().values():
        print(f"    compressed-tensors {ct.name}: {ct.summary}{kernels(ct)}")
    for side in side_file_formats().values():
        print(f"  {side.file_name:20s} {side.name}: {side.summary}{kernels(side)}")
    print("online (--quant, applied to an unquantized checkpoint while it loads):")
    for online in online_formats().values():
        print(f"  {online.name:20s} {online.summary}; {online.lm_head_summary or 'lm_head kept as stored'}"
              f"{kernels(online)}")
    return 0


def _cache(args) -> int:
    from qrt.runtime.compile_cache import Entry, clear_entries, compiled_dir, list_entries, qrt_inductor_dir

    if args.action == "clear":
        files, size = clear_entries()
        print(f"qrt: removed {files} files ({size / 2**20:.1f} MiB) from {compiled_dir()} and {qrt_inductor_dir()}")
        return 0
    entries = list_entries()
    print(f"{compiled_dir()}: {len(entries)} entries")
    for entry in entries:
        if not isinstance(entry, Entry):
            path, problem = entry
            print(f"  {path.name}  UNUSABLE ({problem}); rebuilt on next use, or run `qrt cache clear`")
            continue
        meta = entry.meta
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(meta.get("created", 0)))
        parts = meta.get("parts", {})
        print(f"  {entry.path.stem}  {created}  {entry.size / 2**20:6.1f} MiB  {meta.get('source')}  "
              f"quant={meta.get('quant')}  device={meta.get('device')}  max_seq_len={parts.get('max_seq_len')}  "
              f"max_batch_size={parts.get('max_batch_size')}  {meta.get('payload', 'torch caches')}  "
              f"cold compile {meta.get('compile_seconds')} s")
    return 0
