"""keep_running: a loop that fails is reported and started again; cancellation ends it.
Cadence: periodic calls at a phase of each node's own, without drift; the resource samplers
of a job's nodes, on the session's real Redis, write at their own phases."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import redis.asyncio as aioredis

from elastic_agent.coordination.transport.connection import make_async_client
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.supervision import loops
from elastic_agent.supervision.loops import Cadence, keep_running
from elastic_agent.supervision.records.events import ResourceSampler
from tests.waiting import wait_until_async

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


async def test_samplers_started_together_write_spread_over_their_interval(redis_url, job_id):
    """A job's agents start sampling together (one rendezvous releases them): each node's
    samples go out at its own phase, not every node's in the same instant.

    Seen from the server: MONITOR reports each command with Redis's own time, so what each
    node wrote (an HSET of its ranks' samples into the job's resources hash) and when its
    first write reached Redis come from Redis, not from the samplers."""
    key = JobKeys(job_id).resources
    first: dict[str, float] = {}  # node -> server time of its first sample written
    written: dict[str, dict[str, Any]] = {}  # node -> that sample, as Redis got it
    watcher = aioredis.Redis.from_url(redis_url, protocol=2)
    client = make_async_client(redis_url)
    interval = 1.0
    # A real process to sample, one without children: sampling it is quick, so the writes
    # go out when the samplers' phases say, not when a thread pool gets to them.
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    samplers = [ResourceSampler(client, job_id, f"n{i}", interval=interval) for i in range(16)]
    for i, sampler in enumerate(samplers):
        sampler.track({i: worker.pid})

    async def watch(monitor: Any) -> None:
        async for c in monitor.listen():
            parts = c["command"].split(" ")  # (compact JSON: no spaces inside a value)
            if parts[:2] == ["HSET", key] and len(parts) == 4:
                sample = json.loads(parts[3])
                if sample["node"] not in first:
                    first[sample["node"]] = c["time"]
                    written[sample["node"]] = {"field": parts[2], **sample}

    tasks: list[asyncio.Task[None]] = []
    try:
        async with watcher.monitor() as monitor:  # every command from here on is seen
            tasks.append(asyncio.create_task(watch(monitor)))
            tasks += [asyncio.create_task(s.run()) for s in samplers]
            await wait_until_async(lambda: len(first) == 16, 10, "every node's first sample")
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for t in tasks:
            t.cancel()
        worker.kill()
        worker.wait()
        await client.aclose()
        await watcher.aclose()
    assert {n: (w["field"], w["rank"], w["pid"]) for n, w in written.items()} == {
        f"n{i}": (str(i), i, worker.pid) for i in range(16)}
    # 16 phases drawn over the interval: all within a quarter of it has odds of 16 * 4^-15.
    times = first.values()
    assert max(times) - min(times) > interval / 4, sorted(times)
