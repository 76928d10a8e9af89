"""The wire contract between agents and consoles: every Redis key of a job and every record.

Nothing outside this module spells a key. Both sides import it, so it imports neither
Textual nor torch. docs/PROTOCOL.md documents the same contract for other clients.

Keys
    Every coordination key of a job is ``elastic:{JOB}:...``. The braces are a Redis Cluster
    hash tag: a job's coordination lives in one slot, so multi-key Lua scripts and MULTI work
    on a cluster. Its log streams, the bulk bytes, are ``elastic:log:{JOB/TAG}:NODE``, spread
    over :data:`LOG_SHARDS` other slots and listed in the job's ``logs`` set. The one key
    outside a job is the job index, ``elastic:jobs``.

Records
    Stream entries are flat maps of strings. Every entry carries ``v`` (the protocol
    version). A reader ignores record types it does not know and survives malformed entries:
    ``decode_*`` return ``None`` for them instead of raising.

Hostile input
    Anyone who can write a job's keys can write anything into them, so every decoder here is
    total: it takes any mapping of any bytes and returns a record or ``None`` (a command: the
    reason it was refused), never raising. JSON goes through :func:`decode_json` alone, which
    bounds its size and nesting (``json.loads`` of deep nesting raises RecursionError, which is
    not a ValueError), and every field is checked for its type (``type(x) is int``: a bool is
    not a rank) and range before a record is built.
"""

from __future__ import annotations

import binascii
import contextlib
import functools
import json
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

PROTOCOL_VERSION = 1
#: Record versions a reader of this module understands; a record of any other is skipped.
SUPPORTED_VERSIONS = frozenset({PROTOCOL_VERSION})

#: Bounds on what a reader decodes: far above anything an agent writes, far below what
#: would stall a reader. An agent's log entry is at most ~272 KiB (logs.py), an event's data
#: is cut to fit ``MAX_EVENT_DATA_BYTES`` by ``encode_event``.
MAX_EVENT_DATA_BYTES = 1024 * 1024
MAX_LOG_ENTRY_BYTES = 4 * 1024 * 1024
MAX_COMMAND_ARGS_BYTES = 16 * 1024
MAX_RDZV_RECORD_BYTES = 4 * 1024 * 1024
MAX_JSON_DEPTH = 32
#: Short text fields (node ids, hosts, command ids, issuers).
MAX_NAME_CHARS = 256
MAX_COMMAND_ID_CHARS = 128
#: The largest rank a record may name (far above any job; keeps arithmetic on ranks sane).
MAX_RANK = 1 << 24
#: The most items a reader takes from one list of a record (a node's ranks and pids, a
#: round's nodes, a stall's odd ranks): the design's largest job (32,768 ranks on 4,096 nodes)
#: fits in one; the rest of a longer list is ignored (see :func:`record_list`).
MAX_RECORD_LIST = 32_768

#: The job index: a sorted set of job ids scored by their creation time (server ms).
JOBS_INDEX = "elastic:jobs"

_JOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

#: Default retention of the streams (entries, trimmed with ``MAXLEN ~``).
EVENTS_MAXLEN = 100_000
LOGS_MAXLEN = 200_000
COMMANDS_MAXLEN = 10_000
NOTIFY_MAXLEN = 10_000
#: Stack replies (one entry per rank and request, each up to ``MAX_STACK_TEXT_BYTES``).
STACKS_MAXLEN = 10_000


def replies_maxlen(floor: int, world_size: int) -> int:
    """The cap of a per-rank reply stream (stacks, collectives) for a job of ``world_size``
    ranks: two requests' replies at least. Under a fixed cap, the replies of a job larger than
    it trimmed each other away while a reader was still behind (4,096 nodes x 8 ranks: a
    tenth of them, with 10,000)."""
    return max(floor, 2 * max(0, world_size))


#: Hash tags a job's log streams are spread over (:meth:`JobKeys.logs`): a job uses at most
#: this many slots, hence cluster masters, for its logs; a cluster reader makes one XREAD per
#: tag. Shard ``s``'s tag lands in the ``s``-th sixteenth of the cluster's 16,384 slots, so
#: masters that split the slots evenly (what ``redis-cli --cluster create`` does) get an even
#: share of the shards: 5 or 6 of 16 each with three masters.
LOG_SHARDS = 16
CLUSTER_SLOTS = 16384
#: The shard part of a log stream's tag as readers accept it (``JOB/<this>``).
_LOG_TAG_RE = re.compile(r"[A-Za-z0-9._-]{1,32}")


@functools.lru_cache(maxsize=256)
def log_shard_tags(job_id: str) -> tuple[str, ...]:
    """The :data:`LOG_SHARDS` hash tags of ``job_id``'s log streams: shard ``s`` is
    ``JOB/s``, or ``JOB/s.k`` for the smallest ``k`` whose slot (CRC16 mod 16,384, the cluster's
    rule) falls in the ``s``-th of :data:`LOG_SHARDS` equal ranges of slots. About 16 CRCs a
    shard, once per job and process. Writers only: readers take the names from the set."""
    width = CLUSTER_SLOTS // LOG_SHARDS
    tags = []
    for s in range(LOG_SHARDS):
        tag = f"{job_id}/{s}"
        for k in range(1, 4096):  # (15/16)^4096: never exhausted in practice
            if binascii.crc_hqx(tag.encode(), 0) % CLUSTER_SLOTS // width == s:
                break
            tag = f"{job_id}/{s}.{k}"
        tags.append(tag)
    return tuple(tags)


class InvalidJobIdError(ValueError):
    """A job id that cannot name a job (it would break the key layout or the hash tag)."""


def validate_job_id(job_id: str) -> str:
    """Return ``job_id`` if it is usable, else raise :class:`InvalidJobIdError`.

    A job id is 1-128 characters of letters, digits, ``.``, ``_`` and ``-``, starting with a
    letter or digit: no braces (they would break the hash tag), colons or spaces.
    """
    if not isinstance(job_id, str) or not _JOB_ID_RE.fullmatch(job_id):
        raise InvalidJobIdError(
            f"invalid job id {job_id!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return job_id


class ProtocolError(ValueError):
    """A record that breaks the wire contract; the message says how (for acks and logs)."""


def decode_json(raw: str | bytes | None, what: str, limit: int) -> Any:
    """The one place JSON from Redis is parsed: at most ``limit`` bytes, at most
    ``MAX_JSON_DEPTH`` levels deep; anything else raises :class:`ProtocolError` naming ``what``.
    """
    if raw is None:
        raise ProtocolError(f"{what} is missing")
    if len(raw) > limit:
        raise ProtocolError(f"{what} is {len(raw)} bytes (at most {limit})")
    try:
        value = _loads(raw)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"{what} is not valid JSON ({type(exc).__name__})") from None
    # Each level opens with a bracket: text with few brackets cannot nest deep, and the walk
    # (most of the cost of a small record: 4,096 resource samples a second) is not needed.
    if not isinstance(value, (dict, list)):
        return value
    opens = (raw.count("{") + raw.count("[") if isinstance(raw, str)
             else raw.count(b"{") + raw.count(b"["))
    if opens <= MAX_JSON_DEPTH:
        return value
    if _depth_exceeds(value, MAX_JSON_DEPTH):
        raise ProtocolError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep")
    return value


def _depth_exceeds(value: Any, limit: int) -> bool:
    # Iterative: a recursive walk would itself hit the recursion limit on hostile input.
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children)
    return False


