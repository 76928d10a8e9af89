"""JobView: a pure fold of a job's records into what a console shows. No I/O, no Textual.

Feed it whatever the client read, in any order and as often as you like: events
(:meth:`JobView.apply_event`), log batches (:meth:`JobView.apply_logs`), resource samples
(:meth:`JobView.apply_resources`), the job's meta hash (:meth:`JobView.apply_meta`) and the
connection state (:meth:`JobView.set_connection`). Nothing it is given can make it raise:
unknown event types, missing or mistyped fields and foreign records are ignored (counted in
``ignored``). Every change bumps ``version``, so a UI redraws only when it moved.

Derivation rules (a final job state is sticky: later events never reopen the job)

==========================  ================================================================
event                       effect
==========================  ================================================================
``node_joined``             node -> ``joined`` (host recorded)
``node_left``               node -> ``left``
``node_lost``               ``lost_node`` -> ``lost``
``rendezvous_complete``     ``round``, ``world_size``; every node of the round -> ``joined``
                            with its ``group_rank``; other nodes lose their group rank; ranks
                            at or beyond the new world size are dropped (they no longer exist)
``workers_started``         each listed rank -> ``running`` with node, host, local rank and
                            pid; its start count goes up (``restarts`` = starts - 1); job ->
                            ``running``; ``restarts_used`` = ``restart_count``
``worker_exited``           exit code 0 -> rank ``exited``; nonzero or a signal while the
                            agent was not ``stopping`` it -> ``failed`` (timeline entry with
                            the traceback); while ``stopping`` -> ``stopped``. ``last_exit`` =
                            the signal name, else the exit code. An exit whose pid is not the
                            rank's current pid is stale and changes no state
``workers_stopped``         each listed rank -> ``stopped`` unless it ``failed`` or ``exited``
                            (the more precise outcome stays visible)
``group_failed``            ``root_cause`` = its root cause (timeline detail: traceback)
``restarting``              job -> ``restarting``; every rank -> ``restarting``;
                            ``restarts_used``/``max_restarts`` from the event
``job_succeeded``           job -> ``succeeded``
``job_failed``              job -> ``failed``; ``root_cause`` from the event if it has one
``job_stopped``             job -> ``stopped``
``command_ack``             recorded for :meth:`JobView.acks_for` (one per node per command)
``logs_dropped``            ``lines_dropped`` += count
``worker_timer_expired``    timeline entry (rank, scope, what the watchdog did; detail: deadline)
``stalled``                 timeline entry (``ref``: the stacks capture); the odd ranks ->
                            ``stalled``, the other ranks captured -> ``waiting`` (for them),
                            each until its next log line
``straggler``               timeline entry; the named ranks -> ``slow`` (running, slower than
                            the others), the ranks it no longer names -> ``running``;
                            ``stragglers`` = its ranks (rank, host, ratio), until a restart
==========================  ================================================================

The meta hash gives ``min_nodes``, ``max_nodes``, ``max_restarts``, ``created_ms`` and, for
a job whose final events were trimmed away, ``final_state``.

Duplicates: a retried XADD can write an entry twice (Redis 7 has no idempotent XADD).
A log batch is a duplicate when its ``seq`` is not above the highest seen for the same
``(node, rank, stream, attempt)``: the agent numbers a worker stream's batches in publish
order and its publisher never reorders them. An event is a duplicate when its ``(node, seq)``
was seen among the last 16k events (any order); an event without ``seq`` (an older agent, a
hand-written entry) when the same node wrote the same type with the same data among the last
few hundred events (events carry pids, timestamps or counters, so a genuine repeat is never
identical; ``logs_dropped`` is exempt).

Memory is bounded whatever the records say: at most ``MAX_VIEW_RANKS`` ranks (entries and log
rings; only ranks within the world once a round gave it) and ``MAX_VIEW_NODES`` nodes, every
list of an event taken through :func:`~elastic_agent.coordination.protocol.record_list`, names,
timeline text and detail cut (``MAX_NOTE_CHARS``, ``MAX_DETAIL_CHARS``); within those,
``scrollback`` lines per rank (default 2,000), ``all_scrollback`` lines in the
interleaved all-ranks view (default 50,000; the same line objects as the ranks' newest), a
bounded timeline, bounded resource history. For 1,024 ranks that is at most ~2M lines held:
the ranks' rings pack all but their newest lines
(:class:`~elastic_console.job.packed_buffer.PackedLogBuffer`, ~40 bytes a line instead of ~240).

Log lines live in :class:`~elastic_console.job.logbuffer.LogRing` rings (O(1) indexing,
``total_appended`` tells a view what is new), one per rank and one for all ranks, so a log view
shows one rank by pointing at that rank's ring: no filtering scan. A line is a *plain* tuple
``(server_ms, rank, stream, text)``, field-compatible with
:class:`~elastic_console.job.logbuffer.LogLine` (``LogLine._make(line)`` names the fields):
CPython stops tracking a plain tuple of atomic values in the cyclic GC, a NamedTuple instance
stays tracked for life, and 200k tracked lines made every full collection ~40 ms longer
(``bench/log_view_bench.py``, "tuned").

Text that came from the job (log lines, host names, messages) is passed through
:func:`elastic_agent.coordination.text.sanitize` on the way in, so everything this view holds is
safe to show; render it with ``Text.from_ansi``, never as markup.
"""

from __future__ import annotations

import hashlib
import json
import logging
from array import array
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from elastic_agent.coordination.protocol import (
    MAX_NAME_CHARS,
    MAX_RANK,
    RESTART_PHASES,
    Event,
    EventType,
    LogBatch,
    is_rank,
    rank_list,
    record_list,
)
from elastic_agent.coordination.text import sanitize

from .dedupe import format_ranks
from .inplace import InPlaceRows
from .logbuffer import LogBuffer, LogLine, LogRing
from .packed_buffer import PackedLogBuffer

__all__ = ["BatchDeduper", "ConnectionChange", "JobView", "LogBuffer", "LogLine", "NodeInfo",
           "RankState", "TimelineEntry"]

log = logging.getLogger(__name__)

#: Job states.
WAITING, RUNNING, RESTARTING = "waiting", "running", "restarting"
#: Shown instead of the folded state while no agent of an unfinished job is heartbeating.
LOST = "lost"
#: The rendezvous default, for jobs whose meta does not say (older agents).
DEFAULT_HEARTBEAT_TIMEOUT_MS = 10_000
FAILED, SUCCEEDED, STOPPED = "failed", "succeeded", "stopped"
FINAL_STATES = frozenset({FAILED, SUCCEEDED, STOPPED})

#: Rank states (plus RUNNING, RESTARTING, FAILED, STOPPED above).
EXITED = "exited"
#: A stall (``stalled`` event): the odd ranks, and the ranks waiting for them.
STALLED, WAITS = "stalled", "waiting"
#: A straggler (``straggler`` event, issue 22): running, persistently slower than the others.
SLOW = "slow"

