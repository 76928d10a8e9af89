"""O(N^2) must not come back: what one node costs Redis per heartbeat interval, and per round it
forms, must not grow with the job's size.

Counted: the commands Redis ran (scripts' own calls included, ``INFO commandstats``) and the
bytes it sent back (``total_net_output_bytes``), per node, for a job of 64 and of 1,024 nodes
on a redis-server of the test's own. A node's interval is what an agent does every keep-alive
interval: the membership summary with its heartbeat in the same call
(``lost_since_last_check(beat=True)``) and the stall check: two script calls.

Timed by Redis itself: a count misses a script that walks every member inside one command
(``#redis.call('ZRANGEBYSCORE', ...)`` where ``ZCOUNT`` would do is one command either way).
So the server's own microseconds for each script call (``SLOWLOG`` with every command logged:
the time Redis spent in the call, not the round trip) are compared too, the median per script
at each size. A walk of 1,024 members costs several times a script's fixed cost (here: a beat
with its summary ~50-100 us at either size, 150-360 us at 1,024 nodes with one walk). The
interval's calls of both sizes are interleaved so that the machine's other load falls on both
alike. A node's first join sends the script's text, and hashing 5 KB per call dilutes a walk
there: the rejoin by hash is timed, the first join only against gross growth; bench/fleet.py's
forming times at 4,096 nodes are the check for that path.

Training metrics: a node's resource-sampling interval (records/events.py ``ResourceSampler``)
is one pipeline, the samples' HSET, and with metrics flowing (every node's 8 ranks print steps
and three metrics each interval) the metrics script call in the same round trip
(diagnosis/metrics_publish.py). The commands a node sends (Redis's own log of them: a
script's calls are logged apart, from no client address) may be one more with metrics than
without, at either size; what Redis runs inside, the bytes back, and the script's median
server time must stay flat in N like the rest. A node's first metrics call sends the
script's text and reads the curves' history: not counted, as the beat's first call.
"""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import threading
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis

from elastic_agent.coordination.rendezvous.drivers import RedisRendezvous
from elastic_agent.coordination.rendezvous.scripts import SHAS
from elastic_agent.coordination.rendezvous.types import RendezvousSettings
from elastic_agent.coordination.transport.connection import make_async_client, make_client
from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.supervision.diagnosis import metrics_publish, stall
from elastic_agent.supervision.diagnosis.metrics import MetricsTracker
from elastic_agent.supervision.diagnosis.metrics_publish import MetricsPublisher
from elastic_agent.supervision.diagnosis.stall import StallWatch
from elastic_agent.supervision.hosting.standalone import RedisServer
from elastic_agent.supervision.records.events import ResourceSampler

SIZES = (64, 1024)
#: Per-node counts at 1,024 nodes may exceed those at 64 by this much (hash and sorted-set
#: encodings change size; node names get a digit longer), never by the 16x of a walk.
FLAT = 1.35
#: A script call's median server time at 1,024 nodes may be this many times that at 64
#: (measured: 0.4-1.0x; below 128 members Redis keeps sorted sets and hashes as flat lists
#: it scans, so the small job is often the slower). One walk of 1,024 members makes it 2.5x
#: to 9x.
SLOWER = 2.0
#: Interleaved passes of every node's interval for the timing (each pass beats every node of
#: the big job and as many of the small one's, round robin).
PASSES = 1
SLOWLOG_LEN = 200_000

NAMES = {sha: name for name, sha in SHAS.items()}
NAMES[hashlib.sha1(stall._REPORT_AND_CLAIM.encode()).hexdigest()] = "stall check"
NAMES[metrics_publish._PUBLISH_SHA] = "metrics publish"
#: Ranks of a node, and steps each prints per resource-sampling interval.
NPROC = 8
STEPS_PER_INTERVAL = 4


@pytest.fixture
def server() -> Iterator[RedisServer]:
    s = RedisServer().start()
    yield s
    s.cleanup()


