"""`qrt chat` as a user runs it: the command in a pseudo-terminal, typed at and interrupted with
pexpect. The tiny chat model's weights are random, so what it says means nothing; that the
conversation is kept is checked by construction instead: greedy answers and prompt token counts
(--verbose) against what the same model gives, in this process, for the whole message list.

The command runs with --eager: the reference ops need no compile, which would cost more than
everything else here, and give the same tokens in both processes."""

import io
import json
import os
import re
import shutil
import signal
import sys

import pexpect
import pytest

from qrt import runtime
from qrt.cli import main
from qrt.runtime.sampling import SamplingParams

START_TIMEOUT_S = 180  # python, torch and the model loaded on a busy two-core machine
STEP_TIMEOUT_S = 120
STATS = re.compile(r"qrt: (\d+) prompt tokens, (\d+) new tokens")


@pytest.fixture(scope="module")
def models(chat_llama_dir):
    """The model `qrt chat --eager --max-seq-len N` runs, loaded here to tell what its answers
    should be (the same cache length, so that every sum runs over the same shapes)."""
    loaded = {}

    def get(max_seq_len: int = 2048):
        if max_seq_len not in loaded:
            loaded[max_seq_len] = runtime.compile_model(chat_llama_dir, compile=False, progress=False,
                                                        max_seq_len=max_seq_len)
        return loaded[max_seq_len]

    return get


def greedy(model, messages: list[dict], max_new_tokens: int) -> tuple[str, int]:
    """(The greedy answer's text, the prompt's token count) for a conversation, through the
    engine's own text stream."""
    ids = model.encode_messages(messages)
    seq = model.engine.submit(model.request(ids, max_new_tokens, SamplingParams(), text=True))
    model.engine.run([seq])
    return seq.text, len(ids)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