def decode_counter(raw: str | bytes | None, key: str) -> int:
    """A counter key's value (missing: 0); :class:`ProtocolError` for anything else, since a
    counter read wrong would spend a budget twice or never."""
    text = _str(raw) if raw is not None else "0"
    if not text.isdigit() or len(text) > 18:
        raise ProtocolError(f"{key} holds {text[:40]!r}, not a count: repair or delete that key")
    return int(text)


#: A round end record (JobKeys.restart_history) is at most this long; longer ones are skipped.
MAX_ROUND_END_BYTES = 16 * 1024
#: At most this many nodes are named in one round end.
MAX_ROUND_END_NODES = 64


def decode_round_end(raw: str | bytes) -> dict[str, Any] | None:
    """One entry of ``JobKeys.restart_history``: ``{"round", "ms", "reason", "nodes",
    "progressed"}`` with their types checked; ``None`` for anything malformed (skipped)."""
    try:
        d = decode_json(raw, "a round end record", MAX_ROUND_END_BYTES)
    except ProtocolError:
        return None
    if not isinstance(d, dict):
        return None
    rnd, ms, reason, progressed = d.get("round"), d.get("ms"), d.get("reason"), d.get("progressed")
    if (type(rnd) is not int or not 0 <= rnd < 1 << 40 or type(ms) is not int or ms < 0
            or not isinstance(reason, str) or len(reason) > 32
            or progressed not in (True, False, None)):
        return None
    nodes = [n for n in record_list(d.get("nodes"), MAX_ROUND_END_NODES)
             if isinstance(n, str) and 0 < len(n) <= MAX_NAME_CHARS]
    return {"round": rnd, "ms": ms, "reason": reason, "nodes": nodes, "progressed": progressed}


def is_rank(value: Any) -> bool:
    """A rank as records carry it: a real int (``True`` is not rank 1), 0 <= rank < MAX_RANK."""
    return type(value) is int and 0 <= value < MAX_RANK


def record_list(value: Any, limit: int = MAX_RECORD_LIST) -> list[Any]:
    """A list field of a decoded record: its first ``limit`` items, ``[]`` for anything but a
    list. How a reader takes every list from a record: a 1 MiB event holds ~140k ranks, and
    an item a reader keeps costs it far more than the item's bytes."""
    return value[:limit] if type(value) is list else []


def rank_list(value: Any, limit: int = MAX_RECORD_LIST, world: int | None = None) -> list[int]:
    """The ranks among the first ``limit`` items of a list field (:func:`is_rank`, and below
    ``world`` when it is known); other items are dropped."""
    top = MAX_RANK if world is None else min(world, MAX_RANK)
    return [r for r in record_list(value, limit) if type(r) is int and 0 <= r < top]


def record_version(fields: Mapping[str, str]) -> int | None:
    """The record's ``v`` if this reader supports it, else None."""
    raw = fields.get("v", "")
    if not raw.isdigit() or len(raw) > 6:
        return None
    v = int(raw)
    return v if v in SUPPORTED_VERSIONS else None


def console_client_name(job_id: str) -> str:
    """The connection name (``CLIENT SETNAME``) of a console reading ``job_id``: how a
    ``--standalone`` agent knows a console of its job is still attached, whatever other
    connection its server holds."""
    return f"elastic-console:{validate_job_id(job_id)}"


