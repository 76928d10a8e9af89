"""One node's part in the rendezvous as steps: generators that yield each Redis call they need
(a script by name, a plain command, a pipeline, a blocking read) and take its reply, so that one
set of decisions serves both drivers (rendezvous.py: a thread's blocking clients, or asyncio's).

No Redis I/O here: what to send, what the replies mean, how long to wait, when a node may call
others lost, what a beat must put back. A driver runs the steps (:func:`advance`) and does each
call; a test can feed them replies of its own. The step calls are tuples:
``("script", name, args)``, ``("eval", name, args)``, ``("command", method, args, kwargs)``,
``("pipeline", [commands])``, ``("read", streams, block_ms)``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Generator
from dataclasses import replace
from typing import Any

import redis

from ..ports import free_port
from ..transport.pressure import OOM
from ..wire import keyspace, protocol
from ..wire.keyspace import JobKeys
from ..wire.round_records import NodeDescription, RoundInfo
from .types import (
    Membership,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousProgress,
    RendezvousResult,
    RendezvousSettings,
    RendezvousTimeoutError,
    decode_list,
    decode_result,
    decode_summary,
)

# The rendezvous speaks under one logger whichever of its modules says it: the agent's log lines
# name it.
log = logging.getLogger("elastic_agent.coordination.rendezvous.drivers")

#: Longest single XREAD BLOCK; waits longer than this loop (the socket timeout is set past it).
BLOCK_CHUNK_MS = 30_000
#: How often a waiter with a progress display joins again to refresh it.
_PROGRESS_MS = 5_000


def advance(steps: Generator[Any, Any, Any], reply: Any,
            error: BaseException | None) -> tuple[bool, Any]:
    """Give ``steps`` the last call's reply (or error): (False, the next call) or (True, the
    steps' result)."""
    try:
        return False, (steps.throw(error) if error is not None else steps.send(reply))
    except StopIteration as stop:
        return True, stop.value


def one(call: tuple[Any, ...]) -> Generator[Any, Any, Any]:
    """Steps of one call."""
    return (yield call)


def script(name: str, args: list[Any]) -> Generator[Any, Any, Any]:
    """A step: run the rendezvous script ``name`` over the job's keys."""
    try:
        reply = yield from one(("script", name, args))
    except redis.exceptions.NoScriptError:
        # Redis lost its script cache (a restart, SCRIPT FLUSH, a failover): the text again.
        reply = yield from one(("eval", name, args))
    OOM.accepted()  # a write went through: a memory refusal, if any, is over
    return reply


