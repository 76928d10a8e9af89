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

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

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
#: How often a waiter with a progress display joins again to refresh it.
_PROGRESS_MS = 5_000


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

    @property
    def held_gap(self) -> float:
        """A node whose own beats were this far apart was held up (an outage, a stalled
        process): it calls nobody lost until the others had a heartbeat timeout to beat again.
        Half the heartbeat timeout, but never within the beats' normal spacing (up to 2.25
        keep-alive intervals: see ``RedisRendezvous._beat_due``), and at most the timeout."""
        return min(self.heartbeat_timeout,
                   max(self.heartbeat_timeout / 2, 2.5 * self.keep_alive_interval))


@dataclass(frozen=True)
class RendezvousResult:
    """What a completed round means for this node: O(1) in the job's size. The whole round
    (every node) is :meth:`RedisRendezvous.round_info`, for the one node that announces it."""

    round: int
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    #: Workers in the round (the nodes' nproc added up); 0 when the nodes did not say.
    total_workers: int = 0
    #: Global rank of this node's local rank 0.
    base_rank: int = 0
    completed_ms: int = 0


@dataclass(frozen=True)
class RendezvousProgress:
    """A snapshot while waiting, for progress displays."""

    round: int
    status: str  # "open", "waiting" (round complete without us) or "complete"
    joined: list[str]  # the members so far while they are few (_NAMES), else empty
    min_nodes: int
    max_nodes: int
    last_call_left: float | None  # seconds left in the last call, if it is running
    join_left: float  # seconds left before join_timeout
    joined_count: int = 0
    #: Members of the previous round not back yet (a count: naming them walks the round).
    missing_count: int = 0


@dataclass(frozen=True)
class Membership:
    """The job's rendezvous, read atomically at one server time.

    A node's loop reads a summary (:meth:`RedisRendezvous.lost_since_last_check`): counts,
    and the lists hold at most ``NAMES`` nodes each (``members`` and ``live`` empty).
    :meth:`RedisRendezvous.membership` reads every list in full."""

    round: int
    status: str
    closed: bool
    members: list[str]  # current round (open: joined so far; complete: by group rank)
    live: list[str]
    lost: list[str]  # members of the completed round whose heartbeats stopped
    left: list[str]  # members of the completed round that left on their own
    waiting: list[str]
    now_ms: int
    member_count: int = -1  # -1: len(members)
    left_count: int = -1
    waiting_count: int = -1
    live_count: int = -1
    is_member: bool | None = None  # the reading node's place in the round (summary only)

    def __post_init__(self) -> None:
        for name, of in (("member_count", "members"), ("left_count", "left"),
                         ("waiting_count", "waiting"), ("live_count", "live")):
            if getattr(self, name) < 0:
                object.__setattr__(self, name, len(getattr(self, of)))

    @property
    def whole(self) -> bool:
        return self.status == "complete" and not self.lost and not self.left_count


#: How many nodes a summary names per list (the rest are counted).
NAMES = 16


# -- Lua --------------------------------------------------------------------------------
# Cost at scale (a job of N nodes): every script a node runs per interval (heartbeat,
# summary) and every join is O(log N) in the job's size, plus the few nodes it names
# (capped at _NAMES). Only ``complete`` walks every member, once per round; the full
# ``membership`` read is for tools and tests, never a node's loop. tests/test_scale_counts.py
# counts this on a real Redis.
#
# KEYS: 1 state, 2 members, 3 waiting, 4 ranks, 5 round_info, 6 nodes, 7 heartbeats,
#       8 left, 9 notify, 10 lost, 11 joins, 12 assign, 13 the job's meta
_PRELUDE = """
local K_STATE, K_MEMBERS, K_WAITING, K_RANKS = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local K_ROUND, K_NODES, K_HB, K_LEFT, K_NOTIFY, K_LOST = KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local K_JOINS, K_ASSIGN, K_META = KEYS[11], KEYS[12], KEYS[13]
local NAMES = 16

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""
# The functions of a round's transitions, for the scripts that make them: defining a dozen
# closures on every call was a tenth of a beat's cost, and a node beats every interval.
_ROUND_FNS = """
local function notify(kind)
  return redis.call('XADD', K_NOTIFY, 'MAXLEN', '~', 1000, '*', 'e', kind)
end

local function last_notify_id()
  local last = redis.call('XREVRANGE', K_NOTIFY, '+', '-', 'COUNT', 1)
  if #last == 0 then return '0-0' end
  return last[1][1]
end

-- Joins and leaves are appended for progress displays (the console); no waiter follows
-- this stream: waking every waiter on every join would cost O(N^2) for N nodes.
local function note_join(kind, node)
  redis.call('XADD', K_JOINS, 'MAXLEN', '~', 1000, '*', 'e', kind, 'node', node,
             'n', redis.call('ZCARD', K_MEMBERS))
end

-- A big round wakes nobody for a new deadline: the join that sets it gets it as its own
-- wake time (next_wake), and whoever joins later gets it too; the earlier waiters need not
-- know, because any one join at or past the deadline completes the round and wakes everyone.
-- Waking them (half the job once min_nodes have joined) cost N/2 joins more per round; they
-- show the last call at their next progress refresh instead. If the node that set it dies
-- meanwhile, the next waiter to wake anyway (a heartbeat expiring, at most heartbeat_timeout
-- away) completes the round. A round of up to NAMES members wakes them: cheap, and the
-- progress of a small job, watched by a person, shows the last call at once.
local function set_deadline(value)
  if tonumber(redis.call('HGET', K_STATE, 'deadline')) ~= value then
    redis.call('HSET', K_STATE, 'deadline', value)
    if redis.call('ZCARD', K_MEMBERS) <= NAMES then notify('deadline') end
  end
end

