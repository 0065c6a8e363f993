"""Generated token ids turned into text as they arrive, with stop strings matched across token
boundaries. Text that could still turn out to be the start of a stop string is held back, so a
stream never shows part of a stop string."""

REPLACEMENT = "\ufffd"  # what decode gives for an incomplete UTF-8 sequence
# A token that ends inside a multi-byte character is held until the character completes; after
# this many tokens without completing it, the replacement character is let through.
_MAX_HELD_TOKENS = 4


class TextStream:
    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.ids: list[int] = []
        # ids[prefix:read] decoded to the text already taken in; decoding from `prefix` gives
        # the tokenizer the context it needs (a word-start space, a byte fallback) without
        # decoding the whole output every token.
        self.prefix = 0
        self.read = 0
        self.text = ""  # everything taken in so far, cut at a stop string once one is found
        self.emitted = 0  # characters of `text` handed out
        self.stopped = False  # a stop string was found

    def add(self, token_id: int) -> str:
        """Take in one token; return the text that is now safe to show (may be "")."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if after.endswith(REPLACEMENT) and len(self.ids) - self.read < _MAX_HELD_TOKENS:
            return ""
        searched_from = max(0, len(self.text) - self._longest_stop() + 1)
        self.text += after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        cut = self._first_stop(searched_from)
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
            return self._take(len(self.text))
        return self._take(len(self.text) - self._held_back())

    def flush(self) -> str:
        """The request finished for another reason: whatever is held back is shown now."""
        if not self.stopped and self.read < len(self.ids):  # a character left incomplete
            self.text += self._decode(self.ids[self.prefix:])[len(self._decode(self.ids[self.prefix:self.read])):]
            self.read = len(self.ids)
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        out = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _longest_stop(self) -> int:
        return max((len(s) for s in self.stop_strings), default=1)

    def _first_stop(self, searched_from: int) -> int | None:
        found = [i for i in (self.text.find(s, searched_from) for s in self.stop_strings) if i >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        held = 0
        for stop in self.stop_strings:
            for size in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:size]):
                    held = size
                    break
        return held
