"""Typed events onto the job's event stream, and per-worker resource samples.

Events go through the agent's :class:`StreamPublisher`, so an outage delays them but never
loses or reorders them (they are not droppable). Resource samples are the latest value per
rank in a hash: losing one during an outage costs nothing, so they are written directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TextIO

import psutil
import redis.asyncio as aioredis

from elastic_agent.coordination.wire import event_records, keyspace
from elastic_agent.coordination.wire.event_records import RESTART_PHASES, EventType
from elastic_agent.coordination.wire.keyspace import JobKeys

from ..loops import Cadence
from .publisher import StreamPublisher

log = logging.getLogger(__name__)


class EventSink:
    """Writes this node's events. ``emit`` never blocks and never raises for Redis.

    ``echo``: where torchrun's ``--event-log-handler console`` would log them too, one JSON
    object per line in the shape of torch's ``Event.serialize()`` (name, source, timestamp in
    ms, metadata)."""

    def __init__(self, publisher: StreamPublisher, job_id: str, node_id: str,
                 echo: TextIO | None = None) -> None:
        self._publisher = publisher
        self._key = JobKeys(job_id).events
        self.node_id = node_id
        self._seq = 0
        self._echo = echo

    def emit(self, event_type: str, **data: Any) -> None:
        if event_type not in EventType.ALL:
            raise ValueError(f"unknown event type {event_type!r}")
        self._seq += 1
        self._publisher.publish(
            self._key, event_records.encode_event(event_type, self.node_id, data, self._seq),
            keyspace.EVENTS_MAXLEN, droppable=False)
        if self._echo is not None:
            line = json.dumps({"name": f"elastic_agent.{event_type}", "source": "AGENT",
                               "timestamp": int(time.time() * 1000),
                               "metadata": {"node": self.node_id, **data}}, default=str)
            with contextlib.suppress(OSError, ValueError):  # a closed stderr loses only this
                self._echo.write(line + "\n")
                self._echo.flush()


class RestartClock:
    """When each phase of one restart ended, in ms since the agent saw why the workers must
    stop (a failure, a membership change, a command, a stall), on the agent's monotonic clock:

    ``evidence`` the survivors' stacks captured; ``stopped`` every worker's tree gone;
    ``reported`` the root cause found and the restart counted; ``rendezvous`` the next round
    formed; ``keeper`` the attempt's keeper running with the workers asked of it;
    ``started`` every worker's pid known. ``detected_at`` (wall clock, seconds) lets a reader
    on the same host measure from the worker's own crash time. Carried by the next
    ``workers_started`` event as ``restart`` (docs/PROTOCOL.md). O(1) per restart."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.detected_at = time.time()
        self._t0 = time.monotonic()
        self.marks: dict[str, float] = {}

    def mark(self, phase: str, at: float | None = None) -> None:
        """``phase`` ended now (or at monotonic time ``at``); a phase marked twice keeps its
        first mark."""
        if phase not in RESTART_PHASES:
            raise ValueError(f"unknown restart phase {phase!r}")
        when = time.monotonic() if at is None else at
        self.marks.setdefault(phase, round(max(0.0, when - self._t0) * 1000, 1))

    def record(self) -> dict[str, Any]:
        """The ``restart`` field of ``workers_started``."""
        return {"reason": self.reason, "detected_at": round(self.detected_at, 6),
                "phases_ms": {p: self.marks[p] for p in RESTART_PHASES if p in self.marks}}


class SampleRider(Protocol):
    """What rides with each resource sample, in the same round trip (the training metrics:
    diagnosis/metrics_publish.py). :meth:`ride` queues this interval's writes on the
    pipeline and says what to merge into each rank's sample and how many replies its writes
    take; :meth:`landed` gets those replies (an error as an exception object), or the
    exception when the whole round trip failed."""

    def ride(self, pipe: Any, final: bool = False) -> tuple[Mapping[int, Mapping[str, Any]], int]:
        ...

    def landed(self, replies: list[Any] | BaseException) -> None: ...


#: Seconds between two resource samples of a node: k9s refreshes every 2 s, htop every 1.5 s.
#: One HSET of the node's ranks per sample: at 4,096 nodes, 2,048 writes a second to Redis
#: (at 1 s they were as many as every other steady-state call of the job together).
SAMPLE_INTERVAL = 2.0


