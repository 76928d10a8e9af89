"""keep_running: a loop that fails is reported and started again; cancellation ends it."""

from __future__ import annotations

import asyncio

import pytest

from elastic_agent.supervision.loops import keep_running

pytestmark = pytest.mark.asyncio


async def test_a_failing_loop_is_reported_and_restarted_until_it_returns():
    calls: list[int] = []
    said: list[str] = []

    async def loop() -> None:
        calls.append(1)
        if len(calls) < 3:
            raise RecursionError("maximum recursion depth exceeded")

    await asyncio.wait_for(keep_running("command reader", loop, said.append, first_delay=0.001),
                           10)
    assert len(calls) == 3
    assert said == ["the command reader failed (RecursionError: maximum recursion depth "
                    "exceeded); restarting it"] * 2


async def test_cancellation_ends_it():
    started = asyncio.Event()

    async def loop() -> None:
        started.set()
        await asyncio.sleep(3600)  # a loop that never ends by itself: the cancel ends it

    task = asyncio.create_task(keep_running("reader", loop, print))
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