-- floor: the round a caller wants at least. A state lost with its Redis (a restart without
-- persistence, FLUSHALL) starts again there, never at 0: round numbers name attempts.
local function state(floor)
  local s = redis.call('HMGET', K_STATE, 'round', 'status', 'closed', 'deadline')
  if not s[1] then
    floor = floor or 0
    redis.call('HSET', K_STATE, 'round', floor, 'status', 'open', 'closed', 0, 'deadline', 0,
               'seq', 0, 'back', 0)
    return floor, 'open', false, 0
  end
  return tonumber(s[1]), s[2], s[3] == '1', tonumber(s[4])
end

-- A member of the open round leaves it (dropped or gone): keep the count of previous
-- members that are back right.
local function drop_member(n)
  if redis.call('ZREM', K_MEMBERS, n) == 1 then
    if redis.call('HEXISTS', K_RANKS, n) == 1 then redis.call('HINCRBY', K_STATE, 'back', -1) end
    return 1
  end
  return 0
end

-- Drop nodes whose heartbeats stopped from an open round and from the heartbeats: they
-- are not coming back (one that does beats again). Dropping them from the heartbeats too
-- keeps every later scan from meeting the same dead nodes again. O(log N + stale).
local function purge_open(now, hbt)
  local stale = redis.call('ZRANGEBYSCORE', K_HB, '-inf', '(' .. (now - hbt))
  local dropped = 0
  for _, n in ipairs(stale) do
    dropped = dropped + drop_member(n)
    redis.call('ZREM', K_HB, n)
    redis.call('ZREM', K_WAITING, n)
  end
  return dropped
end

-- The one call that walks every member: once per round, by the join that completes it.
-- Besides the readers' record (rdzv:round) it writes what each node needs of the round in
-- O(1): its assignment (rdzv:assign: "round group_rank base_rank") and the round's head
-- (state field 'head': round, sizes, master address), so no node ever reads the whole round.
local function complete(round, now)
  local members = redis.call('ZRANGE', K_MEMBERS, 0, -1)
  local n = #members
  local descs = {}
  local taken = {}
  local assigned = {}
  for _, m in ipairs(members) do
    local ok, d = pcall(cjson.decode, redis.call('HGET', K_NODES, m) or '')
    if not ok or type(d) ~= 'table' then d = {node = m} end
    descs[m] = d
  end
  -- A static node (--rdzv-backend static) asked for its rank: it gets it, first come.
  for _, m in ipairs(members) do
    local r = descs[m]['node_rank']
    if type(r) == 'number' and r >= 0 and r < n and r == math.floor(r) and not taken[r] then
      assigned[m] = r; taken[r] = true
    end
  end
  for _, m in ipairs(members) do
    local r = assigned[m] == nil and tonumber(redis.call('HGET', K_RANKS, m) or '')
    if r and r < n and not taken[r] then assigned[m] = r; taken[r] = true end
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
    local d = descs[m]
    d['group_rank'] = assigned[m]
    nodes[assigned[m] + 1] = d
  end
  local base, total = 0, 0
  for i = 1, n do
    local p = tonumber(nodes[i]['nproc']) or 0
    redis.call('HSET', K_ASSIGN, nodes[i]['node'], round .. ' ' .. (i - 1) .. ' ' .. base)
    base = base + p
  end
  total = base
  redis.call('SET', K_ROUND, cjson.encode({round = round, world_size = n, nodes = nodes,
                                          completed_ms = now}))
  local head = cjson.encode({round = round, world_size = n, total_workers = total,
    master_addr = nodes[1]['addr'], master_port = nodes[1]['port'], completed_ms = now})
  redis.call('HSET', K_STATE, 'status', 'complete', 'deadline', 0, 'head', head, 'prev_n', n)
  redis.call('DEL', K_WAITING)
  -- Heartbeats of nodes that are not in this round and stopped beating: gone for good.
  redis.call('ZREMRANGEBYSCORE', K_HB, '-inf', '(' .. (now - 3600000))
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

-- What a waiter of the open round shows: counts, and names only while they are few.
local function open_payload()
  local n = redis.call('ZCARD', K_MEMBERS)
  local s = redis.call('HMGET', K_STATE, 'deadline', 'back', 'prev_n')
  local members = {}
  if n <= NAMES then members = redis.call('ZRANGE', K_MEMBERS, 0, -1) end
  return cjson.encode({n = n, members = members, deadline = tonumber(s[1]) or 0,
                       back = tonumber(s[2]) or 0, prev = tonumber(s[3]) or 0})
end
"""

# ARGV: node, description json, min, max, last_call_ms, hbt_ms, want_round, register (1: a
# node's first join registers the job's meta too: its creation time, first write wins, and
# the settings readers need; one round trip fewer before a node waits).
# Returns {status, round, now, wake, notify_id, payload, assignment}: payload is the round's
# head when complete ("round group_rank base_rank" its assignment), open_payload() when open.
_JOIN = _PRELUDE + _ROUND_FNS + """
local node, desc = ARGV[1], ARGV[2]
local min, max = tonumber(ARGV[3]), tonumber(ARGV[4])
local last_call, hbt, want = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local now = now_ms()
if ARGV[8] == '1' then
  redis.call('HSETNX', K_META, 'created_ms', now)
  -- Readers call a job lost when no heartbeat is newer than heartbeat_timeout_ms.
  redis.call('HSET', K_META, 'min_nodes', min, 'max_nodes', max, 'heartbeat_timeout_ms', hbt)
end
local round, status, closed = state(want)
if closed then return {'closed', round, now, 0, last_notify_id(), '', ''} end
redis.call('ZADD', K_HB, now, node)
redis.call('HSET', K_NODES, node, desc)

