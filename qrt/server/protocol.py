"""The OpenAI API's request bodies as qrt serves them, and its error shape.

Every field the OpenAI API defines for these endpoints is known here. Fields qrt implements take
any valid value; fields it does not implement are accepted only at the value that means "off"
(best_of unset, no suffix), and anything else is a 400 naming the field.
Fields the API does not define are a 400 too: nothing a client sends is silently ignored.
"""

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from qrt.runtime import structured
from qrt.runtime.chat_template import CONVERSATION_NAMES
from qrt.runtime.logprobs import MAX_TOP

from . import tools as tool_calls

MAX_PROMPTS = 64  # prompts in one completions request
MAX_N = 16  # choices per prompt


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


def _valid_utf8(text: str, field: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{field} is not valid UTF-8 text ({err.reason} at character {err.start})") from None
    return text


# Fields the OpenAI API defines that qrt does not implement: the values that mean "off" (the first
# is the one to send), and why another value cannot be honoured.
_NOT_IMPLEMENTED = "qrt does not implement it"
OFF_ONLY = {
    "best_of": ((None, 1), "qrt returns every sequence it generates; use n"),
    "suffix": ((None,), _NOT_IMPLEMENTED),
}


class _Generation(BaseModel):
    """The fields both endpoints share."""
    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float = Field(1.0, ge=0, le=2)  # OpenAI's default: sampling
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = None  # not OpenAI's, but every open server takes it; -1 or 0: off
    seed: int | None = None
    stop: str | list[str | int] | None = None  # strings, and token ids (ints)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False  # not OpenAI's (vLLM's): run to max_tokens, for benchmarks
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)  # choices per prompt, each its own sequence (seed + i with a seed)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, allow_inf_nan=False)  # vLLM's; a finite number
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias, -100 to 100
    min_tokens: int = Field(0, ge=0)  # vLLM's: no stop token or EOS before this many new tokens
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs / guided_* fields.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None  # an end-user id for abuse tracking: recorded by nobody, changes nothing

    @field_validator(*OFF_ONLY, check_fields=False)
    @classmethod
    def _off_only(cls, v, info):
        allowed, why = OFF_ONLY[info.field_name]
        # By type and value: logprobs=0 still asks for log-probabilities, though 0 == False.
        if not any(type(v) is type(off) and v == off for off in allowed):
            raise ValueError(f"{info.field_name}={v!r} is not supported ({why}); "
                             f"leave it out or send {allowed[0]!r}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, v):
        for key, bias in (v or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be from -100 to 100, got {bias} for token {key}")
        return v

    def grammar(self) -> str | None:
        """llguidance's grammar for the output this request constrains (None: free text); a
        ValueError names what is wrong with the fields."""
        asked = []
        fmt = self.response_format or {"type": "text"}
        kind = fmt.get("type")
        if kind == "json_object":
            asked.append(("response_format", structured.json_object))
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ValueError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
            asked.append(("response_format", lambda: structured.json_schema(schema)))
        elif kind != "text":
            raise ValueError(f"response_format type {kind!r} is not supported; use text, json_object or json_schema")
        vllm = dict(self.structured_outputs or {})
        unknown = set(vllm) - {"json", "regex", "choice", "grammar", "json_object"}
        if unknown:
            raise ValueError(f"structured_outputs: {sorted(unknown)} not supported; use json, regex, choice or grammar")
        for key, value in (("json", self.guided_json), ("regex", self.guided_regex), ("choice", self.guided_choice),
                           ("grammar", self.guided_grammar)):
            if value is not None:
                vllm[key] = value
        for key, value in vllm.items():
            if key == "json" or key == "json_object":
                schema = {"type": "object"} if key == "json_object" else (
                    json.loads(value) if isinstance(value, str) else value)
                asked.append((key, lambda schema=schema: structured.json_schema(schema)))
            elif key == "regex":
                asked.append((key, lambda value=value: structured.regex(value)))
            elif key == "choice":
                if not value or not all(isinstance(option, str) for option in value):
                    raise ValueError("choice needs a list of strings")
                asked.append((key, lambda value=value: structured.choice(value)))
            else:
                asked.append((key, lambda value=value: structured.lark(value)))
        if len(asked) > 1:
            raise ValueError(f"one structured-output constraint per request, got {[name for name, _ in asked]}")
        return asked[0][1]() if asked else None

    def biases(self) -> list[tuple[int, float]]:
        return [(int(key), float(bias)) for key, bias in (self.logit_bias or {}).items()]

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v is None or v in (-1, 0):
            return None
        if v < 1:
            raise ValueError(f"top_k must be >= 1 (or -1 / 0 for no limit), got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if v is None:
            return v
        items = [v] if isinstance(v, str) else v
        if len(items) > 16:
            raise ValueError(f"stop takes at most 16 entries, got {len(items)}")
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise ValueError("stop strings must not be empty")
                _valid_utf8(item, "stop")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        items = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in items if isinstance(s, str))

    def stop_ids(self) -> tuple[int, ...]:
        items = [] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(i for i in items if isinstance(i, int)) + tuple(self.stop_token_ids or ())

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions; 0 only with echo
    echo: bool = False  # the prompt comes back before the completion (with its logprobs, when asked)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP)  # alternatives listed per token; None: no logprobs
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        prompts = v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
        for prompt in prompts:
            if isinstance(prompt, str):
                _valid_utf8(prompt, "prompt")
            if not prompt:
                raise ValueError("prompt is empty; give at least one token")
        return v

    @model_validator(mode="after")
    def _nothing_to_do(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 returns nothing without echo=true; ask for at least one token")
        return self

    def prompts(self) -> list:
        """Each prompt of the request (a string or token ids), in order: one choice each."""
        v = self.prompt
        return list(v) if isinstance(v, list) and isinstance(v[0], (str, list)) else [v]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class _Strict(BaseModel):
    """A part of a request body: a field the API does not define is a 400."""
    model_config = ConfigDict(extra="forbid")


class FunctionSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments; None: any object
    strict: bool | None = None  # the arguments always follow the schema where the call is forced


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as the API returned it


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # An assistant's earlier reasoning, sent back as reasoning models' clients send it (either name):
    # templates that keep it (gpt-oss's, before a tool call) show it to the model.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content")
    @classmethod
    def _utf8(cls, v):
        for text in [] if v is None else [v] if isinstance(v, str) else [p.text for p in v]:
            _valid_utf8(text, "content")
        return v

    @field_validator("reasoning_content", "reasoning")
    @classmethod
    def _utf8_reasoning(cls, v, info):
        return v if v is None else _valid_utf8(v, info.field_name)

    @model_validator(mode="after")
    def _one_reasoning(self):
        if self.reasoning_content is not None and self.reasoning is not None and self.reasoning_content != self.reasoning:
            raise ValueError("reasoning_content and reasoning disagree; send one of them")
        return self

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's message with tool_calls "
                             f"may leave it out)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only a tool message, has a tool_call_id")
        return self

    def reasoning_text(self) -> str | None:
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # None: up to the end of the KV cache
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # a forced call is one call; in "auto" the model may make several
    # Variables for the chat template: OpenAI's reasoning_effort (gpt-oss's template reads it), and
    # any others a template reads (vLLM's chat_template_kwargs, such as Qwen3's enable_thinking).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, object] | None = None

    @model_validator(mode="after")
    def _template_variables_leave_the_conversation_alone(self):
        given = set(self.chat_template_kwargs or ())
        taken = sorted(given & CONVERSATION_NAMES)
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {taken}: the request's own fields give them")
        effort = (self.chat_template_kwargs or {}).get("reasoning_effort")
        if effort is not None and self.reasoning_effort is not None and effort != self.reasoning_effort:
            raise ValueError("reasoning_effort and chat_template_kwargs.reasoning_effort disagree; send one of them")
        return self

    def template_variables(self) -> dict:
        """What the chat template sees besides the conversation and the tools."""
        variables = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            variables["reasoning_effort"] = self.reasoning_effort
        return variables

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
        return self

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) < len(names):
            raise ValueError(f"tools: function names must differ, got {names}")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools {names}")
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def tool_mode(self) -> str | None:
        """None (a text answer), "auto", "required", or the name of the function to call."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    def grammar(self) -> str | None:
        mode, other = self.tool_mode(), super().grammar()
        if mode in (None, "auto"):
            return other
        if other is not None:
            raise ValueError("a forced tool call constrains the output already; leave out the other "
                             "structured-output fields")
        return tool_calls.forced_grammar(self.tools, mode)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


MAX_EMBEDDING_INPUTS = 2048  # inputs in one embeddings request, as OpenAI allows


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings (qrt/server/embeddings.py)."""
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[int] | list[str] | list[list[int]]  # one text or token-id list, or several
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32 bytes
    dimensions: int | None = Field(None, ge=1)  # the first d values, normalized again
    user: str | None = None  # an end-user id for abuse tracking: recorded by nobody, changes nothing

    @field_validator("input")
    @classmethod
    def _inputs(cls, v):
        inputs = v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"input: at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(inputs)}")
        for item in inputs:
            if isinstance(item, str):
                _valid_utf8(item, "input")
            if not item:
                raise ValueError("input is empty; give at least one token")
        return v

    def inputs(self) -> list:
        """Each input (a string or token ids), in order: one embedding each."""
        v = self.input
        return list(v) if isinstance(v, list) and isinstance(v[0], (str, list)) else [v]
