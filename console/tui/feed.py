"""The workers that read a job into the console's JobView, and the messages they post (the
ConsoleApp's mixin: the app is ``self``).

I/O lives in :class:`~elastic_console.job.client.JobClient`. The app runs it in async workers on
its own event loop (``@work``, ``exit_on_error=False``: a Redis problem is shown, never fatal):

- ``attach``: does the job exist? If not, :class:`~.widgets.waiting.WaitingScreen` polls
  until it does (or the user picks another job);
- ``reader``: the job's meta and the history Redis kept (``client.history``), folded into
  the :class:`~elastic_console.job.state.JobView` in slices that yield to the UI, then
  ``client.follow()`` forever. ``follow`` rides out outages itself (it resumes from the
  last ids: no gap, no duplicate) and yields ``ConnectionChange`` records;
- ``poll``: resource samples every second, the meta hash every few seconds;
- ``acl``: may this Redis user write the command stream (``client.can_write``)?

(``commands``, which sends a command and waits for the agents' acks, is in
:mod:`~elastic_console.tui.command_actions`.)

Workers fold records into the JobView directly (same loop, no locks) and post messages
(:mod:`elastic_console.tui.messages`) only for discrete happenings: connection lost or back,
history loaded, write access known. Their handlers here redraw at once (``_tick``) or open a
screen. The reader steps aside for keys (the app's ``input_gate``), and the server times it
sees set the clock the console shows ages with (``now_ms``).

What it uses of the app: ``client``, ``view`` and ``_new_view``, ``job_id``, ``loaded``,
``scrollback``, ``endpoint_display``, the error fields (``connect_error``, ``reader_error``,
``write_denied``), ``gc_policy``, ``input_gate``, the widgets, and ``_tick``, ``_point_log``,
``_refresh_blocks`` of the other mixins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from textual import work
from textual.worker import Worker, WorkerState

from elastic_agent.coordination.transport.connection import RedisUnavailableError
from elastic_agent.coordination.wire.metric_records import MetricsEntry

from ..job.client import RESOURCES_PER_SLICE, ConnectionChange, JobClient
from ..job.state import RANK_LINES_TOTAL, SCROLLBACK_FLOOR
from .messages import ConnectionChanged, HistoryLoaded, JobAppeared, JobMissing, ReaderFailed, WriteAccess
from .widgets.waiting import WaitingScreen

__all__ = ["JobFeed", "resource_polls_every"]

logger = logging.getLogger(__name__)

POLL_S = 1.0  # resource samples are written once a second
META_EVERY = 5  # meta hash: every fifth poll
METRICS_HISTORY_EVERY = 30  # the metrics' history hash: every 30th poll (written every 30 s)
#: ...every 10th when it is the only aggregate (a big job: _metrics_scope), so that it lags
#: the agents' writes by 10 s at most.
METRICS_HISTORY_EVERY_SCOPED = 10
#: Ranks up to which every node's metrics entries are decoded (see _metrics_scope).
METRICS_ALL_RANKS = 2_048
#: Resource samples are read on every poll up to this many ranks, on every k-th beyond
#: (resource_polls_every): reading and folding 32,768 samples costs ~0.25 s of CPU, a quarter of
#: a core taken from the log reader every second.
RESOURCE_RANKS_PER_POLL = 8_192
HISTORY_EVENTS = 10_000
HISTORY_LINES_TOTAL = 500_000  # log lines read on attach, over all node streams...
#: ...but at least this many per rank of a stream (a few screens of each rank's own past). Per
#: rank, not per stream: 1,000 lines per stream took every line of 30 s at 4,096 nodes (2.5M,
#: minutes to fold and 1 GiB), the total cap having been made moot.
HISTORY_LINES_MIN_PER_RANK = 16
FOLD_SLICE = 500  # history records folded between yields to the UI
FOLD_BUDGET_S = 0.005  # live records folded before yielding to the UI
LIVE_FOLD_SLICE = 256  # live records folded at once (~2 ms at 4,096 ranks) between checks
RETRY_START_S, RETRY_MAX_S = 0.5, 5.0
REFUSED_RETRY_S = 5.0  # a refusal (NOPERM...) is retried slowly


class JobFeed:
    """The reading half of ConsoleApp: its workers and their messages (see the module
    docstring)."""

    # -- clocks ----------------------------------------------------------------------------
    def now_ms(self) -> int:
        """Redis server time, as well as this console knows it (see ``clock``)."""
        if self._clock is not None:
            return self._clock()
        return int(time.time() * 1000 + (self._server_offset_ms or 0.0))

    def _saw_server_ms(self, ms: int) -> None:
        # A live entry's id was the server's clock a moment ago: its offset from ours is a
        # lower bound of the real one, off by the read latency. Keep the largest.
        candidate = ms - time.time() * 1000
        if self._server_offset_ms is None or candidate > self._server_offset_ms:
            self._server_offset_ms = candidate

    # -- workers -----------------------------------------------------------------------------
    @work(exclusive=True, group="attach", exit_on_error=False)
    async def _attach(self) -> None:
        client = self.client
        assert client is not None
        delay = RETRY_START_S
        while True:
            try:
                exists = await client.job_exists()
                break
            except RedisUnavailableError as exc:
                self.connect_error = str(exc)
                await asyncio.sleep(delay)  # retry backoff while Redis cannot be reached
                delay = min(delay * 2, RETRY_MAX_S)
        self.connect_error = ""
        if exists:
            self.post_message(JobAppeared(self.job_id))
        else:
            self.post_message(JobMissing(self.job_id))

    @work(exclusive=True, group="reader", exit_on_error=False)
    async def _read_job(self) -> None:
        client, view = self.client, self.view
        assert client is not None
        delay = RETRY_START_S
        while not self.loaded:
            try:
                meta = await client.meta()
                events, batches = await client.history(
                    max_events=HISTORY_EVENTS,
                    max_log_entries_per_stream=await self._history_entries(client, meta))
            except RedisUnavailableError as exc:
                self.connect_error = str(exc)
                await asyncio.sleep(delay)  # retry backoff while Redis cannot be reached
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            except Exception as exc:  # a bug must not leave the screen on "connecting…"
                logger.exception("reading the job's history failed")
                self.post_message(ReaderFailed(f"internal error: {type(exc).__name__}: {exc}"))
                await asyncio.sleep(REFUSED_RETRY_S)
                continue
            self.connect_error = ""
            view.apply_meta(meta)
            view.note_skipped(client.skipped)
            streams_note = self._note_streams(client, None)
            view.set_connection(True, self.endpoint_display)
            for records in (events, batches):
                for i in range(0, len(records), FOLD_SLICE):
                    view.apply_many(records[i:i + FOLD_SLICE])
                    await asyncio.sleep(0)  # let the UI draw and take keys between slices
                    await self.input_gate.pause()
                self._fit_scrollback()  # the ranks are known from the events: before the lines
            # The metrics stream's newest entries (its cursor: follow reads it from there)
            # and the whole run's curves from before (console/job/metrics.py); after the
            # events, which say how big the job is and where rank 0 runs (_metrics_scope).
            self._metrics_scope()
            recent, curves = await self._read_metrics(client)
            for i in range(0, len(recent), FOLD_SLICE):
                view.apply_many(recent[i:i + FOLD_SLICE])
                await asyncio.sleep(0)
                await self.input_gate.pause()
            view.metrics.apply_history(curves)
            self.loaded = True
            self.post_message(HistoryLoaded(len(events), view.lines_total))
            # The decoded history is folded in: let it go, or every full collection walks it
            # for the app's whole life (bench/console_bench.py: 300+ ms pauses).
            del events, batches, records, recent, curves
            if self.gc_policy is not None:
                self.gc_policy.settle()
        while True:
            try:
                budget = time.monotonic()
                async for records in client.follow_many():
                    first = records[0]
                    if isinstance(first, ConnectionChange):  # always alone in its list
                        view.set_connection(first.connected, self.endpoint_display, first.error)
                        self.post_message(ConnectionChanged(first.connected, first.error))
                        if view.redis_gone:
                            # Its agent said the server stops with the job: nothing will
                            # come back to reconnect to.
                            self.workers.cancel_group(self, "poll")
                            return
                        continue
                    if self.reader_error:
                        self.reader_error = ""
                    if client.streams_note is not streams_note:  # re-read every few seconds
                        streams_note = self._note_streams(client, streams_note)
                    # A read holds up to READ_COUNT entries of every stream: folded in
                    # slices, so a key waits for one slice at most, not the whole read.
                    for i in range(0, len(records), LIVE_FOLD_SLICE):
                        newest = view.apply_many(records[i:i + LIVE_FOLD_SLICE])
                        if newest:
                            self._saw_server_ms(newest)
                        if not self.input_gate.is_open:
                            await self.input_gate.pause()  # a key is on its way: it goes first
                            budget = time.monotonic()
                        elif time.monotonic() - budget > FOLD_BUDGET_S:
                            await asyncio.sleep(0)  # a big reply must not freeze the keys
                            budget = time.monotonic()
            except RedisUnavailableError as exc:
                self.post_message(ReaderFailed(str(exc)))
                await asyncio.sleep(REFUSED_RETRY_S)  # waiting does not cure a refusal fast
            except Exception as exc:  # a bug must not leave a silently frozen screen
                logger.exception("the reader failed")
                self.post_message(ReaderFailed(f"internal error: {type(exc).__name__}: {exc}"))
                await asyncio.sleep(REFUSED_RETRY_S)

    async def _read_metrics(self, client: JobClient) -> tuple[list[MetricsEntry], dict[str, bytes]]:
        """The metrics stream's newest entries and the history hash, retried while Redis
        cannot be reached (the stream's cursor must be set before following starts)."""
        delay = RETRY_START_S
        while True:
            try:
                recent = await client.metrics_recent()
                return recent, await client.metrics_history(_names_in(recent))
            except RedisUnavailableError as exc:
                self.connect_error = str(exc)
                await asyncio.sleep(delay)  # retry backoff while Redis cannot be reached
                delay = min(delay * 2, RETRY_MAX_S)

    def _metrics_scope(self) -> None:
        """What of the metrics stream the reader decodes: every node's entries up to
        METRICS_ALL_RANKS ranks; beyond, those of rank 0's and the chosen ranks' nodes only,
        the aggregate then being the agents' (bench/metrics_fold_bench.py: every entry of
        32,768 ranks is more than a core to decode and fold)."""
        client, view = self.client, self.view
        if client is None:
            return
        metrics = view.metrics
        if len(view.ranks) <= METRICS_ALL_RANKS:
            client.metrics_nodes, metrics.live_aggregate = None, True
            return
        ranks = view.ranks
        client.metrics_nodes = {ranks[r].node for r in (0, *metrics.chosen)
                                if r in ranks and ranks[r].node}
        if metrics.live_aggregate:
            metrics.live_aggregate = False
            metrics.version += 1

    def _note_streams(self, client: JobClient, shown: str | None) -> str | None:
        """A timeline note when the job's set of log streams comes to hold more names than
        the client reads (``JobClient.streams_note``): once, not at every re-read of a set a
        writer keeps growing; returns the note now."""
        note = client.streams_note
        if note is not None and shown is None:
            self.view.add_note(self.now_ms(), "logs", note)
        return note

    def _fit_scrollback(self) -> None:
        """The lines each rank's ring keeps: ``--scrollback``, or less when the job has so many
        ranks that their rings together would hold more than RANK_LINES_TOTAL. Rings made
        from now on get it; those that exist keep theirs (they were made for fewer ranks)."""
        share = RANK_LINES_TOTAL // max(1, len(self.view.ranks))
        self.view.scrollback = min(self.scrollback, max(SCROLLBACK_FLOOR, share))

    async def _history_entries(self, client: JobClient, meta: dict[str, str]) -> int:
        """Log entries to read per node stream on attach.

        Enough for every rank's scrollback (``nproc`` ranks share a node's stream), but at
        most ``HISTORY_LINES_TOTAL`` lines over all streams (or ``HISTORY_LINES_MIN_PER_RANK``
        lines per rank, when that is more: 32,768 ranks get 16): ``client.history`` reads and
        decodes in one go and the console shows nothing new meanwhile. An entry holds the
        lines of one worker stream (older agents) or of the whole node over 50 ms: a probe
        (the newest entry of each stream) counts the streams and the lines an entry holds.
        """
        nproc = max(1, _to_int(meta.get("nproc_per_node"), 8))
        _, probe = await client.history(max_events=1, max_log_entries_per_stream=1)
        streams = max(1, len(client.last_ids) - 1)  # the cursor: the events + each log stream
        # An entry is its stream's (its node's) and its id: ids repeat across streams (the same
        # millisecond), so ids alone counted 3 entries for 400 nodes.
        entries = len({(b.node, b.id) for b in probe})
        per_entry = max(1.0, sum(len(b.lines) for b in probe) / max(1, entries))
        lines = min(self.scrollback * nproc,
                    max(HISTORY_LINES_MIN_PER_RANK * nproc, HISTORY_LINES_TOTAL // streams))
        return max(1, math.ceil(lines / per_entry))

    @work(exclusive=True, group="poll", exit_on_error=False)
    async def _poll(self) -> None:
        client, view = self.client, self.view
        assert client is not None
        n = 0
        while True:
            with contextlib.suppress(RedisUnavailableError):  # the reader reports outages
                if n % resource_polls_every(len(view.ranks)) == 0:
                    samples = list((await client.resources()).items())
                    for i in range(0, len(samples), RESOURCES_PER_SLICE):
                        if i:
                            await asyncio.sleep(0)  # 4,096 ranks: keys and frames go between
                        view.apply_resources(dict(samples[i:i + RESOURCES_PER_SLICE]))
                if n % META_EVERY == 0:
                    view.apply_meta(await client.meta())
                    view.apply_liveness(*await client.liveness())
                if self.loaded:
                    self._metrics_scope()
                every = (METRICS_HISTORY_EVERY if view.metrics.live_aggregate
                         else METRICS_HISTORY_EVERY_SCOPED)
                if n and n % every == 0 and self.loaded:
                    # The agent rewrites the history every 30 s: the curves' older part (and,
                    # for a big job, its aggregate).
                    curves = await client.metrics_history(view.metrics.names)
                    view.metrics.apply_history(curves)
            n += 1
            await asyncio.sleep(POLL_S)  # samples are written once a second

    @work(exclusive=True, group="acl", exit_on_error=False)
    async def _check_write(self) -> None:
        client = self.client
        assert client is not None
        delay = RETRY_START_S
        while True:
            try:
                ok, why = await client.can_write()
                break
            except RedisUnavailableError:
                await asyncio.sleep(delay)  # retry backoff while Redis cannot be reached
                delay = min(delay * 2, RETRY_MAX_S)
        self.post_message(WriteAccess(ok, why))

    # -- worker messages ---------------------------------------------------------------------
    def on_job_appeared(self, message: JobAppeared) -> None:
        self._start_reading()

    def on_job_missing(self, message: JobMissing) -> None:
        assert self.client is not None
        self.push_screen(WaitingScreen(self.client, self.endpoint_display), self._job_chosen)

    def _job_chosen(self, job_id: str | None) -> None:
        if job_id and job_id != self.job_id:
            self._switch_job(job_id)
        self._start_reading()

    def _switch_job(self, job_id: str) -> None:
        """Attach to another job (picked on the waiting screen) instead."""
        old = self.client
        assert old is not None
        self.client = JobClient(old.endpoint, job_id)
        self._owns_client = True
        self.run_worker(old.close(), group="close", exit_on_error=False)
        self.job_id = job_id
        self.view = self._new_view(job_id)
        self.timeline.reset()
        self.rank_table.reset()
        self.rank_table.sync(self.view, self.now_ms(), full=True)
        self.selected_rank = None
        self._point_log(force=True)
        self._drawn_version = -1

    def _start_reading(self) -> None:
        self._read_job()
        self._poll()
        self._check_write()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        # Workers catch what they expect; anything else is a bug the user must hear about.
        if event.state == WorkerState.ERROR:
            error = event.worker.error
            self.notify(f"{event.worker.group} worker failed: {type(error).__name__}: {error}",
                        title="internal error", severity="error", markup=False)

    def on_history_loaded(self, message: HistoryLoaded) -> None:
        self._tick(force=True)

    def on_connection_changed(self, message: ConnectionChanged) -> None:
        if message.connected:
            self.notify(f"reconnected to {self.endpoint_display}", markup=False)
        self._tick(force=True)  # the banner now, not on the next version change

    def on_reader_failed(self, message: ReaderFailed) -> None:
        self.reader_error = message.error
        self._tick(force=True)

    def on_write_access(self, message: WriteAccess) -> None:
        self.write_denied = "" if message.allowed else (message.reason or "not allowed")
        self._refresh_blocks(force=True)
        self._tick(force=True)


def _names_in(entries: list[MetricsEntry]) -> list[str]:
    """The metric names of the newest entries (the history hash's fields, if it holds too
    many to read whole)."""
    names: dict[str, None] = {}
    for entry in entries[-64:]:
        for p in entry.points:
            names.update(dict.fromkeys(p.values))
    return list(names)


def resource_polls_every(ranks: int) -> int:
    """Polls (one a second) between two reads of the resource samples of ``ranks`` ranks: 1
    up to RESOURCE_RANKS_PER_POLL ranks, 4 at 32,768."""
    return max(1, math.ceil(ranks / RESOURCE_RANKS_PER_POLL))

def _to_int(value: object, default: int) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default