class Chat:
    """`qrt chat` in a pseudo-terminal, and the steps the tests take with it."""

    def __init__(self, folder, *flags):
        command = ["-m", "qrt", "chat", str(folder), "--eager", "--verbose", *flags]
        # TERM=dumb: readline writes no escape sequences (bracketed paste and the like) into what
        # the tests read; a wide window keeps it from scrolling long lines sideways.
        # SIGINT as a terminal's user has it: a test run started in the background of a
        # non-interactive shell inherits it ignored, and Python then leaves Ctrl-C at the prompt
        # ignored too.
        self.child = pexpect.spawn(sys.executable, command, env={**os.environ, "TERM": "dumb"},
                                   encoding="utf-8", codec_errors="replace", dimensions=(50, 400),
                                   timeout=STEP_TIMEOUT_S,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.child.expect_exact("leave (so does Ctrl-D)", timeout=START_TIMEOUT_S)  # the banner's end
        self.prompt()

    def prompt(self) -> None:
        self.child.expect_exact(">>> ")

    def stats(self) -> tuple[int, int]:
        """(Prompt tokens, new tokens) of the answer that ends next; waits for the prompt after it."""
        self.child.expect(STATS)
        counts = int(self.child.match.group(1)), int(self.child.match.group(2))
        self.prompt()
        return counts

    def say(self, message: str) -> tuple[int, int]:
        self.child.sendline(message)
        return self.stats()

    def command(self, line: str, reply: str) -> None:
        self.child.sendline(line)
        self.child.expect_exact(reply)
        self.prompt()

    def save(self, path) -> list[dict]:
        self.command(f"/save {path}", f"to {path}")
        return json.loads(path.read_text(encoding="utf-8"))

    def leave_with_ctrl_d(self) -> int:
        self.child.sendeof()
        self.child.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus

    def close(self) -> None:
        if self.child.isalive():
            self.child.terminate(force=True)


def test_turns_keep_the_context_and_reset_and_system_start_over(chat_llama_dir, models, tmp_path):
    model = models()
    chat = Chat(chat_llama_dir, "--max-new-tokens", "24")
    try:
        first = chat.say("hello there")
        second = chat.say("and then?")
        saved = chat.save(tmp_path / "two.json")
        assert [m["role"] for m in saved] == ["user", "assistant", "user", "assistant"]
        assert [saved[0], saved[2]] == [user("hello there"), user("and then?")]
        # Each answer is the model's greedy answer to the whole conversation before it.
        assert (saved[1]["content"], first[0]) == greedy(model, saved[:1], 24)
        assert (saved[3]["content"], second[0]) == greedy(model, saved[:3], 24)
        alone = greedy(model, saved[2:3], 24)
        assert alone != greedy(model, saved[:3], 24)  # so that the check above tells context kept

        chat.command("/reset", "conversation cleared")
        assert chat.say("and then?")[0] == alone[1]
        assert chat.save(tmp_path / "reset.json") == [user("and then?"), {"role": "assistant", "content": alone[0]}]

        chat.command("/system You answer in French.", "system prompt set")
        system = {"role": "system", "content": "You answer in French."}
        prompt_tokens = chat.say("hello there")[0]
        after = chat.save(tmp_path / "system.json")
        assert after[:2] == [system, user("hello there")] and len(after) == 3
        assert (after[2]["content"], prompt_tokens) == greedy(model, after[:2], 24)
        chat.command("/reset", "the system prompt stays")
        assert chat.save(tmp_path / "kept.json") == [system]
        assert chat.leave_with_ctrl_d() == 0
    finally:
        chat.close()


def test_ctrl_c_stops_an_answer_keeps_it_and_clears_a_typed_line(chat_llama_dir, models, tmp_path):
    model = models()
    message = "tell me everything"
    # The greedy answer runs on without an end-of-turn token, so only Ctrl-C can end it early.
    answer = model.generate(model.encode_messages([user(message)]), 100)
    assert len(answer) == 100 and not set(answer) & model.eos_ids
    chat = Chat(chat_llama_dir, "--max-new-tokens", "1000")
    try:
        chat.child.sendline(message)
        chat.child.expect_exact(message)  # the line's echo
        chat.child.expect_exact("\n")
        chat.child.read_nonblocking(1)  # the answer has begun
        chat.child.send("\x03")
        chat.child.expect_exact("answer stopped")
        new_tokens = chat.stats()[1]
        assert 1 <= new_tokens < 1000
        saved = chat.save(tmp_path / "stopped.json")
        assert saved[0] == user(message) and saved[1]["role"] == "assistant" and len(saved) == 2
        assert saved[1]["content"]  # what was shown stays in the conversation

        chat.child.send("a line never sent")
        chat.child.send("\x03")
        chat.prompt()
        chat.child.sendline("go on")
        chat.child.expect_exact("go on")
        chat.child.expect_exact("\n")
        chat.child.read_nonblocking(1)
        chat.child.send("\x03")
        chat.child.expect_exact("answer stopped")
        prompt_tokens = chat.stats()[0]
        assert prompt_tokens == len(model.encode_messages([*saved, user("go on")]))  # the stopped answer counted
        assert [m["content"] for m in chat.save(tmp_path / "again.json")[::2]] == [message, "go on"]
        assert chat.leave_with_ctrl_d() == 0
    finally:
        chat.close()


def test_lines_join_into_messages_and_the_oldest_turns_give_way(chat_llama_dir, models, tmp_path):
    max_seq_len, max_new_tokens = 200, 40
    room = max_seq_len - max_new_tokens
    model = models(max_seq_len)
    joined, pasted = "one\ntwo", "three\nfour"
    first_answer, first_tokens = greedy(model, [user(joined)], max_new_tokens)
    # The second turn needs the first dropped, and fits without it.
    assert len(model.encode_messages([user(joined), {"role": "assistant", "content": first_answer},
                                      user(pasted)])) > room
    second_answer, second_tokens = greedy(model, [user(pasted)], max_new_tokens)
    chat = Chat(chat_llama_dir, "--max-seq-len", str(max_seq_len), "--max-new-tokens", str(max_new_tokens))
    try:
        chat.child.sendline("one\\")
        chat.child.expect_exact("... ")
        assert chat.say("two")[0] == first_tokens
        chat.child.send(pasted + "\n")  # both lines at once, as a paste arrives
        chat.child.expect_exact("dropped the oldest 1 exchange")
        assert chat.stats()[0] == second_tokens
        kept = [user(pasted), {"role": "assistant", "content": second_answer}]
        assert chat.save(tmp_path / "kept.json") == kept

        chat.child.sendline("x" * 300)
        chat.child.expect_exact("not sent")
        chat.prompt()
        assert chat.save(tmp_path / "unchanged.json") == kept
        assert chat.leave_with_ctrl_d() == 0
    finally:
        chat.close()


def test_a_model_without_a_chat_template_is_refused(chat_llama_dir, tmp_path, capsys):
    folder = tmp_path / "no-template"
    shutil.copytree(chat_llama_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["chat", str(folder), "--eager"]) == 2
    assert "has no chat template" in capsys.readouterr().err


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("out", [io.StringIO, _Terminal], ids=["piped", "terminal"])
def test_a_reasoning_models_thinking_is_shown_apart_and_kept_apart(tmp_path, out):
    """A <think> answer, token by token as the engine hands it over: the reasoning is labelled
    (and dimmed on a terminal), the answer follows it, and the conversation keeps them apart so
    that the template decides what the model sees of earlier reasoning."""
    from tiny_tokenizer import write_tokenizer
    from transformers import PreTrainedTokenizerFast

    from qrt.chat_terminal import StreamedAnswer
    from qrt.conversation import Conversation

    (tmp_path / "config.json").write_text("{}")
    write_tokenizer(tmp_path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{# </think> #}"
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = type("Model", (), {"tokenizer": tokenizer, "eos_ids": {eos}})()
    shown = out()
    answer = StreamedAnswer(model, shown, tokenizer.encode("<|im_start|>assistant\n"))
    for token in tokenizer.encode("<think>\nTwo and two.\n</think>\n\nIt is 4.") + [eos]:
        answer.take(token)
    answer.finish()
    dim, plain = ("\x1b[2m", "\x1b[0m") if out is _Terminal else ("", "")
    assert shown.getvalue() == f"{dim}thinking: Two and two.{plain}\n\nIt is 4.\n"
    assert (answer.reasoning, answer.content) == ("Two and two.", "It is 4.")
    conversation = Conversation(None)
    conversation.add("2 + 2?", answer.content, answer.reasoning)
    assert conversation.messages()[-1] == {"role": "assistant", "content": "It is 4.", "reasoning_content": "Two and two."}
