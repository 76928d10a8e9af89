"""Every Redis key of a job: the one module of the code base that spells a key.

Keys
    Every coordination key of a job is ``elastic:{JOB}:...``. The braces are a Redis Cluster
    hash tag: a job's coordination lives in one slot, so multi-key Lua scripts and MULTI work
    on a cluster. Its log streams, the bulk bytes, are ``elastic:log:{JOB/TAG}:NODE``, spread
    over :data:`LOG_SHARDS` other slots and listed in the job's ``logs`` set. The one key
    outside a job is the job index, ``elastic:jobs``.

A job id names its keys, so it is checked here (:func:`validate_job_id`) before any key is
built; the default retention of each stream sits beside it. What the keys hold is in the
record modules (see :mod:`.protocol`).
"""

from __future__ import annotations

import binascii
import functools
import re
import zlib
from dataclasses import dataclass
from typing import Any

from .protocol import MAX_NAME_CHARS

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
#: Collective replies (one entry per rank and request, each up to ``MAX_TRACE_BYTES``).
COLLECTIVES_MAXLEN = 10_000


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
        XREAD when it starts following another stream (coordination/transport/stream_mux.py)."""
        return self._k(f"wake:{node_id}")

    @property
    def resources(self) -> str:
        """Hash: global rank -> the latest resource sample of that worker (JSON)."""
        return self._k("resources")

    @property
    def metrics(self) -> str:
        """Stream: the training metrics read from the workers' output, one entry per node and
        interval (``encode_metrics_entry``), trimmed ``MAXLEN ~``."""
        return self._k("metrics")

    @property
    def metrics_history(self) -> str:
        """Hash: series name (``rank0/loss``, ``median/loss``, ``min/loss``, ``max/loss``) ->
        ``Series.encode()``: the whole run's curves, written by group rank 0's agent."""
        return self._k("metrics:history")

    @property
    def metrics_steps(self) -> str:
        """Hash: round -> the highest step any rank named in that round (a decimal), raised
        by each node in its metrics script call; rounds beyond the newest 79 or 80 fold into
        the field ``base`` (the highest of them). Read by the claimer of a round's restart:
        "no progress" by steps (supervision/diagnosis/restart_patterns.py)."""
        return self._k("metrics:steps")

    def metrics_latest(self, name: str, round_: int) -> str:
        """Sorted set: global rank -> that rank's latest finite value of metric ``name`` (a
        name as ``metric_records.NAME_RE`` allows) in round ``round_``, written by each node
        with its points (ZADD of its own ranks), read by the host of global rank 0 by index
        (min, median, max: O(log N)). One per round, so that ranks of an earlier, larger
        round never count; each expires 30 s after its last write."""
        return self._k(f"metrics:latest:{int(round_)}:{name}")

    @property
    def host_proof(self) -> str:
        """String: written by the agent that hosts the job's Redis under SLURM, a value
        derived from the job's secret; the other nodes read it before they write anything,
        so a server that does not know the secret is never taken for the job's
        (supervision/hosting/slurm_redis.py)."""
        return self._k("host_proof")

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

    def store_queue(self, namespace: str, queue: str) -> str:
        """List: one queue of a store namespace (``queue_push``/``queue_pop``), oldest first.
        The namespace's length comes first so that no (namespace, queue) pair names the key of
        another, whatever either holds; ``store-queue:`` is no ``store:`` key either."""
        return self._k(f"store-queue:{len(namespace)}:{namespace}:{queue}")

    def all_key_patterns(self) -> list[str]:
        """SCAN patterns that together match every key in the job's slot (for clean-up): all
        but its log streams (:meth:`logs`), which the :attr:`log_streams` set lists (a SCAN
        for them would walk every key of every master)."""
        return [self.prefix.replace("{", "\\{").replace("}", "\\}") + "*"]