def _counts(r: redis.Redis) -> tuple[int, int, int]:
    """(commands run, scripts' own calls included; bytes sent to clients; script calls) so far."""
    stats = r.info("commandstats")
    commands = sum(int(v["calls"]) for v in stats.values())
    scripts = sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))
    return commands, int(r.info("stats")["total_net_output_bytes"]), scripts


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _timing_on(r: redis.Redis) -> None:
    """Every command from here on goes to the slow log with the server's time for it."""
    r.config_set("slowlog-max-len", SLOWLOG_LEN)
    r.config_set("slowlog-log-slower-than", 0)
    r.slowlog_reset()


def _read_log(r: redis.Redis) -> list[Any]:
    """Every command logged since :func:`_timing_on`; then timing off."""
    entries = r.execute_command("SLOWLOG", "GET", -1)
    r.config_set("slowlog-log-slower-than", -1)
    r.slowlog_reset()
    assert len(entries) < SLOWLOG_LEN, "the slow log overflowed: calls would be missing"
    return list(entries)


def _sent(entries: Sequence[Any], job: str) -> int:
    """Commands clients sent on ``job``'s keys (a script's own calls come from no client
    address, ``?:0``: not these)."""
    tag = f"{{{job}}}"
    return sum(1 for e in entries if not _text(e[4]).startswith("?")
               and any(tag in _text(a) for a in e[3][1:4]))


def _script_times(entries: Sequence[Any], job: str) -> dict[str, list[int]]:
    """Server microseconds of each script call on ``job``'s keys, by script (a call that sent
    the text is ``"<first call>"``: the slow log keeps only its first bytes)."""
    times: dict[str, list[int]] = defaultdict(list)
    for entry in entries:
        args = [_text(a) for a in entry[3]]
        command = args[0].lower()
        if command not in ("eval", "evalsha") or len(args) < 4:
            continue  # not a script (a script's own commands are logged too: not these)
        if f"{{{job}}}" not in args[3]:
            continue
        name = NAMES.get(args[1], "<other script>") if command == "evalsha" else "<first call>"
        times[name].append(int(entry[2]))
    return times


def _job(url: str, n: int) -> tuple[list[RedisRendezvous], redis.Redis, redis.Redis]:
    """n nodes of one job, formed; background heartbeats far off (the test beats itself)."""
    settings = RendezvousSettings(min_nodes=n, max_nodes=n, heartbeat_timeout=2000,
                                  keep_alive_interval=1000, last_call_timeout=60)
    client = make_client(url, max_connections=n + 8)
    reader = make_client(url, blocking_ms=30_000, max_connections=n + 8)
    job = f"scale-{n}-{uuid.uuid4().hex[:6]}"
    nodes = [RedisRendezvous(url, job, settings, local_addr="127.0.0.1", nproc=8,
                             node_id=f"node-{i:05d}", client=client, reader=reader)
             for i in range(n)]
    errors: list[BaseException] = []

    def join(h: RedisRendezvous) -> None:
        try:
            h.next_rendezvous()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(h,)) for h in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)  # a hang bound, not a speed goal
    assert not errors and all(h.round == 0 for h in nodes), errors
    return nodes, client, reader


def _stall_watches(aclient: Any, nodes: Sequence[RedisRendezvous]) -> list[StallWatch]:
    return [StallWatch(aclient, aclient, h.job_id, h.node_id, "h", 300, "observe", {},
                       lambda *a, **k: None) for h in nodes]


async def _stall_checks(watches: Sequence[StallWatch]) -> None:
    for watch in watches:
        await watch.check(0, 0, 0)


