"""The HTTP side of `qrt serve`: OpenAI's completions, chat completions and models endpoints,
health and metrics, over an EngineLoop."""

import asyncio
import json
import secrets
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from qrt.runtime.engine import ERROR, Update
from qrt.runtime.sampling import SamplingParams

from .body_limit import BodyLimit
from .protocol import ChatCompletionRequest, CompletionRequest, error_body

DISCONNECT_POLL_S = 0.05  # how often a non-streaming request checks that its client is still there
RETRY_AFTER_S = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, kind, param, code), headers


def create_app(loop, *, model_name: str, api_key: str | None = None, max_queue: int = 64,
               max_body_bytes: int = 1 << 20, drain_timeout_s: float = 600) -> FastAPI:
    """loop: an EngineLoop, started with the app and stopped (after its requests finish) with it."""
    metrics = loop.metrics

    @asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        await asyncio.to_thread(loop.stop, drain_timeout_s)

    app = FastAPI(title="qrt", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.exception_handler(ApiError)
    async def _api_error(request, err: ApiError):
        if err.status in (400, 404, 413, 503):
            metrics.requests.labels(outcome="rejected").inc()
        return JSONResponse(err.body, status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, err: RequestValidationError):
        metrics.requests.labels(outcome="rejected").inc()
        first = err.errors()[0]
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden":
            message = f"unknown field {'.'.join(where)!r}: qrt does not take it (the OpenAI API does not define it here)"
        elif first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', message)}"
        elif where and not message.startswith(where[-1]):
            message = f"{'.'.join(where)}: {message}"
        return JSONResponse(error_body(message, param=".".join(where) or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(err.detail), kind), status_code=err.status_code)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header `Authorization: Bearer <key>`",
                           "authentication_error", code="invalid_api_key")

    def ready_model():
        if loop.load_error is not None:
            raise ApiError(503, f"the model failed to load: {loop.load_error}", "server_error")
        if not loop.ready.is_set():
            raise ApiError(503, "the model is still loading and compiling; GET /health says when it is ready",
                           "server_error", headers={"Retry-After": str(RETRY_AFTER_S)})
        return loop.model

    @app.get("/health")
    async def health():
        if loop.ready.is_set():
            return {"status": "ok"}
        status = "failed" if loop.load_error is not None else "loading"
        return JSONResponse({"status": status, "error": loop.load_error}, status_code=503)

    @app.get("/metrics")
    async def metrics_page():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        model = ready_model()
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "qrt", "max_model_len": model.max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        authorize(request)
        model = _checked(body)
        if isinstance(body.prompt, str):
            prompt = _encode(lambda: model.encode(body.prompt), "prompt")
        else:
            prompt = _token_ids(model, body.prompt, "prompt")
        return await _serve(body, model, prompt, body.max_tokens, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        authorize(request)
        model = _checked(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt = _encode(lambda: model.encode_messages(messages), "messages")
        return await _serve(body, model, prompt, body.token_limit(), request, chat=True)

    def _checked(body):
        model = ready_model()
        if body.model != model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist here; this server serves {model_name!r}",
                           "not_found_error", param="model", code="model_not_found")
        return model

    async def _serve(body, model, prompt: list[int], limit: int | None, request: Request, chat: bool):
        room = model.max_seq_len - len(prompt)
        if limit is None:
            limit = room
        if limit < 1 or limit > room:
            field = "max_tokens"
            raise ApiError(400, f"the prompt ({len(prompt)} tokens) + {field} ({limit}) = {len(prompt) + limit} "
                                f"tokens exceeds max_seq_len ({model.max_seq_len}) of this server",
                           param=field)
        stop_ids = _token_ids(model, list(body.stop_ids()), "stop", allow_empty=True)
        if loop.queue_depth() >= max_queue:
            raise ApiError(503, f"the queue is full ({max_queue} requests waiting for a slot); retry shortly",
                           "server_error", headers={"Retry-After": str(RETRY_AFTER_S)})
        sampling = SamplingParams(body.temperature, body.top_k, None if body.top_p >= 1 else body.top_p, body.seed)
        try:
            engine_request = model.request(prompt, limit, sampling, stop_at_eos=not body.ignore_eos,
                                           stop_ids=stop_ids, stop_strings=body.stop_strings(), text=True)
        except ValueError as err:
            raise ApiError(400, str(err)) from None
        seq, updates = loop.submit(engine_request, asyncio.get_running_loop())
        reply = _Reply(chat, model_name, len(prompt))
        if body.stream:
            return StreamingResponse(_stream(seq, updates, reply, body.include_usage()),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(seq, updates, reply, request)

    async def _whole(seq, updates: asyncio.Queue, reply: "_Reply", request: Request):
        clock = asyncio.get_running_loop().time
        next_check = clock() + DISCONNECT_POLL_S
        try:
            while True:
                # Tokens may come faster than the poll interval: the check goes by the clock,
                # not by a quiet spell.
                try:
                    update = await asyncio.wait_for(updates.get(), max(0.0, next_check - clock()))
                except asyncio.TimeoutError:
                    update = None
                if update is not None and update.finish_reason is not None:
                    break
                if clock() >= next_check:
                    if await request.is_disconnected():
                        seq.cancel()  # the slot is freed at the engine's next step
                        return Response(status_code=499)
                    next_check = clock() + DISCONNECT_POLL_S
        except BaseException:
            seq.cancel()
            raise
        if update.finish_reason == ERROR:
            return JSONResponse(_engine_error(update), status_code=500)
        return reply.whole(seq.text, update.finish_reason, len(seq.tokens))

    async def _stream(seq, updates: asyncio.Queue, reply: "_Reply", include_usage: bool):
        try:
            if reply.chat:
                yield _event(reply.chunk({"role": "assistant", "content": ""}, None, include_usage))
            while True:
                update = await updates.get()
                if update.finish_reason == ERROR:
                    yield _event(_engine_error(update))
                    break
                if update.text:
                    yield _event(reply.chunk(update.text, None, include_usage))
                if update.finish_reason is not None:
                    yield _event(reply.chunk(None, update.finish_reason, include_usage))
                    if include_usage:
                        yield _event(reply.usage_chunk(len(seq.tokens)))
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the task is cancelled) or the stream ended
            seq.cancel()

    return app


def _engine_error(update: Update) -> dict:
    return error_body(f"generation failed: {type(update.error).__name__}: {update.error}", "server_error")


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


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


class _Reply:
    """The response and stream-chunk JSON of one request."""

    def __init__(self, chat: bool, model_name: str, prompt_tokens: int):
        self.chat, self.model, self.prompt_tokens = chat, model_name, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str, completion_tokens: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            kind = "text_completion"
        return {**self._head(kind), "choices": [choice], "usage": self.usage(completion_tokens)}

    def chunk(self, delta, finish_reason: str | None, include_usage: bool) -> dict:
        """delta: new text (a dict for chat's first, role-only chunk), None in the last chunk."""
        if self.chat:
            content = delta if isinstance(delta, dict) else {} if delta is None else {"content": delta}
            choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
            kind = "text_completion"
        chunk = {**self._head(kind), "choices": [choice]}
        if include_usage:
            chunk["usage"] = None  # as OpenAI: only the extra last chunk carries it
        return chunk

    def usage_chunk(self, completion_tokens: int) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self.usage(completion_tokens)}
