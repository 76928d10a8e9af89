"""Redis out of memory (``maxmemory`` with ``noeviction``): one report per episode, per process.

Under ``noeviction`` a full Redis refuses every write that may grow memory with an OOM error
and serves everything else (reads, DEL, EXPIRE, XTRIM). For this package that is an outage
like any other: the workers go on, log lines wait in the publisher's bounded buffer and
coordination writes are retried until Redis takes them or their own deadline passes. Every
writer (the publisher, the heartbeat thread, the store, the agent's own calls) refuses in a
loop meanwhile, so none of them reports it: they tell :data:`OOM`, which says once that the
episode began and once that it ended, with what it cost. Episodes that come and go within
``QUIET_S`` of the last report are folded into the next one (a server hovering at its limit
would otherwise print a pair of lines per second).

Why not another policy: any eviction policy may drop a rendezvous or restart-counter key of a
running job (``volatile-*`` too: a job's keys carry a TTL, see ``retention``), which breaks
that job in ways no retry can mend. :func:`eviction_policy_warning` says so once at start.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis

log = logging.getLogger(__name__)

#: Seconds after a report during which a new episode's begin and end are not reported apart.
QUIET_S = 30.0
#: Writes must go through this long after the last refusal for an episode to be over.
SETTLE_S = 2.0


def is_oom(exc: BaseException) -> bool:
    """True for Redis's refusal of a write at ``maxmemory`` (whatever wrapped it)."""
    return isinstance(exc, redis.OutOfMemoryError) or (
        isinstance(exc, redis.ResponseError) and str(exc).startswith("OOM"))


class OomReport:
    """Counts OOM refusals across the process's threads and reports each episode twice.

    An episode starts with a refusal and ends with a write accepted ``SETTLE_S`` or more after
    the last refusal (a server hovering at its limit takes a small write now and then; that is
    not the end of it), or, at exit, with :meth:`settle`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic start of the episode in progress
        self._told_start = False  # its start was reported
        self._last_refusal = 0.0
        self._last_accept = 0.0
        self._last_report = -QUIET_S
        self._first: float | None = None  # start of the first episode not reported as ended
        self._refusals = 0
        self._dropped_base = 0
        self._dropped: Callable[[], int] = lambda: 0

    @property
    def active(self) -> bool:
        """An episode is in progress."""
        return self._since is not None

    def count_dropped(self, counter: Callable[[], int]) -> None:
        """Where the end report reads how many log lines were dropped (the publisher's
        running total)."""
        self._dropped = counter

    def refused(self) -> None:
        """A write was refused for lack of memory (it will be retried by its caller)."""
        with self._lock:
            now = time.monotonic()
            self._refusals += 1
            self._last_refusal = now
            if self._since is not None:
                return
            self._since = now
            if self._first is None:  # else: a relapse soon after a report, told with it
                self._first = now
                self._dropped_base = self._safe_dropped()
            if now - self._last_report < QUIET_S:
                return
            self._last_report = now
            self._told_start = True
        log.warning(
            "Redis is out of memory (maxmemory reached) and refuses writes: the workers go "
            "on, log lines wait in a bounded buffer (the oldest are dropped and counted once "
            "it is full), coordination writes are retried until Redis takes them; free memory "
            "on the server or raise its maxmemory")

    def accepted(self) -> None:
        """A write went through. Cheap when no episode is in progress (called per batch)."""
        if self._since is None:
            return
        with self._lock:
            now = time.monotonic()
            self._last_accept = now
            if self._since is not None and now - self._last_refusal >= SETTLE_S:
                self._end(now)

    def settle(self, unsent: int = 0) -> None:
        """At exit: end the episode in progress, if any, and say how it ended. ``unsent``:
        records the caller could not write before it gave up (they are lost)."""
        with self._lock:
            if self._since is None:
                return
            if self._last_accept > self._last_refusal:
                self._end(time.monotonic())
                return
            now = time.monotonic()
            started = self._first if self._first is not None else self._since
            dropped = self._safe_dropped() - self._dropped_base
            refusals = self._refusals
            self._since = self._first = None
        log.warning(
            "Redis was still out of memory when the agent exited, after %.1f s: %d refused "
            "write%s, %d log line%s dropped, %d record%s never written", now - started,
            refusals, "" if refusals == 1 else "s", dropped, "" if dropped == 1 else "s",
            unsent, "" if unsent == 1 else "s")

    def _end(self, now: float) -> None:
        self._since = None
        if not self._told_start and now - self._last_report < QUIET_S:
            return  # a short relapse right after a report: told with the next one
        started = self._first if self._first is not None else now
        dropped = self._safe_dropped() - self._dropped_base
        refusals = self._refusals
        self._refusals = 0
        self._first = None
        self._told_start = False
        self._last_report = now
        log.warning(
            "Redis accepts writes again after %.1f s out of memory: %d refused write%s "
            "retried, %d log line%s dropped%s", now - started, refusals,
            "" if refusals == 1 else "s", dropped, "" if dropped == 1 else "s",
            " (a logs_dropped record marks the gap)" if dropped else "")

    def _safe_dropped(self) -> int:
        try:
            return int(self._dropped())
        except Exception:  # a counter must never break a writer
            return 0


#: The process's one report (every writer of the process shares it).
OOM = OomReport()


def eviction_policy_warning(config: Mapping[Any, Any]) -> str | None:
    """The warning to print once at start when Redis may evict a job's keys, else None.

    ``config`` is the reply to ``CONFIG GET maxmemory*`` (the caller asks: it may be refused
    to application users by an ACL or a managed service, and then nothing is said).
    """
    reply = {_text(k): _text(v) for k, v in config.items()}
    policy, maxmemory = reply.get("maxmemory-policy", ""), reply.get("maxmemory", "")
    if not policy or policy == "noeviction":
        return None
    limit = "no maxmemory set yet" if maxmemory in ("", "0") else f"maxmemory {maxmemory} bytes"
    return (f"Redis maxmemory-policy is {policy} ({limit}), not noeviction: under memory "
            "pressure Redis may evict this job's rendezvous, restart-counter or meta keys, "
            "and the nodes then see a job that vanished, a restart budget that starts over or "
            "a round that nobody formed; set 'maxmemory-policy noeviction' (a full Redis then "
            "refuses writes, which the agent rides out)")


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)