if status == 'complete' then
  local mine = redis.call('HGET', K_RANKS, node)
  if mine and want <= round then
    return {'complete', round, now, 0, last_notify_id(), redis.call('HGET', K_STATE, 'head'),
            redis.call('HGET', K_ASSIGN, node)}
  end
  if mine then
    -- A member of the completed round asks for a new one: open it.
    round = round + 1
    redis.call('HSET', K_STATE, 'round', round, 'status', 'open', 'deadline', 0, 'back', 0)
    redis.call('DEL', K_MEMBERS, K_WAITING)
    notify('open')
  else
    if redis.call('ZSCORE', K_WAITING, node) == false then
      redis.call('ZADD', K_WAITING, redis.call('HINCRBY', K_STATE, 'wseq', 1), node)
      note_join('waiting', node)
    end
    return {'waiting', round, now, next_wake(now, hbt), last_notify_id(), '', ''}
  end
end

purge_open(now, hbt)
if redis.call('ZSCORE', K_MEMBERS, node) == false then
  redis.call('ZADD', K_MEMBERS, redis.call('HINCRBY', K_STATE, 'seq', 1), node)
  if redis.call('HEXISTS', K_RANKS, node) == 1 then redis.call('HINCRBY', K_STATE, 'back', 1) end
  note_join('joined', node)
end
if maybe_complete(round, now, min, max, last_call, hbt) then
  local id = notify('complete')
  return {'complete', round, now, 0, id, redis.call('HGET', K_STATE, 'head'),
          redis.call('HGET', K_ASSIGN, node)}
end
return {'open', round, now, next_wake(now, hbt), last_notify_id(), open_payload(), ''}
"""

# ARGV: node, its description, the head of the round it runs (JSON as completed, '' before
# any), its assignment there, and the whole round (JSON, group rank 0 only, else '').
# Returns {now, restored}. A node that finds the rendezvous gone while it runs a round puts
# its own part back (every member holds the same head, so the first to beat restores the
# state and the rest add themselves): O(1) per node. Group rank 0 also puts back the
# readers' record and gives every member a fresh heartbeat, so that a member that never
# beats again is seen lost; the rest would otherwise all look lost at once.
# The beat and the summary are functions so that one script can run both: an agent's watch
# loop beats and reads the summary in one call every keep-alive interval (the heartbeat thread
# only beats when that call has not: during a rendezvous, or while the loop is held up). One
# EVALSHA instead of two per node and interval: the call's own cost (a round trip, a script
# started) is most of what either costs Redis.
_BEAT_FN = """
-- Returns restored (1 if this beat put back what Redis had lost); whether the node is a
-- member of the current round when the beat had to find out (nil otherwise); the state as it
-- read it ({round, status, closed}) when it changed nothing (nil otherwise), for a summary in
-- the same script; and need (1: the readers' record of the round is gone and this node holds
-- it, group rank 0: call again with it). full is '1' from the node that holds the round: the
-- round itself (O(N) bytes) is sent only when Redis lost it, never with every beat. The head
-- is decoded only to put it back: the round a node runs is the first word of its assignment.
local function beat(node, desc, head, assign, full, now)
local restored, member, need = 0, nil, 0
local s = redis.call('HMGET', K_STATE, 'round', 'status', 'closed')
if head ~= '' then
  local cur, status = s[1], s[2]
  local mine = tonumber(string.match(assign, '^(%d+) '))
  if not cur or not mine then
    local h = cjson.decode(head)
    mine = h['round']
    if not cur then
      redis.call('DEL', K_RANKS, K_MEMBERS, K_WAITING, K_LEFT, K_LOST)
      redis.call('HSET', K_STATE, 'round', h['round'], 'status', 'complete', 'closed', 0,
                 'deadline', 0, 'seq', h['world_size'], 'back', 0, 'prev_n', h['world_size'],
                 'head', head)
      restored = 1
      cur, status = h['round'], 'complete'
    end
  end
  if tonumber(cur) == mine and status == 'complete' then
    member = redis.call('HEXISTS', K_RANKS, node) == 1
    local rank = tonumber(string.match(assign, '^%d+ (%d+) '))
    if rank and not member then
      redis.call('HSET', K_RANKS, node, rank)
      redis.call('ZADD', K_MEMBERS, rank, node)
      redis.call('HSET', K_ASSIGN, node, assign)
      restored, member = 1, true
    end
    if full ~= '' and redis.call('EXISTS', K_ROUND) == 0 then
      if full == '1' then
        need = 1
      else
        local r = cjson.decode(full)
        for _, n in ipairs(r['nodes']) do
          if redis.call('HSETNX', K_RANKS, n['node'], n['group_rank']) == 1 then
            redis.call('ZADD', K_MEMBERS, n['group_rank'], n['node'])
            redis.call('ZADD', K_HB, now, n['node'])
          end
          local d = {}
          for k, v in pairs(n) do if k ~= 'group_rank' then d[k] = v end end
          redis.call('HSETNX', K_NODES, n['node'], cjson.encode(d))
        end
        redis.call('SET', K_ROUND, full)
        restored = 1
      end
    end
  end
end
-- The node's description was written by its join; it goes back with whatever else was lost.
if desc ~= '' and (restored == 1 or head == '') then redis.call('HSETNX', K_NODES, node, desc) end
redis.call('ZADD', K_HB, now, node)
if restored == 1 then s = nil end
return restored, member, s, need
end
"""
_HEARTBEAT = _PRELUDE + _BEAT_FN + """
local now = now_ms()
local restored, _, _, need = beat(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], now)
return {now, restored, need}
"""

# ARGV: node, min
_LEAVE = _PRELUDE + _ROUND_FNS + """
local node = ARGV[1]
local round, status = state()
redis.call('ZREM', K_HB, node)
redis.call('ZREM', K_WAITING, node)
if status == 'open' then
  drop_member(node)
  if redis.call('ZCARD', K_MEMBERS) < tonumber(ARGV[2]) then set_deadline(0) end
elseif redis.call('HEXISTS', K_RANKS, node) == 1 then
  redis.call('SADD', K_LEFT, node)