@dataclass(frozen=True)
class JobKeys:
    """Every Redis key name of one job."""

    job_id: str

    def __post_init__(self) -> None:
        validate_job_id(self.job_id)

    @property
    def prefix(self) -> str:
        return f"elastic:{{{self.job_id}}}:"

    def _k(self, name: str) -> str:
        return self.prefix + name

    # -- job-level records -------------------------------------------------------------
    @property
    def meta(self) -> str:
        """Hash: job settings and state (min/max nodes, max restarts, created, state)."""
        return self._k("meta")

    @property
    def events(self) -> str:
        """Stream: every event of the job (see ``EventType``)."""
        return self._k("events")

    @property
    def commands(self) -> str:
        """Stream: commands to the agents; every agent reads it on its own cursor."""
        return self._k("commands")

    @property
    def restarts(self) -> str:
        """String (integer): the job-wide count of restarts spent on failures."""
        return self._k("restarts")

    @property
    def log_streams(self) -> str:
        """Set: the names of the job's log streams (one per node). The streams themselves may
        live in other slots (:meth:`logs`): readers, retention and ``rm`` find them here."""
        return self._k("logs")

    def logs(self, node_id: str) -> str:
        """Stream: the log lines of one node's workers (:func:`encode_node_log_entry`).

        ``elastic:log:{JOB/TAG}:NODE``: the bulk bytes of a job, outside the job's slot, in one
        of :data:`LOG_SHARDS` hash tags picked by the node id (:func:`log_shard_tags`), so that
        one job's log traffic spreads over a cluster's masters. On a single server it is just
        a name."""
        tags = log_shard_tags(self.job_id)
        return f"elastic:log:{{{tags[zlib.crc32(node_id.encode()) % len(tags)]}}}:{node_id}"

    def legacy_logs(self, node_id: str) -> str:
        """Stream: a node's log stream as agents named it before :meth:`logs` moved out of the
        job's slot (``elastic:{JOB}:logs:NODE``); still read when the logs set names it."""
        return self._k(f"logs:{node_id}")

    def is_log_stream(self, name: str) -> bool:
        """Whether ``name`` (a member of :attr:`log_streams`, i.e. anything a writer put
        there) can be one of this job's log streams, in either shape: readers read it and
        ``rm`` deletes it only then, never a key of another job or outside ``elastic:``."""
        legacy = self._k("logs:")
        if name.startswith(legacy):
            node = name[len(legacy):]
        else:
            start = f"elastic:log:{{{self.job_id}/"
            end = name.find("}:", len(start))
            if not name.startswith(start) or end < 0 or not _LOG_TAG_RE.fullmatch(
                    name[len(start):end]):
                return False
            node = name[end + 2:]
        return 0 < len(node) <= MAX_NAME_CHARS

    def streams_elsewhere(self, members: Any) -> list[str]:
        """The members of :attr:`log_streams` (an SMEMBERS reply) that are this job's log
        streams outside its slot, sorted: what retention and ``rm`` reach by name (a SCAN of
        the job's slot finds the rest). A foreign name in the set is never touched."""
        names = {m.decode("utf-8", "replace") if isinstance(m, bytes) else str(m)
                 for m in members or ()}
        return sorted(n for n in names if self.is_log_stream(n) and not n.startswith(self.prefix))

    @property
    def collectives(self) -> str:
        """Stream: one entry per rank answering a ``collectives`` request or capture: its
        flight recorder, reduced (see ``encode_collective_reply``; issue 22)."""
        return self._k("collectives")

    def stragglers(self, round_: int) -> str:
        """Sorted set (issue 22): global rank -> the share of its time that rank spent
        outside collectives over the last sampling window of round ``round_`` (0..1: the slow
        rank waits least), written by its node's agent each interval (ZADD of its own ranks:
        O(ranks of the node)); read by the round's group rank 0 agent by index (ZCARD, the
        median by ZRANGE, the top by ZREVRANGE: O(log N + k)). Expires three intervals after
        its last write."""
        return self._k(f"stragglers:{int(round_)}")

    @property
    def stacks(self) -> str:
        """Stream: one entry per rank answering a stack request or capture (see
        ``encode_stack_reply``)."""
        return self._k("stacks")

    @property
    def progress_newest(self) -> str:
        """String ``"<round> <ms>"``: the newest progress of any member of that round (the
        stall check's one shared value, so no check reads every node's field)."""
        return self._k("progress:newest")

    @property
    def restart_history(self) -> str:
        """List: the job's newest round ends that cost a restart (a failure, a stall, a lost
        node), newest first, JSON each (``decode_round_end``); capped (LTRIM) at
        ``supervision/restart_patterns.HISTORY_CAP``. Written once per restart by the agent
        that claimed it, which reads it back whole in the same transaction."""
        return self._k("restart_history")

    @property
    def excluded(self) -> str:
        """Set: nodes that ``--exclude-suspect-nodes`` left out of the job's next rounds; an
        agent asks SISMEMBER for itself before it joins a round (O(1))."""
        return self._k("excluded")

    @property
    def progress(self) -> str:
        """Hash: node -> Redis server time (ms, integer) of the newest progress of any of its
        workers (an output line, or CPU time advancing; see supervision/diagnosis/stall.py). Written by
        each agent every few seconds while its workers run; readers ignore a field that is not
        an integer, or is more than a minute ahead of the server's clock."""
        return self._k("progress")

    def stall(self, round_: int) -> str:
        """String: the progress time (ms) of the newest stall of round ``round_`` that an agent
        claimed (SET with a lease while it captures the stacks; kept once reported). A stall
        is claimed again only after newer progress, so one stall is reported exactly once."""
        return self._k(f"stall:{int(round_)}")

    def wake(self, node_id: str) -> str:
        """Stream (one entry, 5 s TTL): written by one agent to wake its own multiplexed
        XREAD when it starts following another stream (coordination/stream_mux.py)."""
        return self._k(f"wake:{node_id}")

    @property
    def resources(self) -> str:
        """Hash: global rank -> the latest resource sample of that worker (JSON)."""
        return self._k("resources")

    @property
    def lease(self) -> str:
        """String with a TTL: which agent renews the TTL of the job's keys this interval
        (see supervision/records/retention.py)."""
        return self._k("lease")

    # -- rendezvous --------------------------------------------------------------------

    @property
    def lost_sweep(self) -> str:
        """A claim (SET NX PX 60 s) of the reader that gives a lost job's keys without a TTL
        the meta's TTL (``elastic-console ls``): at most one sweep a minute per job."""
        return self._k("lost_sweep")
    @property
    def rdzv_state(self) -> str:
        """Hash: round, status (open|complete), closed, deadline_ms, seq."""
        return self._k("rdzv:state")

    @property
    def rdzv_members(self) -> str:
        """Sorted set: node -> join order, the members of the current round."""
        return self._k("rdzv:members")

    @property
    def rdzv_waiting(self) -> str:
        """Sorted set: node -> arrival order, nodes that arrived after the round completed."""
        return self._k("rdzv:waiting")

    @property
    def rdzv_ranks(self) -> str:
        """Hash: node -> group rank in the last completed round."""
        return self._k("rdzv:ranks")

    @property
    def rdzv_round_info(self) -> str:
        """String (JSON): the last completed round (see ``RoundInfo``)."""
        return self._k("rdzv:round")

    @property
    def rdzv_assign(self) -> str:
        """Hash: node -> ``"<round> <group rank> <base rank>"``, its place in the last round it
        completed; what a node reads of a completed round (O(1), not the whole round)."""
        return self._k("rdzv:assign")

    @property
    def rdzv_nodes(self) -> str:
        """Hash: node -> JSON description (host, addr, port, pid) given at join."""
        return self._k("rdzv:nodes")

    @property
    def rdzv_heartbeats(self) -> str:
        """Sorted set: node -> Redis server time (ms) of its last heartbeat."""
        return self._k("rdzv:heartbeats")

    @property
    def rdzv_left(self) -> str:
        """Set: members of the last completed round that left it on their own."""
        return self._k("rdzv:left")

    @property
    def rdzv_lost(self) -> str:
        """Set: members of the last completed round already reported lost (reported once)."""
        return self._k("rdzv:lost")

    @property
    def rdzv_notify(self) -> str:
        """Stream: an entry for every transition that waiters must act on (XREAD BLOCK it):
        ``e`` = complete | open | closed | deadline."""
        return self._k("rdzv:notify")

    @property
    def rdzv_joins(self) -> str:
        """Stream: an entry per join, leave or late arrival (``e``, ``node``, ``n`` members
        now), for progress displays; waiters that show no progress do not read it."""
        return self._k("rdzv:joins")

    # -- key/value store (c10d Store semantics) ----------------------------------------
    def store(self, namespace: str) -> str:
        """Hash: the keys and values of one store namespace."""
        return self._k(f"store:{namespace}")

    def store_notify(self, namespace: str) -> str:
        """Stream: the names of keys written in a store namespace (wakes blocked waits)."""
        return self._k(f"store:{namespace}:notify")

    def all_key_patterns(self) -> list[str]:
        """SCAN patterns that together match every key in the job's slot (for clean-up): all
        but its log streams (:meth:`logs`), which the :attr:`log_streams` set lists (a SCAN
        for them would walk every key of every master)."""
        return [self.prefix.replace("{", "\\{").replace("}", "\\}") + "*"]


# -- events ------------------------------------------------------------------------------

class EventType:
    """Every event type on a job's event stream, with its documented fields."""

    NODE_JOINED = "node_joined"  # node, host, round
    NODE_LEFT = "node_left"  # node, host, reason
    NODE_LOST = "node_lost"  # node, host, last_heartbeat_ms
    RENDEZVOUS_COMPLETE = "rendezvous_complete"  # round, world_size, nodes[{node,host,group_rank}]
    # ranks[], pids[], restart_count, attempt; after a restart, restart{reason, detected_at,
    # phases_ms{RESTART_PHASES}}: how long each phase of it took
    WORKERS_STARTED = "workers_started"
    WORKER_EXITED = "worker_exited"  # rank, local_rank, exit_code, signal, message, error_file
    # rank, local_rank, pid, scope, deadline (the worker's time.time()), signal, killed: the
    # agent's watchdog (torch's file timer, TORCHELASTIC_ENABLE_FILE_TIMER) saw a timer expire
    WORKER_TIMER_EXPIRED = "worker_timer_expired"
    GROUP_FAILED = "group_failed"  # root_cause{...}, failures[]
    RESTARTING = "restarting"  # reason (failure|membership|command|stalled), restarts_used, max_restarts
    WORKERS_STOPPED = "workers_stopped"  # ranks[], reason
    JOB_SUCCEEDED = "job_succeeded"
    JOB_FAILED = "job_failed"  # root_cause{...}, restarts_used
    # command_id, issuer; or, stopped by a scheduler: issuer, scheduler, signal, meaning
    JOB_STOPPED = "job_stopped"
    COMMAND_ACK = "command_ack"  # command_id, status (accepted|rejected|done), reason
    LOGS_DROPPED = "logs_dropped"  # count (lines lost to a full outage buffer)
    # final_state, linger_s: the job ended and its embedded Redis (--standalone) stops, at the
    # latest linger_s seconds after this event, earlier once no console is attached: a reader
    # that then loses the server knows it is gone for good, not an outage.
    REDIS_STOPPING = "redis_stopping"
    # request (the capture's id on the stacks stream), idle_s, groups[{ranks, hosts, summary,
    # frames}] (at most 20, the odd ones first), odd_ranks[], odd_hosts[], policy
    # (observe|restart|stop), round: no rank of the job made progress for --stall-timeout
    # (stall.py); written once per stall by the agent that claimed it (JobKeys.stall);
    # collectives{request, suspects[], groups[], mismatches[]} when flight recorder traces
    # were captured (coordination/collectives.py, issue 22)
    STALLED = "stalled"
    # Restart patterns (supervision/diagnosis/restart_patterns.py), each written once per restart by
    # the agent that claimed it. restarts, minutes, limit, rounds[]: >= limit restarts within
    # minutes (--restart-storm)
    RESTART_STORM = "restart_storm"
    # suspect_node, host, rounds[], excluded (bool), why: the node was in every failure of the
    # last len(rounds) restarts (its worker was the root cause, or it was lost)
    SUSPECT_NODE = "suspect_node"
    # rounds[]: the last len(rounds) rounds ended without progress (stall.py's progress)
    NO_PROGRESS = "no_progress"
    # host, reason: this node leaves the job for good (--exclude-suspect-nodes)
    NODE_EXCLUDED = "node_excluded"
    # scheduler ("slurm"), slurm_restart_count: the scheduler requeued the job, which runs
    # again under its id; a job_stopped (issuer "the scheduler") before it is not its end
    JOB_REQUEUED = "job_requeued"
    # ranks[{rank, host, node, ratio}] ascending by rank, window_s, threshold, round: ranks
    # that spent at least `threshold` times the job's median share of their time outside
    # collectives (computing) for two windows in a row (supervision/diagnosis/stragglers.py, issue 22)
    STRAGGLER = "straggler"

    ALL = frozenset(
        {
            NODE_JOINED, NODE_LEFT, NODE_LOST, RENDEZVOUS_COMPLETE, WORKERS_STARTED,
            WORKER_EXITED, GROUP_FAILED, RESTARTING, WORKERS_STOPPED, JOB_SUCCEEDED,
            JOB_FAILED, JOB_STOPPED, COMMAND_ACK, LOGS_DROPPED, REDIS_STOPPING,
            WORKER_TIMER_EXPIRED, STALLED, RESTART_STORM, SUSPECT_NODE, NO_PROGRESS,
            NODE_EXCLUDED, JOB_REQUEUED, STRAGGLER,
        }
    )


