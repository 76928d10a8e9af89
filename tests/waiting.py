"""Waiting on conditions with deadlines. Every other sleep a test makes says, in a comment on
or just above its line, why it is not a wait on a condition: the pace of a writer or a bar
under test, a random moment to strike at, a stretch of time in which nothing may happen, a
tight poll whose timing is the figure. (Sleeps in the code of the workers and child processes
that tests start, the strings they run, are those programs' behaviour, not the test's.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from typing import Any

import redis

#: A condition is polled 5 ms after the first look, then ever less often, every 50 ms at most
#: (from the 11th poll on, 0.2 s into the wait). Most conditions hold within a few polls; a long
#: wait polled every 5 ms throughout, on a predicate that reads and decodes a whole stream,
#: took CPU from the agents and Redis under test on a 2-core machine.
FIRST_PAUSE = 0.005
PAUSE_GROWTH = 1.25
LONGEST_PAUSE = 0.05


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition",
               explain: Callable[[], str] | None = None) -> Any:
    """Return the predicate's first truthy value; fail after ``timeout`` seconds, with what
    ``explain`` returns then (the processes' output: a failure in CI is all one gets)."""
    deadline = time.monotonic() + timeout
    pause = FIRST_PAUSE
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(pause)
        pause = min(pause * PAUSE_GROWTH, LONGEST_PAUSE)
    detail = f":\n{explain()}" if explain is not None else ""
    raise AssertionError(f"{what} not reached within {timeout:g} s{detail}")


async def wait_until_async(predicate: Callable[[], Any], timeout: float = 10.0,
                           what: str = "condition") -> Any:
    """``wait_until`` for coroutines: the event loop keeps running while it waits."""
    deadline = time.monotonic() + timeout
    pause = FIRST_PAUSE
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        await asyncio.sleep(pause)
        pause = min(pause * PAUSE_GROWTH, LONGEST_PAUSE)
    raise AssertionError(f"{what} not reached within {timeout:g} s")


def client_ids(r: redis.Redis) -> set[str]:
    """The ids of the server's connections now (to tell a new one apart later)."""
    return {c["id"] for c in r.client_list()}


def blocked_in(r: redis.Redis, command: str, name: str | None = None,
               not_in: Collection[str] = ()) -> bool:
    """Whether the server holds a client (named ``name``, if given; not one of ``not_in``)
    blocked (flag ``b``) in ``command`` (lower case, e.g. ``xread``): a blocking read is under
    way, not about to be."""
    return any(c.get("cmd") == command and "b" in c.get("flags", "")
               and (name is None or c.get("name") == name) and c["id"] not in not_in
               for c in r.client_list())
