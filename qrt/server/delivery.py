"""How an answer reaches its client: whole when every choice has ended, or streamed as
server-sent events. `running` holds, per choice, the engine's Sequence and the asyncio queue its
Updates arrive on (EngineLoop.submit); the client going away cancels the choices."""

import asyncio
import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from qrt.runtime.engine import ERROR, Update
from qrt.runtime.lora import UnknownAdapter

from .protocol import error_body
from .replies import Reply

DISCONNECT_POLL_S = 0.05  # how often a non-streaming request checks that its client is still there


async def whole(running: list, reply: Reply, request: Request):
    """The answer once every choice has ended (cancelled if the client goes away meanwhile)."""
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
        if isinstance(failed[0].error, UnknownAdapter):  # unloaded while the request waited for a slot
            return JSONResponse(error_body(str(failed[0].error), "not_found_error", param="model",
                                           code="model_not_found"), status_code=404)
        return JSONResponse(engine_error(failed[0]), status_code=500)
    return reply.whole([seq for seq, _ in running])



class _Streamed(StreamingResponse):
    """A stream that cancels its choices when it ends, however it ends.

    The events' generator cancels them in its `finally`, but a generator that never started has
    no `finally` to run. Starlette sends the response's start before it first asks the generator
    for an event; under an ASGI server of spec 2.4 that send raises when the client is already
    gone (it hung up while the request was read, checked and queued), and the generator is never
    started: its choices would stay in the engine, holding a place in the queue and then a slot
    until max_tokens, for nobody."""

    def __init__(self, running: list, events):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.running = running

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for seq, _ in self.running:
                seq.cancel()  # the engine frees their places at its next step


def streamed(running: list, reply: Reply, include_usage: bool) -> StreamingResponse:
    """The answer as server-sent events (`stream`), its choices cancelled when it ends."""
    return _Streamed(running, stream(running, reply, include_usage))


async def stream(running: list, reply: Reply, include_usage: bool):
    """The answer's server-sent events as the engine produces tokens."""
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
                yield _event(engine_error(update))
                failed = True
                break
            if not echoed[index]:
                echoed[index] = True
                yield _event(reply.echo_chunk(index, seq, include_usage))
            if update.logprob is not None:
                pending[index].append(update.logprob)
            if reply.tool_mode is None:
                ended = update.finish_reason is not None
                pieces = (reply.deltas(index, update.token, update.text, ended) if reply.chat
                          else [update.text] if update.text else [])
                for piece in pieces:
                    yield _event(reply.chunk(index, piece, None, pending[index], include_usage))
                    pending[index] = []
            if update.finish_reason is not None:
                finish_reason = update.finish_reason
                if reply.tool_mode is not None:  # the answer goes whole: only now is it known to be calls
                    message, finish_reason = reply.message(index, seq)
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


def engine_error(update: Update) -> dict:
    return error_body(f"generation failed: {type(update.error).__name__}: {update.error}", "server_error")


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
