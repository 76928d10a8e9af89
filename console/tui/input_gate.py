"""InputGate: the console's background work steps aside while a key is being handled.

Everything runs on one event loop. A key press travels App -> Screen -> focused widget ->
binding -> handler -> refresh -> frame, and every hop is a message on some queue: between two
hops the loop runs whatever else is ready. At 50k lines/s that is the Redis reader folding a
reply (slices of ~5 ms), the log view's rescans and the refresh timer, so a key that needs
five hops waited behind five slices of someone else's work: 40-90 ms before its own handler
even ran (bench/console_bench.py, "until the key's state changed").

So a key *closes* the gate (:meth:`InputGate.close`), and the readers call :meth:`pause`
between records: while the gate is closed they wait. The app opens it again once the key has
been handled and drawn (:meth:`open`), and in any case ``hold_max_s`` after the key, so a key
that never settles (or a user leaning on one) slows the readers down but never stops them.
Nothing is lost while they wait: the records stay in Redis and in the socket buffer, and the
reader catches up after (each hold is at most a tenth of a second of lines).

No Textual here; the app decides what "handled and drawn" means.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

__all__ = ["HOLD_MAX_S", "InputGate"]

#: The longest a key holds the readers.
HOLD_MAX_S = 0.1


class InputGate:
    """Open: background work runs. Closed (by a key): it waits, for ``hold_max_s`` at most."""

    def __init__(self, hold_max_s: float = HOLD_MAX_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_max_s = hold_max_s
        self._clock = clock
        self._opened = asyncio.Event()
        self._opened.set()
        self._deadline = 0.0
        self.closed_at = 0.0
        self.holds = 0  # keys that closed the gate
        self.waits = 0  # pauses that had to wait

    @property
    def is_open(self) -> bool:
        return self._opened.is_set() or self._clock() >= self._deadline

    def close(self) -> None:
        """A key arrived: hold background work until :meth:`open` or ``hold_max_s``."""
        self.closed_at = self._clock()
        self._deadline = self.closed_at + self.hold_max_s
        self._opened.clear()
        self.holds += 1

    def open(self) -> None:
        """The key was handled and drawn: background work may go on."""
        self._opened.set()

    async def pause(self) -> None:
        """Wait while the gate is closed (at most until its deadline); else return at once
        (without yielding: callers yield on their own budget)."""
        if self._opened.is_set():
            return
        remaining = self._deadline - self._clock()
        if remaining > 0:
            self.waits += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._opened.wait(), remaining)
        self._opened.set()
