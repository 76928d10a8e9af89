"""The rendezvous's Lua scripts: every transition of a job's rendezvous state, each atomic and
timed by Redis server time (the protocol itself: rendezvous.py's docstring tells it).

The texts are the wire contract: they are sent and hashed exactly as written here, so an edit
is a change of protocol, and tests/test_scale_counts.py counts what each costs on a real Redis.
A driver (rendezvous.py) runs them by name (:data:`SCRIPTS`, :data:`SHAS`) over
:func:`script_keys`, the job's keys in the order every script's prelude names them; the steps
(rendezvous_steps.py) choose which to run with what arguments.
"""

from __future__ import annotations

import hashlib

from ..wire.keyspace import JobKeys

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

-- When the open round completes at the latest, given its 'deadline' field (0: no last call
-- yet): the end of its last call; once that is over in a re-forming round that waits for
-- nodes that beat but have not joined (see maybe_complete), one heartbeat timeout after it.
local function completes_by(deadline, now, hbt)
  if deadline > 0 and now >= deadline then return deadline + hbt end
  return deadline
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
  -- Past the last call a re-forming round (here: some node beats that has not joined, the
  -- previous round's members still stopping their workers) waits for them one heartbeat
  -- timeout more: completed without them, they would wait for the next round and make the
  -- job re-form once more at once. One that beats and never comes holds it no longer.
  if now >= deadline and (round == 0 or now >= deadline + hbt) then
    complete(round, now)
    return true
  end
  return false
end

-- The earliest server time at which a time-based transition may happen.
local function next_wake(now, hbt)
  local wake = now + 3600000
  local deadline = completes_by(tonumber(redis.call('HGET', K_STATE, 'deadline')) or 0, now, hbt)
  if deadline > 0 and deadline < wake then wake = deadline end
  local first = redis.call('ZRANGEBYSCORE', K_HB, now - hbt, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if #first > 0 then
    local exp = tonumber(first[2]) + hbt + 1
    if exp < wake then wake = exp end
  end
  return wake
end

-- What a waiter of the open round shows: counts, and names only while they are few;
-- deadline: when the round completes at the latest.
local function open_payload(now, hbt)
  local n = redis.call('ZCARD', K_MEMBERS)
  local s = redis.call('HMGET', K_STATE, 'deadline', 'back', 'prev_n')
  local members = {}
  if n <= NAMES then members = redis.call('ZRANGE', K_MEMBERS, 0, -1) end
  return cjson.encode({n = n, members = members, deadline = completes_by(tonumber(s[1]) or 0, now, hbt),
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
return {'open', round, now, next_wake(now, hbt), last_notify_id(), open_payload(now, hbt), ''}
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
# and mark, then the held gap (ms), then the Redis time of this node's latest beat whose reply
# the caller had seen when it sent this call (0: none yet). Returns {restored, the summary
# (an array), held, need}.
#
# held (1): this node's own previous beat is older than the held gap (RendezvousSettings:
# half the heartbeat timeout, never within the beats' normal spacing), by Redis's clock, so
# it judges nobody: the call may have been sent before an outage that cut this node off, and
# run only now (a request the client gave up on is still delivered by the kernel when the
# network heals); the others' beats are as stale as this node's was. The client's own check
# (``_may_judge``) cannot see that: it decided before the call was sent. "Previous" is the
# older of the beat Redis holds and the one the caller knew of: the node's heartbeat thread
# may have a beat of its own in flight across the same outage, run a moment before this one,
# and a beat that fresh says nothing about the others having had the time to beat again.
_BEAT_SUMMARY = _PRELUDE + _BEAT_FN + _SUMMARY_FN + """
local now, hbt, gap = now_ms(), tonumber(ARGV[6]), tonumber(ARGV[8])
local prev = tonumber(redis.call('ZSCORE', K_HB, ARGV[1]))
local known = tonumber(ARGV[9]) or 0
if prev and known > 0 and known < prev then prev = known end
local held = ARGV[7] == '1' and not (prev and now - prev <= gap)
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


SCRIPTS = {"join": _JOIN, "heartbeat": _HEARTBEAT, "leave": _LEAVE, "close": _CLOSE,
           "membership": _MEMBERSHIP, "summary": _SUMMARY, "beat_summary": _BEAT_SUMMARY}
SHAS = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in SCRIPTS.items()}


def script_keys(k: JobKeys) -> list[str]:
    """The KEYS every script gets, in the prelude's order (``KEYS: 1 state, ...`` above)."""
    return [k.rdzv_state, k.rdzv_members, k.rdzv_waiting, k.rdzv_ranks, k.rdzv_round_info,
            k.rdzv_nodes, k.rdzv_heartbeats, k.rdzv_left, k.rdzv_notify, k.rdzv_lost,
            k.rdzv_joins, k.rdzv_assign, k.meta]