class _Job:
    """One job formed and its interval counted; its nodes stay up for the timing passes."""

    def __init__(self, url: str, r: redis.Redis, n: int) -> None:
        self.n = n
        r.config_resetstat()
        before = _counts(r)
        _timing_on(r)
        self.nodes, self.client, self.reader = _job(url, n)
        self.join_times = _script_times(_read_log(r), self.nodes[0].job_id)
        formed = _counts(r)
        # A fresh Redis knows no script: each node's first call of each sends the text (EVAL),
        # so nodes released together do not each get NOSCRIPT, load it and call again.
        self.loads = int(r.info("commandstats").get("cmdstat_script|load", {}).get("calls", 0))
        self.aclient = make_async_client(parse_endpoint(url))
        self.watches = _stall_watches(self.aclient, self.nodes)
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(_stall_checks(self.watches))  # (first write: not counted)
        for h in self.nodes:  # and the summary's first call, which sends its text: not counted
            h.lost_since_last_check(beat=True)
        start = _counts(r)
        for h in self.nodes:  # one keep-alive interval of every node: the beat rides on the summary
            m, lost = h.lost_since_last_check(beat=True)
            assert m.is_member and not lost and m.member_count == n
        self.loop.run_until_complete(_stall_checks(self.watches))
        end = _counts(r)
        self.figures = {
            "forming commands": (formed[0] - before[0]) / n,
            "forming bytes": (formed[1] - before[1]) / n,
            "interval commands": (end[0] - start[0]) / n,
            "interval bytes": (end[1] - start[1]) / n,
            "interval scripts": (end[2] - start[2]) / n,
        }
        self._metrics_nodes()
        job = self.nodes[0].job_id
        _timing_on(r)
        start = _counts(r)
        self.loop.run_until_complete(self.samples(with_metrics=False))
        end = _counts(r)
        plain = _sent(_read_log(r), job)
        _timing_on(r)
        mstart = _counts(r)
        self.loop.run_until_complete(self.samples(with_metrics=True))
        mend = _counts(r)
        flowing = _sent(_read_log(r), job)
        self.figures.update({
            "samples sent": plain / n,
            "samples+metrics sent": flowing / n,
            "samples commands": (end[0] - start[0]) / n,
            "samples+metrics commands": (mend[0] - mstart[0]) / n,
            "samples+metrics bytes": (mend[1] - mstart[1]) / n,
        })

    def _metrics_nodes(self) -> None:
        """Each node's resource sampler, and its metrics (tracker, publisher) riding on
        another: node i runs global ranks 8i..8i+7, node 0 hosts rank 0 (the curves)."""
        job = self.nodes[0].job_id
        self.plain = [ResourceSampler(self.aclient, job, h.node_id) for h in self.nodes]
        self.trackers = [MetricsTracker() for _ in self.nodes]
        self.pubs = [MetricsPublisher(t, job, h.node_id, lambda *a, **k: None)
                     for t, h in zip(self.trackers, self.nodes)]
        self.riders = [ResourceSampler(self.aclient, job, h.node_id, rider=p)
                       for p, h in zip(self.pubs, self.nodes)]
        for i, p in enumerate(self.pubs):
            p.start_attempt(0, holds_rank0=i == 0)
        self.step = 0
        self.loop.run_until_complete(self.samples(with_metrics=True))  # (first call: text)

    def _samples_of(self, i: int) -> dict[int, dict[str, Any]]:
        node = self.nodes[i].node_id
        return {rank: {"rank": rank, "node": node, "pid": 1000 + rank, "cpu": 99.5,
                       "rss": 1 << 30, "threads": 12, "ts": 1.0}
                for rank in range(i * NPROC, (i + 1) * NPROC)}

    async def sample(self, i: int, with_metrics: bool) -> None:
        """Node i's resource-sampling interval; with metrics, its ranks printed
        STEPS_PER_INTERVAL steps since the last."""
        if not with_metrics:
            await self.plain[i].publish(self._samples_of(i))
            return
        lines = b"".join(f"step {s} loss {1 / (s + 1):.4f} lr 0.001 grad_norm 0.5\n".encode()
                         for s in range(self.step, self.step + STEPS_PER_INTERVAL))
        for rank in range(i * NPROC, (i + 1) * NPROC):
            self.trackers[i].feed(rank, "stdout", lines)
        await self.riders[i].publish(self._samples_of(i))

    async def samples(self, with_metrics: bool) -> None:
        """Every node's resource-sampling interval (the job's steps advance)."""
        for i in range(self.n):
            await self.sample(i, with_metrics)
        if with_metrics:
            self.step += STEPS_PER_INTERVAL

    def close(self) -> None:
        self.loop.run_until_complete(self.aclient.aclose())
        self.loop.close()
        for h in self.nodes:
            h.shutdown()
        self.client.close()
        self.reader.close()