end
note_join('left', node)
notify('left')
return 1
"""

_CLOSE = _PRELUDE + _ROUND_FNS + """
state()
redis.call('HSET', K_STATE, 'closed', 1)
notify('closed')
return 1
"""

# The job's rendezvous as one node's loop needs it, in O(log N + the few nodes named).
# ARGV: node, hbt_ms, mark. Lost members are found among the stalest heartbeats (at most
# NAMES a call); a stale heartbeat of a node that is not a member (a waiter or an old member
# that died) is dropped on the way, so the dead are met once. With mark, records lost members
# and returns those newly recorded, so one caller across the job reports each.
_SUMMARY_FN = """
-- member: whether the node is in the complete round, if the caller knows already (a beat in
-- the same script found out), else nil; s: the state ({round, status, closed}) if the caller
-- read it already, else nil. Returns a flat array (cheaper than JSON at both ends): round,
-- status, closed (0/1), n (members), member (0/1), live, lost, newly_lost, left, n_left,
-- waiting, n_waiting, now.
local function summary(node, hbt, mark, now, member, s)
if s == nil then s = redis.call('HMGET', K_STATE, 'round', 'status', 'closed') end
if not s[1] then
  return {0, 'gone', 0, 0, 0, 0, {}, {}, {}, 0, {}, 0, now}
end
local round, status, closed = tonumber(s[1]), s[2], s[3] == '1'
local lost, newly = {}, {}
local n
if status == 'complete' then
  n = redis.call('HLEN', K_RANKS)
  if member == nil then member = redis.call('HEXISTS', K_RANKS, node) == 1 end
  local stale = redis.call('ZRANGEBYSCORE', K_HB, '-inf', '(' .. (now - hbt), 'LIMIT', 0, NAMES)
  for _, m in ipairs(stale) do
    if redis.call('HEXISTS', K_RANKS, m) == 1 then
      if redis.call('SISMEMBER', K_LEFT, m) == 0 then
        table.insert(lost, m)
        if mark and redis.call('SADD', K_LOST, m) == 1 then table.insert(newly, m) end
      end
    elseif mark then
      redis.call('ZREM', K_HB, m)
      redis.call('ZREM', K_WAITING, m)
    end
  end
else
  n = redis.call('ZCARD', K_MEMBERS)
  member = redis.call('ZSCORE', K_MEMBERS, node) ~= false
end
-- The lists are empty nearly always: count first, list only what is there.
local n_left, n_waiting = redis.call('SCARD', K_LEFT), redis.call('ZCARD', K_WAITING)
local left, waiting = {}, {}
if n_left > 0 then left = redis.call('SRANDMEMBER', K_LEFT, NAMES) end
if n_waiting > 0 then waiting = redis.call('ZRANGE', K_WAITING, 0, NAMES - 1) end
return {round, status, closed and 1 or 0, n, member and 1 or 0,
  redis.call('ZCOUNT', K_HB, now - hbt, '+inf'), lost, newly, left, n_left, waiting, n_waiting,
  now}
end
"""
_SUMMARY = _PRELUDE + _SUMMARY_FN + """
return summary(ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1', now_ms())
"""
# ARGV: the beat's five (node, desc, head, assign, full), then the summary's heartbeat timeout
# and mark, then the held gap (ms). Returns {restored, the summary (an array), held, need}.
#
# held (1): this node's own previous beat is older than the held gap (RendezvousSettings:
# half the heartbeat timeout, never within the beats' normal spacing), by Redis's clock, so
# it judges nobody: the call may have been sent before an outage that cut this node off, and
# run only now (a request the client gave up on is still delivered by the kernel when the
# network heals); the others' beats are as stale as this node's was. The client's own check
# (``_may_judge``) cannot see that: it decided before the call was sent.
_BEAT_SUMMARY = _PRELUDE + _BEAT_FN + _SUMMARY_FN + """
local now, hbt, gap = now_ms(), tonumber(ARGV[6]), tonumber(ARGV[8])
local prev = redis.call('ZSCORE', K_HB, ARGV[1])
local held = ARGV[7] == '1' and not (prev and now - tonumber(prev) <= gap)
local restored, member, state, need = beat(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], now)
local mark = ARGV[7] == '1' and not held
return {restored, summary(ARGV[1], hbt, mark, now, member, state), held and 1 or 0, need}
"""

# ARGV: hbt_ms. The whole membership, every list in full: O(N), for tools and tests (a
# node's loop reads _SUMMARY).
_MEMBERSHIP = _PRELUDE + _ROUND_FNS + """
local hbt = tonumber(ARGV[1])

local now = now_ms()
if redis.call('EXISTS', K_STATE) == 0 then
  -- Lost with its Redis: say so, and leave it to a member's heartbeat to put the round back
  -- (creating a fresh round 0 here would stop it from ever being restored).
  return cjson.encode({round = 0, status = 'gone', closed = false, members = {}, live = {},
    lost = {}, left = {}, waiting = {}, now = now})
end
local round, status, closed = state()
local members, lost = {}, {}
if status == 'complete' then
  local ranks = redis.call('HGETALL', K_RANKS)
  for i = 1, #ranks, 2 do members[tonumber(ranks[i + 1]) + 1] = ranks[i] end
  for _, m in ipairs(members) do
    local s = redis.call('ZSCORE', K_HB, m)
    local is_left = redis.call('SISMEMBER', K_LEFT, m) == 1
    if (not s or tonumber(s) < now - hbt) and not is_left then table.insert(lost, m) end
  end
else
  members = redis.call('ZRANGE', K_MEMBERS, 0, -1)
end
local live = redis.call('ZRANGEBYSCORE', K_HB, now - hbt, '+inf')
return cjson.encode({round = round, status = status, closed = closed, members = members,
  live = live, lost = lost, left = redis.call('SMEMBERS', K_LEFT),
  waiting = redis.call('ZRANGE', K_WAITING, 0, -1), now = now})
