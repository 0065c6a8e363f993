"""The messages of a chat held across turns: a system prompt, then user and assistant turns in
pairs, cut from the oldest end when the next prompt would not fit in the model's context."""

import json
from pathlib import Path


class ContextFull(ValueError):
    """The new message does not fit in the context even with every earlier turn dropped."""


class Conversation:
    def __init__(self, system: str | None = None):
        self.system = system or None
        # Alternating user and assistant messages: every user turn is stored with its answer,
        # so dropping the oldest two messages always drops one whole exchange.
        self.turns: list[dict] = []

    def messages(self, user: str | None = None) -> list[dict]:
        """The whole conversation as chat-template messages, with `user` as the next turn."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        tail = [{"role": "user", "content": user}] if user is not None else []
        return head + self.turns + tail

    def add(self, user: str, answer: str, reasoning: str | None = None) -> None:
        """One exchange; the answer's reasoning, if it has one, goes to the template, which keeps
        or drops it as the model was trained to see it."""
        said = {"role": "assistant", "content": answer}
        self.turns += [{"role": "user", "content": user}, said if reasoning is None else {**said, "reasoning_content": reasoning}]

    def reset(self) -> None:
        """Forget the turns; the system prompt stays."""
        self.turns = []

    def set_system(self, text: str | None) -> None:
        """A new system prompt starts a new conversation: earlier answers followed the old one."""
        self.system = text or None
        self.reset()

    def fit(self, user: str, encode, room: int) -> tuple[list[int], int]:
        """The prompt ids of the conversation with `user` as the next turn, dropping the oldest
        exchanges until they are at most `room` tokens. Returns (ids, exchanges dropped); the
        dropped ones are gone from the conversation. Raises ContextFull (keeping every turn)
        when the system prompt and `user` alone are longer than `room`."""
        alone = encode(Conversation(self.system).messages(user))
        if len(alone) > room:
            raise ContextFull(f"the message comes to {len(alone)} tokens with the chat template and system "
                              f"prompt, more than the {room} the context leaves for a prompt")
        dropped = 0
        ids = encode(self.messages(user))
        while len(ids) > room:  # ends at the latest with no turns left, which `alone` showed fits
            self.turns = self.turns[2:]
            dropped += 1
            ids = encode(self.messages(user))
        return ids, dropped

    def save(self, path: str | Path) -> Path:
        """Write the messages as a JSON list of {"role", "content"} (OpenAI's `messages`)."""
        path = Path(path).expanduser()
        path.write_text(json.dumps(self.messages(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return path
