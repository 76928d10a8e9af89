"""The wire contract between agents and consoles: every Redis key of a job and every record.

Nothing outside this module spells a key. Both sides import it, so it imports neither
Textual nor torch. docs/PROTOCOL.md documents the same contract for other clients.

Keys
    Every key of a job is ``elastic:{JOB}:...``. The braces are a Redis Cluster hash tag:
    a whole job lives in one slot, so multi-key Lua scripts and MULTI work on a cluster.
    The one key outside a job is the job index, ``elastic:jobs``.

Records
    Stream entries are flat maps of strings. Every entry carries ``v`` (the protocol
    version). A reader ignores record types it does not know and survives malformed entries:
    ``decode_*`` return ``None`` for them instead of raising.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PROTOCOL_VERSION = 1

#: The job index: a sorted set of job ids scored by their creation time (server ms).
JOBS_INDEX = "elastic:jobs"

_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

#: Default retention of the streams (entries, trimmed with ``MAXLEN ~``).
EVENTS_MAXLEN = 100_000
LOGS_MAXLEN = 200_000
COMMANDS_MAXLEN = 10_000
NOTIFY_MAXLEN = 10_000


class InvalidJobIdError(ValueError):
    """A job id that cannot name a job (it would break the key layout or the hash tag)."""


def validate_job_id(job_id: str) -> str:
    """Return ``job_id`` if it is usable, else raise :class:`InvalidJobIdError`.

    A job id is 1-128 characters of letters, digits, ``.``, ``_`` and ``-``, starting with a
    letter or digit: no braces (they would break the hash tag), colons or spaces.
    """
    if not isinstance(job_id, str) or not _JOB_ID_RE.match(job_id):
        raise InvalidJobIdError(
            f"invalid job id {job_id!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return job_id


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
        """Set: the names of the job's log streams (one per node)."""
        return self._k("logs")

    def logs(self, node_id: str) -> str:
        """Stream: the log lines of one node's workers (a ``rank`` field in each entry)."""
        return self._k(f"logs:{node_id}")

    @property
    def resources(self) -> str:
        """Hash: global rank -> the latest resource sample of that worker (JSON)."""
        return self._k("resources")

    # -- rendezvous --------------------------------------------------------------------
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
        """SCAN patterns that together match every key of the job (for clean-up)."""
        return [self.prefix.replace("{", "\\{").replace("}", "\\}") + "*"]


# -- events ------------------------------------------------------------------------------

class EventType:
    """Every event type on a job's event stream, with its documented fields."""

    NODE_JOINED = "node_joined"  # node, host, round
    NODE_LEFT = "node_left"  # node, host, reason
    NODE_LOST = "node_lost"  # node, host, last_heartbeat_ms
    RENDEZVOUS_COMPLETE = "rendezvous_complete"  # round, world_size, nodes[{node,host,group_rank}]
    WORKERS_STARTED = "workers_started"  # ranks[], pids[], restart_count, attempt
    WORKER_EXITED = "worker_exited"  # rank, local_rank, exit_code, signal, message, error_file
    GROUP_FAILED = "group_failed"  # root_cause{...}, failures[]
    RESTARTING = "restarting"  # reason (failure|membership|command), restarts_used, max_restarts
    WORKERS_STOPPED = "workers_stopped"  # ranks[], reason
    JOB_SUCCEEDED = "job_succeeded"
    JOB_FAILED = "job_failed"  # root_cause{...}, restarts_used
    JOB_STOPPED = "job_stopped"  # command_id, issuer
    COMMAND_ACK = "command_ack"  # command_id, status (accepted|rejected|done), reason
    LOGS_DROPPED = "logs_dropped"  # count (lines lost to a full outage buffer)

    ALL = frozenset(
        {
            NODE_JOINED, NODE_LEFT, NODE_LOST, RENDEZVOUS_COMPLETE, WORKERS_STARTED,
            WORKER_EXITED, GROUP_FAILED, RESTARTING, WORKERS_STOPPED, JOB_SUCCEEDED,
            JOB_FAILED, JOB_STOPPED, COMMAND_ACK, LOGS_DROPPED,
        }
    )


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
    return {
        "v": str(PROTOCOL_VERSION),
        "type": event_type,
        "node": node,
        "seq": str(seq),
        "data": json.dumps(dict(data or {}), separators=(",", ":"), default=str),
    }


def decode_event(entry_id: str | bytes, fields: Mapping[Any, Any]) -> Event | None:
    """Decode an event entry; ``None`` for a malformed one or an unknown type."""
    f = _strs(fields)
    try:
        version = int(f.get("v", ""))
        event_type = f["type"]
        data = json.loads(f.get("data", "{}"))
        seq = int(f.get("seq", "0"))
    except (KeyError, ValueError):
        return None
    if event_type not in EventType.ALL or not isinstance(data, dict):
        return None
    return Event(event_type, f.get("node", ""), data, _str(entry_id), version, seq)


