"""Reading a model's answer for tool calls (qrt/server/tools.py), without a server: in "auto", each
template family's format (Hermes <tool_call> blocks, Mistral's list or name{arguments}, Llama 3's
JSON objects) and the choice of reader from the template; the forced shapes of "required" and a
named function."""

import json

from qrt.server.protocol import ChatMessage, ToolSpec
from qrt.server.tools import read_answer, reader_for, template_message, template_tools

TOOLS = [ToolSpec.model_validate({"type": "function", "function": {"name": name}}) for name in ("search", "add")]


def _calls(calls):
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


def test_auto_reads_hermes_blocks_that_name_an_offered_tool_and_keeps_the_rest_as_text():
    text = ('Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    content, calls = read_answer(text, TOOLS, "auto")
    assert content == "Let me look." and _calls(calls) == [("search", {"q": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert all(call["id"].startswith("call_") and call["type"] == "function" for call in calls)
    assert len({call["id"] for call in calls}) == 2
    # Not JSON, or a tool nobody offered: the text stays as it is.
    for text in ('<tool_call>{"name": "search", "arguments": </tool_call>',
                 '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>', "Just text."):
        assert read_answer(text, TOOLS, "auto") == (text, [])
    assert read_answer('<tool_call>{"name": "add", "arguments": {}}</tool_call>', TOOLS, "auto")[0] is None


def test_a_forced_answer_is_one_call():
    assert _calls(read_answer('{"name": "add", "arguments": {"a": 1}}', TOOLS, "required")[1]) == [("add", {"a": 1})]
    assert read_answer('{"q": "x"}', TOOLS, "search")[0] is None
    assert _calls(read_answer('{"q": "x"}', TOOLS, "search")[1]) == [("search", {"q": "x"})]


def test_earlier_calls_reach_the_chat_template_with_their_arguments_as_objects():
    message = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]})
    assert template_message(message) == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]}
    answer = ChatMessage.model_validate({"role": "tool", "tool_call_id": "call_1", "content": "3"})
    assert template_message(answer) == {"role": "tool", "content": "3", "tool_call_id": "call_1"}


# A chat template in the style of Qwen2.5's: the offered tools go into the system turn as JSON.
HERMES_TEMPLATE = ("{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
                   "</tools><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                   "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def test_the_tools_reach_a_chat_template_that_shows_them(chat_model):
    tools = [ToolSpec.model_validate({"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tokenizer = chat_model.tokenizer
    saved, tokenizer.chat_template = tokenizer.chat_template, HERMES_TEMPLATE
    try:
        shown = tokenizer.decode(chat_model.encode_messages(messages, template_tools(tools)))
        plain = tokenizer.decode(chat_model.encode_messages(messages))
    finally:
        tokenizer.chat_template = saved
    assert '<tools>{"type": "function", "function": {"name": "get_weather", "parameters": ' in shown
    assert "<tools>" not in plain and shown.endswith(plain)


def test_mistral_calls_end_the_answer_as_a_list_or_as_name_and_arguments():
    # v3 tokenizers: "[TOOL_CALLS] [...]"; the special marker is gone from the decoded text.
    content, calls = read_answer(' [{"name": "search", "arguments": {"q": "Paris"}}, {"name": "add", "arguments": '
                                 '{"a": 1, "b": 2}}]', TOOLS, "auto", "mistral")
    assert content is None and _calls(calls) == [("search", {"q": "Paris"}), ("add", {"a": 1, "b": 2})]
    content, calls = read_answer('I will search. [{"name": "search", "arguments": {"q": "[x]"}}]', TOOLS, "auto", "mistral")
    assert content == "I will search." and _calls(calls) == [("search", {"q": "[x]"})]
    # v11 tokenizers: "[TOOL_CALLS]search[ARGS]{...}", both markers special.
    content, calls = read_answer('search{"q": "a{b}"} add{"a": 1}', TOOLS, "auto", "mistral")
    assert content is None and _calls(calls) == [("search", {"q": "a{b}"}), ("add", {"a": 1})]
    # A list that names a tool nobody offered, text after the calls, or no JSON: the text stays.
    for text in ('[{"name": "delete_all", "arguments": {}}]', '[{"name": "add", "arguments": {}}] and more',
                 "search for [cheap] flights", 'search{"q": '):
        assert read_answer(text, TOOLS, "auto", "mistral") == (text, [])


def test_llama3_json_calls_are_the_whole_answer():
    content, calls = read_answer('{"name": "search", "parameters": {"q": "Paris; France"}}', TOOLS, "auto",
                                 "llama3_json")
    assert content is None and _calls(calls) == [("search", {"q": "Paris; France"})]
    _, calls = read_answer(' {"name": "add", "parameters": {"a": 1}}; {"name": "search", "arguments": {"q": "x"}}',
                           TOOLS, "auto", "llama3_json")
    assert _calls(calls) == [("add", {"a": 1}), ("search", {"q": "x"})]
    for text in ('The answer is {"name": "add", "parameters": {}}', '{"name": "delete_all", "parameters": {}}',
                 '{"name": "add", "parameters": {}} trailing words', "{not json}"):
        assert read_answer(text, TOOLS, "auto", "llama3_json") == (text, [])


def test_the_reader_follows_the_markers_of_the_chat_template():
    # The distinctive lines of each family's template (Qwen2.5, Mistral's v3, Llama 3.1's).
    assert reader_for(HERMES_TEMPLATE.replace("<tools>", "<tools></tools>\n<tool_call>")) == "hermes"
    assert reader_for("{%- if message.tool_calls %}{{- '[TOOL_CALLS] [' }}{%- endif %}") == "mistral"
    assert reader_for("{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument "
                      "name and its value}.' }}") == "llama3_json"
    assert reader_for("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert reader_for(None) == reader_for("{{ messages[0].content }}") == "hermes"
