"""The HTTP side of `qrt serve`: OpenAI's completions, chat completions, embeddings and models endpoints,
vLLM's LoRA adapter endpoints (lora_routes.py), health and metrics, over an EngineLoop. The routes
check and translate; `Service` queues a request's choices on the engine, and delivery.py answers
with replies.py's JSON."""

import asyncio
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from qrt.runtime import reasoning
from qrt.runtime.lora import UnknownAdapter
from qrt.runtime.sampling import SamplingParams

from . import delivery, tools
from .api_errors import ApiError, add_error_handlers
from .body_limit import BodyLimit
from .budgets import Budgets
from .chat_page import add_chat_page
from .grammar_gate import GrammarGate
from .logprob_shapes import LogprobShapes
from .embeddings import Embeddings
from .lora_routes import add_lora_routes, adapter_cards, model_not_found
from .protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from .replies import Prompt, Reply, Scoring

RETRY_AFTER_S = 1


class Service:
    """What the routes share: the engine loop, who may call, how many requests may wait."""

    def __init__(self, loop, model_name: str, api_key: str | None, max_queue: int, tool_call_parser: str,
                 reasoning_parser: str):
        self.loop, self.model_name, self.api_key = loop, model_name, api_key
        self.max_queue, self.tool_call_parser, self.reasoning_parser = max_queue, tool_call_parser, reasoning_parser
        self._budgets = self._gate = None  # made with the model: they read its settings

    def limits(self, model) -> tuple[Budgets, GrammarGate]:
        if self._budgets is None:
            self._budgets = Budgets(model.max_seq_len, model.max_batch_size, self.max_queue)
            self._gate = GrammarGate(model)
        return self._budgets, self._gate

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header `Authorization: Bearer <key>`",
                           "authentication_error", code="invalid_api_key")

    def ready_model(self):
        loop = self.loop
        if loop.load_error is not None:
            raise ApiError(503, f"the model failed to load: {loop.load_error}", "server_error")
        if loop.fault is not None:
            raise ApiError(503, f"the server is shutting down after a fault: {loop.fault}", "server_error")
        if loop.draining.is_set():
            raise ApiError(503, "the server is shutting down: it finishes the requests it holds and takes no new "
                                "ones", "server_error")
        if not loop.ready.is_set():
            raise ApiError(503, "the model is still loading and compiling; GET /health says when it is ready",
                           "server_error", headers={"Retry-After": str(RETRY_AFTER_S)})
        return loop.model

    def model_for(self, body):
        """The served model and the LoRA adapter the request names by its `model` (None: the base)."""
        model = self.ready_model()
        if body.model == self.model_name:
            return model, None
        if body.model in model.lora_names:
            return model, body.model
        raise model_not_found(body.model, self.model_name, model)

    def _reasoning_parser(self, model) -> str | None:
        if self.reasoning_parser == "auto":
            return reasoning.parser_for(model.tokenizer.chat_template)
        return None if self.reasoning_parser == "none" else self.reasoning_parser

    async def serve(self, body, model, lora: str | None, prompts: list[Prompt], limit: int | None,
                    request: Request, chat: bool, scoring: Scoring):
        """Check a request's choices, queue them on the engine and answer, whole or streamed."""
        budgets, gate = self.limits(model)
        budgets.check_choices(len(prompts), body.n)
        budgets.check_seed(body.seed, body.n)
        prompt_tokens = sum(len(p.ids) for p in prompts)  # counted once per prompt, whatever n is
        prompts = [prompt for prompt in prompts for _ in range(body.n)]  # choice i * n + j: prompt i's j-th
        requests = []
        for prompt in prompts:
            room = model.max_seq_len - len(prompt.ids)
            tokens = room if limit is None else limit
            if tokens > room or (tokens < 1 and scoring.prompt is None):
                raise ApiError(400, f"the prompt ({len(prompt.ids)} tokens) + max_tokens ({tokens}) = "
                                    f"{len(prompt.ids) + tokens} tokens exceeds max_seq_len ({model.max_seq_len}) "
                                    f"of this server", param="max_tokens")
            requests.append((prompt, tokens))
        budgets.check_logprobs([(len(prompt.ids), tokens) for prompt, tokens in requests], scoring.generated,
                               scoring.prompt, "top_logprobs" if chat and body.top_logprobs else "logprobs")
        stop_ids = _token_ids(model, list(body.stop_ids()), "stop", allow_empty=True)
        biases = body.biases()
        _token_ids(model, [token for token, _ in biases], "logit_bias", allow_empty=True)
        grammar = await gate.grammar(body)
        # No await from here to the submits: the room checked is the room the request takes.
        budgets.check_room(self.loop.in_hand(), len(requests))
        try:
            engine_requests = [model.request(prompt.ids, tokens, _sampling(body, biases, i % body.n),
                                             stop_at_eos=not body.ignore_eos, stop_ids=stop_ids,
                                             stop_strings=body.stop_strings(), text=True,
                                             logprobs=scoring.generated, prompt_logprobs=scoring.prompt,
                                             grammar=grammar, lora=lora)
                               for i, (prompt, tokens) in enumerate(requests)]
        except UnknownAdapter:  # unloaded since model_for
            raise model_not_found(body.model, self.model_name, model) from None
        except ValueError as err:
            raise ApiError(400, str(err)) from None
        reader = (tools.reader_for(model.tokenizer.chat_template) if self.tool_call_parser == "auto"
                  else self.tool_call_parser)
        reply = Reply(chat, body.model, prompt_tokens, LogprobShapes(model.tokenizer), scoring, prompts,
                      body.tools if chat else None, body.tool_mode() if chat else None, reader,
                      self._reasoning_parser(model))
        # Submitted last: from here on the answer (delivery.py) owns the choices and cancels them.
        running = [self.loop.submit(engine_request, asyncio.get_running_loop()) for engine_request in engine_requests]
        if body.stream:
            return delivery.streamed(running, reply, body.include_usage())
        return await delivery.whole(running, reply, request)


