"""One job's log throughput over a Redis Cluster: 1 master against 3 (and one plain server).

A job's log streams are ``elastic:log:{JOB/TAG}:NODE`` over 16 hash tags spread across the
cluster's slots (docs/PROTOCOL.md), so one job's log traffic can use every master. This bench
measures what that buys on this machine.

Setup, for each configuration (``--configs``, default ``single,1,3``):

* ``single``: one plain ``redis-server``; ``1``/``3``: a real Redis Cluster of that many
  masters on loopback (``tests/cluster.py``, slots split evenly as ``redis-cli --cluster
  create`` does), every client pointed at node 0;
* ``--procs`` producer processes (default 2, the machine's cores) share ``--nodes`` simulated
  nodes of one job (default 256). Each node is the agent's real log pipeline: a
  ``StreamPublisher`` of its own (its own cluster client, as an agent has) and a ``NodeLogs``
  with ``--workers`` workers (``open_worker``; files in a temporary directory, terminal
  output discarded). Only the workers are fake: each feeds chunks of ``--chunk`` lines of
  training-like output (~80 bytes) as fast as its node's publisher takes them (a node whose
  publisher holds more than 1 MiB unsent is skipped that turn), so the lines go through the
  same ``log_shipping.Shipper``/``NodeBatcher`` encoding, 50 ms linger and pipelined ``XADD MAXLEN ~`` as
  an agent's. ``--rate`` paces each worker instead (small entries: Redis's cost per line is
  higher, the producers' too). Streams keep ``--maxlen`` entries (memory stays bounded).
  Every node is connected (its stream's first entry sent) before a common start. Hundreds
  of nodes per process are many agents in one event loop: at 512 per process here
  publishers hit their 2 s connect / 5 s read timeouts (the retried sends are printed);
  256 nodes over 2 processes ran clean;
* after ``--warmup`` seconds, a window of ``--seconds``: lines/s is the lines Redis
  acknowledged in the window (the publishers' ``sent_weight``), summed over producers; CPU of
  each master from ``INFO cpu`` (``used_cpu_user + used_cpu_sys``, % of one core) and its
  commands/s (``INFO stats``); the producers' own CPU (``process_time``).

The honest part: on a 2-core machine the producers (Python, the agents' real encoders) need
more CPU per line than Redis does, so the measured lines/s is capped by the machine rather
than by the masters; the per-master CPU shows how the load splits, and "one master's
ceiling" (lines/s / busiest master's share of a core) is the throughput at which the busiest
master would be saturated, i.e. the job's ceiling on that many masters, given cores enough
for its agents.

    python bench/cluster_logs.py                        # single, 1 and 3 masters, 256 nodes
    python bench/cluster_logs.py --configs 1,3 --nodes 512 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/cluster.py

from tests.cluster import Cluster

from elastic_agent.coordination.wire import log_records
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.supervision.hosting.standalone import RedisServer
from elastic_agent.supervision.records.log_config import LogConfig
from elastic_agent.supervision.records.logs import NodeLogs
from elastic_agent.supervision.records.publisher import StreamPublisher

BACKLOG_BYTES = 1 << 20  # a node's publisher holding more unsent than this is not fed


class _Discard:
    """The agent's terminal, thrown away (the bench measures Redis, not a tty)."""

    def write(self, data: bytes, /) -> int:
        return len(data)

    def flush(self) -> None:
        pass


def _chunk(worker: int, lines: int) -> bytes:
    return b"".join(
        f"step {i:6d} rank {worker:5d} loss=2.{i % 997:04d} lr=3.0e-4 grad_norm=1.{i % 89:02d} "
        f"tok/s=1{i % 9973:04d}\n".encode() for i in range(lines))


