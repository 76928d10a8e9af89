"""JobClient: reads a job's streams from Redis and sends it commands. asyncio; no Textual.

The console's only door to Redis. It speaks the wire contract of
:mod:`elastic_agent.coordination.wire.protocol` (every key comes from
:mod:`elastic_agent.coordination.wire.keyspace`) through the clients of
:mod:`elastic_agent.coordination.transport.connection`:

* a command client (fail fast, a couple of retries) for everything that does not block;
* a blocking reader (socket timeout longer than its ``XREAD BLOCK``) for :meth:`follow` and
  :meth:`wait_acks`. It retries once at most: riding out an outage is :meth:`follow`'s job,
  because the UI must be told (``ConnectionChange``) while it lasts.

Reading contract (FIELD-NOTES: ``$`` can skip entries, a reader must re-send its own ids)

* :meth:`history` reads what Redis still keeps, oldest first, and remembers the newest id of
  every stream it read; :meth:`follow` continues exactly after those ids.
* :meth:`follow` passes the last id it saw for every stream on every ``XREAD``, ``0-0`` for a
  log stream discovered later (so its first lines are not skipped), and never ``$``. After an
  outage it re-sends the same ids: no gap, no duplicate.
* A job's log streams are found through the job's set of them (``JobKeys.log_streams``),
  never by SCAN: they live outside the job's slot (``JobKeys.logs``). The set is read a page
  at a time (SSCAN), at most ``LOG_STREAM_NAMES_MAX`` names, the last round's nodes' streams
  first when it holds more (anyone who may write the job can add names); ``streams_note``
  says how many were left out. On a cluster,
  :meth:`follow` makes one blocking XREAD per slot its streams are in (at most 17: the job's
  and 16 log tags), each on its own connection; on one server, one XREAD as before.

Every message names the endpoint by ``Endpoint.display`` (password redacted). Connection
problems surface as :class:`~elastic_agent.coordination.transport.connection.RedisUnavailableError` with a
one-line explanation.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from elastic_agent.coordination.transport.cluster import (
    give_key_ttls,
    give_ttls,
    is_cluster,
    scan_batches,
)
from elastic_agent.coordination.transport.connection import (
    RedisUnavailableError,
    explain_error,
    make_async_client,
)
from elastic_agent.coordination.transport.endpoints import Endpoint, parse_endpoint
from elastic_agent.coordination.wire.event_records import Event, decode_event
from elastic_agent.coordination.wire.keyspace import (
    JOBS_INDEX,
    InvalidJobIdError,
    JobKeys,
    console_client_name,
    validate_job_id,
)
from elastic_agent.coordination.wire.log_records import LogBatch, decode_log_entries
from elastic_agent.coordination.wire.metric_records import (
    MAX_METRICS_ENTRY_BYTES,
    MetricsEntry,
    decode_metrics_entry,
)
from elastic_agent.coordination.wire.metric_series import MAX_ENCODED
from elastic_agent.coordination.wire.protocol import ProtocolError, decode_json
from elastic_agent.coordination.wire.round_records import RoundInfo
from elastic_agent.coordination.wire.text import sanitize

from .attempts import AttemptLogs, read_attempt
from .commanding import Ack, Commanding, id_key, issuer
from .follow import (
    BLOCK_MS,
    LOG_STREAM_NAMES_MAX,
    STREAM_NAMES_PAGE,
    Following,
    Record,
    _is_wrongtype,
    _s,
)
from .model import FINAL_STATES
from .state import ConnectionChange, JobView

log = logging.getLogger(__name__)

__all__ = ["Ack", "ConnectionChange", "JobClient", "JobSummary", "Record", "issuer"]

HISTORY_STREAMS_PER_READ = 8  # log streams read per round trip on attach
#: Events folded per unfinished job by list_jobs: the newest say its state; the round record
#: and the restart counter say the rest (1,000 jobs with 50 running: 64 events each keep the
#: list under 1 s, 300 did not; bench/home_bench.py).
LIST_EVENTS_PER_JOB = 64
#: An index entry without records is a job that expired or was removed (agents list a job
#: after writing its meta), unless it is younger than this (an older agent listed it first).
INDEX_GRACE_MS = 1_000
#: Index entries one list looks at, the newest first. Every job's agent user may add entries
#: to the index (docs/SECURITY.md), so it may be flooded: this bounds a list's memory and
#: time (one EXISTS per entry, ~20 ms for 20,000), and ``index_note`` says when it was hit.
INDEX_READ_MAX = 20_000
#: Entries dated later than the server's clock by more than this are forged (an agent lists
#: its job at the server's TIME): never read, counted in ``index_note``.
INDEX_FUTURE_SLACK_MS = 60_000
#: Events read ``EVENTS_PAGE`` at a time, newest first, and kept until their data passes
#: ``HISTORY_EVENT_BYTES`` (honest events are a few hundred bytes: 10,000 are ~3 MB). Anyone
#: who may write the job can make each event 1 MiB: 10,000 of them in one reply were 10 GB;
#: a page is at most ~32 MiB of decodable data (10,000 events: ~300 round trips, ~60 ms here).
EVENTS_PAGE = 32
HISTORY_EVENT_BYTES = 32 * 1024 * 1024
#: list_jobs: unfinished jobs whose events one round trip reads (a reply: at most 128 entries,
#: ~128 MiB of decodable data if a writer made each one 1 MiB), and the data bytes of the
#: newest events it keeps per job (64 honest events are ~20 KB).
LIST_JOBS_PER_READ = 2
LIST_EVENT_BYTES = 256 * 1024

#: Names one EXISTS asks about when the set of log streams is past its bound (_existing).
EXISTS_GROUP = 512

_MAX_SAMPLE_BYTES = 64 * 1024
#: Training metrics (``metrics_history``, ``metrics_recent``): fields of the history hash
#: read whole (8 metrics x 4 series are written); entries of the stream read on attach and
#: by ``metrics``, and their data at most (honest entries: a few KiB a node and interval).
METRICS_HISTORY_FIELDS = 64
METRICS_RECENT_ENTRIES = 5_000
METRICS_RECENT_BYTES = 32 * 1024 * 1024
METRICS_PAGE = 64
RESOURCES_PER_SLICE = 128  # samples decoded between two yields to the event loop (~3 ms)



#: Lost jobs whose late keys one ``list_jobs`` gives a TTL (see ``_sweep_lost``).
LOST_SWEEPS_PER_LIST = 20


@dataclass(frozen=True)
class JobSummary:
    """One line of ``elastic-console ls``. ``age_s`` is measured on the Redis server clock."""

    job_id: str
    state: str
    nodes: int
    world_size: int | None
    restarts_used: int
    max_restarts: int | None
    created_ms: int
    age_s: float
    lost_for_s: float | None = None  # state "lost": seconds since the last heartbeat
    #: A finished or lost job: seconds until Redis drops its records (None: kept for good,
    #: or the job still runs).
    expires_in_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job_id, "state": self.state, "nodes": self.nodes,
                "world_size": self.world_size, "restarts_used": self.restarts_used,
                "max_restarts": self.max_restarts, "created_ms": self.created_ms,
                "age_s": round(self.age_s, 3),
                "lost_for_s": None if self.lost_for_s is None else round(self.lost_for_s, 3),
                "expires_in_s": None if self.expires_in_s is None else round(
                    self.expires_in_s, 3)}


class JobClient(Commanding, Following):
    """A console's connection to one Redis server, and optionally to one job on it.

    ``job_id`` is validated here (``InvalidJobIdError``); methods about a job need it.
    Use it from one event loop; call :meth:`close` (or ``async with``) when done.
    """

    def __init__(self, endpoint: Endpoint | str, job_id: str | None = None, *,
                 retries: int = 2) -> None:
        self.endpoint = endpoint if isinstance(endpoint, Endpoint) else parse_endpoint(endpoint)
        self.job_id = validate_job_id(job_id) if job_id is not None else None
        #: Set by ``list_jobs``: one line when the job index held more than it read.
        self.index_note: str | None = None
        #: Set by every read of the job's set of log streams: one line when it held more
        #: names than ``LOG_STREAM_NAMES_MAX`` and some were left out (None: all were read).
        self.streams_note: str | None = None
        # follow: cursors of streams it stopped following to stay within the bound, kept
        # (as many as the bound) so that following one again resumes where it was.
        self._parked: dict[str, str] = {}
        self._job_keys = JobKeys(job_id) if job_id is not None else None
        # Named: a --standalone agent keeps its Redis up while a console of its job is there.
        name = console_client_name(job_id) if job_id is not None else None
        self._client: aioredis.Redis = make_async_client(self.endpoint, retries=retries,
                                                         client_name=name)
        # One retry only: a stale pooled socket after a server restart is re-dialled
        # silently, a real outage is reported by follow() at once.
        self._reader: aioredis.Redis = make_async_client(self.endpoint, blocking_ms=BLOCK_MS,
                                                         retries=1, client_name=name)
        # Its XREAD replies stay as Redis sent them (entries' fields a flat list): at 40k
        # entries/s, redis-py's dict per entry cost more than reading the fields by position
        # (LogEntryDecoder). Every XREAD reply of this client goes through _entry_fields.
        self._reader.set_response_callback("XREAD", _raw_reply)
        self._last_ids: dict[str, str] = {}  # stream key -> last entry id seen (follow cursor)
        self.metrics_nodes: set[str] | None = None  # see Following.metrics_nodes
        #: Records skipped because they could not be read (see :class:`Skipped`).
        self.skipped = 0
        # Keys that are not streams (WRONGTYPE) or names in the logs set that are not this
        # job's log streams: left out of every read (re-checked on each refresh of the set).
        self._bad_keys: set[str] = set()
        self._reported_skips = 0
        self._refresh_due = False  # an event announced a node: re-read the log streams set
        self._sent: dict[str, str] = {}  # command id -> its entry id on the command stream
        # On a cluster a job's streams are in several slots: follow() reads each slot's
        # streams with its own XREAD, pending ones kept here by slot (see _xread).
        self._cluster = is_cluster(self._reader)
        self._reads: dict[int, asyncio.Future[Any]] = {}
        self._slots: dict[str, int] = {}  # stream key -> its slot (as many as the streams)

    # -- plumbing ----------------------------------------------------------------------------
    @property
    def keys(self) -> JobKeys:
        if self._job_keys is None:
            raise ValueError("this JobClient was created without a job id")
        return self._job_keys

    @property
    def last_ids(self) -> dict[str, str]:
        """A copy of the follow cursor: stream key -> last id seen."""
        return dict(self._last_ids)

    async def close(self) -> None:
        """Close both connections (idempotent)."""
        for c in (self._client, self._reader):
            with contextlib.suppress(Exception):
                await c.aclose()

    async def __aenter__(self) -> JobClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _explain(self, exc: BaseException) -> RedisUnavailableError:
        """One sentence naming the endpoint (password redacted), what failed, what to try."""
        if isinstance(exc, NoPermissionError):
            # redis-py strips the NOPERM code from the message, so say it here.
            return RedisUnavailableError(
                f"the Redis user on {self.endpoint.display} is not allowed to do this: "
                f"{sanitize(str(exc))}; check its ACL")
        return explain_error(exc, self.endpoint.display)

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """Any Redis failure becomes one RedisUnavailableError sentence naming the endpoint."""
        try:
            yield
        except RedisUnavailableError:
            raise
        except (redis.RedisError, OSError) as exc:
            raise self._explain(exc) from None

    async def _server_ms(self) -> int:
        try:
            secs, micros = await self._client.time()
            return int(secs) * 1000 + int(micros) // 1000
        except redis.ResponseError:  # TIME not allowed for this ACL user: the local clock
            return int(time.time() * 1000)

    # -- jobs --------------------------------------------------------------------------------
    async def list_jobs(self) -> list[JobSummary]:
        """Every job of the job index, newest first, summarised from its meta, its restart
        counter, its last completed round and, for a job that has not ended, a fold of its
        last few hundred events. Entries of jobs whose records are gone are dropped; at most
        ``INDEX_READ_MAX`` entries are read (``index_note`` says when there were more)."""
        with self._errors():
            now_ms = await self._server_ms()
            jobs, gone = await self._index_entries(now_ms)
            pipe = self._client.pipeline(transaction=False)
            for _, k, _ in jobs:
                pipe.hgetall(k.meta)
                pipe.get(k.restarts)
                pipe.get(k.rdzv_round_info)
                pipe.zrevrange(k.rdzv_heartbeats, 0, 0, withscores=True)
                pipe.pttl(k.meta)
            # A job whose keys hold the wrong types must not hide every other job.
            replies = await pipe.execute(raise_on_error=False) if jobs else []
            _raise_outage(replies)
            # Events only for the jobs that have not ended: an ended job's meta, counter and
            # round say all `ls` shows, and a server keeps far more ended jobs than running
            # ones (1,000 jobs: 0.2 s instead of 1 s, see bench/redis_memory.py).
            unfinished = [i for i in range(len(jobs)) if not _is_final(replies[5 * i])]
            events_of: dict[int, Any] = {}
            streamed: set[int] = set()  # jobs whose event stream has entries, good or not
            # A few jobs per round trip, each reply decoded (and its raw entries dropped)
            # before the next: one reply holds at most LIST_JOBS_PER_READ x 64 entries.
            for g in range(0, len(unfinished), LIST_JOBS_PER_READ):
                group = unfinished[g:g + LIST_JOBS_PER_READ]
                pipe = self._client.pipeline(transaction=False)
                for i in group:
                    pipe.xrevrange(jobs[i][1].events, count=LIST_EVENTS_PER_JOB)
                fetched = await pipe.execute(raise_on_error=False)
                _raise_outage(fetched)
                for i, raw_events in zip(group, fetched):
                    if raw_events and not isinstance(raw_events, Exception):
                        streamed.add(i)
                    events_of[i] = (raw_events if isinstance(raw_events, Exception)
                                    else _newest_decoded(raw_events, LIST_EVENT_BYTES))
                del fetched
        out = []
        expired = gone
        for i, (job, _, score) in enumerate(jobs):
            mine = [*replies[5 * i: 5 * i + 5], events_of.get(i)]
            meta, restarts, round_raw, beat, ttl, events = (
                None if isinstance(r, Exception) else r for r in mine)
            if (not any(mine[:4]) and i not in streamed and i in events_of
                    and not any(isinstance(r, Exception) for r in mine)):
                # Its records expired (or were removed) since they were checked: not a job now.
                if now_ms - score > INDEX_GRACE_MS:
                    expired.append(job)
                continue
            view = JobView(job, scrollback=1)
            view.apply_meta(meta or {})
            view.apply_events(events if isinstance(events, list) else [])
            view.apply_liveness(_newest_beat(beat), now_ms)
            rnd = _round_info(round_raw)
            # Only the newest events are folded: unless they hold the last completed round,
            # the round record says who is in it (a window of joins would undercount).
            nodes = ((len(view.active_nodes()) if view.round is not None else 0)
                     or (len(rnd.nodes) if rnd else len(view.active_nodes())))
            world = view.world_size if view.world_size is not None else (
                (rnd.total_workers or None) if rnd else None)
            used = max(view.restarts_used, _int(restarts))
            created = view.created_ms or int(score)
            lost_for = _lost_for(view, now_ms)
            expires = (_ttl_s(ttl) if view.is_final or lost_for is not None else None)
            out.append(JobSummary(job, view.state, nodes, world, used, view.max_restarts,
                                  created, max(0.0, (now_ms - created) / 1000.0),
                                  lost_for, expires))
        if expired:
            # The index is outside every job: nothing expires it, readers tidy it. A read-only
            # user may not: the job is left out of the list all the same.
            with contextlib.suppress(redis.RedisError):
                await self._client.zrem(JOBS_INDEX, *expired)
        lost = [s.job_id for s in out if s.lost_for_s is not None][:LOST_SWEEPS_PER_LIST]
        for job in lost:
            with contextlib.suppress(redis.RedisError):
                await self._sweep_lost(JobKeys(job))
        return out

    async def _index_entries(self, now_ms: int) -> tuple[list[tuple[str, JobKeys, float]],
                                                         list[Any]]:
        """The job index's entries whose job has records (a meta or events), newest first,
        and the members to tidy away (no records, older than the grace; not a job id). At
        most ``INDEX_READ_MAX`` entries dated up to the server's clock are looked at, one
        EXISTS each: the index is writable by every job's agent (docs/SECURITY.md), whose
        entries are only believed for jobs that exist. Sets ``index_note`` when entries were
        left unread (a flooded index)."""
        raw = await self._client.zrevrangebyscore(
            JOBS_INDEX, now_ms + INDEX_FUTURE_SLACK_MS, "-inf", start=0, num=INDEX_READ_MAX,
            withscores=True)
        entries: list[tuple[Any, str, JobKeys, float]] = []
        gone: list[Any] = []
        for member, score in raw:
            job = _s(member)
            try:
                entries.append((member, job, JobKeys(job), float(score)))
            except InvalidJobIdError:
                gone.append(member)  # not a job id at all: nothing to keep it for
        pipe = self._client.pipeline(transaction=False)
        for _, _, k, _ in entries:
            pipe.exists(k.meta, k.events)
        found = await pipe.execute(raise_on_error=False) if entries else []
        _raise_outage(found)
        jobs = []
        for (member, job, k, score), n in zip(entries, found):
            if isinstance(n, Exception) or n:  # unreadable: shown as what it is, not hidden
                jobs.append((job, k, score))
            elif now_ms - score > INDEX_GRACE_MS:
                gone.append(member)
        total = await self._client.zcard(JOBS_INDEX)
        unread = int(total) - len(raw)
        self.index_note = None if unread <= 0 else (
            f"the job index holds {int(total)} entries: {unread} were not read (the newest "
            f"{INDEX_READ_MAX} dated up to now are); any job's agent user may add entries, "
            f"see docs/SECURITY.md to find and prune them")
        return jobs, gone

    async def _sweep_lost(self, keys: JobKeys) -> None:
        """A lost job's keys made after its agents' last lease renewal (a new round's store,
        the stacks stream) have no TTL, and no agent is left to give them one: they get the
        meta's, so the job still goes one retention after its last agent. At most once a
        minute per job (a claim key); a read-only user may not, and is not told."""
        ttl = await self._client.pttl(keys.meta)
        if not isinstance(ttl, int) or ttl <= 0:
            return  # kept for good (retention 0), or gone
        # The claim is a key of the job too: it must not outlive the rest.
        if not await self._client.set(keys.lost_sweep, "1", nx=True, px=min(60_000, ttl)):
            return
        await give_ttls(self._client, keys.all_key_patterns()[0], ttl)
        # Its log streams are elsewhere (on a cluster, other masters): the set lists them.
        await give_key_ttls(self._client, await self._listed_streams(keys), ttl)

    async def live_agents(self) -> int:
        """How many of the job's agents sent a heartbeat within the job's heartbeat timeout
        (an agent that left removed its own; one that vanished goes stale)."""
        k = self.keys
        with self._errors():
            timeout = _int(await self._client.hget(k.meta, "heartbeat_timeout_ms")) or 10_000
            now = await self._server_ms()
            return int(await self._client.zcount(k.rdzv_heartbeats, now - timeout, "+inf"))

    async def remove(self) -> int:
        """Delete every key of the job and its index entry; return how many keys went.

        Keys are found by SCAN (every key in the job's slot shares its prefix, whatever wrote
        it), its log streams, in other slots, through the job's set of them (read first: the
        set is one of the keys the SCAN removes)."""
        k = self.keys
        n = 0
        with self._errors():
            streams = await self._listed_streams(k)
            for i in range(0, len(streams), 1000):
                # A cluster client splits a many-key UNLINK per slot.
                n += int(await self._client.unlink(*streams[i:i + 1000]))
            for pattern in k.all_key_patterns():
                # On a cluster: on the node that owns the job's slot.
                async for keys in scan_batches(self._client, pattern, 1000):
                    n += int(await self._client.unlink(*keys))
            await self._client.zrem(JOBS_INDEX, k.job_id)
        return n

    async def _listed_streams(self, keys: JobKeys) -> list[str]:
        """The job's log streams outside its slot, as the job's set lists them."""
        try:
            return keys.streams_elsewhere(await self._client.smembers(keys.log_streams))
        except redis.ResponseError as exc:
            if not _is_wrongtype(exc):
                raise
            return []  # not a set: nothing to follow (the SCAN still covers the job's slot)

    async def liveness(self) -> tuple[int | None, int]:
        """The newest heartbeat of any of the job's agents (server ms; None if there is none)
        and the server's time now, for :meth:`JobView.apply_liveness`."""
        with self._errors():
            beat = await self._client.zrevrange(self.keys.rdzv_heartbeats, 0, 0, withscores=True)
            return _newest_beat(beat), await self._server_ms()

    async def job_exists(self) -> bool:
        """True if the job is in the job index or has a meta hash or an event stream."""
        k = self.keys
        with self._errors():
            pipe = self._client.pipeline(transaction=False)
            pipe.zscore(JOBS_INDEX, k.job_id)
            pipe.exists(k.meta, k.events)
            score, count = await pipe.execute()
        return score is not None or bool(count)

    async def meta(self) -> dict[str, str]:
        """The job's meta hash as strings, plus ``restarts_used`` (the job-wide restart
        counter) when the hash has no such field and the counter exists."""
        k = self.keys
        with self._errors():
            pipe = self._client.pipeline(transaction=False)
            pipe.hgetall(k.meta)
            pipe.get(k.restarts)
            pipe.pttl(k.meta)
            raw, restarts, ttl = await pipe.execute()
        meta = {_s(a): _s(b) for a, b in (raw or {}).items()}
        if restarts is not None:
            meta.setdefault("restarts_used", _s(restarts))
        # Not a field of the hash (whatever one of that name holds): its TTL, for "expires in".
        meta.pop("expires_in_ms", None)
        if isinstance(ttl, int) and ttl >= 0:
            meta["expires_in_ms"] = str(ttl)
        return meta

    async def resources(self) -> dict[int, dict[str, Any]]:
        """Global rank -> the latest resource sample of that worker (malformed ones skipped)."""
        with self._errors():
            raw = await self._client.hgetall(self.keys.resources)
        out: dict[int, dict[str, Any]] = {}
        for i, (rank, blob) in enumerate((raw or {}).items()):
            if i and not i % RESOURCES_PER_SLICE:
                await asyncio.sleep(0)  # thousands of samples: let keys and frames through
            try:
                sample = decode_json(blob, "resource sample", _MAX_SAMPLE_BYTES)
                if isinstance(sample, dict) and len(rank) <= 8:
                    out[int(rank)] = sample
                    continue
            except (ProtocolError, ValueError, TypeError):
                pass
            self.skipped += 1
        return out

    # -- training metrics --------------------------------------------------------------------
    async def metrics_history(self, names: Iterable[str] = ()) -> dict[str, bytes]:
        """The history hash (``JobKeys.metrics_history``): series name -> encoded series, for
        ``JobMetrics.apply_history``. Bounded: a hash of at most ``METRICS_HISTORY_FIELDS``
        fields is read (its field names, then each value of at most ``MAX_ENCODED`` bytes); a
        bigger one (anyone who may write the job can add fields) only for the series of
        ``names`` (the metrics known from the stream and the samples), the rest counted as
        skipped. A key of another type is skipped and counted."""
        k = self.keys.metrics_history
        with self._errors():
            try:
                size = int(await self._client.hlen(k))
                if size <= METRICS_HISTORY_FIELDS:
                    fields = [_s(f) for f in await self._client.hkeys(k)]
                else:
                    self.skipped += size - METRICS_HISTORY_FIELDS
                    fields = [f"{src}/{name}" for name in list(names)[:16]
                              for src in ("rank0", "min", "median", "max")]
                if not fields:
                    return {}
                pipe = self._client.pipeline(transaction=False)
                for f in fields:
                    pipe.hstrlen(k, f)
                sizes = await pipe.execute()
                small = [f for f, n in zip(fields, sizes) if isinstance(n, int) and 0 < n <= MAX_ENCODED]
                self.skipped += sum(1 for n in sizes if isinstance(n, int) and n > MAX_ENCODED)
                values = await self._client.hmget(k, small) if small else []
            except redis.ResponseError as exc:
                self._refused(k, exc)  # WRONGTYPE: skipped and counted; else raised
                return {}
        return {f: v for f, v in zip(small, values) if v is not None}

    async def metrics_recent(self, max_entries: int = METRICS_RECENT_ENTRIES,
                             max_bytes: int = METRICS_RECENT_BYTES, *,
                             follow: bool = True) -> list[MetricsEntry]:
        """The newest entries of the metrics stream, oldest first, decoded (the malformed
        skipped and counted): at most ``max_entries``, and no more once their data passed
        ``max_bytes``. ``follow``: :meth:`follow` then reads the stream too, right after the
        newest entry read (the stream's cursor is set: without it nothing follows metrics).
        Entries of nodes not in ``metrics_nodes`` (when set) are left out undecoded."""
        k = self.keys.metrics
        out: list[MetricsEntry] = []
        newest: str | None = None
        high, left, budget = "+", max(0, max_entries), max_bytes
        with self._errors():
            while left > 0 and budget > 0:
                count = min(METRICS_PAGE, left)
                try:
                    page = await self._client.xrevrange(k, max=high, min="-", count=count)
                except redis.ResponseError as exc:
                    self._refused(k, exc)
                    return out[::-1]
                for entry_id, fields in page:
                    eid = _s(entry_id)
                    newest = newest or eid
                    if not self._metrics_wanted(fields):
                        continue
                    raw = fields.get(b"ranks", fields.get("ranks", b""))
                    budget -= min(len(raw), MAX_METRICS_ENTRY_BYTES) if raw else 0
                    entry = decode_metrics_entry(eid, fields)
                    if entry is None:
                        self.skipped += 1
                    else:
                        out.append(entry)
                if len(page) < count:
                    break
                left -= len(page)
                high = "(" + _s(page[-1][0])
            if follow:
                if newest is None and max_entries == 0:
                    newest = await self._newest_id(k)
                self._last_ids[k] = newest or self._last_ids.get(k, "0-0")
        return out[::-1]

    async def _newest_id(self, key: str) -> str | None:
        try:
            page = await self._client.xrevrange(key, count=1)
        except redis.ResponseError as exc:
            self._refused(key, exc)
            return None
        return _s(page[0][0]) if page else None

    # -- reading the streams -----------------------------------------------------------------
    async def history(self, max_events: int = 10_000,
                      max_log_entries_per_stream: int = 2_000, *,
                      logs: bool = True) -> tuple[list[Event], list[LogBatch]]:
        """The newest ``max_events`` events and the newest ``max_log_entries_per_stream``
        entries of every log stream Redis still keeps, each list oldest first (log batches of
        all nodes merged by stream id, i.e. server time). ``0`` log entries: none are read.

        Sets the follow cursor to the newest id of every stream, so :meth:`follow` continues
        exactly after what this returned (no gap, no duplicate). ``logs=False``: the log
        streams are not touched at all, not even for the cursor (one read per node: 4,096
        round trips' worth for a big job), for readers that never follow logs (``status``).
        """
        with self._errors():
            return await self._read_history(max_events, max_log_entries_per_stream, logs)

    async def _read_history(self, max_events: int, max_log_entries_per_stream: int,
                            logs: bool = True) -> tuple[list[Event], list[LogBatch]]:
        # Raw redis errors: follow() tells an outage from a refusal by their type.
        k = self.keys
        events, newest = await self._newest_events(max_events)
        self._last_ids[k.events] = newest or "0-0"
        streams = self._log_stream_names(await self._stream_members()) if logs else []
        lists: list[list[LogBatch]] = []
        # A few streams per round trip, each reply decoded before the next is read: the raw
        # replies of every stream at once (~1 KiB an entry, 70k entries at 1,024 ranks) were
        # the console's peak, and that memory stayed the process's for good.
        for g in range(0, len(streams), HISTORY_STREAMS_PER_READ):
            group = streams[g:g + HISTORY_STREAMS_PER_READ]
            pipe = self._client.pipeline(transaction=False)
            for s in group:
                pipe.xrevrange(s, count=max(1, max_log_entries_per_stream))
            per_stream = await pipe.execute(raise_on_error=False)
            _raise_outage(per_stream)
            for s, entries in zip(group, per_stream):
                if isinstance(entries, Exception):
                    self._refused(s, entries)
                    continue
                self._last_ids[s] = _s(entries[0][0]) if entries else "0-0"
                if max_log_entries_per_stream > 0:
                    lists.append(self._decode_logs(reversed(entries)))
            del per_stream
        logs = list(heapq.merge(*lists, key=lambda b: id_key(b.id))) if lists else []
        return events, logs

    async def _newest_events(self, n: int, *, count: bool = True) -> tuple[list[Event], str | None]:
        """The newest ``n`` events, oldest first, and the newest id (None: none); read a page
        at a time and kept until their data passes ``HISTORY_EVENT_BYTES`` (then the older
        ones are left out); ``count``: add what was left out to ``skipped``."""
        key = self.keys.events
        out: list[Event] = []
        newest: str | None = None
        high, left, budget = "+", max(1, n), HISTORY_EVENT_BYTES
        while left > 0:
            count = min(EVENTS_PAGE, left)
            try:
                page = await self._client.xrevrange(key, max=high, min="-", count=count)
            except redis.ResponseError as exc:
                self._refused(key, exc)  # WRONGTYPE: skipped and counted; else raised
                return out[::-1], newest
            for entry_id, fields in page:
                newest = newest or _s(entry_id)
                if n <= 0:
                    return [], newest  # only the cursor was wanted
                ev = decode_event(entry_id, fields)
                if ev is None:
                    self.skipped += count
                    continue
                out.append(ev)
                budget -= len(fields.get(b"data", fields.get("data", b"")))
            if budget <= 0:
                self.skipped += count  # the older events are left out: say so
                break
            if len(page) < count:
                break
            left -= len(page)
            high = "(" + _s(page[-1][0])  # exclusive: the page after the oldest one read
        return out[::-1], newest

    async def attempt_logs(self, attempt: int, rank: int | None = None,
                           max_lines: int = 100_000) -> AttemptLogs:
        """The log batches of one earlier attempt (a round), of ``rank`` only if given: see
        attempts.py. One read on demand, not a follow."""
        with self._errors():
            names = self._log_stream_names(await self._stream_members())
            found = await read_attempt(self._client, names, attempt, rank, max_lines,
                                       self._decode_logs, self._refused)
        return replace(found, note=self.streams_note or "")

    def _decode_logs(self, entries: Any) -> list[LogBatch]:
        out: list[LogBatch] = []
        for entry_id, fields in entries:
            batches = decode_log_entries(entry_id, fields)
            if batches is not None:
                out += batches
            else:
                self.skipped += 1
        return out

    async def _stream_members(self) -> list[str] | Exception:
        """The names in the job's set of log streams, sorted: all of them, or when it holds
        more than ``LOG_STREAM_NAMES_MAX``, that many (the streams of the last round's nodes
        first, then the others SSCAN brought) with ``streams_note`` saying so. Paged: a
        4,096-node job's set is two or three round trips; past the bound, however many names
        the set holds, a few pages and one EXISTS per ``EXISTS_GROUP`` names. A set Redis
        refuses to read as one (WRONGTYPE) is returned in place, for
        :meth:`_log_stream_names` to count; any other error is raised."""
        k = self.keys
        seen: set[str] = set()
        cursor = 0
        try:
            while True:
                cursor, page = await self._client.sscan(k.log_streams, cursor,
                                                        count=STREAM_NAMES_PAGE)
                seen.update(map(_s, page))
                if not cursor or len(seen) >= LOG_STREAM_NAMES_MAX:
                    break
            if not cursor:  # read whole
                self.streams_note = None
                return sorted(seen)
            total = int(await self._client.scard(k.log_streams))
            info = _round_info(await self._client.get(k.rdzv_round_info))
        except redis.ResponseError as exc:
            if not _is_wrongtype(exc):
                raise
            return exc
        # The current nodes' streams (named as their agents name them) before anything else
        # the set holds: a flood of names must not hide the job's own logs.
        first = sorted({k.logs(str(n.get("node", ""))) for n in (info.nodes if info else ())
                        if isinstance(n, dict) and n.get("node")})[:LOG_STREAM_NAMES_MAX]
        rest = sorted(seen.difference(first))[:LOG_STREAM_NAMES_MAX - len(first)]
        read = len(rest) + len(seen.intersection(first))
        self.streams_note = (
            f"the job's set of log streams holds {total:,} names: {max(0, total - read):,} "
            f"were left out (at most {LOG_STREAM_NAMES_MAX:,} are read, the last round's "
            f"nodes' first); anyone who may write the job can add names, see docs/SECURITY.md")
        return await self._existing(first + rest)

    async def _existing(self, names: list[str]) -> list[str]:
        """``names`` that are keys now, in order. Only for a set past its bound: names of
        nothing cost no stream read then, and a flood of them one EXISTS per group (a group
        of some that are and some that are not: one pipelined EXISTS each). An honest set is
        read as it is, so a node's stream is followed before its first entry lands."""
        out: list[str] = []
        for i in range(0, len(names), EXISTS_GROUP):
            group = names[i:i + EXISTS_GROUP]
            found = int(await self._client.exists(*group))
            if found == len(group):
                out += group
            elif found:
                pipe = self._client.pipeline(transaction=False)
                for name in group:
                    pipe.exists(name)
                out += [n for n, e in zip(group, await pipe.execute()) if e]
        return out

    def _log_stream_names(self, raw: list[str] | Exception) -> list[str]:
        """The names of :meth:`_stream_members` that can be this job's log streams, in its
        order: anything else (a foreign key, a non-stream) is counted once and left out."""
        if isinstance(raw, Exception):
            self._refused(self.keys.log_streams, raw)
            return []
        names = []
        for name in raw:
            if name in self._bad_keys:
                continue
            if not self.keys.is_log_stream(name):
                self._bad_keys.add(name)
                self.skipped += 1
                continue
            names.append(name)
        return names

    def _refused(self, key: str, exc: Exception) -> list[Any]:
        """A key Redis refused to read as a stream (WRONGTYPE): skipped and counted once.
        Anything else (NOPERM...) is an error the user must see."""
        if not _is_wrongtype(exc):
            raise exc
        if key not in self._bad_keys:
            self._bad_keys.add(key)
            self.skipped += 1
            log.warning("%s is not a stream; it is left out (records from it are skipped)", key)
        self._last_ids.pop(key, None)
        return []


