"""The agent's half of the collective traces (issue 22): torch's flight recorder in every
worker, read on demand through a per-rank socket, published like stack replies.

``--flight-recorder N`` (default :data:`DEFAULT_ENTRIES`; 0 is off) gives the workers
``TORCH_FR_BUFFER_SIZE=N`` (unless the user's environment sets it: theirs wins), which makes
torch record the newest N collectives of the worker, all process groups together (gloo on the
CPU build; NCCL too: README, "Below the Python stack"). The worker bootstrap starts a thread
(``recorder_probe.py``) that connects to this rank's Unix socket, made by the agent in its
private runtime directory (``stacks.runtime_dir``, 0700) before the worker starts, named by
``ELASTIC_RECORDER``. The agent asks ``trace`` (the recorder, reduced to the newest entries
of each group) or ``sample`` (the straggler sampler's counts); each answer is a 4-byte length
and JSON of at most ``protocol.MAX_TRACE_BYTES``, decoded by ``protocol`` (the worker is
untrusted input).

A rank blocked inside a collective answers: the collective waits with the GIL released, and
the thread is the worker's own (tests/test_collectives.py proves it on a hung gloo job).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import redis

from ..coordination import protocol
from ..coordination.collectives import RankTrace, analyse, event_record
from ..coordination.protocol import CollectiveReply, CollectiveTrace, ProtocolError
from . import stacks, zygote
from .reply_publisher import ReplyPublisher

log = logging.getLogger(__name__)

#: ``--flight-recorder``'s default: the newest 256 collectives of each worker, all its
#: process groups together. Recording costs nothing measurable per collective (about 10 us
#: an all_reduce with or without it here); reading a full buffer on request is what grows
#: with N: the trace thread's dump took 18 ms at 256 entries, 51 ms at 512 and 113 ms at
#: 2,000 (2 cores at load 7), and it runs before every restart's kill (the evidence). The
#: analysis needs each group's newest entries; raise N for a longer history.
#: bench/flight_recorder_bench.py measures the cost against the step time.
DEFAULT_ENTRIES = 256
#: ``--straggler-interval``: seconds between two slow-rank checks (supervision/stragglers.py);
#: a rank is named after two slow windows in a row, so within about three intervals (45 s).
DEFAULT_STRAGGLER_INTERVAL = 15.0
RECORDER_ENV = zygote.RECORDER_ENV
#: How long ranks have to answer (asked all at once).
ANSWER_TIMEOUT = 2.0
#: The evidence before a kill waits less: a worker whose main thread holds the GIL (stuck in
#: a C call) cannot answer at all, and the restart waits for this capture. A dump took 18 ms
#: at 256 entries, 113 ms at 2,000 here (2 cores at load 7).
EVIDENCE_TIMEOUT = 1.0
NOT_LINKED = "no recorder thread (not a Python worker, still starting, or --flight-recorder 0)"


def worker_env(entries: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The job-wide variables that switch torch's recorder on (none when ``entries`` is 0 or
    the user set the buffer size already)."""
    if entries <= 0 or "TORCH_FR_BUFFER_SIZE" in environ \
            or "TORCH_NCCL_TRACE_BUFFER_SIZE" in environ:
        return {}
    return {"TORCH_FR_BUFFER_SIZE": str(entries)}


def socket_path(key: str) -> Path:
    """The socket of the worker named by ``key`` (run directory, attempt, local rank): a
    short name, since a Unix socket's path is at most 107 bytes."""
    return stacks.runtime_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.fr"


