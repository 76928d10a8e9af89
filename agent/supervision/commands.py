"""The job's command stream, read by every agent on its own cursor.

Plain XREAD fan-out (no consumer group): every agent sees every command. The cursor starts
at the stream's last entry when the agent starts, so a command issued before it joined the
job is not replayed at it. The reader passes the last id it saw on every read, so it rides
out a Redis outage without skipping a command (redis-py re-sends the same explicit id).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import redis
import redis.asyncio as aioredis

from ..coordination.connection import raise_if_cancelled
from ..coordination.protocol import MAX_COMMAND_ID_CHARS, Command, JobKeys, decode_command

log = logging.getLogger(__name__)

# Short enough that a command stream replaced under a blocked read (which Redis 7.0 does not
# wake) is noticed within seconds; an idle XREAD every few seconds costs nothing.
_BLOCK_MS = 5_000
_REFUSED_RETRY_S = 1.0


class Rejected:
    """A command entry that could not be decoded; it is acked as rejected."""

    def __init__(self, command_id: str, reason: str, entry_id: str) -> None:
        self.id = command_id
        self.reason = reason
        self.entry_id = entry_id


class CommandReader:
    """Yields :class:`Command` (or :class:`Rejected`) as they arrive on the job's stream.

    ``client`` must be a blocking-reader client (socket timeout longer than the BLOCK).
    """

    def __init__(self, client: aioredis.Redis, job_id: str) -> None:
        self._client = client
        self._key = JobKeys(job_id).commands
        self.last_id: str | None = None
        #: The first word of the server's refusal while the stream cannot be read, else None.
        self.refused: str | None = None

    async def start_position(self) -> str:
        """The id to read after: the stream's newest entry now ('0-0' when empty)."""
        newest = await self._client.xrevrange(self._key, count=1)
        return newest[0][0].decode() if newest else "0-0"

    async def __aiter__(self) -> AsyncIterator[Command | Rejected]:
        backoff = 0.05
        while True:
            raise_if_cancelled()
            try:
                if self.last_id is None:
                    self.last_id = await self.start_position()
                reply = await self._client.xread({self._key: self.last_id}, block=_BLOCK_MS)
                backoff = 0.05
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                log.debug("command stream unreachable (%s); retrying", exc)
                await asyncio.sleep(backoff)  # backoff between reconnection attempts
                backoff = min(backoff * 2, 1.0)
                continue
            except redis.ResponseError as exc:
                # The key holds something that is not a stream (WRONGTYPE), or the id was
                # refused: say so once per kind of error and keep trying, so commands work
                # again the moment the key is repaired or deleted.
                reason = str(exc).split(" ", 1)[0]
                if reason != self.refused:
                    self.refused = reason
                    log.warning("the command stream %s cannot be read (%s); commands are not "
                                "received until it is a stream again", self._key, exc)
                if reason != "WRONGTYPE":
                    self.last_id = None  # e.g. an id the server refuses: start from the present
                await asyncio.sleep(_REFUSED_RETRY_S)
                continue
            if self.refused is not None:
                log.warning("the command stream %s can be read again", self._key)
                self.refused = None
            for _key, entries in reply or []:
                for entry_id, fields in entries:
                    eid = entry_id.decode()
                    self.last_id = eid
                    decoded = decode_command(eid, fields)
                    if isinstance(decoded, str):
                        raw_id = fields.get(b"id", b"?")[:MAX_COMMAND_ID_CHARS].decode(errors="replace")
                        yield Rejected(raw_id, decoded, eid)
                    else:
                        yield decoded
