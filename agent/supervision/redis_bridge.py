"""A synchronous client over the agent's asyncio clients, for code that runs in threads.

The rendezvous (and the store of the exit barrier) is synchronous: the agent calls it through
``asyncio.to_thread`` and its heartbeats beat in a thread of their own. With clients of its
own it held two more connections; :class:`SyncBridge` lets it use the agent's two instead
(issue 21). Every call is forwarded by name: a method that returns a coroutine is run on the
agent's event loop and its result (or exception) handed back to the calling thread; objects
that are not plain data (a registered script, a pipeline) come back bridged too, so
``register_script(...)(keys=..., args=...)`` and ``pipeline().hset(...).execute()`` work
unchanged. Whatever the rendezvous calls next works as long as the asyncio client has it.

``priority=True`` sends the calls ahead of the agent's other writes (``connection.priority``):
a heartbeat is never queued behind log batches.

The price: a heartbeat waits for the event loop to take it (the longest step the loop is in
when the beat is due), where it used to go out on the thread's own connection. Measured with
4 ranks printing as fast as they can and beats every 0.3 s, on this 2-core machine shared with
other jobs (load 7-11): gaps between beats, by Redis's clock, median 316-330 ms, at most
332-542 ms in 3 runs (with a connection of its own: 306-311 ms, at most 321-355 ms). Far below
any heartbeat timeout; a loop blocked for seconds would delay the beats by as much.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable
from typing import Any

import redis

from ..coordination.transport.connection import priority as redis_priority

_PLAIN = (bytes, str, int, float, bool, list, tuple, dict, set, type(None))


class SyncBridge:
    """``target``'s methods, callable from any thread but the event loop's (see above).
    Call :meth:`attach` with the loop before the first call that does I/O."""

    def __init__(self, target: Any, *, priority: bool = False,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._target = target
        self._priority = priority
        # Shared with the bridges made from this one (a script registered before the loop
        # runs is attached with its client).
        self._loops: list[asyncio.AbstractEventLoop | None] = [loop]

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loops[0] = loop

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        # Passes for the client it stands for: describe_endpoint, socket_timeout_of and
        # is_cluster look at the client's kind (a MuxReader passes for the writer in turn).
        return self._target.__class__

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._result(attr(*args, **kwargs))

        call.__name__ = name
        return call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._result(self._target(*args, **kwargs))

    def close(self) -> None:
        """Nothing: the agent closes its clients itself, after the threads are done."""

    def _result(self, value: Any) -> Any:
        if asyncio.iscoroutine(value):
            value = self._run(value)
        if isinstance(value, (*_PLAIN, BaseException)):
            return value
        bridge = SyncBridge(value, priority=self._priority)
        bridge._loops = self._loops
        return bridge

    def _run(self, coro: Awaitable[Any]) -> Any:
        loop = self._loops[0]
        if loop is None or loop.is_closed():
            _close(coro)
            raise redis.ConnectionError("the agent's event loop is not running")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            _close(coro)
            raise RuntimeError("SyncBridge called from its own event loop (it would wait for "
                               "itself): call it through asyncio.to_thread")
        try:
            future = asyncio.run_coroutine_threadsafe(self._on_loop(coro), loop)
        except RuntimeError:  # closed between the check and the call
            _close(coro)
            raise redis.ConnectionError("the agent's event loop is not running") from None
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            # The loop is ending (asyncio.run cancels what is left): an outage to the caller.
            raise redis.ConnectionError("the agent's event loop stopped") from None

    async def _on_loop(self, coro: Awaitable[Any]) -> Any:
        if not self._priority:
            return await coro
        with redis_priority():
            return await coro


def _close(coro: Awaitable[Any]) -> None:
    close = getattr(coro, "close", None)
    if close is not None:
        close()