# -- log batches ------------------------------------------------------------------------

STDOUT = "out"
STDERR = "err"


@dataclass(frozen=True)
class LogBatch:
    """Consecutive lines of one worker's stdout or stderr.

    ``seq`` numbers a worker's batches within an attempt, so a reader can drop the
    duplicate a retried XADD may write (Redis 7 has no idempotent XADD).
    """

    node: str
    rank: int
    local_rank: int
    attempt: int
    stream: str  # STDOUT or STDERR
    seq: int
    lines: list[str]
    id: str = ""

    @property
    def server_ms(self) -> int:
        return stream_id_ms(self.id)


def encode_log_batch(batch: LogBatch) -> dict[str, str]:
    """Encode a batch as stream fields; lines are joined with newlines (a line has none)."""
    return {
        "v": str(PROTOCOL_VERSION),
        "node": batch.node,
        "rank": str(batch.rank),
        "lrank": str(batch.local_rank),
        "attempt": str(batch.attempt),
        "s": batch.stream,
        "seq": str(batch.seq),
        "lines": "\n".join(batch.lines),
    }


def decode_log_batch(entry_id: str | bytes, fields: Mapping[Any, Any]) -> LogBatch | None:
    """Decode a log entry; ``None`` for a malformed one."""
    if b"lines" in fields:
        # A reply as redis-py gives it without decode_responses (the console, 50k lines/s):
        # look fields up as bytes and decode only the two text ones (int() takes bytes).
        get = fields.get
        try:
            stream = _LOG_STREAMS.get(get(b"s"))  # type: ignore[arg-type]
            if stream is None:
                return None
            return LogBatch(
                node=fields[b"node"].decode("utf-8", "replace"),
                rank=int(fields[b"rank"]),
                local_rank=int(get(b"lrank", -1)),
                attempt=int(get(b"attempt", 0)),
                stream=stream,
                seq=int(get(b"seq", 0)),
                lines=fields[b"lines"].decode("utf-8", "replace").split("\n"),
                id=_str(entry_id),
            )
        except (KeyError, ValueError, TypeError, AttributeError):
            return None
    f = _strs(fields)
    try:
        stream = f["s"]
        if stream not in (STDOUT, STDERR):
            return None
        return LogBatch(
            node=f["node"],
            rank=int(f["rank"]),
            local_rank=int(f.get("lrank", "-1")),
            attempt=int(f.get("attempt", "0")),
            stream=stream,
            seq=int(f.get("seq", "0")),
            lines=f["lines"].split("\n"),
            id=_str(entry_id),
        )
    except (KeyError, ValueError):
        return None


_LOG_STREAMS = {STDOUT.encode(): STDOUT, STDERR.encode(): STDERR}


# -- commands ---------------------------------------------------------------------------

class CommandType:
    STOP = "stop"  # graceful, job-wide
    RESTART = "restart"  # the whole worker group, job-wide, not counted against max restarts
    SIGNAL = "signal"  # args: {"rank": R, "signal": "SIGTERM"|"SIGKILL"}

    ALL = frozenset({STOP, RESTART, SIGNAL})


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

    Agents ack a malformed command as rejected, so the reason must be reportable.
    """
    f = _strs(fields)
    if "id" not in f:
        return "command has no id"
    try:
        args = json.loads(f.get("args", "{}"))
    except ValueError:
        return "command args are not JSON"
    if not isinstance(args, dict):
        return "command args are not an object"
    command_type = f.get("type", "")
    if command_type not in CommandType.ALL:
        return f"unknown command type {command_type!r}"
    return Command(
        id=f["id"],
        type=command_type,
        issuer=f.get("issuer", "?"),
        target=f.get("target", "job"),
        args=args,
        entry_id=_str(entry_id),
    )


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

    def encode(self) -> str:
        return json.dumps(
            {"node": self.node, "host": self.host, "addr": self.addr, "port": self.port,
             "pid": self.pid, "nproc": self.nproc},
            separators=(",", ":"),
        )

    @staticmethod
    def decode(raw: str | bytes) -> NodeDescription:
        d = json.loads(raw)
        return NodeDescription(d["node"], d["host"], d["addr"], int(d["port"]), int(d["pid"]),
                               int(d.get("nproc", 0)))


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
        d = json.loads(raw)
        return RoundInfo(int(d["round"]), int(d["world_size"]), list(d["nodes"]),
                         int(d["completed_ms"]))


# -- helpers ----------------------------------------------------------------------------

def stream_id_ms(entry_id: str) -> int:
    """The millisecond (Redis server time) part of a stream id; 0 if there is none."""
    try:
        return int(entry_id.split("-", 1)[0])
    except (ValueError, AttributeError):
        return 0


def _str(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _strs(fields: Mapping[Any, Any]) -> dict[str, str]:
    return {_str(k): _str(v) for k, v in fields.items()}
