"""Loops that must outlive their own bugs: a reader that dies silently switches off a whole
job's control plane, so one that fails is reported and started again."""

from __future__ import annotations

import asyncio
import logging
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
