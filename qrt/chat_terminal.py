"""`qrt chat`: a conversation with a chat model in the terminal. Messages are read line by line
(qrt/chat_input.py), the conversation is kept across turns in the model's chat template
(qrt/conversation.py), and each answer is printed token by token as the engine makes it."""

import signal
import sys
import time

from qrt.chat_input import MessageReader
from qrt.conversation import ContextFull, Conversation
from qrt.errors import QrtError
from qrt.runtime.reasoning import CONTENT, REASONING

_DIM, _PLAIN = "\x1b[2m", "\x1b[0m"  # a terminal's faint text, and back
# Room for a full answer from a small chat model that still leaves three quarters of the default
# 2048-token context to the conversation.
MAX_NEW_TOKENS = 512

HELP = """\
Type a message and press Enter. End a line with \\ to go on with the message on the next line;
lines pasted together are sent as one message.
Ctrl-C stops an answer (the part already shown stays in the conversation) or clears the line
being typed. When the conversation outgrows the context, its oldest exchanges are dropped.

  /reset          forget the conversation (the system prompt stays)
  /system TEXT    set the system prompt (without TEXT: none) and start over
  /save FILE      write the conversation to FILE as JSON messages
  /help           this text
  /exit           leave (so does Ctrl-D)"""


def add_chat_args(parser) -> None:
    """`qrt chat`'s own flags (the model's and the sampling flags are those of `qrt generate`)."""
    parser.add_argument("--system", default=None, help="the system prompt (default: none)")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="tokens of context the conversation may fill, prompt and answer together "
                             "(default: 2048, or the model's context if shorter)")
    parser.add_argument("--eager", action="store_true", help="skip torch.compile (reference ops)")
    parser.add_argument("--verbose", action="store_true",
                        help="after each answer, print its prompt and answer token counts and speed")


def run_chat(args, load) -> int:
    """The `qrt chat` command. load(**compile_model options): the command line's model."""
    if args.tp != 1:
        raise ValueError("qrt chat runs in one process; --tp is for generate, serve and eval under torchrun")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    try:
        # The graphs are compiled only once the chat template is known to be there: a model
        # without one is refused before the longest part of the start.
        model = load(compile=not args.eager, warmup=False, max_seq_len=args.max_seq_len)
        tokenizer = model.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise QrtError(f"{model.source} has no chat template, which `qrt chat` needs to tell turns apart; "
                           f"`qrt generate --no-chat` continues plain text")
        if args.max_new_tokens >= model.max_seq_len:
            raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the "
                             f"context of {model.max_seq_len} tokens; lower it or raise --max-seq-len")
        if not args.eager:
            model.warmup()
    except KeyboardInterrupt:
        sys.stderr.write("\nqrt: interrupted\n")
        return 130
    return Chat(model, args).run()


class _Stop(Exception):
    """Raised from the stream callback to end an answer: the engine cancels a request whose
    listener raises, and frees its slot."""


class _Interrupts:
    """SIGINT while an answer streams. The first asks the answer to stop at its next token, so
    that the engine ends the request between steps; a second (a long prompt still prefilling)
    stops it at once while `immediate`, and generate drops the request on the way out."""

    def __enter__(self):
        self.requested = False
        self.immediate = True
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested and self.immediate:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)