#: The phases of a restart, in order, as ``workers_started``'s ``restart.phases_ms`` names
#: them (ms since the agent saw why the workers had to stop; docs/PROTOCOL.md): the
#: survivors' stacks captured, the workers stopped, the failure reported, the rendezvous
#: done, the keeper ready, every worker started.
RESTART_PHASES = ("evidence", "stopped", "reported", "rendezvous", "keeper", "started")


@dataclass(frozen=True)
class Event:
    """One event. ``id`` is the stream id; its millisecond part is Redis server time."""

    type: str
    node: str
    data: dict[str, Any]
    id: str = ""
    version: int = PROTOCOL_VERSION
    seq: int = 0  # per writing node, from 1; 0 when absent. (node, seq) repeats = a duplicate

    @property
    def server_ms(self) -> int:
        return stream_id_ms(self.id)


def encode_event(event_type: str, node: str, data: Mapping[str, Any] | None = None,
                 seq: int = 0) -> dict[str, str]:
    """Encode an event as stream fields: ``v``, ``type``, ``node``, ``seq`` and ``data`` (JSON).

    ``seq`` numbers the writing node's events from 1, so a reader can drop the duplicate a
    retried XADD may leave (Redis 7 has no idempotent XADD).
    """
    blob = json.dumps(dict(data or {}), separators=(",", ":"), default=str)
    if len(blob.encode()) > MAX_EVENT_DATA_BYTES:
        # Readers skip larger data whole: keep the scalars (what, who, when) and say so.
        scalars = {k: v for k, v in (data or {}).items()
                   if isinstance(v, (int, float, bool)) or (isinstance(v, str) and len(v) < 1024)}
        blob = json.dumps({**scalars, "truncated": True}, separators=(",", ":"), default=str)
    return {
        "v": str(PROTOCOL_VERSION),
        "type": event_type,
        "node": node,
        "seq": str(seq),
        "data": blob,
    }


def decode_event(entry_id: str | bytes, fields: Mapping[Any, Any]) -> Event | None:
    """Decode an event entry; ``None`` for a malformed one, an unknown type or version."""
    try:
        f = _strs(fields)
        version = record_version(f)
        event_type = f.get("type", "")
        node = f.get("node", "")
        seq_raw = f.get("seq", "0")
        if (version is None or event_type not in EventType.ALL or len(node) > MAX_NAME_CHARS
                or not seq_raw.isdigit() or len(seq_raw) > 18):
            return None
        data = decode_json(f.get("data", "{}"), "event data", MAX_EVENT_DATA_BYTES)
        if not isinstance(data, dict):
            return None
        return Event(event_type, node, data, _str(entry_id), version, int(seq_raw))
    except (ProtocolError, TypeError, AttributeError):
        return None


# -- log batches ------------------------------------------------------------------------

STDOUT = "out"
STDERR = "err"


class LogBatch(NamedTuple):
    """Consecutive lines of one worker's stdout or stderr.

    A NamedTuple, not a frozen dataclass: a console reads tens of thousands a second, and a
    frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field) cost ~3 us of the
    ~10 us a batch may take there (``bench/console_bench.py``, 4,096 ranks).

    ``seq`` numbers a worker's batches within an attempt, so a reader can drop the
    duplicate a retried XADD may write (Redis 7 has no idempotent XADD).

    ``live``: the last line is not finished: it is the latest frame of a line the worker
    redraws in place with ``\r`` (a progress bar). The first line of the stream's next
    batch (``seq + 1``) is that same line again, newer or final: it replaces it.
    """

    node: str
    rank: int
    local_rank: int
    attempt: int
    stream: str  # STDOUT or STDERR
    seq: int
    lines: list[str]
    id: str = ""
    live: bool = False

    @property
    def server_ms(self) -> int:
        return stream_id_ms(self.id)


def encode_log_batch(batch: LogBatch) -> dict[str, str]:
    """Encode a batch as stream fields; lines are joined with newlines (a line has none).
    ``live`` adds ``live=1`` (a reader that does not know the field shows the frame as a line)."""
    fields = {
        "v": str(PROTOCOL_VERSION),
        "node": batch.node,
        "rank": str(batch.rank),
        "lrank": str(batch.local_rank),
        "attempt": str(batch.attempt),
        "s": batch.stream,
        "seq": str(batch.seq),
        "lines": "\n".join(batch.lines),
    }
    if batch.live:
        fields["live"] = "1"
    return fields


def decode_log_batch(entry_id: str | bytes, fields: Mapping[Any, Any]) -> LogBatch | None:
    """Decode a log entry; ``None`` for a malformed one or an unknown version."""
    try:
        if b"lines" in fields:
            # A reply as redis-py gives it without decode_responses (the console, 50k
            # lines/s): look fields up as bytes and decode only the two text ones.
            get = fields.get
            stream = _LOG_STREAMS.get(get(b"s"))  # type: ignore[arg-type]
            raw_lines = fields[b"lines"]
            node_b = fields[b"node"]
            if (stream is None or get(b"v") not in _SUPPORTED_V_BYTES
                    or len(raw_lines) > MAX_LOG_ENTRY_BYTES or len(node_b) > MAX_NAME_CHARS):
                return None
            batch = LogBatch(
                node=node_b.decode("utf-8", "replace"),
                rank=_small_int(fields[b"rank"]),
                local_rank=_small_int(get(b"lrank", b"-1")),
                attempt=_small_int(get(b"attempt", b"0")),
                stream=stream,
                seq=_small_int(get(b"seq", b"0")),
                lines=raw_lines.decode("utf-8", "replace").split("\n"),
                id=_str(entry_id),
                live=_LIVE[get(b"live", b"0")],
            )
        else:
            f = _strs(fields)
            stream = f.get("s", "")
            if (stream not in (STDOUT, STDERR) or record_version(f) is None
                    or len(f["lines"]) > MAX_LOG_ENTRY_BYTES or len(f["node"]) > MAX_NAME_CHARS):
                return None
            batch = LogBatch(
                node=f["node"],
                rank=_small_int(f["rank"]),
                local_rank=_small_int(f.get("lrank", "-1")),
                attempt=_small_int(f.get("attempt", "0")),
                stream=stream,
                seq=_small_int(f.get("seq", "0")),
                lines=f["lines"].split("\n"),
                id=_str(entry_id),
                live=_LIVE[f.get("live", "0").encode()],
            )
    except (KeyError, ValueError, TypeError, AttributeError):
        return None
    if not is_rank(batch.rank) or batch.attempt < 0 or batch.seq < 0 or batch.local_rank < -1:
        return None
    return batch


