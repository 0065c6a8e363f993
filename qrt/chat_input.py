"""The messages typed at `qrt chat`'s prompt. A message may span lines: a line ending in a
backslash goes on with the next, and lines pasted together arrive as one message. From a pipe
(not a terminal) every line is a message of its own, except where a backslash joins them, and
no prompt is printed, so that a script's answers come out clean."""

import select
import sys

PROMPT, CONTINUATION = ">>> ", "... "
# A line that is already waiting this soon after the one before was pasted with it: nobody
# types a line and its Enter that fast.
_PASTE_GAP_S = 0.05


class MessageReader:
    def __init__(self):
        self.interactive = sys.stdin.isatty() and sys.stdout.isatty()
        if self.interactive:
            import readline  # noqa: F401  (importing it gives input() line editing and history)

    def read(self) -> str:
        """The next message, its lines joined by newlines. Raises EOFError at the end of the
        input (Ctrl-D) and KeyboardInterrupt on Ctrl-C, dropping the lines read so far."""
        lines = []
        prompt = PROMPT
        while True:
            line = input(prompt if self.interactive else "")
            prompt = CONTINUATION
            if line.endswith("\\"):
                lines.append(line[:-1])
                continue
            lines.append(line)
            if self.interactive and self._pasted_line_waiting():
                continue
            return "\n".join(lines)

    @staticmethod
    def _pasted_line_waiting() -> bool:
        # input() reads a terminal a line at a time (readline, or stdio in canonical mode), so
        # the rest of a paste is still in the terminal's queue, where select sees it.
        ready, _, _ = select.select([sys.stdin], [], [], _PASTE_GAP_S)
        return bool(ready)