class RecorderLink:
    """The agent's end of one worker's recorder socket (one connection: the worker's)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.server: asyncio.AbstractServer | None = None
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()

    @classmethod
    async def listen(cls, path: Path) -> RecorderLink:
        """Listen at ``path`` (a stale socket of an earlier run is replaced). Raises OSError."""
        link = cls(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        link.server = await asyncio.start_unix_server(link._accept, path=str(path),
                                                      limit=protocol.MAX_TRACE_BYTES * 2)
        os.chmod(path, 0o600)
        return link

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._conn is not None:  # one worker per socket: a second caller is not ours
            writer.close()
            return
        self._conn = (reader, writer)

    async def ask(self, request: str, timeout: float = ANSWER_TIMEOUT) -> bytes | str:
        """The worker's answer to ``request`` (raw JSON bytes, at most MAX_TRACE_BYTES), or why
        there is none. A request that times out drops the connection (a reply cut by the
        timeout would leave the stream out of step); the worker's thread then ends."""
        if self._conn is None:
            return NOT_LINKED
        async with self._lock:
            try:
                return await asyncio.wait_for(self._exchange(request), timeout)
            except asyncio.TimeoutError:
                self._drop()
                return f"no answer within {timeout:g} s"
            except (OSError, asyncio.IncompleteReadError, struct.error):
                self._drop()
                return "the worker's recorder thread is gone"

    async def _exchange(self, request: str) -> bytes | str:
        assert self._conn is not None
        reader, writer = self._conn
        writer.write(request.encode() + b"\n")
        await writer.drain()
        size = struct.unpack(">I", await reader.readexactly(4))[0]
        if size > protocol.MAX_TRACE_BYTES:
            self._drop()
            return f"the worker's answer is {size} bytes (at most {protocol.MAX_TRACE_BYTES})"
        return await reader.readexactly(size)

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None

    def close(self) -> None:
        self._drop()
        if self.server is not None:
            self.server.close()
            self.server = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def to_trace(answer: bytes | str) -> CollectiveTrace:
    """A worker's answer decoded in the guarded place (an error trace for anything else)."""
    if isinstance(answer, str):
        return CollectiveTrace(error=answer)
    try:
        return protocol.decode_collective_trace(answer)
    except ProtocolError as exc:
        return CollectiveTrace(error=f"unreadable trace from the worker: {exc}")


async def ask_all(targets: Iterable[tuple[int, int, RecorderLink | None]], request: str,
                  timeout: float = ANSWER_TIMEOUT) -> list[tuple[int, int, bytes | str]]:
    """``(rank, pid, answer)`` of every ``(rank, pid, link)``, asked at once, by rank."""
    async def one(rank: int, pid: int, link: RecorderLink | None) -> tuple[int, int, bytes | str]:
        if link is None:
            return rank, pid, NOT_LINKED
        return rank, pid, await link.ask(request, timeout)

    return sorted(await asyncio.gather(*(one(*t) for t in targets)))


class RecorderCollector(ReplyPublisher):
    """This agent's side of ``collectives`` requests: ask the local workers, publish per rank."""

    async def capture_local(self, timeout: float = ANSWER_TIMEOUT,
                            ranks: Iterable[int] | None = None) -> list[CollectiveReply]:
        """The traces of this agent's live workers (``ranks``: only those)."""
        answers = await ask_all(self.group.recorder_targets(ranks), "trace", timeout)
        return [CollectiveReply("", self.node, self.host, rank, pid, to_trace(answer))
                for rank, pid, answer in answers]

    async def publish(self, request_id: str, replies: Iterable[CollectiveReply]) -> None:
        """One entry per rank on the job's collectives stream. Raises redis errors / OSError."""
        await self._publish(self.keys.collectives, protocol.COLLECTIVES_MAXLEN, (
            protocol.encode_collective_reply(
                CollectiveReply(request_id, r.node, r.host, r.rank, r.pid, r.trace))
            for r in replies))

    async def answer(self, cmd: Any, mine: set[int], ack: Any) -> None:
        """A ``collectives`` command: publish the traces of this node's workers (or of
        ``args.rank`` if it is here) under the command's id, then ``ack(id, status, reason)``."""
        rank = cmd.args.get("rank")
        if not mine:
            ack(cmd.id, "done", "no workers on this node")
            return
        if rank is not None and rank not in mine:
            ack(cmd.id, "done", f"rank {rank} is not on this node")
            return
        try:
            found = await self.capture_local(ranks=None if rank is None else [rank])
            await self.publish(cmd.id, found)
        except (redis.RedisError, OSError) as exc:
            ack(cmd.id, "rejected", f"collective traces not published: {exc}")
            return
        answered = sum(1 for r in found if not r.trace.error)
        ack(cmd.id, "done", f"collective traces of {answered} of {len(found)} ranks published")

    async def evidence(self, request_id: str,
                       timeout: float = EVIDENCE_TIMEOUT) -> dict[str, Any] | None:
        """Before workers are stopped: the live ones' traces, published under ``request_id``,
        and this node's analysis for the event; None when no worker has a trace."""
        try:
            replies = await self.capture_local(timeout)
        except Exception:
            log.exception("capturing the workers' collective traces before the stop failed")
            return None
        if not any(r.trace.entries for r in replies):
            return None
        try:  # bounded: during an outage the stop must not wait for Redis
            await asyncio.wait_for(self.publish(request_id, replies), ANSWER_TIMEOUT)
        except (redis.RedisError, OSError, asyncio.TimeoutError) as exc:
            log.warning("cannot publish the collective traces captured before the stop: %s",
                        exc or "Redis did not answer in time")
        analysis = analyse([RankTrace(r.rank, r.node, r.host, r.trace) for r in replies])
        return event_record(analysis, request_id)