def test_per_node_cost_per_interval_and_per_round_stays_flat(server: RedisServer) -> None:
    r = make_client(server.url)
    jobs: list[_Job] = []
    try:
        for n in SIZES:
            jobs.append(_Job(server.url, r, n))
        small, large = jobs
        assert small.loads == 0 and large.loads == 0
        report = {k: (round(small.figures[k], 1), round(large.figures[k], 1))
                  for k in small.figures}
        for what in small.figures:
            assert large.figures[what] <= small.figures[what] * FLAT, (
                f"{what} per node grew from {small.figures[what]:.1f} at {SIZES[0]} nodes to "
                f"{large.figures[what]:.1f} at {SIZES[1]}: something walks every member "
                f"({report})")
        # And small in absolute terms: a beat, a summary and a stall check are a few calls.
        assert large.figures["interval commands"] < 25, report
        # A resource sample is one HSET a node; metrics flowing add the script call, no more.
        for j in (small, large):
            assert j.figures["samples sent"] == 1, report
            assert j.figures["samples+metrics sent"] - j.figures["samples sent"] <= 1, report
        # One call beats and reads the summary, one checks for a stall: each call's own cost
        # (a round trip, a script started) is most of what it costs Redis.
        assert large.figures["interval scripts"] <= 2, report
        assert large.figures["interval bytes"] < 1500, report

        # Redis's own time per call. Forming (each node's first join sends the script's
        # text, its second, once the round completed, calls it by hash) cannot be interleaved
        # across sizes: a second small job formed after the big one brackets it in time, and
        # the slower of the two small ones is the reference.
        again = _Job(server.url, r, SIZES[0])
        jobs.append(again)
        _timing_on(r)
        count = large.n * PASSES
        for i in range(count):  # interleaved: the machine's other load falls on both sizes
            for j in (small, large):
                j.nodes[i % j.n].lost_since_last_check(beat=True)
        for i in range(count):
            for j in (small, large):
                j.loop.run_until_complete(j.watches[i % j.n].check(0, 0, 0))
        for i in range(count):
            for j in (small, large):
                j.loop.run_until_complete(j.sample(i % j.n, with_metrics=True))
                if i % j.n == j.n - 1:
                    j.step += STEPS_PER_INTERVAL
        entries = _read_log(r)
        interval = {j.n: _script_times(entries, j.nodes[0].job_id) for j in (small, large)}
        for j in jobs:
            assert len(j.join_times["<first call>"]) == j.n, "every first join sends the text"
        for j in (small, large):
            assert len(interval[j.n]["beat_summary"]) == count, "every interval call timed"
            assert len(interval[j.n]["stall check"]) == count, "every stall check timed"
            assert len(interval[j.n]["metrics publish"]) == count, "every metrics call timed"

        def median(times: dict[str, list[int]], name: str) -> float:
            return statistics.median(times[name])

        us = {name: (max(median(small.join_times, name), median(again.join_times, name)),
                     median(large.join_times, name)) for name in ("<first call>", "join")}
        us.update({name: (median(interval[SIZES[0]], name), median(interval[SIZES[1]], name))
                   for name in ("beat_summary", "stall check", "metrics publish")})
        print(f"per node at {SIZES} nodes: {report}; median server us per call: {us}")
        for name, (at_small, at_large) in us.items():
            assert at_large <= at_small * SLOWER, (
                f"{name}: Redis spent a median {at_large:g} us per call at {SIZES[1]} nodes "
                f"against {at_small:g} us at {SIZES[0]}: the script walks every member "
                f"(median us per call at {SIZES}: {us})")
    finally:
        for j in jobs:
            j.close()
        r.close()