"""


_SCRIPTS = {"join": _JOIN, "heartbeat": _HEARTBEAT, "leave": _LEAVE, "close": _CLOSE,
            "membership": _MEMBERSHIP, "summary": _SUMMARY, "beat_summary": _BEAT_SUMMARY}
_SHAS = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in _SCRIPTS.items()}

T = TypeVar("T")


def _advance(steps: Generator[Any, Any, Any], reply: Any,
             error: BaseException | None) -> tuple[bool, Any]:
    """Give ``steps`` the last call's reply (or error): (False, the next call) or (True, the
    steps' result)."""
    try:
        return False, (steps.throw(error) if error is not None else steps.send(reply))
    except StopIteration as stop:
        return True, stop.value


def _one(call: tuple[Any, ...]) -> Generator[Any, Any, Any]:
    """Steps of one call."""
    return (yield call)


def _script(name: str, args: list[Any]) -> Generator[Any, Any, Any]:
    """A step: run the rendezvous script ``name`` over the job's keys."""
    try:
        reply = yield from _one(("script", name, args))
    except redis.exceptions.NoScriptError:
        # Redis lost its script cache (a restart, SCRIPT FLUSH, a failover): the text again.
        reply = yield from _one(("eval", name, args))
    OOM.accepted()  # a write went through: a memory refusal, if any, is over
    return reply


