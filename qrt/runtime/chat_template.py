"""Chat templates rendered in a sandbox with limits.

A chat template is Jinja code that comes with the checkpoint (tokenizer_config.json,
chat_template.jinja, a GGUF's `tokenizer.chat_template`): it is untrusted. transformers renders
it in jinja2's ImmutableSandboxedEnvironment, which stops access to Python internals
(`''.__class__.__mro__`, `cycler.__init__.__globals__`) and the mutation of lists and dicts, but
not a template that runs for hours or builds a string of gigabytes. qrt renders with an
environment that is transformers' own (the same globals, filters and extensions, the same
sandbox), plus limits on what one rendering may cost (docs/formats.md, "Hostile files"):

* the template: at most MAX_TEMPLATE_BYTES of UTF-8;
* the rendered prompt: streamed, and stopped once it is longer than `max_chars` (the caller's
  bound: CHARS_PER_TOKEN times the model's context);
* every value an operator (`+ * % ** ~`), a call, a filter or a block of the template makes: no
  larger than `max_chars` (characters of strings, items of lists and dicts, counted through
  nested ones), checked before the operation where it could multiply sizes (`'x' * n`,
  `s.ljust(n)`, `s.replace('', t)`, a format width of millions) and after it otherwise;
* at most MAX_STEPS loop iterations and calls, and MAX_SECONDS of wall time, checked at every
  step: a template cannot stop a running Python operation, so time is bounded between steps,
  and each step by the size limit on what it works on.

Any breach, a sandbox violation, a template syntax error or the template's own
`raise_exception(...)` is a ChatTemplateError (a ValueError: a bad request to the server).
"""

import contextvars
import json
import re
import time
from functools import lru_cache, wraps

from jinja2 import Environment, TemplateError, nodes
from jinja2.compiler import CodeGenerator
from jinja2.nodes import EvalContext
from jinja2.runtime import Context, LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from qrt.errors import QrtError

MAX_TEMPLATE_BYTES = 1 << 20
# The names render_chat gives a template from the conversation itself; variables never replace them.
CONVERSATION_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# Characters a prompt may render to per token of the model's context: English averages about 4
# per token and code or whitespace runs reach 10 or so; a prompt whose tokens average more than
# 32 characters would not be a prompt the context holds, and the bound keeps a template from
# rendering megabytes per token of context. MIN_RENDER_CHARS keeps small test contexts usable.
CHARS_PER_TOKEN = 32
MIN_RENDER_CHARS = 1 << 16
MAX_STEPS = 1_000_000  # loop iterations and calls; real templates take one or two per message and tool
MAX_SECONDS = 2.0  # a real template renders in milliseconds
# A format field width or precision this many digits long or longer ("%9999999d", "{:>9999999}").
_WIDE_FORMAT = re.compile(r"%[-#0 +]*(\d{7,}|\.\d{7,})|%[-#0 +]*\d*\.\d{7,}|\{[^{}]*:[^{}]*\d{7,}[^{}]*\}")


class ChatTemplateError(QrtError, ValueError):
    """A chat template that cannot be rendered: too large, unsafe, over a limit, or invalid."""


class _Exceeded(Exception):
    """A limit of one rendering was reached; render_chat reports it as a ChatTemplateError."""


class _Budget:
    """What one rendering may still spend."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        self.steps = MAX_STEPS
        self.deadline = time.monotonic() + MAX_SECONDS

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise _Exceeded(f"it took more than {MAX_STEPS} loop iterations and calls")
        if time.monotonic() > self.deadline:
            raise _Exceeded(f"it ran for more than {MAX_SECONDS} s")

    def check(self, value, what: str):
        """`value`, unless it is larger than max_chars."""
        if _size(value, self.max_chars) > self.max_chars:
            raise _Exceeded(f"{what} made a value larger than {self.max_chars} characters or items")
        return value

    def allow(self, size: int, what: str) -> None:
        """Refuses an operation before it runs, where its result would be `size`."""
        if size > self.max_chars:
            raise _Exceeded(f"{what} would make a value of {size} characters or items, over {self.max_chars}")


_budget: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")


def _size(value, limit: int) -> int:
    """Characters of strings plus items of containers in `value`, through nested containers;
    counting stops once over `limit`, so it costs at most about `limit` steps."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += len(item)
            stack.extend(item)
        elif isinstance(item, dict):
            total += len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        else:
            total += 1
    return total


