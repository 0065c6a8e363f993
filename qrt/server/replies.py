"""The JSON of a completions or chat completions answer: whole, or as the chunks of a stream, for
one choice per prompt (n choices of each), with scores, echo and tool calls where asked, and a chat
answer's reasoning apart from its content where the model's family writes it apart (reasoning.py)."""

import time
import uuid
from dataclasses import dataclass

from qrt.runtime import reasoning
from qrt.runtime.engine import STOP

from . import tools
from .logprob_shapes import LogprobShapes


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


class Reply:
    """The response and stream-chunk JSON of one request (one choice per prompt)."""

    def __init__(self, chat: bool, model_name: str, prompt_tokens: int, shapes: LogprobShapes, scoring: Scoring,
                 prompts: list[Prompt], offered: list | None = None, tool_mode: str | None = None,
                 reader: str = "hermes", reasoning_parser: str | None = None):
        self.chat, self.model, self.prompt_tokens = chat, model_name, prompt_tokens
        self.shapes, self.scoring, self.prompts = shapes, scoring, prompts
        self.offered, self.tool_mode = offered, tool_mode  # the request's tools, and tools.py's mode
        self.reader = reader  # tools.READERS' key for "auto"
        self.reasoning_parser = reasoning_parser if chat else None  # reasoning.PARSERS' key, or None
        # Per choice, the split of its streamed text (made on its first token).
        self.streamed_splits: list[reasoning.Split | None] = [None] * len(prompts)
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
                message, finish_reason = self.message(index, seq)
                choices.append({"index": index, "message": {"role": "assistant", **message},
                                "logprobs": logprobs, "finish_reason": finish_reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": seq.finish_reason})
        kind = "chat.completion" if self.chat else "text_completion"
        completion_tokens = sum(len(seq.tokens) for seq in sequences)
        return {**self._head(kind), "choices": choices, "usage": self.usage(completion_tokens)}

    def _split(self, index: int) -> reasoning.Split:
        return reasoning.split_for(self.reasoning_parser, self.shapes.tokenizer, self.prompts[index].ids)

    def message(self, index: int, seq) -> tuple[dict, str]:
        """Choice `index`'s answer ({"content"}, with "reasoning_content" and "tool_calls" where it
        has them) and finish_reason. A complete answer in a tool mode is read for calls, in the
        model's own call syntax where its split reads one; one cut short stays text."""
        split = self._split(index)
        thought, content = split.whole(seq.tokens, seq.text)
        message = {"content": content} if thought is None else {"content": content, "reasoning_content": thought}
        if self.tool_mode is None or seq.finish_reason != STOP:
            return message, seq.finish_reason
        calls = tools.own_syntax_calls(split.calls, self.offered, self.tool_mode)
        if not calls:
            content, calls = tools.read_answer(content, self.offered, self.tool_mode, self.reader)
        if not calls:
            return {**message, "content": content}, seq.finish_reason
        return {**message, "content": content or None, "tool_calls": calls}, "tool_calls"

    def deltas(self, index: int, token: int | None, text: str, ended: bool) -> list[dict]:
        """A streamed choice's new token and text as chunk deltas, {"reasoning_content"} and
        {"content"} pieces in the order they came."""
        split = self.streamed_splits[index]
        if split is None:
            split = self.streamed_splits[index] = self._split(index)
        if token is not None:
            split.token(token)
        pieces = split.text(text) if text else []
        if ended:
            pieces += split.end()
        return [{field: piece} for field, piece in pieces]

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
