"""Tool calling for chat completions: what the model is shown, what it may write, and how its
answer becomes `tool_calls`.

- `tool_choice` "none", or no tools: a text answer; the tools are not shown to the model.
- "auto" (the default with tools): the tools go to the chat template (`tools=`), the way the model
  was trained to see them, and the answer is read for calls in the format of the template's
  family (`READERS`, chosen by `reader_for` from the template, or by `qrt serve
  --tool-call-parser`):
  - "hermes" (Qwen2.5 and later, Hermes, others that copy them):
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, text outside them the content;
  - "mistral": `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers) or
    `[TOOL_CALLS]name[ARGS]{...}` (v11 tokenizers), at the end of the answer;
  - "llama3_json" (Llama 3.1–3.3): the whole answer is `{"name": ..., "parameters": {...}}`, or
    several such objects separated by ";", after an optional `<|python_tag|>`.
  The markers in brackets are special tokens, which the decoded answer leaves out; the readers
  read what remains. A call that is not JSON, or names no offered tool, stays text.
- "required", or one named function: the output is constrained (structured output) to one call:
  for a named function, its arguments, by its `parameters` schema; for "required", an object
  {"name": one of the tools, "arguments": that tool's parameters}. So the call is always valid
  JSON for its schema.

A stream with tools holds the text back and sends the answer (text or calls) whole in its last
chunk before the finish: what is a call is known only when the answer is complete.
"""

import json
import re
import uuid

from qrt.runtime import structured

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
ANY_ARGUMENTS = {"type": "object"}  # a function without a `parameters` schema takes any object


def parameters(tool) -> dict:
    return tool.function.parameters or ANY_ARGUMENTS


def forced_grammar(tools: list, mode: str) -> str:
    """The grammar of a forced call: `mode` is "required" or a function's name."""
    if mode != "required":
        (tool,) = [t for t in tools if t.function.name == mode]
        return structured.json_schema(parameters(tool))
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return structured.json_schema({"anyOf": calls})


def template_tools(tools: list) -> list[dict]:
    """The tools as chat templates take them (OpenAI's JSON)."""
    return [tool.model_dump(exclude_none=True) for tool in tools]


def template_message(message) -> dict:
    """A ChatMessage as chat templates take it: tool calls' arguments as objects, not JSON text
    (Hugging Face templates render them with tojson)."""
    out = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": _loaded(call.function.arguments)}}
                             for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    reasoning = message.reasoning_text()
    if reasoning is not None:
        out["reasoning_content"] = reasoning  # render_chat hands it on under every name templates read
    return out


def _loaded(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _call(name: str, arguments) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def read_answer(text: str, tools: list, mode: str, reader: str = "hermes") -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a complete answer generated in `mode` ("auto", "required" or a
    function's name); in "auto", read by READERS[reader]."""
    if mode == "required":
        call = json.loads(text)
        return None, [_call(call["name"], call["arguments"])]
    if mode != "auto":
        return None, [_call(mode, json.loads(text))]
    content, calls = READERS[reader](text, {tool.function.name for tool in tools})
    if not calls:
        return text, []
    return (content.strip() or None), [_call(name, arguments) for name, arguments in calls]


def own_syntax_calls(calls: list[tuple[str, str]], tools: list, mode: str) -> list[dict]:
    """The calls a model made in a syntax its reasoning split reads (gpt-oss's messages to
    `functions.NAME`), as tool_calls: those of offered tools (of the one named, in that mode)."""
    names = {tool.function.name for tool in tools} if mode in ("auto", "required") else {mode}
    return [_call(name, _loaded(arguments.strip())) for name, arguments in calls if name in names]


def reader_for(chat_template: str | None) -> str:
    """The tool-call reader of a chat template's family, from the markers it writes; "hermes"
    where none is found (the format most open templates copy)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters": dictionary' in template:
        return "llama3_json"
    return "hermes"


def _hermes(text: str, names: set[str]) -> tuple[str, list[tuple[str, object]]]:
    calls, kept, last = [], [], 0
    for match in _HERMES_CALL.finditer(text):
        call = _json(match.group(1))
        if not _names(call, names):
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append((call["name"], call.get("arguments", {})))
    kept.append(text[last:])
    return "".join(kept), calls


def _mistral(text: str, names: set[str]) -> tuple[str, list[tuple[str, object]]]:
    """The calls end the answer: a JSON list of {"name", "arguments"}, or name{arguments} pairs
    (v11's `name[ARGS]{...}` without its special marker); the text before them is the content."""
    for start in (match.start() for match in re.finditer(r"\[", text)):
        listed = _json(text[start:])
        if isinstance(listed, list) and listed and all(_names(call, names) for call in listed):
            return text[:start], [(call["name"], call.get("arguments", {})) for call in listed]
    starts = sorted(match.start() for name in names for match in re.finditer(re.escape(name) + r"\s*\{", text))
    for start in starts:
        calls, position = [], start
        while position < len(text):
            name = next((n for n in sorted(names, key=len, reverse=True) if text.startswith(n, position)), None)
            arguments, position = _json_at(text, position + len(name)) if name else (None, position)
            if not isinstance(arguments, dict):
                break
            calls.append((name, arguments))
            position = len(text) - len(text[position:].lstrip())
        else:
            return text[:start], calls
    return text, []


def _llama3_json(text: str, names: set[str]) -> tuple[str, list[tuple[str, object]]]:
    """The whole answer is one or more {"name", "parameters" (or "arguments")} objects, ";" between."""
    calls, position = [], len(text) - len(text.lstrip())
    while position < len(text):
        call, position = _json_at(text, position)
        if not _names(call, names):
            return text, []
        arguments = call.get("parameters", call.get("arguments", {}))
        calls.append((call["name"], arguments))
        rest = text[position:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        position = len(text) - len(rest)
    return "", calls


READERS = {"hermes": _hermes, "mistral": _mistral, "llama3_json": _llama3_json}


def _names(call, names: set[str]) -> bool:
    """Whether `call` is a JSON object naming an offered tool."""
    return isinstance(call, dict) and call.get("name") in names


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_at(text: str, position: int):
    """The JSON value that starts at `position` (spaces skipped) and where it ends; (None, position)
    where none does."""
    start = len(text) - len(text[position:].lstrip())
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None, position