async def _produce(url: str, job: str, nodes: list[str], args: argparse.Namespace,
                   pipe: Any, first_rank: int) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="cluster-logs-", dir="/dev/shm"
                                if Path("/dev/shm").is_dir() else None))
    fleet = []
    rank = first_rank
    for node in nodes:
        pub = StreamPublisher(url)
        await pub.start()
        logs = NodeLogs(LogConfig(maxlen=args.maxlen), publisher=pub, job_id=job, node_id=node,
                        stdout=_Discard(), stderr=_Discard())
        workers = []
        for local in range(args.workers):
            workers.append((logs.open_worker(directory=tmp / node, role="w", rank=rank,
                                             local_rank=local, attempt=0),
                            _chunk(rank, args.chunk)))
            rank += 1
        fleet.append((pub, workers))
    # Connected before the start (open_worker queued the stream's SADD): a few hundred
    # cluster clients dialling every master at once while the feed starts timed out here.
    await asyncio.gather(*(pub.flush() for pub, _ in fleet))
    # Each stream's first entry too, so the window does not open on a connection storm.
    for _, workers in fleet:
        for worker, chunk in workers:
            worker.feed(log_records.STDOUT, chunk)
    await asyncio.gather(*(pub.flush() for pub, _ in fleet))
    # Ready: the parent sends the common start time once every producer is.
    pipe.send("ready")
    start_at = await asyncio.to_thread(pipe.recv)
    await asyncio.sleep(max(0.0, start_at - time.time()))
    window_start = time.time() + args.warmup
    period = args.chunk / args.rate if args.rate > 0 else 0.0
    due = [time.time() + period * i / max(1, len(fleet)) for i in range(len(fleet))]
    sent0 = cpu0 = 0.0
    measuring = False
    while True:
        now = time.time()
        if not measuring and now >= window_start:
            measuring = True
            sent0 = sum(p.sent_weight for p, _ in fleet)
            cpu0 = time.process_time()
        if now >= window_start + args.seconds:
            break
        if args.rate > 0:
            # Paced: each node writes a chunk per worker every ``period``, staggered; a node
            # that fell more than a second behind (producers short of CPU) skips ahead.
            for i, (_, workers) in enumerate(fleet):
                if due[i] < now - 1.0:
                    due[i] = now
                while due[i] <= now:
                    for worker, chunk in workers:
                        worker.feed(log_records.STDOUT, chunk)
                    due[i] += period
            await asyncio.sleep(0.005)  # a timer: the pace is the clock's
            continue
        fed = False
        for pub, workers in fleet:
            if pub.stats().buffered_bytes > BACKLOG_BYTES:
                continue
            fed = True
            for worker, chunk in workers:
                worker.feed(log_records.STDOUT, chunk)
        # Let the flushers run; when every publisher is full, give them real time.
        await asyncio.sleep(0 if fed else 0.002)
    sent = sum(p.sent_weight for p, _ in fleet) - sent0
    cpu = time.process_time() - cpu0
    dropped = sum(p.stats().dropped_weight for p, _ in fleet)
    retries = sum(p.stats().retries for p, _ in fleet)
    for pub, workers in fleet:
        for worker, _ in workers:
            worker.close()
        await pub.close(flush_timeout=0.5)
    shutil.rmtree(tmp, ignore_errors=True)
    return {"lines": sent, "cpu_s": cpu, "dropped": dropped, "retries": retries}


def _producer(url: str, job: str, nodes: list[str], args: argparse.Namespace,
              first_rank: int, pipe: Any) -> None:
    pipe.send(asyncio.run(_produce(url, job, nodes, args, pipe, first_rank)))


def _cpu(port: int) -> tuple[float, int]:
    c = redis.Redis(port=port, protocol=2)
    try:
        info = c.info()
    finally:
        c.close()
    return (float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
            int(info["total_commands_processed"]))


