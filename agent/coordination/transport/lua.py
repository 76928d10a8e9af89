"""A Lua script an asyncio client runs by its hash.

redis-py's ``register_script`` object asks at every call whether its client is a pipeline
(``isinstance`` against a class whose metaclass is typing's protocol meta), which cost more
than the rest of a stall check in ``bench/fleet.py`` (2,048 agents in one process). This one
calls EVALSHA straight away and sends the text (EVAL, which also caches it) only when Redis
answers NOSCRIPT: a restarted or flushed Redis, a failover to a replica that never ran it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import redis


class LuaScript:
    """``await script(keys=[...], args=[...])``, as a registered redis-py script is called."""

    __slots__ = ("client", "sha", "source")

    def __init__(self, client: Any, source: str) -> None:
        self.client = client
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        try:
            return await self.client.evalsha(self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return await self.client.eval(self.source, len(keys), *keys, *args)