# -- a node's log entry: the batches of several of its workers ---------------------------


def encode_node_log_entry(node: str, batches: Sequence[LogBatch]) -> dict[str, str]:
    """One log entry for the batches of several worker streams of ``node``: what agents write,
    one XADD per node and flush (``logs.LOG_LINGER``), not one per worker stream, which made
    ~50k one-line entries a second for 4,096 ranks printing ~12 lines/s each; now ~5k.

    Fields: ``v``, ``node``, ``parts`` (JSON: one ``[rank, local_rank, attempt, stream, seq,
    lines, live]`` per batch, in order; ``lines`` counts its lines, at least one) and
    ``lines`` (every batch's lines, in the same order, joined with newlines). Each batch keeps
    its own ``seq`` and ``live`` (:class:`LogBatch`): readers dedupe and redraw per worker
    stream exactly as with one entry per batch.
    """
    parts: list[list[Any]] = []
    texts: list[str] = []
    for b in batches:
        text = "\n".join(b.lines)
        texts.append(text)
        parts.append([b.rank, b.local_rank, b.attempt, b.stream, b.seq, text.count("\n") + 1,
                      1 if b.live else 0])
    return {"v": str(PROTOCOL_VERSION), "node": node,
            "parts": json.dumps(parts, separators=(",", ":")), "lines": "\n".join(texts)}


def decode_log_entries(entry_id: str | bytes, fields: Mapping[Any, Any]) -> list[LogBatch] | None:
    """The batches of any log entry: one worker stream's (:func:`decode_log_batch`) or a
    node's (:func:`encode_node_log_entry`). ``None`` for a malformed entry (one bad part
    refuses the whole entry: its lines could not be told apart)."""
    def field(name: str) -> Any:  # fields as redis-py gives them: bytes or str names
        return fields.get(name.encode(), fields.get(name))

    try:
        parts = field("parts")
        if parts is None:
            batch = decode_log_batch(entry_id, fields)
            return None if batch is None else [batch]
        return _node_batches(entry_id, field("v"), field("node"), parts, field("lines"))
    except TypeError:  # an unhashable name
        return None


def _node_batches(entry_id: Any, v: Any, node_raw: Any, parts_raw: Any,
                  lines_raw: Any) -> list[LogBatch] | None:
    """A node entry's batches from its raw fields (bytes or str); None if malformed."""
    try:
        if (_str(v) not in _SUPPORTED_V_STR or len(node_raw) > MAX_NAME_CHARS
                or len(lines_raw) > MAX_LOG_ENTRY_BYTES or len(parts_raw) > MAX_LOG_ENTRY_BYTES):
            return None
        # Not decode_json: its depth walk would cost more than the rest here (a node's
        # parts hold ~30 lists); the checks below refuse anything but a list of flat lists.
        parts = _loads(parts_raw)
        if type(parts) is not list or not parts:
            return None
        node = _str(node_raw)
        lines = _str(lines_raw).split("\n")
        eid = _str(entry_id)
        out: list[LogBatch] = []
        at = 0
        make = tuple.__new__
        for part in parts:
            if type(part) is not list or len(part) != 7:
                return None
            rank, lrank, attempt, stream, seq, n, live = part
            if not (type(rank) is int and 0 <= rank < MAX_RANK and type(lrank) is int
                    and -1 <= lrank < MAX_RANK and type(attempt) is int and 0 <= attempt < 1 << 53
                    and type(stream) is str and stream in (STDOUT, STDERR) and type(seq) is int
                    and 0 <= seq < 1 << 63 and type(n) is int and 1 <= n <= len(lines) - at
                    and (live == 0 or live == 1) and type(live) is int):
                return None
            out.append(make(LogBatch, (node, rank, lrank, attempt, STDOUT if stream == STDOUT
                                       else STDERR, seq, lines[at:at + n], eid, live == 1)))
            at += n
    except (TypeError, ValueError, AttributeError, RecursionError):
        return None
    return out if at == len(lines) else None


_SCAN_JSON = json.JSONDecoder().scan_once


def _loads(raw: Any) -> Any:
    """``json.loads(raw)`` at a quarter of its cost for the small records Redis holds: its C
    scanner called directly (``json.loads`` of bytes spent 3 of its ~4 us detecting the
    encoding and in its wrappers; a console reads ~50k node log entries a second at 32,768
    ranks, ``status`` 32,768 resource samples). Anything the scanner does not take whole
    (whitespace around it, another encoding, no JSON at all) goes to ``json.loads``, so what
    is accepted or refused, and how, is the same."""
    try:
        text = raw.decode() if type(raw) is bytes else raw
        value, end = _SCAN_JSON(text, 0)
        if end == len(text):
            return value
    except (StopIteration, ValueError, TypeError, RecursionError):
        pass
    return json.loads(raw)


#: A log entry's field names as encode_log_batch writes them, in its order (``live`` after).
_LOG_FIELDS = [b"v", b"node", b"rank", b"lrank", b"attempt", b"s", b"seq", b"lines"]
#: ... and as encode_node_log_entry writes them.
_NODE_LOG_FIELDS = [b"v", b"node", b"parts", b"lines"]


def decode_log_entry(entry_id: str | bytes, flat: list[Any]) -> LogBatch | None:
    """Decode a log entry given as Redis replies it without decode_responses: the flat list
    ``[field, value, field, value, ...]``. ``None`` for a malformed one or an unknown version.

    An entry in the order :func:`encode_log_batch` writes (every agent's) is read by position
    without building a dict; any other is decoded by :func:`decode_log_batch`.
    """
    try:
        n = len(flat)
        if flat[0:16:2] != _LOG_FIELDS or not (n == 16 or (n == 18 and flat[16] == b"live")):
            it = iter(flat)
            return decode_log_batch(entry_id, dict(zip(it, it)))
        v, node_b, rank_b, lrank_b, attempt_b, s_b, seq_b, lines_b = flat[1:16:2]
        stream = _LOG_STREAMS.get(s_b)
        if (stream is None or v not in _SUPPORTED_V_BYTES or len(lines_b) > MAX_LOG_ENTRY_BYTES
                or len(node_b) > MAX_NAME_CHARS
                or max(len(rank_b), len(lrank_b), len(attempt_b), len(seq_b)) > 19):
            return None
        batch = LogBatch(node_b.decode("utf-8", "replace"), int(rank_b), int(lrank_b),
                         int(attempt_b), stream, int(seq_b),
                         lines_b.decode("utf-8", "replace").split("\n"), _str(entry_id),
                         n == 18 and _LIVE[flat[17]])
    except (KeyError, ValueError, TypeError, AttributeError, IndexError):
        return None
    if not is_rank(batch.rank) or batch.attempt < 0 or batch.seq < 0 or batch.local_rank < -1:
        return None
    return batch


