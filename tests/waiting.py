"""Waiting on conditions with deadlines: the tests' only use of sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Return the predicate's first truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.005)
    raise AssertionError(f"{what} not reached within {timeout:g} s")


async def wait_until_async(predicate: Callable[[], Any], timeout: float = 10.0,
                           what: str = "condition") -> Any:
    """``wait_until`` for coroutines: the event loop keeps running while it waits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        await asyncio.sleep(0.005)
    raise AssertionError(f"{what} not reached within {timeout:g} s")
