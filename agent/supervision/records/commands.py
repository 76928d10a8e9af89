"""The job's command stream, read by every agent on its own cursor.

Plain XREAD fan-out (no consumer group): every agent sees every command. The cursor starts
at the stream's last entry when the agent starts, so a command issued before it joined the
job is not replayed at it. The reader passes the last id it saw on every read, so it rides
out a Redis outage without skipping a command (redis-py re-sends the same explicit id).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import redis
import redis.asyncio as aioredis

from elastic_agent.coordination.transport.connection import raise_if_cancelled
from elastic_agent.coordination.wire.command_records import MAX_COMMAND_ID_CHARS, Command, decode_command
from elastic_agent.coordination.wire.keyspace import JobKeys

log = logging.getLogger(__name__)

# Short enough that a command stream replaced under a blocked read (which Redis 7.0 does not
# wake) is noticed within seconds; an idle XREAD every few seconds costs nothing.
_BLOCK_MS = 5_000
_REFUSED_RETRY_S = 1.0
#: Entries per XREAD: a reply holds at most this many, whatever a writer put on the stream
#: (anyone who may write it can make each entry megabytes). Commands come by the handful.
READ_COUNT = 16


#: ``stacks`` requests an agent answers: a burst of this many, then one every
#: ``STACKS_INTERVAL_S`` (each signals every worker of the node and publishes up to 256 KiB a
#: rank; a flood of them is acked ``rejected``). See docs/SECURITY.md.
STACKS_BURST = 4
STACKS_INTERVAL_S = 5.0


class RateLimit:
    """A token bucket: ``burst`` at once, then one every ``interval_s``. O(1) a call."""

    def __init__(self, burst: int, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.interval_s, self._clock = burst, interval_s, clock
        self._tokens = float(burst)
        self._at = clock()

    def take(self) -> float:
        """0.0 if this request may go ahead (a token is spent), else the seconds until one may."""
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) / self.interval_s)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) * self.interval_s


def stacks_limit() -> RateLimit:
    """An agent's limit on the ``stacks`` commands it answers."""
    return RateLimit(STACKS_BURST, STACKS_INTERVAL_S)


def stacks_refused(wait: float) -> str:
    """The ack reason of a ``stacks`` command over the limit, ``wait`` s before the next."""
    return (f"too many stacks requests (at most {STACKS_BURST}, then one every "
            f"{STACKS_INTERVAL_S:g} s): ask again in {max(1, round(wait + 0.5))} s")


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
        #: Entries the consumer finished with (it asked for the next one): the command loop's
        #: progress, which resets keep_running's back-off.
        self.handled = 0

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
                reply = await self._client.xread({self._key: self.last_id}, count=READ_COUNT,
                                                 block=_BLOCK_MS)
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
                    try:
                        decoded = decode_command(eid, fields)
                    except Exception as exc:  # a decoder bug: the command is still acked
                        decoded = f"command could not be decoded ({type(exc).__name__})"
                    if isinstance(decoded, str):
                        yield Rejected(_raw_id(fields), decoded, eid)
                    else:
                        yield decoded
                    self.handled += 1


def _raw_id(fields: object) -> str:
    """The id a refused command gave, cut and decoded: the ack names it."""
    raw = fields.get(b"id", b"?") if isinstance(fields, dict) else b"?"
    return raw[:MAX_COMMAND_ID_CHARS].decode(errors="replace") if isinstance(raw, bytes) else "?"
