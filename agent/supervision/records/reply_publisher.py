"""What the agent's answers to per-rank requests (``stacks``, ``collectives``) share: who
answers, and how the replies go out: one stream entry per rank, in one pipeline, on a stream
whose cap grows with the job (``keyspace.replies_maxlen``: one request of every rank fits).
Cost per node and request: one round trip of its own ranks' entries, whatever the job's size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import redis.asyncio as aioredis

from elastic_agent.coordination.wire import keyspace


class ReplyPublisher:
    """Base of an agent's per-rank request handlers (StackCollector, RecorderCollector)."""

    def __init__(self, group: Any, client: aioredis.Redis, job_id: str, node: str,
                 host: str) -> None:
        self.group = group  # the WorkerGroup whose workers answer
        self.client = client
        self.keys = keyspace.JobKeys(job_id)
        self.node = node
        self.host = host
        #: The job's ranks in the current round (the agent sets it): sizes the stream's cap.
        self.world_size = 0

    async def _publish(self, stream: str, floor: int,
                       entries: Iterable[Mapping[str, str]]) -> None:
        """Append ``entries`` to ``stream`` in one round trip. Raises redis errors / OSError."""
        pipe = self.client.pipeline(transaction=False)
        maxlen = keyspace.replies_maxlen(floor, self.world_size)
        n = 0
        for fields in entries:
            pipe.xadd(stream, dict(fields), maxlen=maxlen, approximate=True)
            n += 1
        if n:
            await pipe.execute()
