"""keep_running: a loop that fails is reported and started again; cancellation ends it.
Cadence: periodic calls at a phase of each node's own, without drift."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from elastic_agent.supervision import loops
from elastic_agent.supervision.loops import Cadence, keep_running
from elastic_agent.supervision.records.events import ResourceSampler

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


async def test_a_cadence_ticks_at_its_phase_then_every_interval_without_drift(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(loops, "time", SimpleNamespace(monotonic=lambda: now[0]))
    c = Cadence(2.0, phase=0.5)
    assert c.until_next() == pytest.approx(0.5)
    now[0] = 100.5  # the tick; the call after it takes 0.3 s
    now[0] += 0.3
    assert c.until_next() == pytest.approx(1.7)  # the next tick, not 2 s after the call
    now[0] = 102.4  # woken early (an entry came): the same tick still
    assert c.until_next() == pytest.approx(0.1)
    now[0] = 107.0  # a call ran long past two ticks: the first tick still ahead
    assert c.until_next() == pytest.approx(1.5)
    monkeypatch.undo()
    phases = {Cadence(2.0).until_next() for _ in range(50)}
    assert all(0 <= p <= 2.0 for p in phases) and max(phases) - min(phases) > 1.0


async def test_samplers_started_together_write_spread_over_their_interval():
    """A job's agents start sampling together (one rendezvous releases them): each node's
    samples go out at its own phase, not every node's in the same instant."""
    firsts: list[float] = []

    class Recorder:
        def __init__(self) -> None:
            self.first: float | None = None

        async def hset(self, key: str, mapping: dict[str, Any]) -> int:
            if self.first is None:
                self.first = time.monotonic()
                firsts.append(self.first)
            return len(mapping)

    class Fake(ResourceSampler):
        def sample(self) -> dict[int, dict[str, Any]]:
            return {0: {"rank": 0}}

        async def collect(self) -> dict[int, dict[str, Any]]:
            return self.sample()

    interval = 0.4
    samplers = [Fake(Recorder(), "job", f"n{i}", interval=interval) for i in range(16)]
    tasks = [asyncio.create_task(s.run()) for s in samplers]
    try:
        await asyncio.wait_for(_until(lambda: len(firsts) == 16), 10)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    # 16 phases drawn over the interval: all within a quarter of it has odds of 16 * 4^-15.
    assert max(firsts) - min(firsts) > interval / 4


async def _until(cond: Any) -> None:
    while not cond():
        await asyncio.sleep(0.01)