#: Node states.
JOINED, LOST, LEFT = "joined", "lost", "left"

RESOURCE_HISTORY = 120  # samples kept per rank for sparklines (two minutes at 1 Hz)
TIMELINE_LIMIT = 2000
_EVENT_DEDUPE_WINDOW = 512  # events without seq: content fingerprints remembered
_EVENT_SEQ_WINDOW = 16_384  # events with seq: (node, seq) pairs remembered
_ACK_COMMANDS_LIMIT = 1000
#: The most ranks (entries and log rings) and nodes a view keeps: the design's largest job,
#: 32,768 ranks on 4,096 nodes (twice as many node ids: agents restart with new ones). A rank
#: entry costs ~1.7 KiB before its lines. Records that name more are ignored and counted, so
#: no forged event can make a console or a CLI command hold more (issue 24: three 1 MB events
#: of 140k ranks each drove ``status`` to 899 MB).
MAX_VIEW_RANKS = 32_768
MAX_VIEW_NODES = 8_192
#: Timeline entries keep at most this much text and detail (a traceback: its head and tail):
#: the timeline holds ``TIMELINE_LIMIT`` entries, each from an event of up to 1 MiB.
MAX_NOTE_CHARS = 1_024
MAX_DETAIL_CHARS = 16_384


@dataclass(slots=True)
class NodeInfo:
    """One agent (node) of the job. ``group_rank`` is None when it is in no completed round."""

    host: str
    status: str = JOINED  # joined | lost | left
    group_rank: int | None = None
    nproc: int = 0


@dataclass(slots=True)
class RankState:
    """One global rank: where it runs, how it is, what it costs."""

    rank: int
    host: str = ""
    node: str = ""
    local_rank: int | None = None
    pid: int | None = None
    state: str = RUNNING  # running | restarting | failed | exited | stopped
    restarts: int = 0  # times this rank was started, minus 1
    last_exit: int | str | None = None  # exit code, or the signal's name ("SIGKILL")
    cpu: float | None = None  # percent of one core, the worker's whole process tree
    rss: int | None = None  # bytes
    threads: int | None = None
    last_line_ms: int = 0  # server ms of its last log line
    # Plain doubles, RESOURCE_HISTORY at most (_push): as deques of Python numbers the samples
    # of 32,768 ranks took 382 MiB, as arrays 64 (issue 21: the console in 1 GiB).
    cpu_history: array[float] = field(default_factory=lambda: array("d"))
    rss_history: array[float] = field(default_factory=lambda: array("d"))
    starts: int = 0
    sample_ts: float | None = None  # the last sample's own timestamp: a repeat is not new


class TimelineEntry(NamedTuple):
    """One thing that happened to the job, in server time. ``detail``: e.g. a traceback."""

    server_ms: int
    kind: str  # rendezvous | node | failure | group_failed | restart | restarted | ack | job | logs
    text: str
    detail: str = ""
    ref: str = ""  # a ``stalled`` entry: the id of its stacks capture (enter shows it)


@dataclass(frozen=True)
class ConnectionChange:
    """A record from the client's ``follow``: Redis went away (with why) or came back."""

    connected: bool
    error: str = ""


@dataclass(frozen=True)
class Skipped:
    """A record from the client: how many records it has skipped so far because they could
    not be read (malformed, unknown version, a key that is not a stream, a foreign name)."""

    total: int


def _log_lines(ms: int, rank: int, stream: str,
               lines: list[str]) -> list[tuple[int, int, str, str]]:
    """A batch's lines as the rings keep them: plain tuples (see the module docstring:
    untracked by the cyclic GC), text escaped (a printable line, the common case, as is)."""
    if len(lines) == 1:  # a batch is often one line (thousands of ranks, ~10 lines/s each)
        t = lines[0]
        return [(ms, rank, stream, t if t.isprintable() else sanitize(t))]
    return [(ms, rank, stream, t if t.isprintable() else sanitize(t)) for t in lines]


class BatchDeduper:
    """Recognises a log batch already seen (a retried XADD wrote it twice).

    Keeps the highest ``seq`` per ``(node, rank, stream, attempt)``; a batch at or below it is
    a repeat. Batches without a sequence number (``seq <= 0``) are never called repeats.
    Bounded: past ``limit`` keys the oldest half (oldest attempts) is forgotten.
    """

    __slots__ = ("_last", "limit")

    def __init__(self, limit: int = 65_536) -> None:
        self._last: dict[tuple[str, int, str, int], int] = {}
        self.limit = limit

    def seen(self, batch: LogBatch) -> bool:
        """True if ``batch`` repeats one seen before; else remember it and return False."""
        seq = batch.seq
        if seq <= 0:
            return False
        key = (batch.node, batch.rank, batch.stream, batch.attempt)
        last = self._last.get(key, 0)
        if seq <= last:
            return True
        self._last[key] = seq
        self.trim()
        return False

    def trim(self) -> None:
        """Forget the oldest half once more than ``limit`` streams are remembered."""
        if len(self._last) > self.limit:
            for k in list(self._last)[: self.limit // 2]:  # dicts keep insertion order
                del self._last[k]


#: Default lines kept per rank, and for all ranks interleaved (see the module docstring).
DEFAULT_SCROLLBACK = 2_000
#: Log lines kept in all the per-rank rings together, at most (the app fits each ring to it,
#: app.py ``_fit_scrollback``): 4,096 ranks of 2,000 lines held ~550 MiB; 32,768 ranks of 2,000
#: would reach 65M lines, several GiB. Past it a rank keeps RANK_LINES_TOTAL / ranks (128 at
#: 32,768), at least SCROLLBACK_FLOOR.
RANK_LINES_TOTAL = 4_194_304
SCROLLBACK_FLOOR = 100
DEFAULT_ALL_SCROLLBACK = 50_000  # rescans (filter, wrap) of the interleaved ring stay under ~50 ms


class JobView:
    """Everything a console shows about one job, folded from its records (see the module doc).

    Header: ``state``, ``round``, ``nodes`` (node id -> :class:`NodeInfo`), ``min_nodes``,
    ``max_nodes``, ``world_size``, ``restarts_used``, ``max_restarts``, ``root_cause``,
    ``created_ms``, ``connected``, ``endpoint``, ``connection_error``, ``redis_stops_ms``
    (see :attr:`redis_gone`).
    Ranks: ``ranks`` (global rank -> :class:`RankState`).
    Timeline: ``timeline``, a deque of :class:`TimelineEntry` bounded by ``timeline_limit``,
    oldest first; ``timeline_total`` counts every entry ever added (a UI that remembers it
    knows how many are new, and how many fell off the front).
    Logs: ``logs`` (rank -> :class:`PackedLogBuffer` of ``scrollback`` lines) and ``all_logs``
    (one :class:`LogBuffer` of every rank interleaved in arrival order, ``all_scrollback``
    lines; the same tuples as the per-rank rings' newest lines). ``lines_total`` counts every line ever
    appended to ``all_logs``. :meth:`buffer_for` gives a rank's ring even before it printed,
    so a view can point at it and see its first lines arrive.
    Change tracking: ``version`` goes up on every change, never otherwise.
    """

    def __init__(self, job_id: str, scrollback: int = DEFAULT_SCROLLBACK, *,
                 all_scrollback: int | None = None, timeline_limit: int = TIMELINE_LIMIT) -> None:
        self.job_id = job_id
        self.scrollback = max(1, int(scrollback))
        # The interleaved ring holds at least one rank's worth (a 1-rank job loses nothing).
        self.all_scrollback = max(self.scrollback, int(all_scrollback or DEFAULT_ALL_SCROLLBACK))
        # -- header
        self._state: str = WAITING
        self.heartbeat_timeout_ms = DEFAULT_HEARTBEAT_TIMEOUT_MS
        #: Server ms of the last heartbeat of an unfinished job none of whose agents beats any
        #: more (0: none was ever seen); None while the job is alive or final.
        self.lost_since_ms: int | None = None
        self.liveness_ms = 0  # server time of the last apply_liveness
        self.round: int | None = None
        self.nodes: dict[str, NodeInfo] = {}
        self.min_nodes: int | None = None
        self.max_nodes: int | None = None
        self.world_size: int | None = None
        self.restarts_used: int = 0
        self.max_restarts: int | None = None
        self.root_cause: dict[str, Any] | None = None
        #: The newest ``straggler`` event's ranks: [{rank, host, ratio}] (issue 22).
        self.stragglers: list[dict[str, Any]] = []
        self.created_ms: int | None = None
        self.connected: bool = False
        self.endpoint: str = ""
        self.connection_error: str = ""
        #: Server ms by which the job's embedded Redis (--standalone) stops, as its agent
        #: announced after the job ended (``redis_stopping``); None when none was announced.
        self.redis_stops_ms: int | None = None
        #: Milliseconds until Redis drops the job's records, as of the last meta read (None:
        #: no expiry; a running job's is a lease its agents renew, not shown).
        self.expires_in_ms: int | None = None
        self.last_event_ms: int = 0
        self._stalled_ms = 0  # server ms of the newest ``stalled`` event
        #: The restart patterns the job's latest round end showed (issue 22): pattern kind
        #: (restart_storm, suspect_node, no_progress) -> one sentence, for the banner. A new
        #: round end (group_failed, stalled, node_lost) clears them; its claimer then writes
        #: the ones that still hold.
        self.patterns: dict[str, str] = {}
        # -- ranks, timeline, logs
        self.ranks: dict[int, RankState] = {}
        self.timeline: deque[TimelineEntry] = deque(maxlen=timeline_limit)
        self.timeline_total: int = 0
        self.logs: dict[int, LogRing] = {}
        self.all_logs: LogBuffer = LogBuffer(self.all_scrollback)
        self.lines_dropped: int = 0
        # -- bookkeeping
        self.version: int = 0
        self.ignored: int = 0  # malformed or foreign records skipped by this fold
        self.client_skipped: int = 0  # records the client could not decode
        self._round_nodes: list[str] = []  # node ids of the last completed round
        self._acks: dict[str, dict[str, tuple[str, str, str]]] = {}
        self._dedupe = BatchDeduper()
        # Lines redrawn in place: (rank ring seq, interleaved ring seq) of each unfinished one.
        self._inplace: InPlaceRows[tuple[int, int]] = InPlaceRows()
        self._recent_events: deque[tuple[str, ...]] = deque()
        self._recent_set: set[tuple[str, ...]] = set()
        self._seen_seq_order: deque[tuple[str, ...]] = deque()
        self._seen_seqs: set[tuple[str, ...]] = set()
        self._events_applied = 0  # apply_event calls: nodes change only through events
        self._active_count: tuple[int, int] = (-1, 0)  # (at _events_applied, the count)

    # -- queries ---------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """The job's state as events and meta tell it, or ``lost`` while no agent of the
        unfinished job heartbeats (see :meth:`apply_liveness`)."""
        if self.lost_since_ms is not None and self._state not in FINAL_STATES:
            return LOST
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = value

    @property
    def is_final(self) -> bool:
        """True once the job succeeded, failed or was stopped."""
        return self._state in FINAL_STATES

    def apply_liveness(self, last_heartbeat_ms: int | None, now_ms: int) -> None:
        """Fold the newest heartbeat of any of the job's agents (None: there is none) at
        server time ``now_ms``: older than the heartbeat timeout means every agent is gone."""
        self.liveness_ms = now_ms
        lost = last_heartbeat_ms is None or now_ms - last_heartbeat_ms > self.heartbeat_timeout_ms
        since = (last_heartbeat_ms or 0) if lost else None
        if since != self.lost_since_ms:
            self.lost_since_ms = since
            self.version += 1

    @property
    def redis_gone(self) -> bool:
        """The job ended and its embedded Redis stopped as its agent announced: the lost
        connection is the end of the story, not an outage to ride out."""
        return self.redis_stops_ms is not None and self.is_final and not self.connected

    def acks_for(self, command_id: str) -> list[tuple[str, str, str]]:
        """``(node, status, reason)`` of every ack of ``command_id`` seen, in arrival order."""
        return list(self._acks.get(command_id, {}).values())

    def active_nodes(self) -> dict[str, str]:
        """node id -> host of the agents expected to answer a command now: the nodes of the
        last completed round that were not lost and did not leave since (before any round
        completed: every node that joined and is still there)."""
        ids = self._round_nodes or list(self.nodes)
        return {n: self.nodes[n].host for n in ids
                if n in self.nodes and self.nodes[n].status == JOINED}

    def active_node_count(self) -> int:
        """``len(active_nodes())``, worked out again only after an event: the header and the
        command keys ask on every refresh, and at 4,096 nodes a dict of them each time was
        ~4% of the console's time while lines arrive (``bench/console_bench.py``)."""
        at, count = self._active_count
        if at != self._events_applied:
            count = len(self.active_nodes())
            self._active_count = (self._events_applied, count)
        return count

    @property
    def lines_total(self) -> int:
        """Lines ever appended to the interleaved view (monotonic)."""
        return self.all_logs.total_appended

    def logs_for(self, rank: int) -> LogRing:
        """The scrollback of one rank, oldest first (an empty ring if it never printed).

        Does not create the rank's ring: use :meth:`buffer_for` to hold on to it.
        """
        buf = self.logs.get(rank)
        return buf if buf is not None else LogBuffer(1)

    def buffer_for(self, rank: int) -> LogRing:
        """The ring of one rank, created empty if it never printed: a view pointed at it sees
        the rank's lines as they arrive."""
        buf = self.logs.get(rank)
        if buf is None:
            if len(self.logs) >= MAX_VIEW_RANKS:
                return LogBuffer(1)  # past the bound: an empty ring nothing will fill
            buf = self.logs[rank] = PackedLogBuffer(self.scrollback)
        return buf

    def tail(self, n: int, rank: int | None = None, stream: str | None = None) -> list[LogLine]:
        """The last ``n`` lines of one rank (or all ranks interleaved), optionally one stream."""
        source = self.all_logs if rank is None else self.logs_for(rank)
        if n <= 0:
            return []
        out: list[LogLine] = []
        for i in range(len(source) - 1, -1, -1):  # O(1) indexing from the newest end
            line = source[i]
            if stream is None or line[2] == stream:
                out.append(line)
                if len(out) >= n:
                    break
        out.reverse()
        return out

    # -- inputs ----------------------------------------------------------------------------
    def add_note(self, server_ms: int, kind: str, text: str, detail: str = "") -> None:
        """Add a timeline entry that is not an event (e.g. "restart command c-1 sent" by this
        console). Text is sanitized like everything else."""
        self.timeline.append(TimelineEntry(int(server_ms), kind,
                                           sanitize(_clip(str(text), MAX_NOTE_CHARS)),
                                           _detail(detail)))
        self.timeline_total += 1
        self.version += 1

    def set_connection(self, connected: bool, endpoint_display: str, error: str = "") -> None:
        """Record whether the client reaches Redis (``endpoint_display``: password-free)."""
        error = sanitize(str(error)) if not connected else ""
        if (connected, endpoint_display, error) != (self.connected, self.endpoint,
                                                   self.connection_error):
            self.connected, self.endpoint, self.connection_error = (
                bool(connected), str(endpoint_display), error)
            self.version += 1

    def apply(self, record: object) -> None:
        """Dispatch any record the client yields (Event, LogBatch, ConnectionChange)."""
        if isinstance(record, LogBatch):  # tens of thousands a second: the first test
            self.apply_logs(record)
        elif isinstance(record, Event):
            self.apply_event(record)
        elif isinstance(record, ConnectionChange):
            self.set_connection(record.connected, self.endpoint, record.error)
        elif isinstance(record, Skipped):
            self.note_skipped(record.total)
        else:
            self.ignored += 1

    def apply_many(self, records: Iterable[object]) -> int:
        """:meth:`apply` each record in order: the same view at a fraction of the cost per log
        batch (the console's reader folds tens of thousands a second, ~1 line each at 4,096
        ranks). Returns the newest server ms the records carry (0: none).

        The common batch (lines of a rank already shown, not a repeat, nothing redrawn in
        place) is folded here inline, and the lines of a run of them reach the interleaved
        ring in one extend; any other record goes through :meth:`apply`.
        """
        logs, ranks, last_seq = self.logs, self.ranks, self._dedupe._last
        inplace = self._inplace
        redrawn = len(inplace) > 0
        pending: list[LogLine] = []  # lines for the interleaved ring, in arrival order
        newest = 0
        head, ms = "", 0
        last_eid: str | None = None
        folded = False
        for rec in records:
            if type(rec) is LogBatch and rec.live is False:
                node, rank, _, attempt, stream, seq, lines, eid, _ = rec
                buf = logs.get(rank)
                rs = ranks.get(rank)
                key = (node, rank, stream, attempt)
                # Else: a rank's first lines, the next state of a line redrawn in place, or
                # a batch the decoder did not make.
                fast = (buf is not None and rs is not None and type(lines) is list
                        and type(eid) is str and not (redrawn and key in inplace))
            else:
                fast = False
            if not fast:
                if pending:
                    self.all_logs.extend(pending)
                    pending = []
                self.apply(rec)
                if isinstance(rec, (Event, LogBatch)):
                    newest = max(newest, rec.server_ms)
                redrawn = len(inplace) > 0
                continue
            if seq > 0:
                if seq <= last_seq.get(key, 0):
                    continue  # a retried XADD's second copy
                last_seq[key] = seq
            if eid is not last_eid:  # a node's entry: its batches share their id
                last_eid = eid
                h = eid.partition("-")[0]
                if h != head:  # consecutive ids often share their millisecond
                    try:
                        ms = int(h)
                    except ValueError:
                        ms = 0
                    head = h
            made = _log_lines(ms, rank, stream, lines)
            buf.extend_list(made)  # type: ignore[arg-type]  # plain 4-tuples, LogLine-compatible
            pending += made  # type: ignore[arg-type]
            folded = True
            if ms > rs.last_line_ms:
                self._printed(rs, ms)
            if ms > newest:
                newest = ms
        if pending:
            self.all_logs.extend(pending)
        if folded:
            self._dedupe.trim()
            self.version += 1
        return newest

    def note_skipped(self, total: int) -> None:
        """The client's count of records it could not read (see :class:`Skipped`)."""
        if total != self.client_skipped:
            self.client_skipped = total
            self.version += 1

    @property
    def skipped(self) -> int:
        """Records left out of this view because they could not be read, wherever they were
        found: shown to the user, so a hostile or broken writer never goes unnoticed."""
        return self.ignored + self.client_skipped

    def apply_meta(self, meta: Mapping[Any, Any]) -> None:
        """Fold the job's meta hash (bytes or str keys and values)."""
        try:
            m = {_s(k): _s(v) for k, v in dict(meta).items()}
        except (TypeError, ValueError, AttributeError):
            self.ignored += 1
            return
        self.min_nodes = _int(m.get("min_nodes"), self.min_nodes)
        self.max_nodes = _int(m.get("max_nodes"), self.max_nodes)
        self.max_restarts = _int(m.get("max_restarts"), self.max_restarts)
        self.created_ms = _int(m.get("created_ms"), self.created_ms)
        timeout = _int(m.get("heartbeat_timeout_ms"), None)
        if timeout is not None and timeout > 0:
            self.heartbeat_timeout_ms = timeout
        used = _int(m.get("restarts_used"), None)
        if used is not None:
            self.restarts_used = max(self.restarts_used, used)
        final = m.get("final_state")
        if final in FINAL_STATES and not self.is_final:
            self.state = final
        # The client adds the hash's TTL (see JobClient.meta): the job's records expire then.
        self.expires_in_ms = _int(m.get("expires_in_ms"), None)
        self.version += 1

    def apply_events(self, events: Iterable[Event]) -> None:
        """:meth:`apply_event` for each event, in order."""
        for ev in events:
            self.apply_event(ev)

    def apply_event(self, ev: Event) -> None:
        """Fold one event (see the rules in the module docstring). Never raises."""
        self._events_applied += 1
        try:
            if not isinstance(ev, Event) or not isinstance(ev.data, dict):
                self.ignored += 1
                return
            handler = self._HANDLERS.get(ev.type)
            if handler is None:
                self.ignored += 1
                return
            if self._is_repeat(ev):
                return
            self.last_event_ms = max(self.last_event_ms, ev.server_ms)
            handler(self, ev, sanitize(ev.node), ev.data)
        except Exception as exc:  # bad data must never take the console down
            log.debug("ignored malformed %s event %s: %r", getattr(ev, "type", "?"),
                      getattr(ev, "id", "?"), exc)
            self.ignored += 1
        self.version += 1

    def apply_logs(self, batch: LogBatch) -> None:
        """Append a batch's lines to its rank and to the interleaved view: O(lines). A line
        redrawn in place (``batch.live``, :mod:`~elastic_console.job.inplace`) is one row in both,
        replaced by each newer state."""
        try:
            rank, lines, stream = batch.rank, batch.lines, batch.stream
            if type(rank) is not int or not isinstance(lines, list) or (
                    rank not in self.logs and len(self.logs) >= MAX_VIEW_RANKS):
                self.ignored += 1
                return
            if self._dedupe.seen(batch):
                return
            ms = batch.server_ms
            made = _log_lines(ms, rank, stream, lines)
            row = self._inplace.take(batch)
        except Exception:
            self.ignored += 1
            return
        buf = self.logs.get(rank)
        if buf is None:
            buf = self.logs[rank] = PackedLogBuffer(self.scrollback)
        if row is not None and made:
            first = made.pop(0)
            buf.replace(row[0], first)  # type: ignore[arg-type]
            self.all_logs.replace(row[1], first)  # type: ignore[arg-type]
        buf.extend(made)  # type: ignore[arg-type]  # plain 4-tuples, LogLine-compatible
        self.all_logs.extend(made)  # type: ignore[arg-type]
        if batch.live is True:
            if made:
                row = (buf.total_appended - 1, self.all_logs.total_appended - 1)
            if row is not None:
                self._inplace.hold(batch, row)
        rs = self.ranks.get(rank)
        if rs is None:
            # Lines can arrive before the workers_started event (different streams).
            rs = self._new_rank(rank)
            if rs is not None:
                rs.node = sanitize(str(batch.node)[:MAX_NAME_CHARS])
                rs.local_rank = _int(batch.local_rank, None)
                rs.host = self._host_of(rs.node)
        if rs is not None and ms > rs.last_line_ms:
            self._printed(rs, ms)
        self.version += 1

    def _printed(self, rs: RankState, ms: int) -> None:
        """``rs`` printed a line at server ms ``ms``, newer than its last one."""
        rs.last_line_ms = ms
        if rs.state in (STALLED, WAITS) and ms > self._stalled_ms:
            rs.state = RUNNING  # it printed again: it is not stalled any more

    def apply_resources(self, samples: Mapping[Any, Any]) -> None:
        """Fold the latest resource sample per rank (``{rank: {cpu, rss, threads, pid, ts}}``)."""
        changed = False
        try:
            items = list(dict(samples).items())
        except (TypeError, ValueError, AttributeError):
            self.ignored += 1
            return
        for key, sample in items:
            rank = _int(key, None)
            if rank is None or not isinstance(sample, Mapping):
                self.ignored += 1
                continue
            rs = self.ranks.get(rank)
            if rs is None:
                # None: a sample left behind by a rank that no longer exists, or past the bound
                rs = self._new_rank(rank)
                if rs is None:
                    continue
                rs.node = sanitize(str(sample.get("node", ""))[:MAX_NAME_CHARS])
                rs.host = self._host_of(rs.node)
            ts = _float(sample.get("ts"), None)
            if ts is not None and ts == rs.sample_ts:
                continue  # the same sample again (a dead worker's last one stays in Redis)
            rs.sample_ts = ts
            cpu, rss = _float(sample.get("cpu"), None), _int(sample.get("rss"), None)
            rs.threads = _int(sample.get("threads"), rs.threads)
            if cpu is not None:
                rs.cpu = cpu
                _push(rs.cpu_history, cpu)
            if rss is not None:
                rs.rss = rss
                _push(rs.rss_history, rss)
            changed = True
        if changed:
            self.version += 1

    # -- event handlers --------------------------------------------------------------------
    def _is_repeat(self, ev: Event) -> bool:
        """True for the second copy of an event a retried XADD wrote twice (see module doc)."""
        seq = getattr(ev, "seq", 0)
        if isinstance(seq, int) and seq > 0:
            key: tuple[str, ...] = (ev.node, str(seq))
            seen, order, window = self._seen_seqs, self._seen_seq_order, _EVENT_SEQ_WINDOW
        elif ev.type == EventType.LOGS_DROPPED:
            return False  # two overflow episodes of the same size are both real
        else:
            # A digest, not the text: 512 events of 1 MiB each would otherwise be kept whole.
            data = json.dumps(ev.data, sort_keys=True, default=str).encode("utf-8", "replace")
            key = (ev.type, ev.node, hashlib.blake2b(data, digest_size=16).hexdigest())
            seen, order, window = self._recent_set, self._recent_events, _EVENT_DEDUPE_WINDOW
        if key in seen:
            return True
        seen.add(key)
        order.append(key)
        if len(order) > window:
            seen.discard(order.popleft())
        return False

    def _note(self, ev: Event, kind: str, text: str, detail: Any = "", ref: str = "") -> None:
        self.timeline.append(TimelineEntry(ev.server_ms, kind,
                                           sanitize(_clip(text, MAX_NOTE_CHARS)),
                                           _detail(detail), sanitize(ref[:MAX_NAME_CHARS])))
        self.timeline_total += 1

    def _pattern(self, ev: Event, kind: str, text: str) -> None:
        self.patterns[kind] = sanitize(_clip(text, MAX_NOTE_CHARS))
        self._note(ev, "pattern", text)

    def _on_restart_storm(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        text = (f"restart storm: {_q(_int(d.get('restarts'), None))} restarts within "
                f"{_q(_float(d.get('minutes'), None))} min")
        if d.get("policy") == "stop":
            text += " (--on-restart-storm stop: the job fails)"
        self._pattern(ev, EventType.RESTART_STORM, text)

    def _on_suspect_node(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        suspect = d.get("suspect_node")
        if not isinstance(suspect, str) or not suspect:
            self.ignored += 1
            return
        suspect = sanitize(suspect[:MAX_NAME_CHARS])
        rounds = [r for r in record_list(d.get("rounds"), 64) if type(r) is int]
        text = (f"suspect node {_host(d.get('host'), suspect)} ({suspect}): in every failure "
                f"of the last {len(rounds)} rounds")
        if d.get("excluded") is True:
            text += "; left out of the job"
        self._pattern(ev, EventType.SUSPECT_NODE, text)

    def _on_no_progress(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        rounds = [r for r in record_list(d.get("rounds"), 64) if type(r) is int]
        self._pattern(ev, EventType.NO_PROGRESS,
                      f"no progress: the last {len(rounds)} rounds ended before any")

    def _on_node_excluded(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        info = self._node(node, d.get("host"))
        info.status = LEFT
        self._note(ev, "pattern", f"node {info.host} left the job as a suspect ({node})",
                   str(d.get("reason", "")))

    def _node(self, node_id: str, host: Any = None) -> NodeInfo:
        info = self.nodes.get(node_id)
        if info is None:
            info = NodeInfo(host=_host(host, node_id))
            if len(self.nodes) < MAX_VIEW_NODES:
                self.nodes[node_id] = info
            else:
                self.ignored += 1  # past the bound: a record nobody keeps
        elif host:
            info.host = _host(host, node_id)
        return info

    def _new_rank(self, rank: int) -> RankState | None:
        """A new entry for ``rank`` (not in ``ranks``), if the rank may exist: a rank of the
        world when it is known, while the view holds fewer than ``MAX_VIEW_RANKS``."""
        world = self.world_size
        if not is_rank(rank) or (world is not None and rank >= world) \
                or len(self.ranks) >= MAX_VIEW_RANKS:
            return None
        rs = self.ranks[rank] = RankState(rank)
        return rs

    def _host_of(self, node_id: str) -> str:
        info = self.nodes.get(node_id)
        return info.host if info else _host(None, node_id)

    def _on_node_joined(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        info = self._node(node, d.get("host"))
        info.status = JOINED
        info.nproc = _int(d.get("nproc"), info.nproc) or 0
        self._note(ev, "node", f"node {info.host} joined ({node})")

    def _on_node_left(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        info = self._node(node, d.get("host"))
        info.status = LEFT
        reason = d.get("reason")
        self._note(ev, "node", f"node {info.host} left" + (f": {reason}" if reason else ""))

    def _on_node_lost(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        lost = d.get("lost_node")
        if not isinstance(lost, str) or not lost:
            self.ignored += 1
            return
        lost = sanitize(lost[:MAX_NAME_CHARS])
        self.patterns.clear()  # a round end: its claimer says which patterns still hold
        info = self._node(lost, d.get("host"))
        info.status = LOST
        self._note(ev, "node", f"node {info.host} lost: its heartbeats stopped ({lost})")

    def _on_rendezvous_complete(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        self.round = _int(d.get("round"), self.round)
        world = _int(d.get("world_size"), None)
        members: list[str] = []
        lines = []
        for n in record_list(d.get("nodes"), MAX_VIEW_NODES):
            if not isinstance(n, dict) or not isinstance(n.get("node"), str):
                continue
            member = sanitize(n["node"][:MAX_NAME_CHARS])
            info = self._node(member, n.get("host"))
            info.status = JOINED
            info.group_rank = _int(n.get("group_rank"), None)
            info.nproc = _int(n.get("nproc"), info.nproc) or 0
            members.append(member)
            lines.append(f"group rank {info.group_rank}: {info.host} ({member})")
        for node_id, info in self.nodes.items():
            if node_id not in members:
                info.group_rank = None
        self._round_nodes = members
        if world is not None and 0 <= world <= MAX_RANK:
            self.world_size = world
            for rank in [r for r in self.ranks if r >= world]:
                del self.ranks[rank]
        again = " (announced again: Redis had lost the job)" if d.get("restored") is True else ""
        self._note(ev, "rendezvous", f"round {self.round} complete: {len(members)} node"
                   f"{'' if len(members) == 1 else 's'}, world size {self.world_size}{again}",
                   "\n".join(lines))

    def _on_workers_started(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        ranks = record_list(d.get("ranks"))  # one node's workers: past the bound, ignored
        local = record_list(d.get("local_ranks"))
        pids = record_list(d.get("pids"))
        host = _host(d["host"], node) if d.get("host") else self._host_of(node)
        self._node(node, d.get("host"))
        refused = False
        for i, r in enumerate(ranks):
            rank = _int(r, None)
            if rank is None:
                continue
            rs = self.ranks.get(rank)
            if rs is None:
                rs = self._new_rank(rank)
                if rs is None:  # outside the world, or past the bound
                    refused = True
                    continue
            pid = _int(pids[i], None) if i < len(pids) else None
            # The same workers announced again after Redis lost the job: not a new start.
            again = d.get("restored") is True and rs.state == RUNNING and rs.pid == pid
            rs.node, rs.host, rs.state = node, host, RUNNING
            rs.local_rank = _int(local[i], None) if i < len(local) else None
            rs.pid = pid
            if not again:
                rs.starts += 1
                rs.restarts = rs.starts - 1
        raw = d.get("ranks")
        if refused or (type(raw) is list and len(raw) > len(ranks)):
            self.ignored += 1  # one count for the event, however many ranks it named
        used = _int(d.get("restart_count"), None)
        if used is not None:
            self.restarts_used = used
        if not self.is_final:
            self.state = RUNNING
        took = restart_took(d.get("restart"))
        if took is not None:
            self._note(ev, "restarted", f"workers on {host} running again {took[0]}", took[1])

    def _on_worker_exited(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        rank = _int(d.get("rank"), None)
        if rank is None:
            self.ignored += 1
            return
        code = d.get("exit_code")
        sig = d.get("signal")
        failed = bool(sig) or (code not in (0, None))
        rs = self.ranks.get(rank)
        pid = _int(d.get("pid"), None)
        stale = rs is not None and rs.pid is not None and pid is not None and pid != rs.pid
        if rs is None:
            rs = self._new_rank(rank)
            if rs is not None:
                rs.node, rs.pid, rs.host = node, pid, self._host_of(node)
        if rs is not None and not stale:
            rs.last_exit = sanitize(str(sig)) if sig else _int(code, None)
            if d.get("stopping"):
                rs.state = STOPPED
            else:
                rs.state = FAILED if failed else EXITED
        if failed and not d.get("stopping"):
            host = sanitize(str(d.get("host") or self._host_of(node)))
            what = d.get("message") or (f"signal {sig}" if sig else f"exit code {code}")
            self._note(ev, "failure", f"rank {rank} failed on {host}: {what}",
                       _traceback(d.get("error_file")) or what)

    def _on_worker_timer_expired(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        rank = _int(d.get("rank"), None)
        scope = d.get("scope")
        if rank is None or not isinstance(scope, str):
            self.ignored += 1
            return
        host = d.get("host") or self._host_of(node)
        did = f"killed with {d.get('signal')}" if d.get("killed") is True else "not killed"
        deadline = _float(d.get("deadline"), None)
        self._note(ev, "watchdog", f"rank {rank} on {host}: timer {scope[:200]!r} expired; {did}",
                   f"scope: {scope}\ndeadline: {_q(deadline)} (the worker's time.time())\n"
                   f"pid: {_q(_int(d.get('pid'), None))}")

    def _on_stalled(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        groups = [g for g in record_list(d.get("groups"), 50) if isinstance(g, dict)]
        odd = set(rank_list(d.get("odd_ranks")))
        captured = {r for g in groups for r in rank_list(g.get("ranks"))}
        self._stalled_ms = max(self._stalled_ms, ev.server_ms)
        self.patterns.clear()
        for rank in captured | odd:
            rs = self.ranks.get(rank)
            if rs is not None and rs.state in (RUNNING, STALLED, WAITS):
                rs.state = STALLED if rank in odd or not odd else WAITS
        idle = _float(d.get("idle_s"), None)
        text = f"job stalled: no rank made progress for {_q(idle)} s; "
        if odd:
            hosts = [_host(h, "?") for h in record_list(d.get("odd_hosts"), 4)]
            text += f"odd rank{'s' if len(odd) > 1 else ''} {format_ranks(odd)}"
            text += f" on {', '.join(hosts)}" if hosts else ""
            first = next((g for g in groups if set(rank_list(g.get("ranks"))) <= odd), None)
            if first and first.get("summary"):
                text += f" ({str(first['summary'])[:200]})"
        else:
            text += f"no rank stands out ({len(groups)} group{'' if len(groups) == 1 else 's'}"
            text += " of stacks)"
        traced = d.get("collectives")  # issue 22: every rank's flight recorder, analysed
        suspects = rank_list(traced.get("suspects")) if isinstance(traced, dict) else []
        if suspects:
            text += (f"; collectives wait for rank{'s' if len(suspects) > 1 else ''} "
                     f"{format_ranks(suspects)}")
        policy = d.get("policy")
        if policy in ("restart", "stop"):
            text += f"; --on-stall {policy}"
        lines = []
        for g in groups[:20]:
            ranks = rank_list(g.get("ranks"))
            hosts = ", ".join(_host(h, "?") for h in record_list(g.get("hosts"), 4))
            lines.append(f"{len(ranks)} rank{'' if len(ranks) == 1 else 's'} "
                         f"[{format_ranks(ranks)}] on {hosts}: {g.get('summary', '?')}")
            for f in record_list(g.get("frames"), 12):
                if isinstance(f, list) and len(f) == 3:
                    lines.append(f'    File "{f[0]}", line {f[1]}, in {f[2]}')
        request = d.get("request")
        self._note(ev, "stalled", text, "\n".join(lines),
                   request if isinstance(request, str) else "")

    def _on_straggler(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        named = []
        for item in record_list(d.get("ranks"), 64):
            if not isinstance(item, dict):
                continue
            rank = _int(item.get("rank"), None)
            ratio = _float(item.get("ratio"), None)
            if rank is None or not 0 <= rank < MAX_VIEW_RANKS or ratio is None:
                continue
            host = _host(item.get("host"), str(item.get("node") or "?"))
            named.append({"rank": rank, "host": host, "ratio": round(ratio, 2)})
        named.sort(key=lambda x: x["rank"])
        ranks = {x["rank"] for x in named}
        for rank, rs in self.ranks.items():
            if rs.state == SLOW and rank not in ranks:
                rs.state = RUNNING
            elif rank in ranks and rs.state == RUNNING:
                rs.state = SLOW
        self.stragglers = named
        if not named:
            self._note(ev, "straggler", "no straggler any more")
            return
        window = _float(d.get("window_s"), None)
        text = "straggler" + ("s" if len(named) > 1 else "") + ": " + ", ".join(
            f"rank {x['rank']} on {x['host']} ({x['ratio']:g}x the median compute time)"
            for x in named[:8])
        self._note(ev, "straggler", text,
                   f"each rank's share of time outside collectives, against the job's median, "
                   f"over windows of {_q(window)} s (torch's flight recorder, sampled)")

    def _on_workers_stopped(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        for r in rank_list(d.get("ranks")):
            rs = self.ranks.get(r)
            if rs is not None and rs.state not in (FAILED, EXITED):
                rs.state = STOPPED

    def _on_group_failed(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        cause = d.get("root_cause")
        if isinstance(cause, dict):
            self.root_cause = cause
        self.patterns.clear()
        self._note(ev, "group_failed", "worker group failed: " + _cause_text(cause),
                   _cause_detail(cause))

    def _on_restarting(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        self.restarts_used = _int(d.get("restarts_used"), self.restarts_used) or 0
        self.max_restarts = _int(d.get("max_restarts"), self.max_restarts)
        if not self.is_final:
            self.state = RESTARTING
        for rs in self.ranks.values():
            rs.state = RESTARTING
        self.stragglers = []
        reason = d.get("reason") or "?"
        text = f"restarting ({reason}): {self.restarts_used}/{_q(self.max_restarts)} restarts used"
        if d.get("command_id"):
            text += f", command {d['command_id']}"
        if d.get("detail"):
            text += f": {d['detail']}"
        # The round that ended: enter on the entry shows that attempt's logs (issue 22).
        self._note(ev, "restart", text, ref="" if self.round is None else str(self.round))

    def _on_job_end(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        final = {EventType.JOB_SUCCEEDED: SUCCEEDED, EventType.JOB_FAILED: FAILED,
                 EventType.JOB_STOPPED: STOPPED}[ev.type]
        self.restarts_used = _int(d.get("restarts_used"), self.restarts_used) or 0
        self.max_restarts = _int(d.get("max_restarts"), self.max_restarts)
        if not self.is_final:
            self.state = final
        if final == FAILED:
            cause = d.get("root_cause")
            if isinstance(cause, dict):
                self.root_cause = cause
            self._note(ev, "job", f"job failed after {self.restarts_used} restarts: "
                       + _cause_text(self.root_cause), _cause_detail(self.root_cause))
        elif final == STOPPED and d.get("scheduler"):
            self._note(ev, "job", f"job stopped by the scheduler ({d.get('scheduler')}, "
                       f"{d.get('signal', '?')}: {d.get('meaning', '')})")
        elif final == STOPPED:
            self._note(ev, "job", f"job stopped by {d.get('issuer', '?')} "
                       f"(command {d.get('command_id', '?')})")
        else:
            self.patterns.clear()
            self._note(ev, "job", f"job succeeded ({self.restarts_used} restarts used)")

    def _on_job_requeued(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        """The scheduler requeued the job: its stop was not its end, it runs again."""
        self.state = RUNNING
        self._note(ev, "job", f"job requeued by the scheduler ({d.get('scheduler', '?')}, "
                   f"restart {_int(d.get('slurm_restart_count'), 0)}): it runs again under "
                   "the same id")

    def _on_command_ack(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        cid = d.get("command_id")
        if not isinstance(cid, str):
            self.ignored += 1
            return
        cid = cid[:MAX_NAME_CHARS]
        status = sanitize(str(d.get("status", "?"))[:32])
        reason = sanitize(_clip(str(d.get("reason", "")), MAX_NOTE_CHARS))
        acks = self._acks.setdefault(cid, {})
        if node in acks or len(acks) >= MAX_VIEW_NODES:
            return  # exactly one ack per agent per command: a second one is a repeat
        acks[node] = (node, status, reason)
        if len(self._acks) > _ACK_COMMANDS_LIMIT:
            del self._acks[next(iter(self._acks))]
        host = d.get("host") or self._host_of(node)
        self._note(ev, "ack", f"command {cid} {status} by {host}" + (f": {reason}" if reason else ""))

    def _on_redis_stopping(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        final = d.get("final_state")
        if isinstance(final, str) and final in FINAL_STATES and not self.is_final:
            self.state = final  # the job's own end event may have been trimmed away
        linger = _float(d.get("linger_s"), None)
        if linger is None or not 0 <= linger <= 86_400:  # NaN and absurd values included
            linger = 0.0
        self.redis_stops_ms = ev.server_ms + int(linger * 1000)
        self._note(ev, "job", f"the job's embedded Redis (--standalone) stops once no console "
                   f"is attached, in {linger:g} s at the latest")

    def _on_logs_dropped(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        count = _int(d.get("count"), 0) or 0
        self.lines_dropped += count
        self._note(ev, "logs", f"{count} log lines dropped on {self._host_of(node)} "
                   "(its buffer overflowed while Redis was unreachable)")

    _HANDLERS = {
        EventType.NODE_JOINED: _on_node_joined,
        EventType.NODE_LEFT: _on_node_left,
        EventType.NODE_LOST: _on_node_lost,
        EventType.RENDEZVOUS_COMPLETE: _on_rendezvous_complete,
        EventType.WORKERS_STARTED: _on_workers_started,
        EventType.WORKER_EXITED: _on_worker_exited,
        EventType.WORKER_TIMER_EXPIRED: _on_worker_timer_expired,
        EventType.STALLED: _on_stalled,
        EventType.STRAGGLER: _on_straggler,
        EventType.WORKERS_STOPPED: _on_workers_stopped,
        EventType.GROUP_FAILED: _on_group_failed,
        EventType.RESTARTING: _on_restarting,
        EventType.JOB_SUCCEEDED: _on_job_end,
        EventType.JOB_FAILED: _on_job_end,
        EventType.JOB_STOPPED: _on_job_end,
        EventType.JOB_REQUEUED: _on_job_requeued,
        EventType.COMMAND_ACK: _on_command_ack,
        EventType.LOGS_DROPPED: _on_logs_dropped,
        EventType.REDIS_STOPPING: _on_redis_stopping,
        EventType.RESTART_STORM: _on_restart_storm,
        EventType.SUSPECT_NODE: _on_suspect_node,
        EventType.NO_PROGRESS: _on_no_progress,
        EventType.NODE_EXCLUDED: _on_node_excluded,
    }


# -- helpers ----------------------------------------------------------------------------

def _s(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


_RESTART_REASONS = {"failed": "failure", "reform": "membership change",
                    "restart": "restart command", "stalled": "stall"}
_PHASE_NAMES = {"evidence": "survivors' stacks captured", "stopped": "workers stopped",
                "reported": "failure reported", "rendezvous": "rendezvous done",
                "keeper": "keeper ready", "started": "every worker started"}


def restart_took(record: Any) -> tuple[str, str] | None:
    """``workers_started``'s ``restart`` field as (a line: how long the restart took and
    where it went, the detail: one phase a line), or None when there is none that makes
    sense. Phases are ms since the agent saw the failure; unknown ones are skipped, and a
    value that is not a finite, non-negative number below a day drops the whole record."""
    if not isinstance(record, dict) or not isinstance(record.get("phases_ms"), dict):
        return None
    marks: list[tuple[str, float]] = []
    for phase in RESTART_PHASES:
        value = record["phases_ms"].get(phase)
        if value is None:
            continue
        ms = _float(value, None)
        if ms is None or not 0 <= ms < 86_400_000:  # NaN fails this too
            return None
        marks.append((phase, ms))
    if not marks:
        return None
    why = record.get("reason")
    reason = (_RESTART_REASONS.get(why) if isinstance(why, str) else None) or sanitize(
        str(why))[:40]
    steps, lines, last = [], [f"restart after: {reason}"], 0.0
    for phase, ms in marks:
        took = max(0.0, ms - last)
        last = max(last, ms)
        steps.append(f"{phase} {took:.0f}")
        lines.append(f"{_PHASE_NAMES[phase]}: +{took:.0f} ms (at {ms:.0f} ms)")
    return (f"{last:.0f} ms after the {reason} was seen ({', '.join(steps)} ms)",
            "\n".join(lines))


def _int(value: Any, default: int | None) -> int | None:
    if isinstance(value, bool):  # True is an int to Python, not to the protocol
        return default
    if isinstance(value, int):
        return value
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default


def _push(history: array[float], value: float) -> None:
    """Append to a rank's samples, keeping the newest RESOURCE_HISTORY."""
    try:
        history.append(value)
    except OverflowError:  # an int too big for a double (hostile): as big as one gets
        history.append(float("inf"))
    if len(history) > RESOURCE_HISTORY:
        del history[0]


def _float(value: Any, default: float | None) -> float | None:
    if isinstance(value, bool):
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def _q(value: Any) -> str:
    return "?" if value is None else str(value)


def _host(host: Any, node_id: str) -> str:
    if host:
        return sanitize(str(host)[:MAX_NAME_CHARS])
    # Node ids are "<host>-<pid>-<random>": the host is the best guess we have.
    return sanitize(node_id.rsplit("-", 2)[0] if node_id.count("-") >= 2 else node_id)


def _detail(value: Any) -> str:
    if not value:
        return ""
    text = _clip(str(value), MAX_DETAIL_CHARS)
    return "\n".join(sanitize(line) for line in text.splitlines())


def _clip(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its head and its tail (a
    traceback's last lines name the error) around a note of how much was cut."""
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head
    return f"{text[:head]}\n… {len(text) - limit} characters cut …\n{text[-tail:]}"


def _traceback(error_file: Any) -> str | None:
    """The Python traceback in torch's ``@record`` error file, if there is one."""
    if not isinstance(error_file, dict):
        return None
    msg = error_file.get("message")
    if isinstance(msg, dict):
        extra = msg.get("extraInfo")
        if isinstance(extra, dict) and extra.get("py_callstack"):
            return str(extra["py_callstack"])
    return None


def _cause_text(cause: Any) -> str:
    if not isinstance(cause, dict):
        return "cause unknown"
    where = f"rank {_q(cause.get('rank'))}"
    if cause.get("host"):
        where += f" on {cause['host']}"
    what = cause.get("message") or (
        f"signal {cause['signal']}" if cause.get("signal") else f"exit code {_q(cause.get('exit_code'))}")
    return f"{where}: {what}"


def _cause_detail(cause: Any) -> str:
    if not isinstance(cause, dict):
        return ""
    return str(cause.get("traceback") or cause.get("message") or "")
