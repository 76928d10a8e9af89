"""Loops that must outlive their own bugs: a reader that dies silently switches off a whole
job's control plane, so one that fails is reported and started again."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


async def keep_running(name: str, loop: Callable[[], Awaitable[None]],
                       report: Callable[[str], None], *, first_delay: float = 0.1,
                       max_delay: float = 5.0, progress: Callable[[], int] | None = None) -> None:
    """Run ``loop()`` until it returns; whenever an exception escapes it, ``report`` one line
    naming ``name`` and the error, wait and run it again. Cancellation passes through: that is
    how the agent ends it.

    The wait doubles from ``first_delay`` to ``max_delay`` while the loop fails without doing
    anything, and starts again at ``first_delay`` after a good pass: ``progress()`` (a count of
    the items the loop finished, e.g. commands handled) moved since the run began. Without that
    reset, a few bad records spread over a day would delay every later good one by
    ``max_delay``."""
    delay = first_delay
    while True:
        done = progress() if progress is not None else 0
        try:
            await loop()
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            report(f"the {name} failed ({type(exc).__name__}: {exc}); restarting it")
            log.debug("%s failure", name, exc_info=True)
            if progress is not None and progress() != done:
                delay = first_delay
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay)


class Cadence:
    """The ticks of a periodic call: every ``interval`` s, at a phase of this node's own.

    The agents of a job start their periodic calls together (one rendezvous releases them
    all), so without a phase of their own N nodes' calls reach Redis at the same instant,
    every interval: 4,096 summaries queued at once ahead of a console's read, and a lost node
    seen only when the next of those bursts comes. A random phase per node spreads them over
    the interval (with N nodes one checks every interval/N s), and the ticks keep their
    spacing whatever the calls between them take, so the loop's beat never drifts late enough
    for the heartbeat thread to send one of its own.
    """

    def __init__(self, interval: float, phase: float | None = None) -> None:
        self.interval = interval
        phase = random.uniform(0, interval) if phase is None else phase
        self._next = time.monotonic() + phase

    def until_next(self) -> float:
        """Seconds to the next tick. A tick that is due (or was missed: the call ran long)
        moves on to the first one still ahead, so each call after a tick waits for the next."""
        now = time.monotonic()
        if self._next <= now:
            self._next += ((now - self._next) // self.interval + 1) * self.interval
        return self._next - now
