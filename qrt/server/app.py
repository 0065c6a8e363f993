"""The HTTP side of `qrt serve`: OpenAI's completions, chat completions and models endpoints,
health and metrics, over an EngineLoop."""

import asyncio
import json
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from qrt.runtime.engine import ERROR, STOP, Update
from qrt.runtime.sampling import SamplingParams

from .body_limit import BodyLimit
from .logprob_shapes import LogprobShapes
from . import tools
from .protocol import ChatCompletionRequest, CompletionRequest, error_body

DISCONNECT_POLL_S = 0.05  # how often a non-streaming request checks that its client is still there
RETRY_AFTER_S = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, kind, param, code), headers


def create_app(loop, *, model_name: str, api_key: str | None = None, max_queue: int = 64,
               max_body_bytes: int = 1 << 20, drain_timeout_s: float = 600, tool_call_parser: str = "auto") -> FastAPI:
    """loop: an EngineLoop, started with the app and stopped (after its requests finish) with it.
    tool_call_parser: how "auto" tool choice reads calls (tools.READERS), or "auto" for the one
    of the chat template's family."""
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
        prompts = [Prompt(_encode(lambda: model.encode(p), "prompt"), p) if isinstance(p, str)
                   else Prompt(_token_ids(model, p, "prompt"), None) for p in body.prompts()]
        # Echo with logprobs scores the prompt; echo with max_tokens 0 has the engine stop after it.
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        if body.echo and body.max_tokens == 0 and prompt_logprobs is None:
            prompt_logprobs = 0
        scoring = Scoring(body.logprobs, prompt_logprobs, body.echo, top=True)
        return await _serve(body, model, prompts, body.max_tokens, request, chat=False, scoring=scoring)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        authorize(request)
        model = _checked(body)
        messages = [tools.template_message(m) for m in body.messages]
        offered = tools.template_tools(body.tools) if body.tool_mode() is not None else None
        prompt = Prompt(_encode(lambda: model.encode_messages(messages, offered), "messages"), None)
        top = body.top_logprobs or 0
        scoring = Scoring(top if body.logprobs else None, None, False, top=body.top_logprobs is not None)
        return await _serve(body, model, [prompt], body.token_limit(), request, chat=True, scoring=scoring)

    def _checked(body):
        model = ready_model()
        if body.model != model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist here; this server serves {model_name!r}",
                           "not_found_error", param="model", code="model_not_found")
        return model

    async def _serve(body, model, prompts: list["Prompt"], limit: int | None, request: Request, chat: bool,
                     scoring: "Scoring"):
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
        stop_ids = _token_ids(model, list(body.stop_ids()), "stop", allow_empty=True)
        if loop.queue_depth() + len(requests) > max_queue:
            raise ApiError(503, f"the queue is full ({max_queue} requests waiting for a slot); retry shortly",
                           "server_error", headers={"Retry-After": str(RETRY_AFTER_S)})
        biases = body.biases()
        _token_ids(model, [token for token, _ in biases], "logit_bias", allow_empty=True)
        try:
            grammar = body.grammar()
            engine_requests = [model.request(prompt.ids, tokens, _sampling(body, biases, i % body.n),
                                             stop_at_eos=not body.ignore_eos, stop_ids=stop_ids,
                                             stop_strings=body.stop_strings(), text=True,
                                             logprobs=scoring.generated, prompt_logprobs=scoring.prompt,
                                             grammar=grammar)
                               for i, (prompt, tokens) in enumerate(requests)]
        except ValueError as err:
            raise ApiError(400, str(err)) from None
        running = [loop.submit(engine_request, asyncio.get_running_loop()) for engine_request in engine_requests]
        reader = tools.reader_for(model.tokenizer.chat_template) if tool_call_parser == "auto" else tool_call_parser
        reply = _Reply(chat, model_name, prompt_tokens, LogprobShapes(model.tokenizer), scoring, prompts,
                       body.tools if chat else None, body.tool_mode() if chat else None, reader)
        if body.stream:
            return StreamingResponse(_stream(running, reply, body.include_usage()),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(running, reply, request)

    async def _whole(running: list, reply: "_Reply", request: Request):
        clock = asyncio.get_running_loop().time
        next_check = clock() + DISCONNECT_POLL_S
        ended = {}  # choice -> its last Update
        try:
            while len(ended) < len(running):
                index = next(i for i in range(len(running)) if i not in ended)
                seq, updates = running[index]
                # Tokens may come faster than the poll interval: the check goes by the clock,
                # not by a quiet spell.
                try:
                    update = await asyncio.wait_for(updates.get(), max(0.0, next_check - clock()))
                except asyncio.TimeoutError:
                    update = None
                if update is not None and update.finish_reason is not None:
                    ended[index] = update
                if clock() >= next_check:
                    if await request.is_disconnected():
                        for seq, _ in running:
                            seq.cancel()  # the slots are freed at the engine's next step
                        return Response(status_code=499)
                    next_check = clock() + DISCONNECT_POLL_S
        except BaseException:
            for seq, _ in running:
                seq.cancel()
            raise
        failed = [update for update in ended.values() if update.finish_reason == ERROR]
        if failed:
            return JSONResponse(_engine_error(failed[0]), status_code=500)
        return reply.whole([seq for seq, _ in running])

    async def _stream(running: list, reply: "_Reply", include_usage: bool):
        merged: asyncio.Queue = asyncio.Queue()  # (choice, Update) of every choice, as they come

        async def forward(index: int, updates: asyncio.Queue):
            while True:
                update = await updates.get()
                await merged.put((index, update))
                if update.finish_reason is not None:
                    return

        forwarders = [asyncio.create_task(forward(i, updates)) for i, (_, updates) in enumerate(running)]
        try:
            if reply.chat:
                for index in range(len(running)):
                    yield _event(reply.chunk(index, {"role": "assistant", "content": ""}, None, [], include_usage))
            pending = [[] for _ in running]  # scored tokens not yet sent, per choice
            # With echo, a choice's prompt goes first: at once, or, when it is scored, with its
            # scores, which the engine has computed by the time the choice's first update comes.
            echoed = [not reply.scoring.echo for _ in running]
            if reply.scoring.echo and reply.scoring.prompt is None:
                for index, (seq, _) in enumerate(running):
                    echoed[index] = True
                    yield _event(reply.echo_chunk(index, seq, include_usage))
            left, failed = len(running), False
            while left:
                index, update = await merged.get()
                seq = running[index][0]
                if update.finish_reason == ERROR:
                    yield _event(_engine_error(update))
                    failed = True
                    break
                if not echoed[index]:
                    echoed[index] = True
                    yield _event(reply.echo_chunk(index, seq, include_usage))
                if update.logprob is not None:
                    pending[index].append(update.logprob)
                if update.text and reply.tool_mode is None:
                    yield _event(reply.chunk(index, update.text, None, pending[index], include_usage))
                    pending[index] = []
                if update.finish_reason is not None:
                    finish_reason = update.finish_reason
                    if reply.tool_mode is not None:  # the answer goes whole: only now is it known to be calls
                        message, finish_reason = reply.message(seq)
                        yield _event(reply.chunk(index, message, None, pending[index], include_usage))
                        pending[index] = []
                    yield _event(reply.chunk(index, None, finish_reason, pending[index], include_usage))
                    left -= 1
            if include_usage and not failed:
                yield _event(reply.usage_chunk(sum(len(seq.tokens) for seq, _ in running)))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the task is cancelled) or the stream ended
            for task in forwarders:
                task.cancel()
            for seq, _ in running:
                seq.cancel()

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


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str | None  # as the client sent it; None for token ids (echo decodes them)