def _size_of_product(left, right, limit: int) -> int | None:
    """The size of `left * right` where it repeats a sequence, before it is made (counted no
    further than `limit` per repetition: past it the product is over the limit anyway)."""
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
            return _size(seq, limit) * max(times, 0)
    return None


class _Counted:
    """Wraps a for loop's iterable: each item is a step of the budget."""

    def __init__(self, budget_of):
        self._budget_of = budget_of

    def __call__(self, iterable):
        for item in iterable:
            self._budget_of().step()
            yield item


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator with `a ~ b` (string concatenation) routed through the environment,
    which checks the result's size before joining."""

    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment with every way a template makes values or time metered
    against the current rendering's _Budget."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "%", "**"})

    def __init__(self, **options):
        super().__init__(**options)
        self.counted = _Counted(self._budget)

    @staticmethod
    def _budget() -> _Budget:
        return _budget.get()

    def _parse(self, source, name, filename):
        """The template's syntax tree with each for loop's iterable counted step by step."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.EnvironmentAttribute("counted"), [loop.iter], [], None, None,
                                   lineno=loop.iter.lineno)
        return tree

    def call_binop(self, context, operator, left, right):
        budget = self._budget()
        budget.step()
        if operator == "*":
            size = _size_of_product(left, right, budget.max_chars)
            if size is not None:
                budget.allow(size, "'*'")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            budget.allow(max(abs(left).bit_length(), 1) * right // 8, "'**'")
        elif operator == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
            raise _Exceeded("a '%' format has a field width or precision of a million or more")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, type(left)):
            budget.allow(_size(left, budget.max_chars) + _size(right, budget.max_chars), "'+'")
        return budget.check(super().call_binop(context, operator, left, right), f"'{operator}'")

    def checked_concat(self, parts) -> str:
        budget = self._budget()
        budget.step()
        texts = [str(budget.check(part, "'~'")) for part in parts]
        budget.allow(sum(map(len, texts)), "'~'")
        return "".join(texts)

    def concat(self, pieces) -> str:
        """Joins the output of a block ({% set %}...{% endset %}, a macro's body), checked first."""
        pieces = list(pieces)
        self._budget().allow(sum(map(len, pieces)), "a block")
        return "".join(pieces)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        budget = __self._budget()
        budget.step()
        _check_arguments(budget, getattr(__obj, "__name__", ""), getattr(__obj, "__self__", None), args, kwargs)
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level: counted as the first
            args = (__self.counted(args[0]), *args[1:])
        return budget.check(super().call(__context, __obj, *args, **kwargs), "a call")

    def unsafe_undefined(self, obj, attribute):
        """An unsafe attribute (`''.__class__`, `f.__globals__`) is an error where it is reached:
        jinja's sandbox makes it an undefined value that renders as nothing, which would let a
        template probe for what it may touch."""
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def wrap_str_format(self, value):
        wrapper = super().wrap_str_format(value)
        if wrapper is not None and _WIDE_FORMAT.search(value.__self__):
            raise _Exceeded("a format string has a field width or precision of a million or more")
        return wrapper


def _check_arguments(budget: _Budget, name: str, receiver, args: tuple, kwargs: dict) -> None:
    """Refuses a call, filter or method whose arguments would make it build more than the budget
    allows in one go: a count or width over it, or the multiplying string methods."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > budget.max_chars:
            raise _Exceeded(f"{name or 'a call'} got the number {value}, over {budget.max_chars}")
    if isinstance(receiver, str):
        limit = budget.max_chars
        if name == "replace" and len(args) >= 2 and isinstance(args[1], str):
            budget.allow(len(receiver) + (len(receiver) + 1) * len(args[1]), "str.replace")
        elif name == "expandtabs" and args and isinstance(args[0], int):
            budget.allow(len(receiver) * max(args[0], 1), "str.expandtabs")
        elif name == "join" and args and isinstance(args[0], (list, tuple)):
            budget.allow(_size(args[0], limit) + len(receiver) * len(args[0]), "str.join")


def _bounded_filter(name: str, function):
    """A filter with its arguments checked before it runs and its result after."""

    @wraps(function)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        budget = _budget.get()
        budget.step()
        values = [a for a in args if not isinstance(a, (Context, EvalContext, Environment))]  # jinja's own
        _check_arguments(budget, f"the {name} filter", None, tuple(values[1:]), kwargs)
        if values:
            subject = values[0]
            if name == "join" and isinstance(subject, (list, tuple)):
                separator = values[1] if len(values) > 1 and isinstance(values[1], str) else ""
                budget.allow(_size(subject, budget.max_chars) + len(separator) * len(subject), "the join filter")
            elif name == "replace" and isinstance(subject, str) and len(values) >= 3 and isinstance(values[2], str):
                budget.allow(len(subject) + (len(subject) + 1) * len(values[2]), "the replace filter")
            elif name in ("format", "tojson") and isinstance(subject, str) and _WIDE_FORMAT.search(subject):
                raise _Exceeded("a format string has a field width or precision of a million or more")
            if name == "tojson" and isinstance(kwargs.get("indent"), int) and kwargs["indent"] > 64:
                raise _Exceeded(f"tojson's indent {kwargs['indent']} is over 64")
        return budget.check(function(*args, **kwargs), f"the {name} filter")

    return bounded


@lru_cache(maxsize=1)
def _environment() -> BoundedSandbox:
    """A BoundedSandbox with transformers' chat-template globals, filters and extensions (its
    `raise_exception`, `strftime_now`, `dict`, `namespace`, `tojson`, `{% generation %}`)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    reference = _compile_jinja_template("").environment
    environment = BoundedSandbox(trim_blocks=reference.trim_blocks, lstrip_blocks=reference.lstrip_blocks,
                                 extensions=[type(extension) for extension in reference.extensions.values()])
    environment.globals.update(reference.globals)
    environment.filters.update(reference.filters)
    environment.filters = {name: _bounded_filter(name, f) for name, f in environment.filters.items()}
    return environment