def run_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    if name == "single":
        servers: Any = RedisServer().start()
        ports, url = [servers.port], servers.url
    else:
        servers = Cluster(int(name)).start()
        ports, url = [n.port for n in servers.nodes], servers.url(0)
    job = f"bench-{name}-{int(time.time())}"
    try:
        nodes = [f"node-{i:05d}" for i in range(args.nodes)]
        ctx = multiprocessing.get_context("fork")
        pipes, procs = [], []
        for p in range(args.procs):
            mine = nodes[p::args.procs]
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_producer, args=(url, job, mine, args,
                                                       p * len(nodes) * args.workers, there))
            proc.start()
            pipes.append(here)
            procs.append(proc)
        for pipe in pipes:  # every producer built and connected its nodes
            if pipe.recv() != "ready":
                raise RuntimeError("a producer failed to start")
        start_at = time.time() + 0.5
        for pipe in pipes:
            pipe.send(start_at)
        time.sleep(max(0.0, start_at + args.warmup - time.time()))
        before = [_cpu(port) for port in ports]
        time.sleep(args.seconds)
        after = [_cpu(port) for port in ports]
        results = [pipe.recv() for pipe in pipes]
        for proc in procs:
            proc.join(30)
        keys = JobKeys(job)
        streams = [keys.logs(n) for n in nodes]
        owners = ([servers.owner(s) for s in streams] if name != "single"
                  else [0] * len(streams))
    finally:
        servers.cleanup()
    return {
        "config": name,
        "lines_s": sum(r["lines"] for r in results) / args.seconds,
        "dropped": sum(r["dropped"] for r in results),
        "retries": sum(r["retries"] for r in results),
        "load": os.getloadavg()[0],
        "producers_cpu": sum(r["cpu_s"] for r in results) / args.seconds,
        "masters_cpu": [(a[0] - b[0]) / args.seconds for a, b in zip(after, before)],
        "masters_cmds": [(a[1] - b[1]) / args.seconds for a, b in zip(after, before)],
        "streams": [owners.count(i) for i in range(len(ports))],
    }


def _ceiling(res: dict[str, Any]) -> float:
    """Lines/s at which the busiest master would be at 100% of a core, at the measured mix."""
    return float(res["lines_s"] / max(max(res["masters_cpu"]), 1e-9))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="single,1,3",
                    help="comma-separated: single (one plain server) and/or cluster sizes")
    ap.add_argument("--nodes", type=int, default=256)
    ap.add_argument("--workers", type=int, default=4, help="workers per node")
    ap.add_argument("--chunk", type=int, default=16, help="lines per worker write")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="lines/s per worker, paced (0: as fast as the publishers take them)")
    ap.add_argument("--procs", type=int, default=2, help="producer processes")
    ap.add_argument("--maxlen", type=int, default=200, help="entries kept per log stream")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    rows = []
    for name in configs:
        res = run_config(name, args)
        rows.append(res)
        label = "single redis-server" if name == "single" else f"cluster, {name} master(s)"
        offered = (f", {args.nodes * args.workers * args.rate:,.0f} offered" if args.rate > 0
                   else "")
        print(f"{label}: {res['lines_s']:,.0f} lines/s shipped{offered} "
              f"({args.nodes} nodes x {args.workers} workers, {args.procs} producer processes "
              f"using {res['producers_cpu'] * 100:.0f}% of a core; {res['dropped']} dropped, "
              f"{res['retries']} failed sends retried; load average {res['load']:.1f} on "
              f"{os.cpu_count()} cores)", flush=True)
        for i, (cpu, cmds, n) in enumerate(zip(res["masters_cpu"], res["masters_cmds"],
                                               res["streams"])):
            print(f"  master {i}: {cpu * 100:5.1f}% of a core, {cmds:,.0f} commands/s, "
                  f"{n} of the job's log streams", flush=True)
        if max(res["masters_cpu"]) > 0:
            print(f"  busiest master's ceiling: {_ceiling(res):,.0f} lines/s "
                  "(lines/s over its share of a core)", flush=True)
    base = next((r for r in rows if r["config"] == "1"), None)
    for r in rows:
        if base is not None and r is not base and r["config"] != "single":
            print(f"{r['config']} masters vs 1: measured lines/s x"
                  f"{r['lines_s'] / base['lines_s']:.2f}; busiest master's ceiling x"
                  f"{_ceiling(r) / _ceiling(base):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
