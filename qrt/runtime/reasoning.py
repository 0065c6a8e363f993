"""An answer's reasoning told apart from its content, in the two ways chat templates write it:

- "think": the reasoning between <think> and </think> (Qwen3, QwQ, DeepSeek-R1, SmolLM3). A
  template may open the block in its generation prompt (DeepSeek-R1's ends in "<think>\\n"), so
  where the prompt's last tag is an opening one, the answer starts inside the block.
- "harmony": gpt-oss's messages, each a header and a body. `<|channel|>analysis<|message|>…<|end|>`
  is reasoning; the final channel, and commentary addressed to nobody (a preamble), are content;
  commentary addressed `to=functions.NAME` is a call of that tool, its body the arguments. The
  markers are special tokens, which the answer's text (decoded without them) no longer shows, so
  this reader follows the token ids.

A split takes an answer as the engine produces it: each new id (`token`), then the text the engine
released for it (`text`), which may lag the ids (a stop string's start or a character's first
bytes are held back). It hands back (field, text) pieces, field being REASONING or CONTENT."""

import bisect
import re
from dataclasses import dataclass

from .text_stream import TextStream

REASONING, CONTENT = "reasoning_content", "content"
PARSERS = ("harmony", "think")


@dataclass(frozen=True)
class ChatAnswer:
    """An assistant's answer (`CompiledModel.chat`): its content, its reasoning apart (None where
    the model gave none, or its template does not set reasoning apart), and the ids it generated."""

    content: str
    reasoning: str | None
    tokens: list[int]

    def __str__(self) -> str:
        return self.content


def parser_for(chat_template: str | None) -> str | None:
    """The reasoning parser of a chat template's family, from the markers it writes (None: the
    template's models do not reason apart from their answer)."""
    template = chat_template or ""
    if "<|channel|>" in template and "<|message|>" in template:
        return "harmony"
    if "</think>" in template:
        return "think"
    return None