class LogEntryDecoder:
    """:func:`decode_log_entries` for many entries at once, for a reader of tens of thousands
    a second (the console at 4,096 ranks): the same batches, or the same refusals (a property
    test holds it to that), at about a third of the cost for one worker stream's entries.

    Why it is cheaper: the fields that name a worker stream (``v``, ``node``, ``rank``,
    ``lrank``, ``attempt``, ``s``, names and values) are the same in every entry of that
    stream. They are validated and decoded once and remembered by their raw bytes (one dict
    lookup instead of four ``int()`` and a name check); at most ``limit`` are kept (a writer
    that varies them only costs the full decode). A node's entries (what agents write)
    are read by position; entries in any other order through :func:`decode_log_entries`.
    """

    __slots__ = ("_sources", "limit")

    def __init__(self, limit: int = 16_384) -> None:
        # raw header (12 items) -> (node, rank, local_rank, attempt, stream)
        self._sources: dict[tuple[Any, ...], tuple[str, int, int, int, str]] = {}
        self.limit = limit

    def decode(self, entries: Any) -> tuple[list[LogBatch], int]:
        """Decode one stream's entries as a raw XREAD reply holds them (``[[id, [field,
        value, ...]], ...]``). Returns the batches in order and how many entries were refused."""
        out: list[LogBatch] = []
        refused = 0
        sources = self._sources
        make = tuple.__new__
        for entry in entries:
            try:
                entry_id, flat = entry
                n = len(flat)
                src = sources.get(tuple(flat[:12])) if n == 16 or n == 18 else None
                if (src is None or flat[12] != b"seq" or flat[14] != b"lines"
                        or (n == 18 and flat[16] != b"live")):
                    if n == 8 and flat[0:8:2] == _NODE_LOG_FIELDS:  # an agent's node entry
                        many = _node_batches(entry_id, flat[1], flat[3], flat[5], flat[7])
                    elif (n == 16 or n == 18) and flat[0:16:2] == _LOG_FIELDS:
                        batch = decode_log_entry(entry_id, flat)  # a worker stream's, new
                        many = None if batch is None else [batch]
                        if batch is not None:
                            self._remember(flat, batch)
                    else:  # any other order or shape
                        it = iter(flat)
                        many = decode_log_entries(entry_id, dict(zip(it, it)))
                    if many is None:
                        refused += 1
                    else:
                        out += many
                    continue
                seq_b, lines_b = flat[13], flat[15]
                if len(seq_b) > 19 or len(lines_b) > MAX_LOG_ENTRY_BYTES:
                    refused += 1
                    continue
                seq = int(seq_b)
                if seq < 0:
                    refused += 1
                    continue
                out.append(make(LogBatch, (
                    src[0], src[1], src[2], src[3], src[4], seq,
                    lines_b.decode("utf-8", "replace").split("\n"),
                    entry_id.decode() if type(entry_id) is bytes else str(entry_id),
                    n == 18 and _LIVE[flat[17]])))
            except (KeyError, ValueError, TypeError, AttributeError, IndexError):
                refused += 1
        return out, refused

    def _remember(self, flat: list[Any], batch: LogBatch) -> None:
        """Keep the header of a worker stream's entry in the agent's field order that
        :func:`decode_log_entry` accepted."""
        if len(self._sources) >= self.limit:
            self._sources.clear()  # a writer varying its headers: start again, bounded
        with contextlib.suppress(TypeError):  # an unhashable value: never looked up either
            self._sources[tuple(flat[:12])] = (batch.node, batch.rank, batch.local_rank,
                                               batch.attempt, batch.stream)


def _small_int(raw: str | bytes) -> int:
    """int() of a decimal field of at most 18 digits (int() of a huge string is quadratic)."""
    if len(raw) > 19:
        raise ValueError("number too long")
    return int(raw)


_LOG_STREAMS = {STDOUT.encode(): STDOUT, STDERR.encode(): STDERR}
# ``live`` as written; any other value (KeyError, or TypeError if unhashable) skips the entry.
_LIVE = {b"0": False, b"1": True}
_SUPPORTED_V_BYTES = frozenset(str(v).encode() for v in SUPPORTED_VERSIONS)
_SUPPORTED_V_STR = frozenset(str(v) for v in SUPPORTED_VERSIONS)


# -- commands ---------------------------------------------------------------------------

class CommandType:
    STOP = "stop"  # graceful, job-wide
    RESTART = "restart"  # the whole worker group, job-wide, not counted against max restarts
    SIGNAL = "signal"  # args: {"rank": R, "signal": one of SIGNALS}
    # args: {"rank": R} optional; read-only: every agent publishes its ranks' Python stacks on
    # JobKeys.stacks (request = the command id), then acks "done"
    STACKS = "stacks"
    # args: {"rank": R} optional; read-only: every agent publishes its ranks' flight recorder
    # traces on JobKeys.collectives (request = the command id), then acks "done" (issue 22)
    COLLECTIVES = "collectives"

    ALL = frozenset({STOP, RESTART, SIGNAL, STACKS, COLLECTIVES})
    #: The signals a ``signal`` command may send (an allow-list: no SIGSTOP, no SIGUSR1 that a
    #: worker may use for its own purposes).
    SIGNALS = frozenset({"SIGTERM", "SIGKILL", "SIGINT"})


@dataclass(frozen=True)
class Command:
    """A command on the job's command stream. Every agent acks it with a ``command_ack``."""

    id: str
    type: str
    issuer: str
    target: str = "job"
    args: dict[str, Any] = field(default_factory=dict)
    entry_id: str = ""


def encode_command(command: Command) -> dict[str, str]:
    return {
        "v": str(PROTOCOL_VERSION),
        "id": command.id,
        "type": command.type,
        "issuer": command.issuer,
        "target": command.target,
        "args": json.dumps(command.args, separators=(",", ":")),
    }


def decode_command(entry_id: str | bytes, fields: Mapping[Any, Any]) -> Command | str:
    """Decode a command; for a malformed one return the reason (a string) instead.

    Agents ack a malformed command as rejected, so the reason must be reportable; it quotes
    nothing of the record but its type and field names (the ack is shown to people).
    A rank is checked against the job's world by the agent, which knows it.
    """
    try:
        f = _strs(fields)
    except (TypeError, AttributeError):
        return "command is not a map of strings"
    command_id = f.get("id", "")
    if not command_id:
        return "command has no id"
    if len(command_id) > MAX_COMMAND_ID_CHARS:
        return f"command id is longer than {MAX_COMMAND_ID_CHARS} characters"
    if record_version(f) is None:
        return f"unsupported protocol version (this agent speaks {sorted(SUPPORTED_VERSIONS)})"
    command_type = f.get("type", "")
    if command_type not in CommandType.ALL:
        return f"unknown command type (known: {', '.join(sorted(CommandType.ALL))})"
    issuer, target = f.get("issuer", "?"), f.get("target", "job")
    if len(issuer) > MAX_NAME_CHARS or len(target) > MAX_NAME_CHARS:
        return f"command issuer or target is longer than {MAX_NAME_CHARS} characters"
    try:
        args = decode_json(f.get("args", "{}"), "command args", MAX_COMMAND_ARGS_BYTES)
    except ProtocolError as exc:
        return str(exc)
    if not isinstance(args, dict):
        return "command args are not an object"
    if command_type == CommandType.SIGNAL:
        if not is_rank(args.get("rank")):
            return "signal needs args.rank, a non-negative integer"
        sig = args.get("signal", "SIGTERM")
        # type first: a list or an object is unhashable, and ``in`` a frozenset would raise
        if type(sig) is not str or sig not in CommandType.SIGNALS:
            return f"signal must be one of {', '.join(sorted(CommandType.SIGNALS))}"
    if command_type in (CommandType.STACKS, CommandType.COLLECTIVES):
        if args.get("rank") is not None and not is_rank(args.get("rank")):
            return f"{command_type}: args.rank must be a non-negative integer when given"
        if not is_request_id(command_id):
            return f"{command_type}: the command id must be letters, digits, '.', '_', ':' or '-'"
    return Command(id=command_id, type=command_type, issuer=issuer, target=target, args=args,
                   entry_id=_str(entry_id))


