"""A stop request ends every loop of Redis reads, even when redis-py swallows the cancellation.

redis-py 8's asyncio client now and then returns from a command that was cancelled as if
nothing happened (CI saw ``elastic-console logs -f`` ignore its Ctrl-C). The loops check the
task's pending cancellation on every turn (``raise_if_cancelled``). The first tests make the
swallowing certain by wrapping the reader's XREAD; the last one cancels real reads at random
moments against a real server."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis

from elastic_agent.coordination.transport.connection import make_async_client, raise_if_cancelled
from elastic_agent.coordination.wire.keyspace import console_client_name
from elastic_agent.supervision.records.commands import CommandReader
from elastic_console.job.client import BLOCK_MS, JobClient
from tests.waiting import blocked_in, wait_until_async

# A loop must end within one blocked read after the request, plus slack for a loaded machine.
ENDS_WITHIN_S = BLOCK_MS / 1000 + 5


class Swallowing:
    """A command as redis-py behaves at its worst: a cancellation that lands in it is lost
    and the command returns nothing. ``swallowed`` counts the cancellations it lost."""

    def __init__(self, call: Callable[..., Awaitable[Any]]) -> None:
        self.call = call
        self.swallow = True
        self.swallowed = 0

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self.call(*args, **kwargs)
        except asyncio.CancelledError:
            if not self.swallow:
                raise
            self.swallowed += 1
            return None


async def cancel_when_inside(task: asyncio.Task[Any], command: Swallowing,
                             r: redis.Redis, name: str) -> None:
    """Cancel ``task`` once its client (connection ``name``) is blocked in an XREAD."""
    await wait_until_async(lambda: blocked_in(r, "xread", name), 10, "a blocked XREAD")
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=ENDS_WITHIN_S)
    if not done:  # end it for good before failing, or asyncio.run would wait for it forever
        command.swallow = False
        task.cancel()
        await asyncio.wait({task}, timeout=ENDS_WITHIN_S)
    assert command.swallowed == 1, "the cancellation never reached the XREAD to be swallowed"
    assert done, "the loop ran on after its task was cancelled"
    assert task.cancelled()


def test_raise_if_cancelled_sees_a_swallowed_cancellation() -> None:
    async def body() -> None:
        started, swallowed = asyncio.Event(), asyncio.Event()

        async def swallower() -> None:
            started.set()
            try:
                await asyncio.sleep(10)  # a long call, cancelled long before it ends
            except asyncio.CancelledError:
                swallowed.set()
            raise_if_cancelled()
            await asyncio.sleep(10)  # not reached

        task = asyncio.ensure_future(swallower())
        await asyncio.wait_for(started.wait(), 10)
        raise_if_cancelled()  # this task was not asked to stop: nothing happens
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        assert swallowed.is_set()

    asyncio.run(body())


def test_follow_ends_when_its_cancellation_is_swallowed(redis_url: str, r: redis.Redis,
                                                        job_id: str) -> None:
    async def body() -> None:
        client = JobClient(redis_url, job_id)
        command = client._reader.xread = Swallowing(client._reader.xread)  # type: ignore[method-assign]

        async def consume() -> None:
            async for _ in client.follow():
                pass

        try:
            await cancel_when_inside(asyncio.ensure_future(consume()), command, r,
                                     console_client_name(job_id))
        finally:
            await client.close()

    asyncio.run(body())


def test_the_agents_command_reader_ends_when_its_cancellation_is_swallowed(
        redis_url: str, r: redis.Redis, job_id: str) -> None:
    async def body() -> None:
        client = make_async_client(redis_url, blocking_ms=5000, client_name=f"reader-{job_id}")
        command = client.xread = Swallowing(client.xread)  # type: ignore[method-assign]

        async def consume() -> None:
            async for _ in CommandReader(client, job_id):
                pass

        try:
            await cancel_when_inside(asyncio.ensure_future(consume()), command, r,
                                     f"reader-{job_id}")
        finally:
            await client.aclose()

    asyncio.run(body())


def test_follow_cancelled_at_random_moments_always_ends(redis_url: str, job_id: str) -> None:
    """The real thing: without the check, about one in a hundred of these ran on forever
    (the deterministic tests above are the ones certain to fail without it)."""

    async def body() -> None:
        client = JobClient(redis_url, job_id)
        rng = random.Random(7)

        async def consume() -> None:
            async for _ in client.follow():
                pass

        try:
            for i in range(120):
                task = asyncio.ensure_future(consume())
                # Not a wait: a random moment of the read (connect, send, block) to cancel in.
                await asyncio.sleep(rng.random() * 0.06)
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=ENDS_WITHIN_S)
                assert done, f"cancellation {i} was lost: follow ran on"
        finally:
            await client.close()

    asyncio.run(body())