class ResourceSampler:
    """Samples each worker's CPU %, RSS and threads every :data:`SAMPLE_INTERVAL` (GPU memory
    when ``nvidia-smi`` is there) into ``JobKeys.resources``: global rank -> latest JSON sample.
    Cost per node: one O(ranks of the node) HSET per interval, whatever the job's size.

    ``rider`` (the training metrics) merges its fields into each rank's sample and queues its
    own writes in the same pipeline: one round trip per interval either way."""

    def __init__(self, client: aioredis.Redis, job_id: str, node_id: str,
                 interval: float = SAMPLE_INTERVAL, rider: SampleRider | None = None) -> None:
        self._client = client
        self._key = JobKeys(job_id).resources
        self._node = node_id
        self.interval = interval
        self.rider = rider
        #: The rider's fields last written per rank (this attempt's ranks: reset by track).
        self._merged: dict[int, Mapping[str, Any]] = {}
        self._procs: dict[int, psutil.Process] = {}
        self._nvidia_smi = shutil.which("nvidia-smi")

    def track(self, ranks_to_pids: Mapping[int, int]) -> None:
        self._procs = {}
        self._merged = {}
        for rank, pid in ranks_to_pids.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                p.cpu_percent(None)  # the first call only starts the measurement
                self._procs[rank] = p

    def sample(self) -> dict[int, dict[str, Any]]:
        gpu = self._gpu_memory()
        out: dict[int, dict[str, Any]] = {}
        for rank, p in self._procs.items():
            try:
                with p.oneshot():
                    # A worker's tree (data loader workers) is part of its cost.
                    procs = [p, *p.children(recursive=True)]
                    cpu = sum(_cpu(c) for c in procs)
                    rss = sum(_rss(c) for c in procs)
                    threads = p.num_threads()
            except psutil.Error:
                continue
            sample: dict[str, Any] = {"rank": rank, "node": self._node, "pid": p.pid,
                                      "cpu": round(cpu, 1), "rss": rss, "threads": threads,
                                      "ts": time.time()}
            if p.pid in gpu:
                sample["gpu_mem"] = gpu[p.pid]
            out[rank] = sample
        return out

    def _gpu_memory(self) -> dict[int, int]:
        if not self._nvidia_smi:
            return {}
        try:
            text = subprocess.run(
                [self._nvidia_smi, "--query-compute-apps=pid,used_memory",
                 "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=2, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            return {}
        mem: dict[int, int] = {}
        for line in text.splitlines():
            pid, _, used = line.partition(",")
            with contextlib.suppress(ValueError):
                mem[int(pid)] = int(used) * 1024 * 1024
        return mem

    async def collect(self) -> dict[int, dict[str, Any]]:
        """:meth:`sample`, off the event loop (psutil reads /proc; nvidia-smi may take a while)."""
        return await asyncio.to_thread(self.sample)

    async def run(self, stop: Callable[[], bool] = lambda: False) -> None:
        cadence = Cadence(self.interval)  # N nodes' samples spread over the interval
        while not stop():
            await asyncio.sleep(cadence.until_next())  # sampling is periodic by nature
            await self.publish(await self.collect())

    async def final(self, rounds: int = 3) -> None:
        """The agent exits: what the rider still holds goes now (a few round trips at most)."""
        for _ in range(rounds):
            if not await self.publish({}, final=True):
                return

    async def publish(self, samples: dict[int, dict[str, Any]], final: bool = False) -> bool:
        """One interval's writes: the samples (HSET) and what the rider queues, pipelined;
        nothing at all when neither has anything. ``final``: the agent's last, before it
        exits (the rider writes what it would otherwise write later). Whether anything was
        sent."""
        pipe = self._client.pipeline(transaction=False)
        riding = 0
        if self.rider is not None:
            try:
                fields, riding = self.rider.ride(pipe, final)
            except Exception:  # never fatal: the samples still go
                log.exception("the metrics could not be prepared for this interval")
                pipe, fields, riding = self._client.pipeline(transaction=False), {}, 0
            for rank, extra in fields.items():
                if rank in samples:
                    samples[rank].update(extra)
                elif self._merged.get(rank) != extra:
                    # No sample (the worker exited): its last step and values still go, once.
                    samples[rank] = {"rank": rank, "node": self._node, "ts": time.time(), **extra}
            self._merged.update((rank, fields[rank]) for rank in samples if rank in fields)
        if not samples and not riding:
            return False
        if samples:
            pipe.hset(self._key, mapping={
                str(rank): json.dumps(s, separators=(",", ":")) for rank, s in samples.items()
            })
        try:
            replies = await pipe.execute(raise_on_error=False)
        except (Exception, asyncio.CancelledError) as exc:
            log.debug("resource sample not written: %s", exc)
            self._landed(riding, exc)  # the rider keeps what did not go (bounded)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return False
        self._landed(riding, list(replies[:riding]))
        return True

    def _landed(self, riding: int, replies: list[Any] | BaseException) -> None:
        if riding and self.rider is not None:
            try:
                self.rider.landed(replies)
            except Exception:
                log.exception("the metrics' replies could not be handled")


def _cpu(p: psutil.Process) -> float:
    try:
        return p.cpu_percent(None)
    except psutil.Error:
        return 0.0


def _rss(p: psutil.Process) -> int:
    try:
        return int(p.memory_info().rss)
    except psutil.Error:
        return 0