@dataclass(frozen=True)
class Scoring:
    """What a request asked to be scored: `generated`: the new tokens, with that many alternatives
    (None: not); `prompt`: the prompt's tokens likewise; `echo`: the prompt is sent back; `top`:
    chat lists the alternatives (top_logprobs was given)."""
    generated: int | None
    prompt: int | None
    echo: bool
    top: bool

    @property
    def reported(self) -> bool:
        return self.generated is not None


class _Reply:
    """The response and stream-chunk JSON of one request (one choice per prompt)."""

    def __init__(self, chat: bool, model_name: str, prompt_tokens: int, shapes: LogprobShapes, scoring: Scoring,
                 prompts: list[Prompt], offered: list | None = None, tool_mode: str | None = None,
                 reader: str = "hermes"):
        self.chat, self.model, self.prompt_tokens = chat, model_name, prompt_tokens
        self.shapes, self.scoring, self.prompts = shapes, scoring, prompts
        self.offered, self.tool_mode = offered, tool_mode  # the request's tools, and tools.py's mode
        self.reader = reader  # tools.READERS' key for "auto"
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.sent = [[] for _ in prompts]  # per choice, the ids whose text went out (for text_offset)

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _echo_text(self, index: int) -> str:
        prompt = self.prompts[index]
        return prompt.text if prompt.text is not None else self.shapes.tokenizer.decode(prompt.ids)

    def _logprobs(self, index: int, ids: list[int], scores: list) -> dict | None:
        """The scores of `ids`, the next tokens of choice `index`, in this endpoint's shape."""
        if not self.scoring.reported:
            return None
        if self.chat:
            return self.shapes.chat(scores, self.scoring.top)
        shaped = self.shapes.legacy(ids, scores, self.sent[index])
        self.sent[index] += ids
        return shaped

    def whole(self, sequences: list) -> dict:
        choices = []
        for index, seq in enumerate(sequences):
            text, logprobs = seq.text, None
            if self.scoring.echo:
                text = self._echo_text(index) + text
                if self.scoring.reported:
                    prompt = self._logprobs(index, list(seq.request.prompt), seq.prompt_logprobs)
            if self.scoring.reported:
                logprobs = self._logprobs(index, seq.tokens, seq.logprobs)
                if self.scoring.echo:
                    logprobs = {key: prompt[key] + logprobs[key] for key in logprobs}
            if self.chat:
                message, finish_reason = self.message(seq)
                choices.append({"index": index, "message": {"role": "assistant", **message},
                                "logprobs": logprobs, "finish_reason": finish_reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": seq.finish_reason})
        kind = "chat.completion" if self.chat else "text_completion"
        completion_tokens = sum(len(seq.tokens) for seq in sequences)
        return {**self._head(kind), "choices": choices, "usage": self.usage(completion_tokens)}

    def message(self, seq) -> tuple[dict, str]:
        """A chat choice's answer ({"content"}, or {"content", "tool_calls"}) and finish_reason.
        A complete answer in a tool mode is read for calls; one cut short stays text."""
        if self.tool_mode is None or seq.finish_reason != STOP:
            return {"content": seq.text}, seq.finish_reason
        content, calls = tools.read_answer(seq.text, self.offered, self.tool_mode, self.reader)
        if not calls:
            return {"content": content}, seq.finish_reason
        return {"content": content, "tool_calls": calls}, "tool_calls"

    def echo_chunk(self, index: int, seq, include_usage: bool) -> dict:
        """A completions stream's first chunk of a choice with echo: its prompt (and its scores)."""
        scores = self._logprobs(index, list(seq.request.prompt), seq.prompt_logprobs)
        return self._chunk(index, {"text": self._echo_text(index)}, None, scores, include_usage)

    def chunk(self, index: int, delta, finish_reason: str | None, scores: list, include_usage: bool) -> dict:
        """delta: new text (a dict for chat's first, role-only chunk), None in the last chunk;
        scores: the tokens scored since the choice's last chunk."""
        logprobs = self._logprobs(index, [s.token for s in scores], scores) if scores else None
        if self.chat:
            content = delta if isinstance(delta, dict) else {} if delta is None else {"content": delta}
            if "tool_calls" in content:  # a stream's calls carry their place in the list
                content = {**content, "tool_calls": [{"index": i, **call} for i, call in enumerate(content["tool_calls"])]}
            return self._chunk(index, {"delta": content}, finish_reason, logprobs, include_usage)
        return self._chunk(index, {"text": delta or ""}, finish_reason, logprobs, include_usage)

    def _chunk(self, index: int, body: dict, finish_reason, logprobs, include_usage: bool) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {**self._head(kind), "choices": [{"index": index, **body, "logprobs": logprobs,
                                                  "finish_reason": finish_reason}]}
        if include_usage:
            chunk["usage"] = None  # as OpenAI: only the extra last chunk carries it
        return chunk

    def usage_chunk(self, completion_tokens: int) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self.usage(completion_tokens)}
