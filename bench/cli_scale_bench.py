"""`elastic-console ls` and `status` for one job of 4,096 nodes x 8 ranks (issue 21, point 5).

Goal: both commands answer within 1 s for such a job.

Setup: a fresh ``redis-server`` on a free loopback port, and the records such a job leaves
there, written the way its agents write them (``console_bench.Feeder``: the protocol's
``encode_event`` for events; log entries byte for byte ``encode_node_log_entry``, see
tests/test_bench_feeder.py):

* the job index, the meta hash, the log-stream set (4,096 streams), the completed round's
  record (4,096 nodes), ``node_joined`` and ``workers_started`` of every node and the
  ``rendezvous_complete`` of the round;
* ``--history`` seconds of log lines at ``--rate`` lines/s in every node's stream;
* a failure and a restart: ``worker_exited`` of all 32,768 ranks (one with a traceback),
  ``group_failed``, ``restarting``, ``workers_stopped`` and ``workers_started`` attempt 2 of
  every node (~49k events in all);
* a resource sample of every rank (one hash of 32,768 fields), a heartbeat of every node
  (the sorted set scored with server time), and ``--other-jobs`` small finished jobs in the
  index (``ls`` lists them too).

Then each command runs ``--repeat`` times as a user runs it: ``elastic-console ...`` in a new
process (interpreter start and imports included), its output into a pipe and counted. The
median and the worst are printed, with the Redis commands each one sent (``INFO
commandstats``, so a read that walks every stream, rank or event shows as a count) and the
bytes it read from Redis.

Baseline: torchrun has no such commands (its state is in the logs of each node), so the
figure is printed against the goal itself. Exit status 0 when every run of both commands
answered within 1 s, 1 otherwise.

    python bench/cli_scale_bench.py [--ranks 32768] [--nproc-per-node 8] [--history 10]
                                    [--repeat 5] [--other-jobs 20]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.supervision.hosting.standalone import RedisServer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from console_bench import Feeder

GOAL_S = 1.0
BIG_JOB = "big-job"
COMMANDS = (("ls", []), ("ls --json", ["--json"]), ("status", None), ("status --json", None))


def build_job(r: redis.Redis, job: str, ranks: int, nproc: int, history: float,
              rate: float) -> dict[str, int]:
    """The records of a big job that ran ``history`` seconds, failed once and restarted."""
    feeder = Feeder(r, job, ranks, rate, seed=7, nproc=nproc)
    feeder.setup()
    lines = feeder.prefill(history)
    pipe = r.pipeline(transaction=False)
    feeder.fail_and_stop(pipe)
    feeder.restart(pipe)
    pipe.execute()
    feeder.resources()  # a sample of every rank, and every node's heartbeat
    k = JobKeys(job)
    return {"nodes": len(feeder.nodes), "lines": lines, "entries": feeder.entries_written,
            "events": int(r.xlen(k.events))}


def build_small_jobs(r: redis.Redis, n: int) -> None:
    """``n`` small jobs that ended (two nodes of 4 ranks, a few seconds of logs)."""
    from elastic_agent.coordination.wire.event_records import encode_event
    from elastic_agent.coordination.wire.keyspace import EVENTS_MAXLEN

    for i in range(n):
        job = f"small-{i:03d}"
        feeder = Feeder(r, job, 8, 1000, seed=i, nproc=4)
        feeder.setup()
        feeder.prefill(2)
        r.xadd(JobKeys(job).events, encode_event(EventType.JOB_SUCCEEDED, feeder.nodes[0].node,
                                                 {}, 99), maxlen=EVENTS_MAXLEN, approximate=True)
        r.hset(JobKeys(job).meta, "final_state", "succeeded")


def beat(r: redis.Redis) -> None:
    """Every node of the big job heartbeats now (rendezvous.py: a sorted set scored with server
    time), as its agents do every few seconds: the job is running, not lost."""
    k = JobKeys(BIG_JOB)
    secs, micros = r.time()
    now_ms = int(secs) * 1000 + int(micros) // 1000
    nodes = [n.decode() for n in r.zrange(k.rdzv_heartbeats, 0, -1)]
    r.zadd(k.rdzv_heartbeats, dict.fromkeys(nodes, now_ms))


def commandstats(r: redis.Redis) -> dict[str, int]:
    """Calls per Redis command so far (``INFO commandstats``)."""
    return {name.removeprefix("cmdstat_"): int(v["calls"])
            for name, v in r.info("commandstats").items()}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_command(url: str, argv: list[str]) -> tuple[float, float, int, int]:
    """Wall seconds of ``elastic-console argv`` in a new process, its CPU seconds (user +
    system: what the machine's other load does not inflate), its exit status and the lines
    it printed."""
    cmd = [sys.executable, "-m", "elastic_console.cli", "--redis", url, *argv]
    cpu0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, check=False)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr.decode(errors="replace"))
    return wall, cpu, proc.returncode, proc.stdout.count(b"\n")


def measure(url: str, r: redis.Redis, argv: list[str], repeat: int) -> dict[str, Any]:
    walls, cpus = [], []
    calls: dict[str, int] = {}
    read = 0
    code = lines = 0
    for _ in range(repeat):
        beat(r)
        before, net0 = commandstats(r), int(r.info("stats")["total_net_output_bytes"])
        wall, cpu, code, lines = run_command(url, argv)
        after, net1 = commandstats(r), int(r.info("stats")["total_net_output_bytes"])
        walls.append(wall)
        cpus.append(cpu)
        # Less this measurement's own INFO calls (and their replies, a few KiB).
        calls = {c: n - before.get(c, 0) for c, n in after.items()
                 if n - before.get(c, 0) > 0 and c != "info"}
        read = net1 - net0
    return {"median": statistics.median(walls), "max": max(walls),
            "cpu": statistics.median(cpus), "code": code,
            "lines": lines, "calls": calls, "read": read}


def python_start(repeat: int) -> tuple[float, float]:
    """The interpreter start and the CLI's imports alone (``--help``): median wall and CPU
    seconds."""
    walls, cpus = [], []
    for _ in range(repeat):
        cpu0, t0 = _children_cpu(), time.perf_counter()
        subprocess.run([sys.executable, "-m", "elastic_console.cli", "--help"],
                       stdout=subprocess.DEVNULL, check=True)
        walls.append(time.perf_counter() - t0)
        cpus.append(_children_cpu() - cpu0)
    return statistics.median(walls), statistics.median(cpus)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", type=int, default=32_768)
    parser.add_argument("--nproc-per-node", type=int, default=8)
    parser.add_argument("--history", type=float, default=10.0,
                        help="seconds of log lines in the node streams (default 10)")
    parser.add_argument("--rate", type=float, default=50_000.0, help="lines/s of that history")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--other-jobs", type=int, default=20)
    args = parser.parse_args(argv)
    server = RedisServer()
    server.start()
    try:
        r = make_client(server.url)
        version = r.info("server")["redis_version"]
        job = BIG_JOB
        t0 = time.perf_counter()
        built = build_job(r, job, args.ranks, args.nproc_per_node, args.history, args.rate)
        build_small_jobs(r, args.other_jobs)
        used = int(r.info("memory")["used_memory"])
        print(f"cli scale bench: job {job}: {built['nodes']:,} nodes x {args.nproc_per_node} = "
              f"{args.ranks:,} ranks, {built['events']:,} events, {built['entries']:,} log "
              f"entries ({built['lines']:,} lines) in {built['nodes']:,} streams, "
              f"+{args.other_jobs} small finished jobs; Redis {version} holds "
              f"{used / 2**20:,.0f} MiB (built in {time.perf_counter() - t0:.0f} s); "
              f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, median of "
              f"{args.repeat}", flush=True)
        start = python_start(args.repeat)
        rows = []
        ok = True
        for label, extra in COMMANDS:
            cmd = ["ls", *extra] if extra is not None else ["status", job, *label.split()[1:]]
            res = measure(server.url, r, cmd, args.repeat)
            ok = ok and res["code"] == 0 and res["max"] <= GOAL_S
            rows.append((label, res))
        print()
        print(f"{'command':<15} {'median s':>9} {'max s':>7} {'/ goal':>7} {'CPU s':>6} "
              f"{'lines out':>10} {'Redis read':>11}  Redis commands per run")
        for label, res in rows:
            calls = ", ".join(f"{c} {n:,}" for c, n in sorted(res["calls"].items(),
                                                               key=lambda kv: -kv[1]))
            print(f"{label:<15} {res['median']:>9.2f} {res['max']:>7.2f} "
                  f"{res['max'] / GOAL_S:>6.2f}x {res['cpu']:>6.2f} {res['lines']:>10,} "
                  f"{res['read'] / 2**20:>8.1f} MiB  {calls}")
        print(f"\n(interpreter start and imports alone, `--help`: {start[0]:.2f} s, "
              f"{start[1]:.2f} s CPU; machine load average {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} CPUs)")
        print(f"goal: each within {GOAL_S:g} s: " + ("holds" if ok else "NOT shown"))
        print("baseline: the goal itself; torchrun has no ls or status")
        r.close()
        return 0 if ok else 1
    finally:
        server.cleanup()


if __name__ == "__main__":
    raise SystemExit(main())