# -- stack replies ----------------------------------------------------------------------

#: faulthandler text of one rank, as published (an agent cuts it there and says so).
MAX_STACK_TEXT_BYTES = 256 * 1024
MAX_STACK_ERROR_CHARS = 512
#: A request id: a command id, or a capture id an agent chose (``stop-3``, ``stall-...``).
_REQUEST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


@dataclass(frozen=True)
class StackReply:
    """One rank's answer to a stack request: faulthandler ``text``, or the ``error`` that
    says why there is none. ``coordination.stack_dumps`` parses the text."""

    request: str
    node: str
    host: str
    rank: int
    pid: int
    text: str
    error: str = ""
    truncated: bool = False
    id: str = ""


def encode_stack_reply(reply: StackReply) -> dict[str, str]:
    """Stream fields of a reply; ``text`` is cut to ``MAX_STACK_TEXT_BYTES`` (``truncated``
    says so) and ``error`` to ``MAX_STACK_ERROR_CHARS``."""
    raw = reply.text.encode("utf-8", "replace")
    cut = len(raw) > MAX_STACK_TEXT_BYTES
    return {
        "v": str(PROTOCOL_VERSION),
        "request": reply.request,
        "node": reply.node[:MAX_NAME_CHARS],
        "host": reply.host[:MAX_NAME_CHARS],
        "rank": str(reply.rank),
        "pid": str(reply.pid),
        "text": raw[:MAX_STACK_TEXT_BYTES].decode("utf-8", "ignore") if cut else reply.text,
        "truncated": "1" if cut or reply.truncated else "0",
        "error": reply.error[:MAX_STACK_ERROR_CHARS],
    }


def decode_stack_reply(entry_id: str | bytes, fields: Mapping[Any, Any]) -> StackReply | None:
    """Decode a stack reply; ``None`` for a malformed one or an unknown version (sizes are
    checked before anything is decoded)."""
    try:
        raw_text = fields.get(b"text", fields.get("text", ""))
        if len(raw_text) > MAX_STACK_TEXT_BYTES + 4:
            return None
        f = _strs(fields)
        request, node, host = f.get("request", ""), f.get("node", ""), f.get("host", "")
        if (record_version(f) is None or not _REQUEST_RE.fullmatch(request)
                or len(node) > MAX_NAME_CHARS or len(host) > MAX_NAME_CHARS
                or len(f.get("error", "")) > MAX_STACK_ERROR_CHARS * 4):
            return None
        rank, pid = _small_int(f["rank"]), _small_int(f.get("pid", "0"))
    except (KeyError, ValueError, TypeError, AttributeError):
        return None
    if not is_rank(rank) or not 0 <= pid < (1 << 31):
        return None
    return StackReply(request=request, node=node, host=host, rank=rank, pid=pid,
                      text=f.get("text", ""), error=f.get("error", "")[:MAX_STACK_ERROR_CHARS],
                      truncated=f.get("truncated") == "1", id=_str(entry_id))


def is_request_id(value: Any) -> bool:
    """A request id as stack replies carry it (a command id or an agent's capture id)."""
    return isinstance(value, str) and _REQUEST_RE.fullmatch(value) is not None


# -- rendezvous records -----------------------------------------------------------------

@dataclass(frozen=True)
class NodeDescription:
    """What a node says of itself when it joins a rendezvous."""

    node: str
    host: str
    addr: str
    port: int
    pid: int
    nproc: int = 0  # workers this node runs (0: not an elastic-agent, e.g. torchrun)
    node_rank: int | None = None  # the group rank a static node asks for

    def encode(self) -> str:
        d: dict[str, Any] = {"node": self.node, "host": self.host, "addr": self.addr,
                             "port": self.port, "pid": self.pid, "nproc": self.nproc}
        if self.node_rank is not None:
            d["node_rank"] = self.node_rank
        return json.dumps(d, separators=(",", ":"))

    @staticmethod
    def decode(raw: str | bytes) -> NodeDescription:
        """Raises :class:`ProtocolError` for anything but a well-formed description."""
        d = decode_json(raw, "node description", MAX_RDZV_RECORD_BYTES)
        if not isinstance(d, dict):
            raise ProtocolError("node description is not an object")
        return NodeDescription(_name(d, "node"), _name(d, "host"), _name(d, "addr"),
                               _int_in(d, "port", 0, 65535), _int_in(d, "pid", 0, 1 << 31),
                               _int_in(d, "nproc", 0, MAX_RANK, default=0),
                               _int_in(d, "node_rank", 0, MAX_RANK) if "node_rank" in d else None)


@dataclass(frozen=True)
class RoundInfo:
    """A completed rendezvous round: who is in it and with which group rank."""

    round: int
    world_size: int
    nodes: list[dict[str, Any]]  # [{node, host, addr, port, pid, nproc, group_rank}], by rank
    completed_ms: int

    def base_rank(self, group_rank: int) -> int:
        """Global rank of local rank 0 on the node with ``group_rank`` (nodes may differ in
        how many workers they run)."""
        return sum(int(n.get("nproc", 0)) for n in self.nodes[:group_rank])

    @property
    def total_workers(self) -> int:
        return sum(int(n.get("nproc", 0)) for n in self.nodes)

    def rank_of(self, node: str) -> int | None:
        for n in self.nodes:
            if n["node"] == node:
                return int(n["group_rank"])
        return None

    def master(self) -> tuple[str, int]:
        """Address and port published by group rank 0 for the workers' process group."""
        first = self.nodes[0]
        return first["addr"], int(first["port"])

    @staticmethod
    def decode(raw: str | bytes) -> RoundInfo:
        """Raises :class:`ProtocolError` for anything but a well-formed round."""
        d = decode_json(raw, "round record", MAX_RDZV_RECORD_BYTES)
        if not isinstance(d, dict) or not isinstance(d.get("nodes"), list) or not d["nodes"]:
            raise ProtocolError("round record has no list of nodes")
        nodes = []
        for n in d["nodes"]:
            if not isinstance(n, dict):
                raise ProtocolError("round record has a node that is not an object")
            nodes.append({**n, "node": _name(n, "node"), "host": _name(n, "host", ""),
                          "addr": _name(n, "addr"), "port": _int_in(n, "port", 0, 65535),
                          "nproc": _int_in(n, "nproc", 0, MAX_RANK, default=0),
                          "group_rank": _int_in(n, "group_rank", 0, MAX_RANK)})
        return RoundInfo(_int_in(d, "round", 0, 1 << 53), _int_in(d, "world_size", 1, MAX_RANK),
                         nodes, _int_in(d, "completed_ms", 0, 1 << 53, default=0))


# -- helpers ----------------------------------------------------------------------------

def stream_id_ms(entry_id: str) -> int:
    """The millisecond (Redis server time) part of a stream id; 0 if there is none."""
    try:
        return int(entry_id.split("-", 1)[0])
    except (ValueError, AttributeError):
        return 0