def command(method: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """A step: one plain command, by its redis-py method name."""
    return ("command", method, args, kwargs)


class RendezvousSteps:
    """One node's state in a job's rendezvous and the steps that change it; no client. A
    driver (:class:`~.rendezvous.RedisRendezvous` and its asyncio subclass) runs the steps
    with its clients and starts the heartbeats (:meth:`_start_heartbeats`)."""

    def __init__(
        self,
        job_id: str,
        settings: RendezvousSettings | None = None,
        *,
        local_addr: str | None = None,
        node_id: str | None = None,
        nproc: int = 0,
        node_rank: int | None = None,
    ) -> None:
        self.job_id = keyspace.validate_job_id(job_id)
        self.keys = JobKeys(job_id)
        self.settings = settings or RendezvousSettings()
        self.host = socket.gethostname()
        self.local_addr = local_addr or _default_addr()
        self.node_id = node_id or f"{self.host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.nproc = nproc
        #: The group rank asked for (a static rendezvous); the round still decides.
        self.node_rank = node_rank
        self._last_round: int | None = None  # the last round this node completed
        # What a heartbeat puts back if Redis comes back empty: the round's head, this node's
        # assignment and description, and (group rank 0 only) the whole round.
        self._head: bytes = b""
        self._assign: bytes = b""
        self._round_json: bytes = b""
        self._desc = ""
        #: How many times this node put the rendezvous back after finding it gone.
        self.restorations = 0
        #: When (``time.monotonic()``) the last heartbeat that reached Redis was sent; None
        #: before the first. Redis stamped it later, so no node can call this one lost before
        #: this plus the heartbeat timeout: the agent fences its workers on it.
        self.renewed_at: float | None = None
        self._renewal_done: float | None = None  # when that heartbeat's reply came back
        self._judge_after = 0.0  # see _may_judge
        #: Redis's time (ms) of the latest beat whose reply came back: the beat-and-summary
        #: call sends it, so a beat of the heartbeat thread run just before it in Redis, both
        #: held up by the same outage, does not make it judge (see _BEAT_SUMMARY).
        self._beat_server_ms = 0
        self._stop = threading.Event()

    # -- what this node knows (no I/O) ------------------------------------------------------
    @property
    def last_round_info(self) -> RoundInfo | None:
        """The whole last round, on group rank 0 only (the node that announces it); None
        elsewhere. No I/O: it was read once when the round completed."""
        if not self._round_json:
            return None
        try:
            return RoundInfo.decode(self._round_json)
        except protocol.ProtocolError:
            return None

    @property
    def round(self) -> int | None:
        """The last round this node completed, or None before the first."""
        return self._last_round

    # -- the rendezvous -------------------------------------------------------------------
    def _rendezvous_steps(self, progress: Callable[[RendezvousProgress], None] | None
                          ) -> Generator[Any, Any, RendezvousResult]:
        s = self.settings
        register = self._last_round is None  # the first join registers the job's meta
        self._start_heartbeats()
        want = 0 if self._last_round is None else self._last_round + 1
        desc = NodeDescription(self.node_id, self.host, self.local_addr,
                               free_port(self.local_addr if _bindable(self.local_addr) else ""),
                               os.getpid(), self.nproc, self.node_rank).encode()
        join_deadline = time.monotonic() + s.join_timeout
        last_seen: tuple[Any, ...] = ()
        while True:
            if self._stop.is_set():  # shutdown() from another thread: do not join again
                raise RendezvousClosedError(f"node {self.node_id} left the rendezvous")
            sent = time.monotonic()
            status, rnd, now, wake, notify_id, payload, assign = yield from script(
                "join",
                [self.node_id, desc, s.min_nodes, s.max_nodes, int(s.last_call_timeout * 1000),
                 int(s.heartbeat_timeout * 1000), want, int(register)],
            )
            if register:
                # Listed after its meta exists: an index entry without one is a job that
                # expired or was removed, which readers drop (retention.py). The index lives
                # outside the job's hash slot: a command of its own.
                register = False
                yield command("zadd", keyspace.JOBS_INDEX, {self.job_id: int(now)}, nx=True)
            # A join beats too: the heartbeat thread's next beat is due an interval after it,
            # not at its first tick (N nodes released together all beat at once then, in the
            # middle of their forming).
            self.renewed_at = max(self.renewed_at or sent, sent)
            self._renewal_done = time.monotonic()
            status = status.decode()
            if status == "closed":
                raise RendezvousClosedError(
                    f"the rendezvous of job {self.job_id!r} is closed; start the job under a "
                    "new --job-id to run it again"
                )
            if status == "complete":
                if not assign:
                    continue  # completed without us (we were purged): join the next one
                result = decode_result(payload, assign)
                self._last_round = result.round
                self._head, self._assign, self._desc = payload, assign, desc
                # Group rank 0 alone keeps the whole round (it announces it, and puts it back
                # for readers if Redis comes back empty): one read of O(N) bytes per round.
                self._round_json = b""
                if result.group_rank == 0:
                    self._round_json = (yield command("get", self.keys.rdzv_round_info)) or b""
                    # One node deletes what the round before left, not N nodes the same keys.
                    yield from self._drop_round_store(result.round - 1)
                return result
            left = join_deadline - time.monotonic()
            members: list[str] = []
            count = missing = 0
            deadline_ms = 0
            if status == "open":
                d = json.loads(payload)
                members, deadline_ms = decode_list(d["members"]), int(d["deadline"])
                count = int(d["n"])
                if self._last_round is not None:
                    missing = max(0, int(d["prev"]) - int(d["back"]))
            if progress is not None and (status, count, deadline_ms, missing) != last_seen:
                last_seen = (status, count, deadline_ms, missing)
                progress(RendezvousProgress(
                    round=int(rnd), status=status, joined=members, min_nodes=s.min_nodes,
                    max_nodes=s.max_nodes,
                    last_call_left=(deadline_ms - int(now)) / 1000 if deadline_ms else None,
                    join_left=max(0.0, left), joined_count=count, missing_count=missing))
            if left <= 0:
                raise RendezvousTimeoutError(self._timeout_message(status, count, members))
            block_ms = max(1, min(int(wake) - int(now), int(left * 1000) + 1, BLOCK_CHUNK_MS))
            if progress is not None:
                # Progress is refreshed by a join every few seconds, never by following every
                # other node's join: that would wake N waiters N times.
                block_ms = min(block_ms, _PROGRESS_MS)
            # Any entry means "look again": the join script re-reads the state and returns
            # fresh ids, so nothing read here needs to be kept.
            yield ("read", {self.keys.rdzv_notify: notify_id}, block_ms)

    def _register_job(self) -> Generator[Any, Any, None]:
        """List the job in the job index so consoles can find it (first registration wins)."""
        secs, micros = yield command("time")
        now_ms = secs * 1000 + micros // 1000
        # One round trip, in this order: listed after its meta exists (an index entry
        # without one is a job that expired or was removed, which readers drop; retention.py).
        yield ("pipeline", [
            command("hsetnx", self.keys.meta, "created_ms", now_ms),
            command("hset", self.keys.meta, mapping={
                "min_nodes": self.settings.min_nodes, "max_nodes": self.settings.max_nodes,
                # Readers call a job lost when no heartbeat is newer than this.
                "heartbeat_timeout_ms": int(self.settings.heartbeat_timeout * 1000)}),
            command("zadd", keyspace.JOBS_INDEX, {self.job_id: now_ms}, nx=True)])

    def _drop_round_store(self, rnd: int) -> Generator[Any, Any, None]:
        """Delete round ``rnd``'s store namespace (``r<round>``: the agents' exit barrier,
        torch's own store): only that round's members used it, and they have moved on to a
        newer round or are gone. Without this a job keeps one namespace per round it ran."""
        if rnd < 0:
            return
        ns = f"r{rnd}"
        try:
            yield command("unlink", self.keys.store(ns), self.keys.store_notify(ns))
        except (RendezvousConnectionError, redis.RedisError) as exc:  # left to retention then
            log.debug("cannot delete the store of round %d: %s", rnd, exc)

    def _timeout_message(self, status: str, count: int, members: list[str]) -> str:
        s = self.settings
        if status == "waiting":
            return (f"rendezvous of job {self.job_id!r} timed out after {s.join_timeout:g} s "
                    "waiting for the running round to end (the job is full or not re-forming)")
        return (f"rendezvous of job {self.job_id!r} timed out after {s.join_timeout:g} s: "
                f"{count} of at least {s.min_nodes} nodes joined"
                + (f" ({', '.join(members)})" if members else "")
                + "; start the missing agents or lower --nnodes")

    # -- the membership -------------------------------------------------------------------
    def _lost_steps(self, beat: bool = False) -> Generator[Any, Any, tuple[Membership, list[str]]]:
        if not self._may_judge():
            m, _ = yield from self._summary_steps(mark_lost=False, beat=beat)
            return replace(m, lost=[]), []
        return (yield from self._summary_steps(mark_lost=True, beat=beat))

    def _may_judge(self) -> bool:
        """Whether this node may call others lost now: not while its own heartbeats are not
        getting through, nor for a heartbeat timeout after they were held up for a while.
        From here an outage of Redis or of the network that cut every node off looks the same
        as this node being cut off alone; when it ends, the others' heartbeats are as stale as
        ours until they have had the time to beat again (and their clients may reconnect
        seconds after ours). A node really gone meanwhile is seen that much later."""
        now, gap = time.monotonic(), self.settings.held_gap
        done = self._renewal_done
        return done is not None and now - done <= gap and now >= self._judge_after

    def _summary_steps(self, mark_lost: bool, beat: bool = False
                       ) -> Generator[Any, Any, tuple[Membership, list[str]]]:
        s = self.settings
        summary_args = [int(s.heartbeat_timeout * 1000), int(mark_lost)]
        held = False
        if beat:
            sent = time.monotonic()
            restored, raw, held, need = yield from script("beat_summary", [
                *self._beat_args(), *summary_args, int(s.held_gap * 1000),
                self._beat_server_ms])
            m, newly = decode_summary(raw)
            yield from self._beaten(sent, restored, need, m.now_ms)
            if held:  # cut off until just now, by Redis's clock: judge nobody yet
                self._judge_after = max(self._judge_after,
                                        time.monotonic() + s.heartbeat_timeout)
        else:
            m, newly = decode_summary((yield from script("summary", [self.node_id,
                                                                     *summary_args])))
        if held:
            return replace(m, lost=[]), []
        return m, newly

    def waiting_count(self, m: Membership, include_lost: bool = True,
                      departures: bool = True) -> int:
        """``num_nodes_waiting`` for a membership already read. ``include_lost=False`` ignores
        stale heartbeats (right after a Redis outage every heartbeat looks stale).
        ``departures=False`` counts only nodes that asked to join, as torch's handler does:
        members lost or gone free their places for late arrivals but are not counted."""
        mine = self._last_round
        if mine is not None and m.round > mine:
            return max(1, m.member_count)
        if m.status != "complete":
            return m.member_count if mine is not None else 0
        lost = len(m.lost) if include_lost else 0
        room = max(0, self.settings.max_nodes - m.member_count + lost + m.left_count)
        if not departures:
            return min(m.waiting_count, room)
        return min(m.waiting_count, room) + lost + m.left_count

    # -- heartbeats -----------------------------------------------------------------------
    def _beat_args(self, full: bool = False) -> list[Any]:
        """A beat's arguments: the round itself (group rank 0 holds it) only when ``full``,
        after a beat said Redis lost it; '1' otherwise, to say this node holds it."""
        held = (self._round_json if full else b"1") if self._round_json else b""
        return [self.node_id, self._desc, self._head, self._assign, held]

    def _heartbeat_steps(self) -> Generator[Any, Any, None]:
        sent = time.monotonic()
        server_ms, restored, need = yield from script("heartbeat", self._beat_args())
        yield from self._beaten(sent, restored, need, server_ms)

    def _beat_due(self) -> bool:
        """Whether the heartbeat thread, at one of its ticks (every interval), must beat: no
        beat went out (of its own, or riding on a summary: ``lost_since_last_check(beat=True)``)
        for 1.25 intervals. A loop that beats every interval plus its own call's time is
        always younger than that at a tick, whatever the two phases; when it stops, the gap
        between beats stays under 2.25 intervals (4.5 s of a 10 s timeout by default)."""
        done = self._renewal_done
        return done is None or (
            time.monotonic() - done >= 1.25 * self.settings.keep_alive_interval)

    def _beaten(self, sent: float, restored: Any, need: Any = 0, server_ms: Any = 0
                ) -> Generator[Any, Any, None]:
        """After a beat that was sent at ``sent`` and run at ``server_ms`` (Redis's clock): the
        renewal's bookkeeping, the round's record sent if the beat said Redis lost it
        (``need``), and the job's listing put back if the beat found the rendezvous lost and
        restored it."""
        with contextlib.suppress(TypeError, ValueError):
            self._beat_server_ms = max(self._beat_server_ms, int(server_ms))
        if need:
            _, again, _ = yield from script("heartbeat", self._beat_args(full=True))
            restored = restored or again
        done = time.monotonic()
        if self._renewal_done is not None and done - self._renewal_done > self.settings.held_gap:
            self._judge_after = done + self.settings.heartbeat_timeout  # held up: _may_judge
        self.renewed_at = max(self.renewed_at or sent, sent)
        self._renewal_done = done
        if restored:
            self.restorations += 1
            log.warning("Redis lost the rendezvous of job %s; round %s put back", self.job_id,
                        self._last_round)
            yield from self._register_job()

    def _start_heartbeats(self) -> None:
        """Start beating (a thread, a task: the driver's), once; the first join calls it."""
        raise NotImplementedError


def _default_addr() -> str:
    return socket.getfqdn()


def _bindable(addr: str) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False
