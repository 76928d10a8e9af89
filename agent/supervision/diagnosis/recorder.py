"""The agent's half of the collective traces (issue 22): torch's flight recorder in every
worker, read on demand through a per-rank socket, published like stack replies.

``--flight-recorder N`` (default :data:`DEFAULT_ENTRIES`; 0 is off) gives the workers
``TORCH_FR_BUFFER_SIZE=N`` (unless the user's environment sets it: theirs wins), which makes
torch record the newest N collectives of the worker, all process groups together (gloo on the
CPU build; NCCL too: README, "Below the Python stack"). The worker bootstrap starts a thread
(``recorder_probe.py``) that connects to this rank's Unix socket, made by the agent in its
private runtime directory (``probes.runtime_dir``, 0700) before the worker starts, named by
``ELASTIC_RECORDER``. The agent asks ``trace`` (the recorder, reduced to the newest entries
of each group) or ``sample`` (the straggler sampler's counts); each answer is a 4-byte length
and JSON of at most ``trace_records.MAX_TRACE_BYTES``, decoded by ``trace_records`` (the worker is
untrusted input).

A rank blocked inside a collective answers: the collective waits with the GIL released, and
the thread is the worker's own (tests/test_collectives.py proves it on a hung gloo job).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import redis

from elastic_agent.coordination.wire import keyspace, trace_records
from elastic_agent.coordination.wire.collectives import RankTrace, analyse, event_record
from elastic_agent.coordination.wire.protocol import ProtocolError
from elastic_agent.coordination.wire.trace_records import CollectiveReply, CollectiveTrace

from ..launch import probes
from ..records.reply_publisher import ReplyPublisher

log = logging.getLogger(__name__)

#: ``--flight-recorder``'s default: the newest 256 collectives of each worker, all its
#: process groups together. Recording costs nothing measurable per collective (about 10 us
#: an all_reduce with or without it here); reading a full buffer on request is what grows
#: with N: the trace thread's dump took 18 ms at 256 entries, 51 ms at 512 and 113 ms at
#: 2,000 (2 cores at load 7), and it runs before every restart's kill (the evidence). The
#: analysis needs each group's newest entries; raise N for a longer history.
#: bench/flight_recorder_bench.py measures the cost against the step time.
DEFAULT_ENTRIES = 256
#: ``--straggler-interval``: seconds between two slow-rank checks (supervision/diagnosis/stragglers.py);
#: a rank is named after two slow windows in a row, so within about three intervals (45 s).
DEFAULT_STRAGGLER_INTERVAL = 15.0
#: How long ranks have to answer (asked all at once).
ANSWER_TIMEOUT = 2.0
#: The evidence before a kill waits less: a worker whose main thread holds the GIL (stuck in
#: a C call) cannot answer at all, and the restart waits for this capture. A dump took 18 ms
#: at 256 entries, 113 ms at 2,000 here (2 cores at load 7).
EVIDENCE_TIMEOUT = 1.0


def worker_env(entries: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The job-wide variables that switch torch's recorder on (none when ``entries`` is 0 or
    the user set the buffer size already)."""
    if entries <= 0 or "TORCH_FR_BUFFER_SIZE" in environ \
            or "TORCH_NCCL_TRACE_BUFFER_SIZE" in environ:
        return {}
    return {"TORCH_FR_BUFFER_SIZE": str(entries)}


def to_trace(answer: bytes | str) -> CollectiveTrace:
    """A worker's answer decoded in the guarded place (an error trace for anything else)."""
    if isinstance(answer, str):
        return CollectiveTrace(error=answer)
    try:
        return trace_records.decode_collective_trace(answer)
    except ProtocolError as exc:
        return CollectiveTrace(error=f"unreadable trace from the worker: {exc}")


async def ask_all(targets: Iterable[tuple[int, int, probes.RecorderLink | None]], request: str,
                  timeout: float = ANSWER_TIMEOUT) -> list[tuple[int, int, bytes | str]]:
    """``(rank, pid, answer)`` of every ``(rank, pid, link)``, asked at once, by rank."""
    async def one(rank: int, pid: int, link: probes.RecorderLink | None) -> tuple[int, int, bytes | str]:
        if link is None:
            return rank, pid, probes.NOT_LINKED
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
        await self._publish(self.keys.collectives, keyspace.COLLECTIVES_MAXLEN, (
            trace_records.encode_collective_reply(
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