def _name(d: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = d.get(key, default)
    if not isinstance(value, str) or len(value) > MAX_NAME_CHARS:
        raise ProtocolError(f"field {key!r} is not a string of at most {MAX_NAME_CHARS} characters")
    return value


def _int_in(d: Mapping[str, Any], key: str, low: int, high: int, default: int | None = None) -> int:
    value = d.get(key, default)
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(f"field {key!r} is not an integer in [{low}, {high}]")
    return value


def _str(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _strs(fields: Mapping[Any, Any]) -> dict[str, str]:
    return {_str(k): _str(v) for k, v in fields.items()}


# -- collective traces (issue 22) ---------------------------------------------------------

#: One rank's reduced flight recorder, as a worker sends it and an agent publishes it (the
#: worker cuts its oldest entries to fit: supervision/launch/recorder_probe.py).
MAX_TRACE_BYTES = 64 * 1024
#: Entries and process groups a reader takes from one trace; members listed per group.
MAX_TRACE_ENTRIES = 1024
MAX_TRACE_GROUPS = 64
MAX_TRACE_DIMS = 8
COLLECTIVES_MAXLEN = 10_000


class CollectiveEntry(NamedTuple):
    """One collective a rank entered, as its flight recorder saw it."""

    pg: str
    seq: int
    op: str
    in_sizes: tuple[tuple[int, ...], ...]
    out_sizes: tuple[tuple[int, ...], ...]
    done: bool
    t_ns: int = 0


@dataclass(frozen=True)
class CollectiveTrace:
    """A rank's trace: the members of each process group it knows (group name -> global
    ranks) and its newest collective entries, oldest first; ``error`` when it has none."""

    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    entries: tuple[CollectiveEntry, ...] = ()
    error: str = ""
    cut: bool = False


def _sizes(value: Any) -> tuple[tuple[int, ...], ...]:
    out = []
    for shape in record_list(value, MAX_TRACE_DIMS):
        dims = record_list(shape, MAX_TRACE_DIMS)
        if not all(type(d) is int and 0 <= d < (1 << 62) for d in dims):
            raise ProtocolError("a tensor size is not a list of non-negative integers")
        out.append(tuple(dims))
    return tuple(out)


def decode_collective_trace(raw: str | bytes) -> CollectiveTrace:
    """A trace from a worker or a reply (bounded, checked field by field); :class:`ProtocolError`
    for anything that is not one."""
    value = decode_json(raw, "collective trace", MAX_TRACE_BYTES)
    if not isinstance(value, dict):
        raise ProtocolError("collective trace is not an object")
    error = value.get("error", "")
    if not isinstance(error, str):
        raise ProtocolError("collective trace error is not a string")
    groups: dict[str, tuple[int, ...]] = {}
    raw_groups = value.get("groups", {})
    if not isinstance(raw_groups, dict):
        raise ProtocolError("collective trace groups are not an object")
    for name, members in list(raw_groups.items())[:MAX_TRACE_GROUPS]:
        if len(name) > MAX_NAME_CHARS:
            raise ProtocolError("a process group name is too long")
        groups[name] = tuple(sorted(set(rank_list(members))))
    entries = []
    for e in record_list(value.get("entries", []), MAX_TRACE_ENTRIES):
        if not isinstance(e, dict):
            raise ProtocolError("a collective entry is not an object")
        pg, op = e.get("pg", ""), e.get("op", "")
        seq, t_ns = e.get("seq", 0), e.get("t_ns", 0)
        if not (isinstance(pg, str) and isinstance(op, str) and len(pg) <= MAX_NAME_CHARS
                and len(op) <= MAX_NAME_CHARS and type(seq) is int and 0 <= seq < (1 << 62)
                and type(t_ns) is int and 0 <= t_ns < (1 << 63)):
            raise ProtocolError("a collective entry has a bad pg, op, seq or time")
        entries.append(CollectiveEntry(pg, seq, op, _sizes(e.get("in")), _sizes(e.get("out")),
                                       e.get("done") is True, t_ns))
    return CollectiveTrace(groups, tuple(entries), error[:MAX_STACK_ERROR_CHARS],
                           value.get("cut") is True)


def encode_collective_trace(trace: CollectiveTrace) -> str:
    """The JSON of a trace, as :func:`decode_collective_trace` reads it."""
    return json.dumps({
        "groups": {k: list(v) for k, v in trace.groups.items()},
        "entries": [{"pg": e.pg, "seq": e.seq, "op": e.op, "in": [list(s) for s in e.in_sizes],
                     "out": [list(s) for s in e.out_sizes], "done": e.done, "t_ns": e.t_ns}
                    for e in trace.entries],
        "error": trace.error, "cut": trace.cut}, separators=(",", ":"))


@dataclass(frozen=True)
class CollectiveReply:
    """One rank's answer to a ``collectives`` request (``trace.error`` says why it is empty)."""

    request: str
    node: str
    host: str
    rank: int
    pid: int
    trace: CollectiveTrace
    id: str = ""


def encode_collective_reply(reply: CollectiveReply) -> dict[str, str]:
    """Stream fields of a reply. A trace that does not fit ``MAX_TRACE_BYTES`` loses its
    oldest entries (``cut``)."""
    trace = reply.trace
    text = encode_collective_trace(trace)
    while len(text.encode()) > MAX_TRACE_BYTES and trace.entries:
        trace = CollectiveTrace(trace.groups, trace.entries[len(trace.entries) // 4 + 1:],
                                trace.error, True)
        text = encode_collective_trace(trace)
    if len(text.encode()) > MAX_TRACE_BYTES:
        text = encode_collective_trace(CollectiveTrace(error="the trace is too large"))
    return {"v": str(PROTOCOL_VERSION), "request": reply.request,
            "node": reply.node[:MAX_NAME_CHARS], "host": reply.host[:MAX_NAME_CHARS],
            "rank": str(reply.rank), "pid": str(reply.pid), "trace": text}


def decode_collective_reply(entry_id: str | bytes,
                            fields: Mapping[Any, Any]) -> CollectiveReply | None:
    """Decode a collectives reply; ``None`` for a malformed one or an unknown version (the
    trace's size is checked before it is decoded)."""
    try:
        raw = fields.get(b"trace", fields.get("trace", ""))
        if len(raw) > MAX_TRACE_BYTES:
            return None
        f = _strs(fields)
        request, node, host = f.get("request", ""), f.get("node", ""), f.get("host", "")
        if (record_version(f) is None or not _REQUEST_RE.fullmatch(request)
                or len(node) > MAX_NAME_CHARS or len(host) > MAX_NAME_CHARS):
            return None
        rank, pid = _small_int(f["rank"]), _small_int(f.get("pid", "0"))
        trace = decode_collective_trace(f.get("trace", ""))
    except (KeyError, ValueError, TypeError, AttributeError):  # ProtocolError is a ValueError
        return None
    if not is_rank(rank) or not 0 <= pid < (1 << 31):
        return None
    return CollectiveReply(request, node, host, rank, pid, trace, _str(entry_id))


def decode_busy_sample(raw: str | bytes) -> tuple[int, int, float]:
    """A worker's sampler reply: ``(samples, samples inside a collective, window seconds)``;
    :class:`ProtocolError` for anything else."""
    value = decode_json(raw, "recorder sample", 4096)
    if not isinstance(value, dict):
        raise ProtocolError("recorder sample is not an object")
    n, busy, window = value.get("samples"), value.get("busy"), value.get("window_s")
    if not (type(n) is int and type(busy) is int and 0 <= busy <= n < (1 << 40)
            and isinstance(window, (int, float)) and type(window) is not bool
            and 0 <= window < 1e9):
        raise ProtocolError("recorder sample has bad counts")
    return n, busy, float(window)
