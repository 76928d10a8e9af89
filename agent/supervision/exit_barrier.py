"""The exit barrier's store: waits that give up when the node must leave the barrier.

torch's ``barrier`` (here ``store_collectives.barrier``) blocks a thread until every node of the round has
arrived. A node must leave it early when another node fails, a ``stop`` comes, or a signal
arrives; a thread the event loop cannot cancel (and that ``asyncio.run`` would wait for at
exit) cannot be told to, so the store waits in slices and looks at ``leave`` between them.
Cost: one blocking read per slice per node, on the agent's own connection.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ..coordination.store import RedisStore, StoreTimeoutError

_BARRIER_SLICE_S = 0.25  # how long the barrier's thread blocks before it looks at ``leave``


class BarrierLeft(Exception):
    """The exit barrier was left before it filled."""


class LeavableStore(RedisStore):
    """A store whose waits give up once ``leave`` is set. The exit barrier blocks in a thread
    the event loop cannot cancel (and ``asyncio.run`` would wait for it at exit), so it waits
    in slices and looks at ``leave`` between them."""

    _leave: threading.Event

    @classmethod
    def on(cls, writer: Any, reader: Any, job_id: str, namespace: str,
           leave: threading.Event) -> LeavableStore:
        """A store on the agent's bridged clients (no connection of its own)."""
        store = cls.from_clients(writer, reader, job_id, namespace)
        assert isinstance(store, LeavableStore)
        store._leave = leave
        return store

    def wait(self, keys: Sequence[str | bytes], timeout: Any = None) -> None:
        if timeout is None:
            seconds = self.timeout_seconds
        elif isinstance(timeout, timedelta):
            seconds = timeout.total_seconds()
        else:
            seconds = float(timeout)
        deadline = None if seconds == 0 else time.monotonic() + seconds
        while True:
            if self._leave.is_set():
                if self.check(keys):
                    return  # it filled just as the node was told to leave: passing wins
                raise BarrierLeft
            remaining = _BARRIER_SLICE_S if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                names = [k.decode() if isinstance(k, bytes) else k for k in keys]
                raise StoreTimeoutError(f"timeout after {seconds:g} s waiting for {names}",
                                        names, seconds)
            with contextlib.suppress(StoreTimeoutError):
                super().wait(keys, min(remaining, _BARRIER_SLICE_S))
                return

    def _pause(self, seconds: float) -> None:
        # A write refused for lack of memory is retried; leaving the barrier ends that too.
        if self._leave.wait(seconds):
            raise BarrierLeft
