"""The records of a job's event stream (``JobKeys.events``): every event type and its fields.

Agents write events (what happened to the job, a node, a round, a rank); consoles and other
agents read them. A reader skips an event of a type or version it does not know.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .protocol import (
    MAX_NAME_CHARS,
    PROTOCOL_VERSION,
    ProtocolError,
    _str,
    _strs,
    decode_json,
    record_version,
    stream_id_ms,
)

#: The most event data a reader decodes; ``encode_event`` cuts an event's data to fit.
MAX_EVENT_DATA_BYTES = 1024 * 1024


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
    # were captured (coordination/wire/collectives.py, issue 22)
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
    # rank, step, metric, value ("nan", "inf" or "-inf"), node, host, attempt (the round),
    # policy (observe|stop): the first non-finite value a rank printed in an attempt, read
    # from its output (supervision/diagnosis/metrics.py); one per rank and attempt
    NAN = "nan"

    ALL = frozenset(
        {
            NODE_JOINED, NODE_LEFT, NODE_LOST, RENDEZVOUS_COMPLETE, WORKERS_STARTED,
            WORKER_EXITED, GROUP_FAILED, RESTARTING, WORKERS_STOPPED, JOB_SUCCEEDED,
            JOB_FAILED, JOB_STOPPED, COMMAND_ACK, LOGS_DROPPED, REDIS_STOPPING,
            WORKER_TIMER_EXPIRED, STALLED, RESTART_STORM, SUSPECT_NODE, NO_PROGRESS,
            NODE_EXCLUDED, JOB_REQUEUED, STRAGGLER, NAN,
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
