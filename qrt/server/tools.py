"""Tool calling for chat completions: what the model is shown, what it may write, and how its
answer becomes `tool_calls`.

- `tool_choice` "none", or no tools: a text answer; the tools are not shown to the model.
- "auto" (the default with tools): the tools go to the chat template (`tools=`), the way the model
  was trained to see them, and the answer is read for calls in the Hermes format that open chat
  models use (Qwen2.5, Hermes, Llama 3.x with a Hermes template):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks. Text outside them stays the
  content. A block that is not JSON naming an offered tool stays text.
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

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
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
    return out


def _loaded(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _call(name: str, arguments) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def read_answer(text: str, tools: list, mode: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a complete answer generated in `mode` ("auto", "required" or a
    function's name)."""
    names = {tool.function.name for tool in tools}
    if mode == "required":
        call = json.loads(text)
        return None, [_call(call["name"], call["arguments"])]
    if mode != "auto":
        return None, [_call(mode, json.loads(text))]
    calls, kept, last = [], [], 0
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or call.get("name") not in names:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(_call(call["name"], call.get("arguments", {})))
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls
