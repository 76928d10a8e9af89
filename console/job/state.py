"""JobView: a pure fold of a job's records into what a console shows. No I/O, no Textual.

Feed it whatever the client read, in any order and as often as you like: events
(:meth:`JobView.apply_event`), log batches (:meth:`JobView.apply_logs`), resource samples
(:meth:`JobView.apply_resources`), the job's meta hash (:meth:`JobView.apply_meta`) and the
connection state (:meth:`JobView.set_connection`). Nothing it is given can make it raise:
unknown event types, missing or mistyped fields and foreign records are ignored (counted in
``ignored``). Every change bumps ``version``, so a UI redraws only when it moved.

The meta hash gives ``min_nodes``, ``max_nodes``, ``max_restarts``, ``created_ms`` and, for
a job whose final events were trimmed away, ``final_state``.

JobView is one class written in three parts: :mod:`~elastic_console.job.event_fold` (its
base :class:`~elastic_console.job.event_fold.EventFold`: the rules by which each event
changes the view, and which events are repeats), :mod:`~elastic_console.job.log_fold` (its
base :class:`~elastic_console.job.log_fold.LogFold`: each rank's log ring and the interleaved
one, repeated batches, lines redrawn in place) and this module (the view's fields, the
header's queries, meta, liveness, the connection, resource samples). The states and entries
they fold into are in :mod:`~elastic_console.job.model`; how a field of a record is read
without trusting it, in :mod:`~elastic_console.job.fields`.

Memory is bounded whatever the records say: at most ``MAX_VIEW_RANKS`` ranks (entries and log
rings; only ranks within the world once a round gave it) and ``MAX_VIEW_NODES`` nodes, every
list of an event taken through :func:`~elastic_agent.coordination.wire.protocol.record_list`, names,
timeline text and detail cut (``MAX_NOTE_CHARS``, ``MAX_DETAIL_CHARS``); within those,
``scrollback`` lines per rank (default 2,000), ``all_scrollback`` lines in the
interleaved all-ranks view (default 50,000; the same line objects as the ranks' newest), a
bounded timeline, bounded resource history. For 1,024 ranks that is at most ~2M lines held:
the ranks' rings pack all but their newest lines
(:class:`~elastic_console.job.packed_buffer.PackedLogBuffer`, ~40 bytes a line instead of ~240).

Text that came from the job (log lines, host names, messages) is passed through
:func:`elastic_agent.coordination.wire.text.sanitize` on the way in, so everything this view holds is
safe to show; render it with ``Text.from_ansi``, never as markup.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elastic_agent.coordination.wire.event_records import Event, EventType
from elastic_agent.coordination.wire.log_records import LogBatch
from elastic_agent.coordination.wire.metric_records import MetricsEntry
from elastic_agent.coordination.wire.protocol import MAX_NAME_CHARS, is_rank
from elastic_agent.coordination.wire.text import sanitize

from .event_fold import EventFold
from .fields import _clip, _detail, _float, _host, _int, _s
from .inplace import InPlaceRows
from .log_fold import BatchDeduper, LogFold
from .logbuffer import LogBuffer, LogRing
from .metrics import JobMetrics
from .model import (
    FINAL_STATES,
    JOINED,
    LOST,
    MAX_NOTE_CHARS,
    MAX_VIEW_RANKS,
    WAITING,
    NodeInfo,
    RankState,
    TimelineEntry,
    _push,
)

__all__ = ["ConnectionChange", "JobView", "Skipped"]

#: The rendezvous default, for jobs whose meta does not say (older agents).
DEFAULT_HEARTBEAT_TIMEOUT_MS = 10_000
TIMELINE_LIMIT = 2000


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


#: Default lines kept per rank, and for all ranks interleaved (see the module docstring).
DEFAULT_SCROLLBACK = 2_000
#: Log lines kept in all the per-rank rings together, at most (the app fits each ring to it,
#: tui/feed.py ``_fit_scrollback``): 4,096 ranks of 2,000 lines held ~550 MiB; 32,768 ranks of 2,000
#: would reach 65M lines, several GiB. Past it a rank keeps RANK_LINES_TOTAL / ranks (128 at
#: 32,768), at least SCROLLBACK_FLOOR.
RANK_LINES_TOTAL = 4_194_304
SCROLLBACK_FLOOR = 100
DEFAULT_ALL_SCROLLBACK = 50_000  # rescans (filter, wrap) of the interleaved ring stay under ~50 ms


class JobView(EventFold, LogFold):
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
        #: The earliest ``nan`` event: {rank, step, metric, value, host, node, attempt,
        #: server_ms} of the first rank whose metric became NaN or infinite (None: none).
        self.first_nan: dict[str, Any] | None = None
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
        #: The training metrics (console/job/metrics.py): each rank's latest step and values,
        #: the curves; fed by the metrics stream, the resource samples and restart events.
        self.metrics = JobMetrics()
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
        elif isinstance(record, MetricsEntry):
            self.metrics.apply_entry(record)
            self.version += 1
        elif isinstance(record, Skipped):
            self.note_skipped(record.total)
        else:
            self.ignored += 1

    def apply_event(self, ev: Event) -> None:
        """:meth:`EventFold.apply_event`, and what the metrics take of it: a restart is a
        marker on the curves, a round's world size bounds the ranks they keep."""
        super().apply_event(ev)
        kind = getattr(ev, "type", None)
        if kind == EventType.RESTARTING:
            reason = ev.data.get("reason") if isinstance(ev.data, dict) else None
            self.metrics.note_restart(ev.server_ms, self.round,
                                      reason if isinstance(reason, str) else "")
        elif kind == EventType.RENDEZVOUS_COMPLETE and self.world_size is not None:
            self.metrics.set_world(self.world_size)

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
            self.metrics.apply_sample(rank, sample)
            changed = True
        if changed:
            self.version += 1

    # -- shared by the folds (events, logs, samples) ---------------------------------------
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