def create_app(loop, *, model_name: str, api_key: str | None = None, max_queue: int = 64,
               max_body_bytes: int = 1 << 20, drain_timeout_s: float = 600, tool_call_parser: str = "auto",
               reasoning_parser: str = "auto", allow_runtime_lora: bool = False) -> FastAPI:
    """loop: an EngineLoop, started with the app and stopped (after its requests finish) with it.
    tool_call_parser: how "auto" tool choice reads calls (tools.READERS), or "auto" for the one
    of the chat template's family. reasoning_parser: how a chat answer's reasoning is told from its
    content (reasoning.PARSERS, "none", or "auto" for the chat template's family).
    allow_runtime_lora: serve the LoRA load and unload endpoints."""
    service = Service(loop, model_name, api_key, max_queue, tool_call_parser, reasoning_parser)

    @asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        await asyncio.to_thread(loop.stop, drain_timeout_s)

    app = FastAPI(title="qrt", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    add_error_handlers(app, loop.metrics)
    add_chat_page(app)

    @app.get("/health")
    async def health():
        if loop.fault is not None or loop.draining.is_set():  # a balancer stops sending here
            return JSONResponse({"status": "stopping", "error": loop.fault}, status_code=503)
        if loop.ready.is_set():
            return {"status": "ok"}
        status = "failed" if loop.load_error is not None else "loading"
        return JSONResponse({"status": status, "error": loop.load_error}, status_code=503)

    @app.get("/metrics")
    async def metrics_page():
        return Response(loop.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        service.authorize(request)
        model = service.ready_model()
        base = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "qrt",
                "max_model_len": model.max_seq_len}
        return {"object": "list", "data": [base, *adapter_cards(model, model_name)]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        service.authorize(request)
        model, lora = service.model_for(body)
        prompts = [Prompt(_encode(lambda: model.encode(p), "prompt"), p) if isinstance(p, str)
                   else Prompt(_token_ids(model, p, "prompt"), None) for p in body.prompts()]
        # Echo with logprobs scores the prompt; echo with max_tokens 0 has the engine stop after it.
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        if body.echo and body.max_tokens == 0 and prompt_logprobs is None:
            prompt_logprobs = 0
        scoring = Scoring(body.logprobs, prompt_logprobs, body.echo, top=True)
        return await service.serve(body, model, lora, prompts, body.max_tokens, request, chat=False,
                                   scoring=scoring)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        service.authorize(request)
        model, lora = service.model_for(body)
        messages = [tools.template_message(m) for m in body.messages]
        offered = tools.template_tools(body.tools) if body.tool_mode() is not None else None
        variables = body.template_variables()
        prompt = Prompt(_encode(lambda: model.encode_messages(messages, offered, variables), "messages"), None)
        top = body.top_logprobs or 0
        scoring = Scoring(top if body.logprobs else None, None, False, top=body.top_logprobs is not None)
        return await service.serve(body, model, lora, [prompt], body.token_limit(), request, chat=True,
                                   scoring=scoring)

    embeddings = Embeddings(service)

    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, request: Request):
        service.authorize(request)
        model, _ = service.model_for(body)  # an embedding model has no adapters
        return await embeddings.answer(body, model)

    add_lora_routes(app, service, allow_runtime_lora)
    return app


def _sampling(body, biases: list, choice: int) -> SamplingParams:
    """A choice's sampling: the request's, with seed + choice when it has a seed (so that n > 1
    gives n different sequences, each the same on every run)."""
    seed = None if body.seed is None else body.seed + choice
    try:
        return SamplingParams(body.temperature, body.top_k, None if body.top_p >= 1 else body.top_p, seed,
                              body.presence_penalty, body.frequency_penalty, body.repetition_penalty, tuple(biases),
                              body.min_tokens)
    except ValueError as err:
        raise ApiError(400, str(err)) from None


def _encode(encode, field: str) -> list[int]:
    try:
        return encode()
    except ValueError as err:
        raise ApiError(400, f"{field}: {err}", param=field) from None


def _token_ids(model, ids: list[int], field: str, allow_empty: bool = False) -> list[int]:
    if not ids and not allow_empty:
        raise ApiError(400, f"{field} is empty; give at least one token", param=field)
    bad = [i for i in ids if not 0 <= i < model.vocab_size]
    if bad:
        raise ApiError(400, f"{field}: token ids must be in [0, {model.vocab_size}); got {bad[:5]}", param=field)
    return list(ids)
