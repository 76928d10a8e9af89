"""Reading a stream a page at a time: an agent never asks Redis for a whole stream at once.

Anyone who may write a job's keys can make each entry of its event stream about 1 MiB (the
most a reader decodes, ``MAX_EVENT_DATA_BYTES``) or far more (Redis itself takes up to
512 MB a field): a read without ``COUNT`` held every such entry at once. 300 forged 900 KiB
events took an agent from 41 MB to 316 MB on one failure. A page of ``PAGE`` entries bounds
what one reply holds; a caller that stops early (the first match) reads no further.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import redis

#: Entries per read: at most ~32 MiB of decodable event data in one reply, and a few hundred
#: round trips for the tens of thousands of events of a 32,768-rank round.
PAGE = 32


async def forward(client: Any, key: str, start: str, *, page: int = PAGE,
                  limit: int | None = None) -> AsyncIterator[tuple[Any, Any]]:
    """The entries of ``key`` from id ``start`` (inclusive) on, oldest first, ``page`` per
    XRANGE; at most ``limit`` entries in all (None: to the end)."""
    low, left = start, limit
    while left is None or left > 0:
        count = page if left is None else min(page, left)
        entries = await client.xrange(key, min=low, max="+", count=count)
        for entry in entries:
            yield entry
        if len(entries) < count:
            return
        if left is not None:
            left -= len(entries)
        last = entries[-1][0]
        low = "(" + (last.decode() if isinstance(last, bytes) else str(last))  # exclusive


async def backward(client: Any, key: str, *, page: int = PAGE,
                   limit: int) -> AsyncIterator[tuple[Any, Any]]:
    """The newest ``limit`` entries of ``key``, newest first, ``page`` per XREVRANGE."""
    high, left = "+", limit
    while left > 0:
        count = min(page, left)
        entries = await client.xrevrange(key, max=high, min="-", count=count)
        for entry in entries:
            yield entry
        if len(entries) < count:
            return
        left -= len(entries)
        last = entries[-1][0]
        high = "(" + (last.decode() if isinstance(last, bytes) else str(last))


async def until_unreachable(entries: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``entries`` until Redis fails to give the next page, then nothing more: what was read
    stands (a root cause found in it), and the caller falls back on what it knows itself."""
    with contextlib.suppress(redis.RedisError, OSError):
        async for entry in entries:
            yield entry