def _command(method: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """A step: one plain command, by its redis-py method name."""
    return ("command", method, args, kwargs)


def _decode_list(value: Any) -> list[str]:
    # A script's array reply: bytes each (JSON's, from older scripts: str); anything else is
    # empty (cjson encodes an empty Lua table as {}).
    return [_text(x) for x in value] if isinstance(value, list) else []


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


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
        #: Scripts this handle has run: the first call of each sends its text (EVAL), later
        #: ones its hash. On a fresh Redis, N nodes released together would otherwise each
        #: get NOSCRIPT, load the script and call again: three commands instead of one.
        self._sent: set[str] = set()
        self._last_round: int | None = None  # the last round this node completed
        # What a heartbeat puts back if Redis comes back empty: the round's head, this node's
        # assignment and description, and (group rank 0 only) the whole round.
        self._head: bytes = b""
        self._assign: bytes = b""
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
                k.rdzv_joins, k.rdzv_assign, k.meta]

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

    # -- I/O: the steps below yield what they need; a driver does it ---------------------
    def _drive(self, steps: Generator[Any, Any, T]) -> T:
        """Run ``steps`` with this handle's (synchronous) clients."""
        reply: Any = None
        error: BaseException | None = None
        while True:
            done, call = _advance(steps, reply, error)
            if done:
                return call
            reply, error = None, None
            try:
                with self._redis_errors():
                    reply = self._dispatch(call)
            except (RendezvousConnectionError, redis.RedisError) as exc:
                error = exc  # the steps may handle it (or it comes back out of throw)

    def _dispatch(self, call: tuple[Any, ...]) -> Any:
        """Do ``call`` on this handle's clients (a coroutine when they are asyncio's)."""
        kind = call[0]
        if kind in ("script", "eval"):
            name, keys = call[1], self._keys
            if kind == "eval" or name not in self._sent:
                self._sent.add(name)
                return self._client.eval(_SCRIPTS[name], len(keys), *keys, *call[2])
            # By hash, straight to the client: redis-py's Script object checks what kind of
            # client it runs on at every call, a tenth of a simulated node's CPU in the fleet.
            return self._client.evalsha(_SHAS[name], len(keys), *keys, *call[2])
        if kind == "read":
            return self._reader.xread(call[1], count=1, block=call[2])
        if kind == "pipeline":
            pipe = self._client.pipeline(transaction=False)
            for _, method, args, kwargs in call[1]:
                getattr(pipe, method)(*args, **kwargs)
            return pipe.execute()
        return getattr(self._client, call[1])(*call[2], **call[3])

    def _call(self, name: str, args: list[Any]) -> Any:
        return self._drive(_script(name, args))

    # -- the handler contract -----------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self.job_id

    @property
    def last_round_info(self) -> RoundInfo | None:
        """The whole last round, on group rank 0 only (the node that announces it); None
        elsewhere. No I/O: it was read once when the round completed."""
        if not self._round_json:
            return None
        try:
            return RoundInfo.decode(self._round_json)
        except protocol.ProtocolError:
            return None

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
        return self._drive(self._rendezvous_steps(progress))

    def _rendezvous_steps(self, progress: Callable[[RendezvousProgress], None] | None
                          ) -> Generator[Any, Any, RendezvousResult]:
        s = self.settings
        register = self._last_round is None  # the first join registers the job's meta
        self._start_heartbeats()
        want = 0 if self._last_round is None else self._last_round + 1
        desc = NodeDescription(self.node_id, self.host, self.local_addr,
                               free_port(self.local_addr if _bindable(self.local_addr) else ""),
                               os.getpid(), self.nproc, self.node_rank).encode()
        join_deadline = time.monotonic() + s.join_timeout
        last_seen: tuple[Any, ...] = ()
        while True:
            if self._stop.is_set():  # shutdown() from another thread: do not join again
                raise RendezvousClosedError(f"node {self.node_id} left the rendezvous")
            sent = time.monotonic()
            status, rnd, now, wake, notify_id, payload, assign = yield from _script(
                "join",
                [self.node_id, desc, s.min_nodes, s.max_nodes, int(s.last_call_timeout * 1000),
                 int(s.heartbeat_timeout * 1000), want, int(register)],
            )
            if register:
                # Listed after its meta exists: an index entry without one is a job that
                # expired or was removed, which readers drop (retention.py). The index lives
                # outside the job's hash slot: a command of its own.
                register = False
                yield _command("zadd", protocol.JOBS_INDEX, {self.job_id: int(now)}, nx=True)
            # A join beats too: the heartbeat thread's next beat is due an interval after it,
            # not at its first tick (N nodes released together all beat at once then, in the
            # middle of their forming).
            self.renewed_at = max(self.renewed_at or sent, sent)
            self._renewal_done = time.monotonic()
            status = status.decode()
            if status == "closed":
                raise RendezvousClosedError(
                    f"the rendezvous of job {self.job_id!r} is closed; start the job under a "
                    "new --job-id to run it again"
                )
            if status == "complete":
                if not assign:
                    continue  # completed without us (we were purged): join the next one
                result = _decode_result(payload, assign)
                self._last_round = result.round
                self._head, self._assign, self._desc = payload, assign, desc
                # Group rank 0 alone keeps the whole round (it announces it, and puts it back
                # for readers if Redis comes back empty): one read of O(N) bytes per round.
                self._round_json = b""
                if result.group_rank == 0:
                    self._round_json = (yield _command("get", self.keys.rdzv_round_info)) or b""
                    # One node deletes what the round before left, not N nodes the same keys.
                    yield from self._drop_round_store(result.round - 1)
                return result
            left = join_deadline - time.monotonic()
            members: list[str] = []
            count = missing = 0
            deadline_ms = 0
            if status == "open":
                d = json.loads(payload)
                members, deadline_ms = _decode_list(d["members"]), int(d["deadline"])
                count = int(d["n"])
                if self._last_round is not None:
                    missing = max(0, int(d["prev"]) - int(d["back"]))
            if progress is not None and (status, count, deadline_ms, missing) != last_seen:
                last_seen = (status, count, deadline_ms, missing)
                progress(RendezvousProgress(
                    round=int(rnd), status=status, joined=members, min_nodes=s.min_nodes,
                    max_nodes=s.max_nodes,
                    last_call_left=(deadline_ms - int(now)) / 1000 if deadline_ms else None,
                    join_left=max(0.0, left), joined_count=count, missing_count=missing))
            if left <= 0:
                raise RendezvousTimeoutError(self._timeout_message(status, count, members))
            block_ms = max(1, min(int(wake) - int(now), int(left * 1000) + 1, _BLOCK_CHUNK_MS))
            if progress is not None:
                # Progress is refreshed by a join every few seconds, never by following every
                # other node's join: that would wake N waiters N times.
                block_ms = min(block_ms, _PROGRESS_MS)
            # Any entry means "look again": the join script re-reads the state and returns
            # fresh ids, so nothing read here needs to be kept.
            yield ("read", {self.keys.rdzv_notify: notify_id}, block_ms)

    def round_info(self) -> RoundInfo | None:
        """The last completed round, every node of it: O(N) bytes, for readers and the node
        that announces the round, not for every node."""
        raw = self._drive(_one(_command("get", self.keys.rdzv_round_info)))
        return _decode_round(raw) if raw else None

    def _register_job(self) -> Generator[Any, Any, None]:
        """List the job in the job index so consoles can find it (first registration wins)."""
        secs, micros = yield _command("time")
        now_ms = secs * 1000 + micros // 1000
        # One round trip, in this order: listed after its meta exists (an index entry
        # without one is a job that expired or was removed, which readers drop; retention.py).
        yield ("pipeline", [
            _command("hsetnx", self.keys.meta, "created_ms", now_ms),
            _command("hset", self.keys.meta, mapping={
                "min_nodes": self.settings.min_nodes, "max_nodes": self.settings.max_nodes,
                # Readers call a job lost when no heartbeat is newer than this.
                "heartbeat_timeout_ms": int(self.settings.heartbeat_timeout * 1000)}),
            _command("zadd", protocol.JOBS_INDEX, {self.job_id: now_ms}, nx=True)])

    def _drop_round_store(self, rnd: int) -> Generator[Any, Any, None]:
        """Delete round ``rnd``'s store namespace (``r<round>``: the agents' exit barrier,
        torch's own store): only that round's members used it, and they have moved on to a
        newer round or are gone. Without this a job keeps one namespace per round it ran."""
        if rnd < 0:
            return
        ns = f"r{rnd}"
        try:
            yield _command("unlink", self.keys.store(ns), self.keys.store_notify(ns))
        except (RendezvousConnectionError, redis.RedisError) as exc:  # left to retention then
            log.debug("cannot delete the store of round %d: %s", rnd, exc)

    def _timeout_message(self, status: str, count: int, members: list[str]) -> str:
        s = self.settings
        if status == "waiting":
            return (f"rendezvous of job {self.job_id!r} timed out after {s.join_timeout:g} s "
                    "waiting for the running round to end (the job is full or not re-forming)")
        return (f"rendezvous of job {self.job_id!r} timed out after {s.join_timeout:g} s: "
                f"{count} of at least {s.min_nodes} nodes joined"
                + (f" ({', '.join(members)})" if members else "")
                + "; start the missing agents or lower --nnodes")

    def membership(self) -> Membership:
        """The job's rendezvous now, read atomically, every list in full: O(N), for tools
        and tests. A node's loop reads :meth:`lost_since_last_check`."""
        raw = self._call("membership", [int(self.settings.heartbeat_timeout * 1000)])
        d = json.loads(raw)
        return Membership(
            round=int(d["round"]), status=str(d["status"]), closed=bool(d["closed"]),
            members=_decode_list(d["members"]), live=_decode_list(d["live"]),
            lost=_decode_list(d["lost"]), left=_decode_list(d["left"]),
            waiting=_decode_list(d["waiting"]), now_ms=int(d["now"]))

    def lost_since_last_check(self, beat: bool = False) -> tuple[Membership, list[str]]:
        """A summary of the membership (counts; at most ``NAMES`` nodes per list) plus the
        lost members that this call was first to see: O(log N) in the job's size.

        Exactly one caller across the job gets each lost node, so it alone reports it.
        A node that cannot judge now (see ``_may_judge``) calls nobody lost: ``lost`` is empty.

        ``beat``: the same call also beats, as :meth:`heartbeat` does (one script call a node
        makes every keep-alive interval instead of two); the heartbeat thread then skips the
        beat that is due, and beats by itself only when these calls stop coming.
        """
        return self._drive(self._lost_steps(beat))

    def _lost_steps(self, beat: bool = False) -> Generator[Any, Any, tuple[Membership, list[str]]]:
        if not self._may_judge():
            m, _ = yield from self._summary_steps(mark_lost=False, beat=beat)
            return replace(m, lost=[]), []
        return (yield from self._summary_steps(mark_lost=True, beat=beat))

    def _may_judge(self) -> bool:
        """Whether this node may call others lost now: not while its own heartbeats are not
        getting through, nor for a heartbeat timeout after they were held up for a while.
        From here an outage of Redis or of the network that cut every node off looks the same
        as this node being cut off alone; when it ends, the others' heartbeats are as stale as
        ours until they have had the time to beat again (and their clients may reconnect
        seconds after ours). A node really gone meanwhile is seen that much later."""
        now, gap = time.monotonic(), self.settings.held_gap
        done = self._renewal_done
        return done is not None and now - done <= gap and now >= self._judge_after

    def _summary_steps(self, mark_lost: bool, beat: bool = False
                       ) -> Generator[Any, Any, tuple[Membership, list[str]]]:
        s = self.settings
        summary_args = [int(s.heartbeat_timeout * 1000), int(mark_lost)]
        held = False
        if beat:
            sent = time.monotonic()
            restored, raw, held, need = yield from _script("beat_summary", [
                *self._beat_args(), *summary_args, int(s.held_gap * 1000)])
            yield from self._beaten(sent, restored, need)
            if held:  # cut off until just now, by Redis's clock: judge nobody yet
                self._judge_after = max(self._judge_after,
                                        time.monotonic() + s.heartbeat_timeout)
        else:
            raw = yield from _script("summary", [self.node_id, *summary_args])
        m, newly = _decode_summary(raw)
        if held:
            return replace(m, lost=[]), []
        return m, newly

    def num_nodes_waiting(self) -> int:
        """How many nodes want a new round: the agent should re-rendezvous when > 0.

        Counts late arrivals the completed round has room for, members lost or gone, and,
        when a newer round has opened without this node, everyone in it.
        """
        return self.waiting_count(self._drive(self._summary_steps(mark_lost=False))[0])

    def waiting_count(self, m: Membership, include_lost: bool = True) -> int:
        """``num_nodes_waiting`` for a membership already read. ``include_lost=False`` ignores
        stale heartbeats (right after a Redis outage every heartbeat looks stale)."""
        mine = self._last_round
        if mine is not None and m.round > mine:
            return max(1, m.member_count)
        if m.status != "complete":
            return m.member_count if mine is not None else 0
        lost = len(m.lost) if include_lost else 0
        room = max(0, self.settings.max_nodes - m.member_count + lost + m.left_count)
        return min(m.waiting_count, room) + lost + m.left_count

    def is_closed(self) -> bool:
        return self._client.hget(self.keys.rdzv_state, "closed") == b"1"

    def set_closed(self) -> None:
        """Close the job's rendezvous for every node: no new round will start."""
        self._call("close", [])

    def shutdown(self) -> bool:
        """Leave the rendezvous (the others may re-form without us); stop heartbeats."""
        self._stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        try:
            self._call("leave", [self.node_id, self.settings.min_nodes])
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
        self._drive(self._heartbeat_steps())

    def _beat_args(self, full: bool = False) -> list[Any]:
        """A beat's arguments: the round itself (group rank 0 holds it) only when ``full``,
        after a beat said Redis lost it; '1' otherwise, to say this node holds it."""
        held = (self._round_json if full else b"1") if self._round_json else b""
        return [self.node_id, self._desc, self._head, self._assign, held]

    def _heartbeat_steps(self) -> Generator[Any, Any, None]:
        sent = time.monotonic()
        _, restored, need = yield from _script("heartbeat", self._beat_args())
        yield from self._beaten(sent, restored, need)

    def _beat_due(self) -> bool:
        """Whether the heartbeat thread, at one of its ticks (every interval), must beat: no
        beat went out (of its own, or riding on a summary: ``lost_since_last_check(beat=True)``)
        for 1.25 intervals. A loop that beats every interval plus its own call's time is
        always younger than that at a tick, whatever the two phases; when it stops, the gap
        between beats stays under 2.25 intervals (4.5 s of a 10 s timeout by default)."""
        done = self._renewal_done
        return done is None or (
            time.monotonic() - done >= 1.25 * self.settings.keep_alive_interval)

    def _beaten(self, sent: float, restored: Any, need: Any = 0) -> Generator[Any, Any, None]:
        """After a beat that was sent at ``sent``: the renewal's bookkeeping, the round's
        record sent if the beat said Redis lost it (``need``), and the job's listing put back
        if the beat found the rendezvous lost and restored it."""
        if need:
            _, again, _ = yield from _script("heartbeat", self._beat_args(full=True))
            restored = restored or again
        done = time.monotonic()
        if self._renewal_done is not None and done - self._renewal_done > self.settings.held_gap:
            self._judge_after = done + self.settings.heartbeat_timeout  # held up: _may_judge
        self.renewed_at = max(self.renewed_at or sent, sent)
        self._renewal_done = done
        if restored:
            self.restorations += 1
            log.warning("Redis lost the rendezvous of job %s; round %s put back", self.job_id,
                        self._last_round)
            yield from self._register_job()

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
            if not self._beat_due():
                continue
            try:
                self.heartbeat()
                last_error = ""
            except RendezvousOutOfMemoryError:
                last_error = ""  # pressure.OOM reports the episode, for every writer at once
            except Exception as exc:  # this thread must outlive any refusal
                last_error = self._heartbeat_failed(exc, last_error)

    def _heartbeat_failed(self, exc: BaseException, last_error: str) -> str:
        """Keep trying, whatever Redis answers: an outage, or a refusal such as OOM
        (maxmemory with noeviction) that ends by itself, must not stop the beats and make
        the node look lost (and freeze its workers) once it is over. Says so once per kind
        of failure, not every interval; returns the failure's wording."""
        message = str(exc) if isinstance(exc, RendezvousConnectionError) else (
            str(explain_error(exc, self.endpoint.display)))
        if message != last_error:
            log.warning("heartbeat failed: %s", message)
        return message


