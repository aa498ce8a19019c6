"""Clean interruption: the first SIGINT or SIGTERM asks the trainer to finish its step and wrap
up (final checkpoint, summary, plots); a second one stops the process at once."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulStop:
    """Context manager: on the first signal call `on_first()` and print `message` (if any); on
    the next, print `last_words` and exit with 130 at once. `signalled` holds the first signal's
    name (None if none came). Outside the main thread (where handlers cannot be installed) it
    does nothing."""

    def __init__(self, on_first: Callable[[], None], message: str | None, last_words: str):
        self.on_first, self.message, self.last_words = on_first, message, last_words
        self.signalled: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.signalled is not None:
            # NB: not KeyboardInterrupt: raised inside a finaliser (__del__) it is printed with
            # a traceback and dropped, and the run goes on
            print(self.last_words, file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(130)
        self.signalled = signal.Signals(signum).name
        if self.message:
            print(f"\n{self.signalled}: {self.message}", file=sys.stderr, flush=True)
        self.on_first()

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