# -- helpers ------------------------------------------------------------------------------

def _raw_reply(response: Any, **_options: Any) -> Any:
    """The reader's XREAD callback: the reply as Redis sent it (see JobClient.__init__)."""
    return response


def _int(value: Any) -> int:
    try:
        return int(value) if value is not None else 0
    except (TypeError, ValueError):
        return 0


def _newest_decoded(entries: list[Any], budget: int) -> list[Event]:
    """The events of an XREVRANGE reply (newest first), oldest first, decoded; the newest kept
    until their data passes ``budget`` bytes, the malformed left out."""
    out = []
    for entry_id, fields in entries:
        if budget <= 0:
            break
        ev = decode_event(entry_id, fields)
        if ev is not None:
            out.append(ev)
            budget -= len(fields.get(b"data", fields.get("data", b"")))
    return out[::-1]


def _raise_outage(replies: list[Any]) -> None:
    """A pipeline run with ``raise_on_error=False`` hands back errors in place: an outage or a
    refusal other than WRONGTYPE is raised as it would have been; a WRONGTYPE is the caller's
    to skip."""
    for r in replies:
        if isinstance(r, Exception) and not _is_wrongtype(r):
            raise r


def _newest_beat(reply: Any) -> int | None:
    """Server ms of the newest heartbeat from a ZREVRANGE ... WITHSCORES reply."""
    try:
        return int(reply[0][1]) if reply else None
    except (TypeError, ValueError, IndexError):
        return None


def _lost_for(view: JobView, now_ms: int) -> float | None:
    """Seconds since the last heartbeat of a lost job (None unless lost; since it was
    created when no heartbeat is left at all)."""
    if view.lost_since_ms is None or view.is_final:
        return None
    since = view.lost_since_ms or view.created_ms or now_ms
    return max(0.0, (now_ms - since) / 1000.0)


def _is_final(meta: Any) -> bool:
    """A meta hash (HGETALL reply) that records the job's end."""
    return isinstance(meta, dict) and _s(meta.get(b"final_state", b"")) in FINAL_STATES


def _ttl_s(pttl: Any) -> float | None:
    """A PTTL reply as seconds; None for no expiry (-1), no key (-2) or an error."""
    return pttl / 1000.0 if isinstance(pttl, int) and pttl >= 0 else None


def _round_info(raw: Any) -> RoundInfo | None:
    if not raw:
        return None
    try:
        return RoundInfo.decode(raw)
    except (ValueError, KeyError, TypeError):
        return None
