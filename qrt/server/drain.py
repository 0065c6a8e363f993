"""How `qrt serve` stops on SIGTERM or Ctrl-C without losing work.

uvicorn's own shutdown closes the listening socket at the signal, so a client that arrives during
the drain sees its connection refused, which a load balancer cannot tell from a crash. Here the
first signal only starts a drain: the socket stays open, the routes answer new requests with 503
and a message saying the server is shutting down, and the requests already accepted run to their
end. When none is left in hand, or after --shutdown-timeout seconds, the server stops as uvicorn
does (letting the last responses finish sending). A second signal stops it at once."""

import signal
import threading
import time
from typing import Callable

import uvicorn

POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM or SIGINT drains. `draining` is the event the routes
    read; `in_hand()` counts the requests accepted and not yet ended."""

    def __init__(self, config: uvicorn.Config, *, draining: threading.Event, in_hand: Callable[[], int],
                 timeout_s: float):
        super().__init__(config)
        self.draining, self.in_hand, self.timeout_s = draining, in_hand, timeout_s

    def handle_exit(self, sig: int, frame) -> None:
        # Not uvicorn's: it records the signal to raise it again after shutdown, which would end
        # the process by the signal rather than with the drain's exit status.
        if self.draining.is_set():  # a second signal: stop now
            if sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        self.draining.set()
        threading.Thread(target=self._drain, name="qrt-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while self.in_hand() > 0 and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self.should_exit = True