class AsyncRedisRendezvous(RedisRendezvous):
    """The same rendezvous on an asyncio loop: the same steps and scripts, driven with
    asyncio clients (``client``; ``reader`` blocking longer than ``_BLOCK_CHUNK_MS``), and
    heartbeats as a task instead of a thread. The calls a node makes are coroutines here.

    For many nodes in one process (``bench/fleet.py`` packs 2,048 into each), where a thread
    per node and a hop between threads per call would be the bench measuring itself. An agent
    (one node) keeps :class:`RedisRendezvous` in a thread, over its two connections
    (``supervision/redis_bridge.py``), as torch's handler contract is synchronous.
    """

    def __init__(self, endpoint: Endpoint | str | None, job_id: str,
                 settings: RendezvousSettings | None = None, *, client: Any, reader: Any,
                 **kwargs: Any) -> None:
        super().__init__(endpoint, job_id, settings, client=client, reader=reader, **kwargs)
        self._hb_task: asyncio.Task[None] | None = None

    async def _adrive(self, steps: Generator[Any, Any, T]) -> T:
        reply: Any = None
        error: BaseException | None = None
        while True:
            done, call = _advance(steps, reply, error)
            if done:
                return call
            reply, error = None, None
            try:
                with self._redis_errors():
                    reply = await self._dispatch(call)
            except (RendezvousConnectionError, redis.RedisError) as exc:
                error = exc

    async def next_rendezvous(  # type: ignore[override]
            self, progress: Callable[[RendezvousProgress], None] | None = None
    ) -> RendezvousResult:
        return await self._adrive(self._rendezvous_steps(progress))

    async def heartbeat(self) -> None:  # type: ignore[override]
        await self._adrive(self._heartbeat_steps())

    async def lost_since_last_check(  # type: ignore[override]
            self, beat: bool = False) -> tuple[Membership, list[str]]:
        return await self._adrive(self._lost_steps(beat))

    async def shutdown(self) -> bool:  # type: ignore[override]
        """Leave the rendezvous and stop the heartbeats (the clients are the caller's)."""
        self.stop_heartbeats()
        try:
            await self._adrive(_script("leave", [self.node_id, self.settings.min_nodes]))
        except RendezvousConnectionError as exc:
            log.warning("could not leave the rendezvous cleanly: %s", exc)
            return False
        return True

    def stop_heartbeats(self) -> None:
        """No more heartbeats, nothing said: to Redis this node is gone (a host that died)."""
        self._stop.set()
        if self._hb_task is not None:
            self._hb_task.cancel()

    def _start_heartbeats(self) -> None:
        if self._hb_task is None:
            self._hb_task = asyncio.get_running_loop().create_task(
                self._heartbeat_task(), name=f"rdzv-heartbeat-{self.node_id}")

    async def _heartbeat_task(self) -> None:
        last_error = ""
        while not self._stop.is_set():
            await asyncio.sleep(self.settings.keep_alive_interval)  # a beat is due
            if not self._beat_due():
                continue
            try:
                await self.heartbeat()
                last_error = ""
            except RendezvousOutOfMemoryError:
                last_error = ""  # pressure.OOM reports the episode
            except Exception as exc:  # the beats must outlive any refusal
                last_error = self._heartbeat_failed(exc, last_error)


