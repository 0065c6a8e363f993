"""`CompiledModel.chat`: a conversation in the chat template, the answer back with a reasoning
model's reasoning apart from its content (the split itself: test_reasoning_split.py)."""

import json
import shutil

import pytest

from qrt import runtime
from qrt.runtime import ChatAnswer

# DeepSeek-R1's way: earlier answers' reasoning cut from the history, and the generation prompt
# opening the <think> block the answer goes on in.
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'].split('</think>')[-1] }}"
                     "<|im_end|>\n{% endfor %}<|im_start|>assistant\n<think>\n")


@pytest.fixture(scope="module")
def plain(chat_llama_dir):
    return runtime.compile_model(chat_llama_dir, compile=False, progress=False)


@pytest.fixture(scope="module")
def thinker(chat_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("thinker")
    shutil.copytree(chat_llama_dir, folder, dirs_exist_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return runtime.compile_model(folder, compile=False, progress=False)


def test_a_model_that_does_not_reason_apart_answers_in_its_content(plain):
    streamed = []
    answer = plain.chat("Hello there", 10, stream=streamed.append)
    assert isinstance(answer, ChatAnswer) and answer.reasoning is None
    assert answer.content == plain.generate("Hello there", 10, chat=True) and answer.content.strip()
    assert streamed == answer.tokens and len(answer.tokens) == 10 and str(answer) == answer.content


def test_an_answer_inside_a_prompt_opened_think_block_is_reasoning(thinker):
    """The tiny model never closes the block, so all it says is reasoning, whitespace-trimmed, and
    there is no content yet: what `qrt serve` returns for the same answer."""
    answer = thinker.chat("Think", 12)
    whole = thinker.generate("Think", 12, chat=True)
    assert "</think>" not in whole and whole.strip()
    assert answer.reasoning == whole.strip() and answer.content == ""
    assert answer.tokens == thinker.generate(thinker.encode("Think", chat=True), 12)


def test_a_conversation_of_several_turns_is_rendered_whole(plain):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]
    answer = plain.chat(messages, 8, temperature=0.8, seed=3)
    ids = plain.encode_messages(messages)
    assert answer.tokens == plain.generate(ids, 8, temperature=0.8, seed=3)
    assert answer.reasoning is None and answer.content.strip()
    assert plain.chat(messages, 8, temperature=0.8, seed=4).tokens != answer.tokens  # the seed is the one given
