"""O(N^2) must not come back: what one node costs Redis per heartbeat interval, and per round it
forms, must not grow with the job's size.

Counted, never timed: the commands Redis ran (scripts' own calls included, ``INFO
commandstats``) and the bytes it sent back (``total_net_output_bytes``), per node, for a job of
64 and of 256 nodes on a redis-server of the test's own. A node's interval is what an agent does
every keep-alive interval: the membership summary with its heartbeat in the same call
(``lost_since_last_check(beat=True)``) and the stall check: two script calls. A script that
walks every member on each call makes the per-node figures grow fourfold from 64 to 256
nodes; flat is what we ask. bench/fleet.py has the timings.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator

import pytest
import redis

from elastic_agent.coordination.rendezvous.drivers import RedisRendezvous
from elastic_agent.coordination.rendezvous.types import RendezvousSettings
from elastic_agent.coordination.transport.connection import make_async_client, make_client
from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.supervision.diagnosis.stall import StallWatch
from elastic_agent.supervision.hosting.standalone import RedisServer

SIZES = (64, 256)
#: Per-node figures at 256 nodes may exceed those at 64 by this much (hash and sorted-set
#: encodings change size; node names get a digit longer), never by the 4x of a walk.
FLAT = 1.35


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


def _per_node(url: str, n: int) -> dict[str, float]:
    r = make_client(url)
    r.config_resetstat()
    before = _counts(r)
    nodes, client, reader = _job(url, n)
    formed = _counts(r)
    # A fresh Redis knows no script: each node's first call of each sends the text (EVAL), so
    # nodes released together do not each get NOSCRIPT, load it and call again.
    loads = int(r.info("commandstats").get("cmdstat_script|load", {}).get("calls", 0))

    async def stall_checks() -> None:
        aclient = make_async_client(parse_endpoint(url))
        try:
            for h in nodes:
                watch = StallWatch(aclient, aclient, h.job_id, h.node_id, "h", 300, "observe", {},
                                   lambda *a, **k: None)
                await watch.check(0, 0, 0)
        finally:
            await aclient.aclose()

    asyncio.run(stall_checks())  # (its first write per node: not counted below)
    start = _counts(r)
    for h in nodes:  # one keep-alive interval of every node: the beat rides on the summary
        m, lost = h.lost_since_last_check(beat=True)
        assert m.is_member and not lost and m.member_count == n
    asyncio.run(stall_checks())
    end = _counts(r)
    for h in nodes:
        h.shutdown()
    client.close()
    reader.close()
    r.close()
    return {
        "forming commands": (formed[0] - before[0]) / n,
        "forming bytes": (formed[1] - before[1]) / n,
        "interval commands": (end[0] - start[0]) / n,
        "interval bytes": (end[1] - start[1]) / n,
        "interval scripts": (end[2] - start[2]) / n,
        "forming script loads": loads,
    }


def test_per_node_cost_per_interval_and_per_round_stays_flat(server: RedisServer) -> None:
    small, large = (_per_node(server.url, n) for n in SIZES)
    assert small.pop("forming script loads") == 0 and large.pop("forming script loads") == 0
    report = {k: (round(small[k], 1), round(large[k], 1)) for k in small}
    for what in small:
        assert large[what] <= small[what] * FLAT, (
            f"{what} per node grew from {small[what]:.1f} at {SIZES[0]} nodes to "
            f"{large[what]:.1f} at {SIZES[1]}: something walks every member ({report})")
    # And small in absolute terms: a beat, a summary and a stall check are a few calls.
    assert large["interval commands"] < 25, report
    # One call beats and reads the summary, one checks for a stall: each call's own cost (a
    # round trip, a script started) is most of what it costs Redis.
    assert large["interval scripts"] <= 2, report
    assert large["interval bytes"] < 1500, report