class Split:
    """One answer's reasoning and content, told apart as its ids and text come. This base class
    is the answer of a model that does not reason apart: all of it is content."""

    def token(self, token_id: int) -> None:
        """Take in the answer's next id, before the text the engine released with it."""

    def text(self, piece: str) -> list[tuple[str, str]]:
        return [(CONTENT, piece)] if piece else []

    def end(self) -> list[tuple[str, str]]:
        """The answer ended: whatever was held back."""
        return []

    @property
    def calls(self) -> list[tuple[str, str]]:
        """(function name, arguments as written) of the calls the answer made in its own syntax."""
        return []

    def whole(self, tokens: list[int], text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a finished answer."""
        for token_id in tokens:
            self.token(token_id)
        pieces = self.text(text) + self.end()
        reasoning = "".join(piece for field, piece in pieces if field == REASONING)
        return reasoning or None, "".join(piece for field, piece in pieces if field == CONTENT)


def split_for(parser: str | None, tokenizer, prompt_ids: list[int]) -> Split:
    """A new answer's split under `parser`: all content where it is None, or where the tokenizer
    lacks the parser's markers."""
    if parser == "think":
        return ThinkSplit(_prompt_opens_think(tokenizer, prompt_ids))
    markers = _harmony_ids(tokenizer) if parser == "harmony" else None
    return HarmonySplit(tokenizer, markers) if markers is not None else Split()


# ---- <think> … </think> ------------------------------------------------------------------------
OPEN_THINK, CLOSE_THINK = "<think>", "</think>"
_PROMPT_TAIL_TOKENS = 16  # enough to hold "<think>\n\n</think>\n\n" in any tokenizer


def _prompt_opens_think(tokenizer, prompt_ids: list[int]) -> bool:
    tail = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return tail.rfind(OPEN_THINK) > tail.rfind(CLOSE_THINK)


class ThinkSplit(Split):
    """Reasoning between <think> and </think>, the tags themselves dropped, and the whitespace
    around each part, as transformers' response parser gives them (templates write newlines
    inside the tags and after them). Whitespace at a part's end is held until more text follows."""

    def __init__(self, inside: bool):
        self.field = REASONING if inside else None  # None: not yet known whether a <think> opens the answer
        self.pending = ""  # text received, not yet routed: it may hold the start of a tag
        self.held = ""  # whitespace at the end of the reasoning so far, sent only if more follows it
        self.part_begun = False  # the current part has shown something (its leading whitespace is gone)

    def text(self, piece: str) -> list[tuple[str, str]]:
        self.pending += piece
        out = []
        while True:
            if self.field is None:
                begun = self.pending.lstrip()
                if begun.startswith(OPEN_THINK):
                    self.field, self.pending = REASONING, begun[len(OPEN_THINK):]
                    continue
                if OPEN_THINK.startswith(begun):  # whitespace, or part of the tag so far
                    return out
                self.field = CONTENT
            if self.field == CONTENT:
                out += self._show(self.pending, closing=False)
                self.pending = ""
                return out
            closed = self.pending.find(CLOSE_THINK)
            if closed >= 0:
                out += self._show(self.pending[:closed], closing=True)
                self.pending = self.pending[closed + len(CLOSE_THINK):]
                self.field, self.held, self.part_begun = CONTENT, "", False
                continue
            shown = len(self.pending) - _tag_start_at_end(self.pending, CLOSE_THINK)
            out += self._show(self.pending[:shown], closing=False)
            self.pending = self.pending[shown:]
            return out

    def end(self) -> list[tuple[str, str]]:
        rest, self.pending = self.pending, ""
        if self.field is None:  # the answer was only whitespace, or a cut-off "<thi"
            self.field = CONTENT
        return self._show(rest, closing=True)

    def _show(self, piece: str, closing: bool) -> list[tuple[str, str]]:
        piece, self.held = self.held + piece, ""
        if not self.part_begun:
            piece = piece.lstrip()
            self.part_begun = bool(piece)
        body = piece.rstrip()
        if not closing:
            self.held = piece[len(body):]
        return [(self.field, body)] if body else []


def _tag_start_at_end(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (0: none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


# ---- harmony -----------------------------------------------------------------------------------
_HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
_RECIPIENT = re.compile(r"\bto=(\S+)")
FUNCTIONS = "functions."


def _harmony_ids(tokenizer) -> dict[int, str] | None:
    vocab = tokenizer.get_vocab()
    if not all(marker in vocab for marker in _HARMONY_MARKERS):
        return None
    return {vocab[marker]: marker for marker in _HARMONY_MARKERS}


class HarmonySplit(Split):
    """gpt-oss's channels, told by the special tokens between them. The answer's text (without
    the specials) is decoded here too, ahead of the engine's, to learn where in it each marker
    falls; the engine's text is then routed by those places."""

    def __init__(self, tokenizer, markers: dict[int, str]):
        self.markers = markers
        self.decoded = TextStream(tokenizer)  # the answer's text, without its markers
        # Where each field begins in the text: (offset, field), the field being REASONING,
        # CONTENT, None (a header, or text outside any message: not shown) or the index of a call.
        # Text before any marker (an answer a grammar forced into plain text) is content.
        self.offsets, self.fields = [0], [CONTENT]
        self.header_at = 0  # where the current message's header began (its role and recipient)
        self.channel_at = None  # where its channel's name began
        self.routed = 0  # characters of the engine's text routed so far
        self._calls: list[list[str]] = []  # [name, arguments so far]

    @property
    def calls(self) -> list[tuple[str, str]]:
        return [(name, arguments) for name, arguments in self._calls]

    def token(self, token_id: int) -> None:
        marker = self.markers.get(token_id)
        if marker is None:
            self.decoded.add(token_id)
            return
        at = len(self.decoded.text)
        field = None
        if marker == "<|channel|>":
            self.channel_at = at
        elif marker == "<|message|>":
            field = self._field_of_header(at)
        else:  # a message ends, or a new one's header starts
            self.header_at, self.channel_at = at, None
        self.offsets.append(at)
        self.fields.append(field)

    def _field_of_header(self, at: int):
        text = self.decoded.text
        role = text[self.header_at:self.channel_at if self.channel_at is not None else at]
        channel = text[self.channel_at:at] if self.channel_at is not None else ""
        found = _RECIPIENT.search(role) or _RECIPIENT.search(channel)
        recipient = found.group(1) if found else None
        if recipient is not None and recipient.startswith(FUNCTIONS):
            self._calls.append([recipient[len(FUNCTIONS):], ""])
            return len(self._calls) - 1
        if recipient is not None:  # a built-in tool of OpenAI's (browser, python): nothing to show
            return None
        name = channel.split()[0] if channel.split() else ""
        return REASONING if name == "analysis" else CONTENT

    def text(self, piece: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        begin, end = self.routed, self.routed + len(piece)
        at = begin
        while at < end:
            index = bisect.bisect_right(self.offsets, at) - 1  # the last mark at or before `at` rules
            until = min(end, self.offsets[index + 1]) if index + 1 < len(self.offsets) else end
            part, field = piece[at - begin:until - begin], self.fields[index]
            if isinstance(field, int):
                self._calls[field][1] += part
            elif field is not None and part:
                if out and out[-1][0] == field:
                    out[-1] = (field, out[-1][1] + part)
                else:
                    out.append((field, part))
            at = until
        self.routed = end
        return out