def opens_a_round(entries: list[Any]) -> bool:
    """Whether notify-stream ``entries`` (as XREAD returns them) include a round being
    opened. Only a member of the completed round opens the next one, so to a member that
    read the stream from its own round on, this says "re-form" without asking Redis again:
    4,096 nodes woken together then send a join each rather than a summary and a join."""
    for entry in entries:
        fields = entry[1] if len(entry) > 1 else None
        if isinstance(fields, dict) and fields.get(b"e", fields.get("e")) in (b"open", "open"):
            return True
    return False


def _decode_result(head: Any, assign: Any) -> RendezvousResult:
    """A completed round's head and this node's assignment (``round group_rank base``)."""
    try:
        d = protocol.decode_json(head, "round head", protocol.MAX_RDZV_RECORD_BYTES)
        rnd, rank, base = (int(x) for x in assign.split())
        return RendezvousResult(
            round=rnd, group_rank=rank, group_world_size=int(d["world_size"]),
            master_addr=str(d["master_addr"]), master_port=int(d["master_port"]),
            total_workers=int(d.get("total_workers") or 0), base_rank=base,
            completed_ms=int(d.get("completed_ms") or 0))
    except (protocol.ProtocolError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RendezvousError(f"the rendezvous record is unreadable ({exc}): another writer "
                              "broke the job's keys; start it under a new --job-id") from None


def _decode_summary(raw: Any) -> tuple[Membership, list[str]]:
    """The summary script's array (see _SUMMARY_FN) and its newly lost nodes. A state another
    writer broke (a round that is no number) truncates the array: one clear error."""
    try:
        (rnd, status, closed, n, member, live, lost, newly, left, n_left, waiting, n_waiting,
         now) = raw
        m = Membership(
            round=int(rnd), status=_text(status), closed=bool(closed), members=[], live=[],
            lost=_decode_list(lost), left=_decode_list(left), waiting=_decode_list(waiting),
            now_ms=int(now), member_count=int(n), left_count=int(n_left),
            waiting_count=int(n_waiting), live_count=int(live), is_member=bool(member))
    except (ValueError, TypeError) as exc:
        raise RendezvousError(f"the rendezvous record is unreadable ({exc}): another writer "
                              "broke the job's keys; start it under a new --job-id") from None
    return m, _decode_list(newly)


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