@lru_cache(maxsize=16)
def _compiled(template: str):
    return _environment().from_string(template)


def template_of(tokenizer, tools, source) -> str:
    """The tokenizer's chat template for a conversation with(out) tools, checked for size."""
    try:
        template = tokenizer.get_chat_template(None, tools)
    except ValueError as err:
        raise ChatTemplateError(f"{source}: {err}") from None
    size = len(template.encode("utf-8", "surrogatepass"))
    if size > MAX_TEMPLATE_BYTES:
        raise ChatTemplateError(f"{source}: the chat template is {size} bytes, over qrt's limit of "
                                f"{MAX_TEMPLATE_BYTES}")
    return template


def _plain(value):
    """The JSON-shaped copy of a conversation or tools that the template sees (as transformers
    gives it): plain dicts, lists, strings and numbers, anything else a "<type>" placeholder."""
    return json.loads(json.dumps(value, default=lambda other: f"<{type(other).__name__}>"))


def _messages(messages: list[dict]) -> list[dict]:
    """transformers' normalisation: keys whose value is None dropped (templates test for a key,
    not for None), and a message's reasoning under every name templates read it by."""
    out = []
    for message in _plain(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"a chat message must be an object, got {message!r:.100}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in ("reasoning_content", "thinking", "reasoning") if key in message),
                         None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None, max_chars: int, source,
                variables: dict | None = None) -> str:
    """The conversation in the tokenizer's chat template, ending with the prompt for the
    assistant's turn, rendered within the limits above; `max_chars` bounds the prompt's length
    and every value the template makes. `variables`: more names the template may read (as
    apply_chat_template's keyword arguments); the conversation's own names are not among them.
    `source` names the model in errors."""
    template = template_of(tokenizer, tools, source)
    budget = _Budget(max_chars)
    token = _budget.set(budget)
    try:
        compiled = _compiled(template)
        context = {**tokenizer.special_tokens_map, **_plain(variables or {}), "messages": _messages(messages),
                   "tools": None if tools is None else _plain(tools), "documents": None,
                   "add_generation_prompt": True}
        pieces, length = [], 0
        for piece in compiled.generate(**context):
            length += len(piece)
            if length > max_chars:
                raise _Exceeded(f"the prompt it renders is longer than {max_chars} characters")
            pieces.append(piece)
        return "".join(pieces)
    except _Exceeded as exceeded:
        raise ChatTemplateError(f"{source}: the chat template was stopped: {exceeded}") from None
    except TemplateError as err:  # a syntax error, a sandbox violation (SecurityError), raise_exception()
        raise ChatTemplateError(f"{source}: the chat template failed: {type(err).__name__}: {err}") from None
    except RecursionError:
        raise ChatTemplateError(f"{source}: the chat template recursed too deeply") from None
    finally:
        _budget.reset(token)


def max_render_chars(max_seq_len: int) -> int:
    """The longest prompt (in characters) a model with this context renders: see CHARS_PER_TOKEN."""
    return max(MIN_RENDER_CHARS, CHARS_PER_TOKEN * max_seq_len)
