"""Elastic rendezvous native to Redis, with the contract of torch's ``RendezvousHandler``.

No torch here: ``torch_compat`` wraps :class:`RedisRendezvous` in torch's ABC.

The protocol
    A job has one rendezvous state (``JobKeys.rdzv_*``) changed only by Lua scripts, so
    every transition is atomic and timed by Redis server time. Rounds are numbered from 0.

    * A node joins the open round. Once ``min_nodes`` have joined, a last-call window of
      ``last_call_timeout`` admits more; reaching ``max_nodes`` completes the round at once.
      A later round (re-forming after a failure or a membership change) also completes as
      soon as every live node of the job has joined, since nobody else can come.
    * Completion assigns group ranks 0..N-1. A node that was in the previous round keeps its
      rank when that rank still fits; the others fill the gaps in join order. Group rank 0's
      address and the free port it picked at join time become MASTER_ADDR/MASTER_PORT.
    * A node that arrives after completion waits (``num_nodes_waiting`` counts it while the
      round has room; beyond ``max_nodes`` it waits as a spare). A member of the completed
      round that calls ``next_rendezvous`` again opens the next round.
    * Every node heartbeats into a sorted set scored with server time. A node whose
      heartbeats stop for ``heartbeat_timeout`` is lost: it is dropped from an open round and
      counted by ``num_nodes_waiting`` of a completed one, so the survivors re-form
      (torch's own handler never notices this, pytorch #111646).
    * ``set_closed`` closes the job's rendezvous for everyone; ``shutdown`` only leaves.

    Waiters are woken by a notify stream that every script appends to (XREAD BLOCK from the
    id the script returned, so no wake-up is lost); time-based transitions (last-call
    deadline, a heartbeat expiring) are handled by blocking exactly until the earliest one.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import redis

from . import protocol
from .connection import Endpoint, explain_error, make_client, parse_endpoint
from .ports import free_port
from .pressure import OOM, is_oom
from .protocol import JobKeys, NodeDescription, RoundInfo

log = logging.getLogger(__name__)

BACKEND = "redis"

#: Longest single XREAD BLOCK; waits longer than this loop (the socket timeout is set past it).
_BLOCK_CHUNK_MS = 30_000


class RendezvousError(Exception):
    """Base of the rendezvous errors (torch_compat maps them to torch's classes)."""


class RendezvousClosedError(RendezvousError):
    """The job's rendezvous was closed: no new round can start."""


class RendezvousTimeoutError(RendezvousError):
    """The rendezvous did not complete within ``join_timeout``."""


class RendezvousConnectionError(RendezvousError):
    """Redis could not be reached."""


class RendezvousOutOfMemoryError(RendezvousConnectionError):
    """Redis refused a write for lack of memory (``maxmemory``): an outage that ends when
    memory is freed; ``pressure.OOM`` has reported it already."""


@dataclass(frozen=True)
class RendezvousSettings:
    """Tunables, with their ``--rdzv-conf`` names. Times in seconds."""

    min_nodes: int = 1
    max_nodes: int = 1
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    heartbeat_timeout: float = 10.0
    keep_alive_interval: float = 2.0

    def __post_init__(self) -> None:
        if self.min_nodes < 1:
            raise ValueError(f"min nodes must be at least 1, not {self.min_nodes}")
        if self.max_nodes < self.min_nodes:
            raise ValueError(
                f"max nodes ({self.max_nodes}) must be at least min nodes ({self.min_nodes})"
            )
        for name in ("join_timeout", "last_call_timeout", "heartbeat_timeout",
                     "keep_alive_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive number of seconds")
        if self.keep_alive_interval >= self.heartbeat_timeout:
            raise ValueError(
                f"keep_alive_interval ({self.keep_alive_interval} s) must be shorter than "
                f"heartbeat_timeout ({self.heartbeat_timeout} s)"
            )


@dataclass(frozen=True)
class RendezvousResult:
    """What a completed round means for this node."""

    round: int
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    info: RoundInfo


@dataclass(frozen=True)
class RendezvousProgress:
    """A snapshot while waiting, for progress displays."""

    round: int
    status: str  # "open", "waiting" (round complete without us) or "complete"
    joined: list[str]
    min_nodes: int
    max_nodes: int
    last_call_left: float | None  # seconds left in the last call, if it is running
    join_left: float  # seconds left before join_timeout
    missing: list[str] = field(default_factory=list)  # previous round's nodes not yet back


@dataclass(frozen=True)
class Membership:
    """The job's rendezvous as a whole, read atomically at one server time."""

    round: int
    status: str
    closed: bool
    members: list[str]  # current round (open: joined so far; complete: by group rank)
    live: list[str]
    lost: list[str]  # members of the completed round whose heartbeats stopped
    left: list[str]  # members of the completed round that left on their own
    waiting: list[str]
    now_ms: int

    @property
    def whole(self) -> bool:
        return self.status == "complete" and not self.lost and not self.left


# -- Lua --------------------------------------------------------------------------------
# KEYS: 1 state, 2 members, 3 waiting, 4 ranks, 5 round_info, 6 nodes, 7 heartbeats,
#       8 left, 9 notify, 10 lost, 11 joins
_PRELUDE = """
local K_STATE, K_MEMBERS, K_WAITING, K_RANKS = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local K_ROUND, K_NODES, K_HB, K_LEFT, K_NOTIFY, K_LOST = KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local K_JOINS = KEYS[11]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function notify(kind)
  return redis.call('XADD', K_NOTIFY, 'MAXLEN', '~', 1000, '*', 'e', kind)
end

local function last_id(key)
  local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
  if #last == 0 then return '0-0' end
  return last[1][1]
end

local function last_notify_id()
  return last_id(K_NOTIFY)
end

-- Joins and leaves wake only progress displays: waking every waiter on every join would
-- cost O(N^2) script calls for N nodes.
local function note_join(kind, node)
  redis.call('XADD', K_JOINS, 'MAXLEN', '~', 1000, '*', 'e', kind, 'node', node,
             'n', redis.call('ZCARD', K_MEMBERS))
end

local function set_deadline(value)
  if tonumber(redis.call('HGET', K_STATE, 'deadline')) ~= value then
    redis.call('HSET', K_STATE, 'deadline', value)
    notify('deadline')
  end
end

-- floor: the round a caller wants at least. A state lost with its Redis (a restart without
-- persistence, FLUSHALL) starts again there, never at 0: round numbers name attempts.
local function state(floor)
  local s = redis.call('HMGET', K_STATE, 'round', 'status', 'closed', 'deadline')
  if not s[1] then
    floor = floor or 0
    redis.call('HSET', K_STATE, 'round', floor, 'status', 'open', 'closed', 0, 'deadline', 0,
               'seq', 0)
    return floor, 'open', false, 0
  end
  return tonumber(s[1]), s[2], s[3] == '1', tonumber(s[4])
end

-- Drop members of an open round whose heartbeats stopped; they are not coming back.
local function purge_open(now, hbt)
  local stale = redis.call('ZRANGEBYSCORE', K_HB, '-inf', '(' .. (now - hbt))
  local dropped = 0
  for _, n in ipairs(stale) do
    dropped = dropped + redis.call('ZREM', K_MEMBERS, n)
  end
  return dropped
end

local function complete(round, now)
  local members = redis.call('ZRANGE', K_MEMBERS, 0, -1)
  local n = #members
  local old = {}
  local taken = {}
  local assigned = {}
  -- A static node (--rdzv-backend static) asked for its rank: it gets it, first come.
  for _, m in ipairs(members) do
    local ok, d = pcall(cjson.decode, redis.call('HGET', K_NODES, m) or '')
    local r = ok and type(d) == 'table' and d['node_rank']
    if type(r) == 'number' and r >= 0 and r < n and r == math.floor(r) and not taken[r] then
      assigned[m] = r; taken[r] = true
    end
  end
  for _, m in ipairs(members) do
    local r = assigned[m] == nil and redis.call('HGET', K_RANKS, m)
    if r then
      r = tonumber(r)
      if r < n and not taken[r] then assigned[m] = r; taken[r] = true end
    end
  end
  local nxt = 0
  for _, m in ipairs(members) do
    if assigned[m] == nil then
      while taken[nxt] do nxt = nxt + 1 end
      assigned[m] = nxt; taken[nxt] = true
    end
  end
  redis.call('DEL', K_RANKS, K_LEFT, K_LOST)
  local nodes = {}
  for _, m in ipairs(members) do
    redis.call('HSET', K_RANKS, m, assigned[m])
    local d = cjson.decode(redis.call('HGET', K_NODES, m))
    d['group_rank'] = assigned[m]
    nodes[assigned[m] + 1] = d
  end
  redis.call('SET', K_ROUND, cjson.encode({round = round, world_size = n, nodes = nodes,
                                          completed_ms = now}))
  redis.call('HSET', K_STATE, 'status', 'complete', 'deadline', 0)
  redis.call('DEL', K_WAITING)
end

-- Complete the open round if its conditions hold now. Returns true if it completed.
local function maybe_complete(round, now, min, max, last_call, hbt)
  local n = redis.call('ZCARD', K_MEMBERS)
  local deadline = tonumber(redis.call('HGET', K_STATE, 'deadline'))
  if n < min then
    set_deadline(0)
    return false
  end
  if n >= max then complete(round, now); return true end
  if round > 0 then
    -- Re-forming: once every live node has joined nobody else can come; don't wait.
    local live = redis.call('ZCOUNT', K_HB, now - hbt, '+inf')
    if n >= live then complete(round, now); return true end
  end
  if deadline == 0 then
    set_deadline(now + last_call)
    return false
  end
  if now >= deadline then complete(round, now); return true end
  return false
end

-- The earliest server time at which a time-based transition may happen.
local function next_wake(now, hbt)
  local wake = now + 3600000
  local deadline = tonumber(redis.call('HGET', K_STATE, 'deadline'))
  if deadline and deadline > 0 and deadline < wake then wake = deadline end
  local first = redis.call('ZRANGEBYSCORE', K_HB, now - hbt, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if #first > 0 then
    local exp = tonumber(first[2]) + hbt + 1
    if exp < wake then wake = exp end
  end
  return wake
end
"""

# ARGV: node, description json, min, max, last_call_ms, hbt_ms, want_round
# Returns {status, round, now, wake, notify_id, payload, joins_id}
_JOIN = _PRELUDE + """
local node, desc = ARGV[1], ARGV[2]
local min, max = tonumber(ARGV[3]), tonumber(ARGV[4])
local last_call, hbt, want = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local now = now_ms()
local round, status, closed = state(want)
if closed then return {'closed', round, now, 0, last_notify_id(), '', '0-0'} end
redis.call('ZADD', K_HB, now, node)
redis.call('HSET', K_NODES, node, desc)

if status == 'complete' then
  local mine = redis.call('HGET', K_RANKS, node)
  if mine and want <= round then
    return {'complete', round, now, 0, last_notify_id(), redis.call('GET', K_ROUND), '0-0'}
  end
  if mine then
    -- A member of the completed round asks for a new one: open it.
    round = round + 1
    redis.call('HSET', K_STATE, 'round', round, 'status', 'open', 'deadline', 0)
    redis.call('DEL', K_MEMBERS, K_WAITING)
    notify('open')
  else
    if redis.call('ZSCORE', K_WAITING, node) == false then
      redis.call('ZADD', K_WAITING, redis.call('HINCRBY', K_STATE, 'wseq', 1), node)
      note_join('waiting', node)
    end
    return {'waiting', round, now, next_wake(now, hbt), last_notify_id(), '', last_id(K_JOINS)}
  end
end

purge_open(now, hbt)
if redis.call('ZSCORE', K_MEMBERS, node) == false then
  redis.call('ZADD', K_MEMBERS, redis.call('HINCRBY', K_STATE, 'seq', 1), node)
  note_join('joined', node)
end
if maybe_complete(round, now, min, max, last_call, hbt) then
  local id = notify('complete')
  return {'complete', round, now, 0, id, redis.call('GET', K_ROUND), '0-0'}
end
local members = redis.call('ZRANGE', K_MEMBERS, 0, -1)
local deadline = tonumber(redis.call('HGET', K_STATE, 'deadline'))
return {'open', round, now, next_wake(now, hbt), last_notify_id(),
        cjson.encode({members = members, deadline = deadline}), last_id(K_JOINS)}
"""

# ARGV: node, its description, the round it runs in (JSON as completed, '' before any).
# Returns {now, restored}. A node that finds the rendezvous gone while it runs a round puts
# that round back as it was (every member keeps the same copy, so the first to beat wins and
# the rest find it there), with a fresh heartbeat for every member: they are running, and
# would otherwise all look lost at once.
_HEARTBEAT = _PRELUDE + """
local node, desc, round_json = ARGV[1], ARGV[2], ARGV[3]
local now = now_ms()
local restored = 0
if round_json ~= '' and redis.call('EXISTS', K_STATE) == 0 then
  local r = cjson.decode(round_json)
  redis.call('DEL', K_RANKS, K_MEMBERS, K_WAITING, K_LEFT, K_LOST)
  for _, n in ipairs(r['nodes']) do
    redis.call('HSET', K_RANKS, n['node'], n['group_rank'])
    redis.call('ZADD', K_MEMBERS, n['group_rank'], n['node'])
    redis.call('ZADD', K_HB, now, n['node'])
    local d = {}
    for k, v in pairs(n) do if k ~= 'group_rank' then d[k] = v end end
    redis.call('HSETNX', K_NODES, n['node'], cjson.encode(d))
  end
  redis.call('SET', K_ROUND, round_json)
  redis.call('HSET', K_STATE, 'round', r['round'], 'status', 'complete', 'closed', 0,
             'deadline', 0, 'seq', #r['nodes'])
  restored = 1
end
if desc ~= '' then redis.call('HSETNX', K_NODES, node, desc) end
redis.call('ZADD', K_HB, now, node)
return {now, restored}
"""

# ARGV: node, min
_LEAVE = _PRELUDE + """
local node = ARGV[1]
local round, status = state()
redis.call('ZREM', K_HB, node)
redis.call('ZREM', K_WAITING, node)
if status == 'open' then
  redis.call('ZREM', K_MEMBERS, node)
  if redis.call('ZCARD', K_MEMBERS) < tonumber(ARGV[2]) then set_deadline(0) end
elseif redis.call('HEXISTS', K_RANKS, node) == 1 then
  redis.call('SADD', K_LEFT, node)
end
note_join('left', node)
notify('left')
return 1
"""

_CLOSE = _PRELUDE + """
state()
redis.call('HSET', K_STATE, 'closed', 1)
notify('closed')
return 1
"""

# ARGV: hbt_ms, mark. With mark, records lost members and returns those newly recorded,
# so one caller across the job reports each.
_MEMBERSHIP = _PRELUDE + """
local hbt, mark = tonumber(ARGV[1]), ARGV[2] == '1'

local now = now_ms()
if redis.call('EXISTS', K_STATE) == 0 then
  -- Lost with its Redis: say so, and leave it to a member's heartbeat to put the round back
  -- (creating a fresh round 0 here would stop it from ever being restored).
  return cjson.encode({round = 0, status = 'gone', closed = false, members = {}, live = {},
    lost = {}, newly_lost = {}, left = {}, waiting = {}, now = now})
end
local round, status, closed = state()
local members, lost, newly = {}, {}, {}
if status == 'complete' then
  local ranks = redis.call('HGETALL', K_RANKS)
  for i = 1, #ranks, 2 do members[tonumber(ranks[i + 1]) + 1] = ranks[i] end
  for _, m in ipairs(members) do
    local s = redis.call('ZSCORE', K_HB, m)
    local is_left = redis.call('SISMEMBER', K_LEFT, m) == 1
    if (not s or tonumber(s) < now - hbt) and not is_left then
      table.insert(lost, m)
      if mark and redis.call('SADD', K_LOST, m) == 1 then table.insert(newly, m) end
    end
  end
else
  members = redis.call('ZRANGE', K_MEMBERS, 0, -1)
end
local live = redis.call('ZRANGEBYSCORE', K_HB, now - hbt, '+inf')
return cjson.encode({round = round, status = status, closed = closed, members = members,
  live = live, lost = lost, newly_lost = newly, left = redis.call('SMEMBERS', K_LEFT),
  waiting = redis.call('ZRANGE', K_WAITING, 0, -1), now = now})
"""


def _decode_list(value: Any) -> list[str]:
    # cjson encodes an empty Lua table as {}: treat any non-list as empty.
    return [str(x) for x in value] if isinstance(value, list) else []


class RedisRendezvous:
    """One node's handle on a job's rendezvous. Thread-safe for the calls torch makes.

    ``next_rendezvous`` blocks until a round including this node completes and returns its
    group rank; it raises :class:`RendezvousClosedError` if the job's rendezvous is closed
    and :class:`RendezvousTimeoutError` after ``join_timeout``. Heartbeats start with the
    first join and stop with :meth:`shutdown`.
    """

    def __init__(
        self,
        endpoint: Endpoint | str | None,
        job_id: str,
        settings: RendezvousSettings | None = None,
        *,
        local_addr: str | None = None,
        node_id: str | None = None,
        nproc: int = 0,
        node_rank: int | None = None,
        client: redis.Redis | None = None,
        reader: redis.Redis | None = None,
    ) -> None:
        self.endpoint = endpoint if isinstance(endpoint, Endpoint) else parse_endpoint(endpoint)
        self.job_id = protocol.validate_job_id(job_id)
        self.keys = JobKeys(job_id)
        self.settings = settings or RendezvousSettings()
        self.host = socket.gethostname()
        self.local_addr = local_addr or _default_addr()
        self.node_id = node_id or f"{self.host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.nproc = nproc
        #: The group rank asked for (a static rendezvous); the round still decides.
        self.node_rank = node_rank
        self._client = client or make_client(self.endpoint)
        self._reader = reader or make_client(self.endpoint, blocking_ms=_BLOCK_CHUNK_MS)
        self._owns_clients = client is None
        c = self._client
        self._join = c.register_script(_JOIN)
        self._heartbeat = c.register_script(_HEARTBEAT)
        self._leave = c.register_script(_LEAVE)
        self._close = c.register_script(_CLOSE)
        self._membership = c.register_script(_MEMBERSHIP)
        self._last_round: int | None = None  # the last round this node completed
        # That round as Redis completed it, and this node's description: what a heartbeat puts
        # back if Redis comes back empty.
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
        self._stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- keys ---------------------------------------------------------------------------
    @property
    def _keys(self) -> list[str]:
        k = self.keys
        return [k.rdzv_state, k.rdzv_members, k.rdzv_waiting, k.rdzv_ranks, k.rdzv_round_info,
                k.rdzv_nodes, k.rdzv_heartbeats, k.rdzv_left, k.rdzv_notify, k.rdzv_lost,
                k.rdzv_joins]

    @contextlib.contextmanager
    def _redis_errors(self) -> Iterator[None]:
        """Redis's errors as the rendezvous's: an outage is a RendezvousConnectionError, a
        write refused at maxmemory a RendezvousOutOfMemoryError (retried as an outage: a
        script is checked for memory at its first write, so a refused one changed nothing)."""
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise RendezvousConnectionError(str(explain_error(exc, self.endpoint.display))) from None
        except redis.ResponseError as exc:
            if not is_oom(exc):
                raise
            OOM.refused()
            raise RendezvousOutOfMemoryError(
                str(explain_error(exc, self.endpoint.display))) from None

    def _call(self, script: Any, args: list[Any]) -> Any:
        with self._redis_errors():
            reply = script(keys=self._keys, args=args)
        OOM.accepted()
        return reply

    # -- the handler contract -----------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self.job_id

    @property
    def round(self) -> int | None:
        """The last round this node completed, or None before the first."""
        return self._last_round

    def next_rendezvous(
        self, progress: Callable[[RendezvousProgress], None] | None = None
    ) -> RendezvousResult:
        """Join the next round and block until it completes with this node in it.

        ``progress`` is called whenever the wait changes (members join, the last call
        starts), from this thread.
        """
        s = self.settings
        if self._last_round is None:
            self._register_job()
        self._start_heartbeats()
        want = 0 if self._last_round is None else self._last_round + 1
        desc = NodeDescription(self.node_id, self.host, self.local_addr,
                               free_port(self.local_addr if _bindable(self.local_addr) else ""),
                               os.getpid(), self.nproc, self.node_rank).encode()
        join_deadline = time.monotonic() + s.join_timeout
        last_seen: tuple[Any, ...] = ()
        previous = self._previous_members()
        while True:
            if self._stop.is_set():  # shutdown() from another thread: do not join again
                raise RendezvousClosedError(f"node {self.node_id} left the rendezvous")
            sent = time.monotonic()
            status, rnd, now, wake, notify_id, payload, joins_id = self._call(
                self._join,
                [self.node_id, desc, s.min_nodes, s.max_nodes, int(s.last_call_timeout * 1000),
                 int(s.heartbeat_timeout * 1000), want],
            )
            self.renewed_at = max(self.renewed_at or sent, sent)  # a join beats too
            status = status.decode()
            if status == "closed":
                raise RendezvousClosedError(
                    f"the rendezvous of job {self.job_id!r} is closed; start the job under a "
                    "new --job-id to run it again"
                )
            if status == "complete":
                info = _decode_round(payload)
                rank = info.rank_of(self.node_id)
                if rank is not None:
                    self._last_round = info.round
                    self._round_json, self._desc = payload, desc
                    self._drop_round_store(info.round - 1)
                    addr, port = info.master()
                    return RendezvousResult(info.round, rank, info.world_size, addr, port, info)
                continue  # completed without us (we were purged): join the next one
            left = join_deadline - time.monotonic()
            members: list[str] = []
            deadline_ms = 0
            if status == "open":
                d = json.loads(payload)
                members, deadline_ms = _decode_list(d["members"]), int(d["deadline"])
            if progress is not None and (status, members, deadline_ms) != last_seen:
                last_seen = (status, members, deadline_ms)
                progress(RendezvousProgress(
                    round=int(rnd), status=status, joined=members, min_nodes=s.min_nodes,
                    max_nodes=s.max_nodes,
                    last_call_left=(deadline_ms - int(now)) / 1000 if deadline_ms else None,
                    join_left=max(0.0, left),
                    missing=[m for m in previous if m not in members]))
            if left <= 0:
                raise RendezvousTimeoutError(self._timeout_message(status, members))
            block_ms = max(1, min(int(wake) - int(now), int(left * 1000) + 1, _BLOCK_CHUNK_MS))
            streams = {self.keys.rdzv_notify: notify_id}
            if progress is not None:
                streams[self.keys.rdzv_joins] = joins_id
            self._wait_notify(streams, block_ms)

    def _register_job(self) -> None:
        """List the job in the job index so consoles can find it (first registration wins)."""
        with self._redis_errors():
            secs, micros = self._client.time()
            now_ms = secs * 1000 + micros // 1000
            self._client.hsetnx(self.keys.meta, "created_ms", now_ms)
            self._client.hset(self.keys.meta, mapping={
                "min_nodes": self.settings.min_nodes, "max_nodes": self.settings.max_nodes,
                # Readers call a job lost when no heartbeat is newer than this.
                "heartbeat_timeout_ms": int(self.settings.heartbeat_timeout * 1000),
            })
            # Listed after its meta exists: an index entry without one is a job that expired
            # or was removed, which readers drop from the index (see retention.py).
            self._client.zadd(protocol.JOBS_INDEX, {self.job_id: now_ms}, nx=True)

    def _drop_round_store(self, rnd: int) -> None:
        """Delete round ``rnd``'s store namespace (``r<round>``: the agents' exit barrier,
        torch's own store): only that round's members used it, and they have moved on to a
        newer round or are gone. Without this a job keeps one namespace per round it ran."""
        if rnd < 0:
            return
        ns = f"r{rnd}"
        try:
            self._client.unlink(self.keys.store(ns), self.keys.store_notify(ns))
        except (redis.RedisError, OSError) as exc:  # left to the job's retention then
            log.debug("cannot delete the store of round %d: %s", rnd, exc)

    def _wait_notify(self, streams: dict[str, bytes], block_ms: int) -> None:
        # Any entry means "look again": the join script re-reads the state and returns
        # fresh ids, so nothing read here needs to be kept.
        try:
            self._reader.xread(streams, count=1, block=block_ms)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise RendezvousConnectionError(str(explain_error(exc, self.endpoint.display))) from None

    def _timeout_message(self, status: str, members: list[str]) -> str:
        s = self.settings
        if status == "waiting":
            return (f"rendezvous of job {self.job_id!r} timed out after {s.join_timeout:g} s "
                    "waiting for the running round to end (the job is full or not re-forming)")
        return (f"rendezvous of job {self.job_id!r} timed out after {s.join_timeout:g} s: "
                f"{len(members)} of at least {s.min_nodes} nodes joined"
                + (f" ({', '.join(members)})" if members else "")
                + "; start the missing agents or lower --nnodes")

    def _previous_members(self) -> list[str]:
        if self._last_round is None:
            return []
        try:
            raw = self._client.get(self.keys.rdzv_round_info)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise RendezvousConnectionError(str(explain_error(exc, self.endpoint.display))) from None
        return [n["node"] for n in _decode_round(raw).nodes] if raw else []

    def membership(self) -> Membership:
        """The job's rendezvous now, read atomically."""
        return self._read_membership(mark_lost=False)[0]

    def lost_since_last_check(self) -> tuple[Membership, list[str]]:
        """``membership()`` plus the lost members that this call was first to see.

        Exactly one caller across the job gets each lost node, so it alone reports it.
        A node that cannot judge now (see ``_may_judge``) calls nobody lost: ``lost`` is empty.
        """
        if not self._may_judge():
            m, _ = self._read_membership(mark_lost=False)
            return replace(m, lost=[]), []
        return self._read_membership(mark_lost=True)

    def _may_judge(self) -> bool:
        """Whether this node may call others lost now: not while its own heartbeats are not
        getting through, nor for a heartbeat timeout after they were held up for a while.
        From here an outage of Redis or of the network that cut every node off looks the same
        as this node being cut off alone; when it ends, the others' heartbeats are as stale as
        ours until they have had the time to beat again (and their clients may reconnect
        seconds after ours). A node really gone meanwhile is seen that much later."""
        now, gap = time.monotonic(), self.settings.heartbeat_timeout / 2
        done = self._renewal_done
        return done is not None and now - done <= gap and now >= self._judge_after

    def _read_membership(self, mark_lost: bool) -> tuple[Membership, list[str]]:
        s = self.settings
        raw = self._call(self._membership, [int(s.heartbeat_timeout * 1000), int(mark_lost)])
        d = json.loads(raw)
        m = Membership(
            round=int(d["round"]), status=str(d["status"]), closed=bool(d["closed"]),
            members=_decode_list(d["members"]), live=_decode_list(d["live"]),
            lost=_decode_list(d["lost"]), left=_decode_list(d["left"]),
            waiting=_decode_list(d["waiting"]), now_ms=int(d["now"]),
        )
        return m, _decode_list(d["newly_lost"])

    def num_nodes_waiting(self) -> int:
        """How many nodes want a new round: the agent should re-rendezvous when > 0.

        Counts late arrivals the completed round has room for, members lost or gone, and,
        when a newer round has opened without this node, everyone in it.
        """
        return self.waiting_count(self.membership())

    def waiting_count(self, m: Membership, include_lost: bool = True) -> int:
        """``num_nodes_waiting`` for a membership already read. ``include_lost=False`` ignores
        stale heartbeats (right after a Redis outage every heartbeat looks stale)."""
        mine = self._last_round
        if mine is not None and m.round > mine:
            return max(1, len(m.members))
        if m.status != "complete":
            return len(m.members) if mine is not None else 0
        lost = len(m.lost) if include_lost else 0
        room = max(0, self.settings.max_nodes - len(m.members) + lost + len(m.left))
        return min(len(m.waiting), room) + lost + len(m.left)

    def is_closed(self) -> bool:
        return self._client.hget(self.keys.rdzv_state, "closed") == b"1"

    def set_closed(self) -> None:
        """Close the job's rendezvous for every node: no new round will start."""
        self._call(self._close, [])

    def shutdown(self) -> bool:
        """Leave the rendezvous (the others may re-form without us); stop heartbeats."""
        self._stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        try:
            self._call(self._leave, [self.node_id, self.settings.min_nodes])
        except RendezvousConnectionError as exc:
            log.warning("could not leave the rendezvous cleanly: %s", exc)
            return False
        finally:
            if self._owns_clients:
                self._client.close()
                self._reader.close()
        return True

    @property
    def use_agent_store(self) -> bool:
        # Workers build their own process group store on MASTER_ADDR:MASTER_PORT.
        return False

    # -- heartbeats ---------------------------------------------------------------------
    def heartbeat(self) -> None:
        """Beat; if Redis lost the rendezvous while this node runs a round, put it back and
        list the job again (everything a reader needs of the rendezvous)."""
        sent = time.monotonic()
        _, restored = self._call(self._heartbeat, [self.node_id, self._desc, self._round_json])
        done = time.monotonic()
        if self._renewal_done is not None and done - self._renewal_done > (
                self.settings.heartbeat_timeout / 2):
            self._judge_after = done + self.settings.heartbeat_timeout  # held up: _may_judge
        self.renewed_at = max(self.renewed_at or sent, sent)
        self._renewal_done = done
        if restored:
            self.restorations += 1
            log.warning("Redis lost the rendezvous of job %s; round %s put back", self.job_id,
                        self._last_round)
            self._register_job()

    def _start_heartbeats(self) -> None:
        with self._lock:
            if self._hb_thread is not None:
                return
            self._hb_thread = threading.Thread(
                target=self._heartbeat_loop, name=f"rdzv-heartbeat-{self.job_id}", daemon=True
            )
            self._hb_thread.start()

    def _heartbeat_loop(self) -> None:
        last_error = ""
        while not self._stop.wait(self.settings.keep_alive_interval):
            try:
                self.heartbeat()
                last_error = ""
            except RendezvousOutOfMemoryError:
                last_error = ""  # pressure.OOM reports the episode, for every writer at once
            except Exception as exc:  # this thread must outlive any refusal
                # Keep trying, whatever Redis answers: an outage, or a refusal such as OOM
                # (maxmemory with noeviction) that ends by itself, must not stop the beats and
                # make the node look lost (and freeze its workers) once it is over.
                message = str(exc) if isinstance(exc, RendezvousConnectionError) else (
                    str(explain_error(exc, self.endpoint.display)))
                if message != last_error:  # once per kind of failure, not every interval
                    log.warning("heartbeat failed: %s", message)
                    last_error = message


def _decode_round(raw: Any) -> RoundInfo:
    try:
        return RoundInfo.decode(raw)
    except protocol.ProtocolError as exc:
        raise RendezvousError(f"the rendezvous record is unreadable ({exc}): another writer "
                              "broke the job's keys; start it under a new --job-id") from None


def _default_addr() -> str:
    return socket.getfqdn()


def _bindable(addr: str) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False