class Chat:
    def __init__(self, model, args):
        self.model = model
        self.args = args
        self.conversation = Conversation(args.system)
        self.reader = MessageReader()
        self.out = sys.stdout

    def run(self) -> int:
        if self.reader.interactive:
            self._say_out(f"qrt chat: {self.model.source} ({self.model.scheme.describe()}), "
                          f"context {self.model.max_seq_len} tokens\n{HELP}\n")
        while True:
            try:
                if not self._turn():
                    return 0
            except KeyboardInterrupt:  # at the prompt: the line being typed is dropped
                self._say_out("\n")

    def _turn(self) -> bool:
        """Read one message and answer it, or run one command; False once the chat is over."""
        try:
            message = self.reader.read()
        except EOFError:
            self._say_out("\n")
            return False
        if not message.strip():
            return True
        if message.startswith("/") and "\n" not in message:
            return self._command(message.strip())
        self._answer(message)
        return True

    # ---- commands ------------------------------------------------------------------------------
    def _command(self, line: str) -> bool:
        """Run a /command; False when it is the one that leaves."""
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name == "/help":
            self._say_out(HELP + "\n")
        elif name == "/reset":
            self.conversation.reset()
            self._note("conversation cleared" + (" (the system prompt stays)" if self.conversation.system else ""))
        elif name == "/system":
            self.conversation.set_system(rest)
            self._note("system prompt set; conversation cleared" if rest else
                       "system prompt removed; conversation cleared")
        elif name == "/save":
            if not rest:
                self._note("/save needs a file name: /save FILE")
                return True
            try:
                path = self.conversation.save(rest)
            except OSError as err:
                self._note(f"could not save: {err}")
            else:
                self._note(f"saved {len(self.conversation.messages())} messages to {path}")
        else:
            self._note(f"unknown command {name}; /help lists the commands")
        return True

    # ---- one turn --------------------------------------------------------------------------------
    def _answer(self, message: str) -> None:
        args, model = self.args, self.model
        room = model.max_seq_len - args.max_new_tokens
        try:
            ids, dropped = self.conversation.fit(message, self._encode, room)
        except ContextFull as err:
            self._note(f"{err}; not sent (shorten it, or raise --max-seq-len or lower --max-new-tokens)")
            return
        except ValueError as err:
            self._note(f"not sent: {err}")
            return
        if dropped:
            self._note(f"the conversation outgrew the context of {model.max_seq_len} tokens "
                       f"({args.max_new_tokens} kept for the answer); dropped the oldest {dropped} "
                       f"exchange{'s' if dropped > 1 else ''}")
        answer = StreamedAnswer(model, self.out, ids)
        # Until the answer is in the conversation, Ctrl-C only asks it to stop: one that comes
        # as the answer ends must not lose the turn.
        with _Interrupts() as interrupts:
            answer.interrupts = interrupts
            started = time.perf_counter()
            try:
                model.generate(ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                               top_p=args.top_p, seed=args.seed, stream=answer.take)
            except KeyboardInterrupt:  # a second Ctrl-C: generate has dropped the request
                answer.stopped = True
            interrupts.immediate = False
            elapsed = time.perf_counter() - started
            if answer.error is not None:
                raise answer.error
            answer.finish()
            self.conversation.add(message, answer.content, answer.reasoning)
            if answer.stopped:
                self._note("answer stopped; what was shown stays in the conversation")
            elif answer.length_cut(args.max_new_tokens):
                self._note(f"the answer reached --max-new-tokens ({args.max_new_tokens})")
            if args.verbose:
                count = len(answer.tokens)
                self._note(f"{len(ids)} prompt tokens, {count} new tokens in {elapsed:.2f} s "
                           f"({count / max(elapsed, 1e-6):.1f} tok/s incl. prefill)")

    def _encode(self, messages: list[dict]) -> list[int]:
        from jinja2 import TemplateError

        try:
            return self.model.encode_messages(messages)
        except TemplateError as err:  # a template may refuse a role, such as a system prompt
            raise ValueError(f"the chat template refused the conversation: {err}") from None

    def _say_out(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def _note(self, text: str) -> None:
        """What qrt says about the conversation goes to stderr, apart from the answers."""
        self.out.flush()
        sys.stderr.write(f"qrt: {text}\n")
        sys.stderr.flush()


class StreamedAnswer:
    """The stream callback of one answer: each token's text printed as soon as it is safe to
    show (a character's bytes may span tokens), and the answer kept as shown. A reasoning
    model's reasoning (qrt/runtime/reasoning.py) is shown first, dimmed on a terminal and
    labelled, and kept apart from the answer."""

    def __init__(self, model, out, prompt_ids: list[int]):
        from qrt.runtime import reasoning
        from qrt.runtime.text_stream import TextStream

        self.eos_ids = model.eos_ids
        self.text_stream = TextStream(model.tokenizer)
        parser = reasoning.parser_for(model.tokenizer.chat_template)
        self.split = reasoning.split_for(parser, model.tokenizer, prompt_ids)
        self.parts = {reasoning.REASONING: "", reasoning.CONTENT: ""}  # the answer's text so far, by field
        self.showing = None  # the field of the text printed last
        self.styled = getattr(out, "isatty", lambda: False)()
        self.out = out
        self.tokens: list[int] = []
        self.interrupts = None
        self.stopped = False
        self.error: BaseException | None = None

    def take(self, token: int) -> None:
        if self.stopped:  # tokens of the step the stop came in
            raise _Stop
        if self.interrupts is not None and self.interrupts.requested:
            self.stopped = True
            raise _Stop
        try:
            self.tokens.append(token)
            self.split.token(token)
            if token not in self.eos_ids:  # an end-of-turn token ends the answer, it is not text
                self._show(self.split.text(self.text_stream.add(token)))
        except Exception as err:
            # The engine would take this for a request to stop; it is kept to be raised once
            # the engine is done with the request.
            self.error = err
            raise

    def finish(self) -> None:
        self._show(self.split.text(self.text_stream.flush()) + self.split.end())
        self.out.write((_PLAIN if self.styled and self.showing == REASONING else "") + "\n")
        self.out.flush()

    @property
    def content(self) -> str:
        return self.parts[CONTENT]

    @property
    def reasoning(self) -> str | None:
        return self.parts[REASONING] or None

    def length_cut(self, max_new_tokens: int) -> bool:
        return len(self.tokens) >= max_new_tokens and self.tokens[-1] not in self.eos_ids

    def _show(self, pieces: list[tuple[str, str]]) -> None:
        for field, piece in pieces:
            self.parts[field] += piece
            if field != self.showing:
                self.out.write(self._turn_to(field))
                self.showing = field
            self.out.write(piece)
        if pieces:
            self.out.flush()

    def _turn_to(self, field: str) -> str:
        """What is printed where the answer turns from one part to the other."""
        if field == REASONING:
            return (_DIM if self.styled else "") + "thinking: "
        if self.showing == REASONING:
            return (_PLAIN if self.styled else "") + "\n\n"
        return ""
