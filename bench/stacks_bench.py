"""Stacks of every rank (issue 13): how long from the request to grouped stacks, and what the
stack handler costs a worker nobody asks.

Latency: a real job on this machine (a private redis-server, real ``elastic-agent`` processes,
tiny Python workers that sleep: 256 torch processes would not fit), ``--agents`` x
``--nproc`` ranks. Each request is what ``elastic-console stacks`` does: ``request_stacks``
(the command, every agent signals its workers and publishes one reply per rank, the replies
read back) and ``group_stacks``; timed from the call to the groups, ``--requests`` times,
p50/p95 printed. ``--screen`` also times the console's key: ``d`` delivered to the app
(headless, ``run_test``) to the groups in the stacks screen's tree.

Overhead: a CPU-bound worker's loop timed started as ``python -u loop.py`` and as the agent
starts it (``python -u zygote.py --worker loop.py`` with the handler registered on a FIFO
held open), alternated ``--overhead-runs`` times; medians and their difference printed. The
handler is a ``sigaction``: nothing runs until the signal comes, so the expected cost is none.

    python bench/stacks_bench.py                      # 64 ranks / 8 agents, 256 / 32
    python bench/stacks_bench.py --sizes 64x8 --requests 20 --screen
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from elastic_agent.coordination.transport.connection import make_async_client, make_client
from elastic_agent.coordination.wire.command_records import Command, encode_command
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.stack_dumps import group_line, group_stacks
from elastic_agent.coordination.wire.stack_replies import request_stacks
from elastic_agent.supervision.hosting.standalone import RedisServer
from elastic_agent.supervision.launch import probes

SLEEPER = """\
import time

def idle():
    time.sleep(3600)

print("up", flush=True)
idle()
"""

# The same loop in a function (where training code runs) and at the top level of the script
# (names in the module's dict). CPU time: other processes on the machine do not count.
LOOPS = {
    "in a function": """\
import sys, time
def loop(n):
    x = 0
    for i in range(n):
        x += i * i
    return x
t = time.process_time()
loop(int(sys.argv[1]))
print(time.process_time() - t)
""",
    "at module level": """\
import sys, time
n = int(sys.argv[1])
t = time.process_time()
x = 0
for i in range(n):
    x += i * i
print(time.process_time() - t)
""",
}


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(p / 100 * len(values) + 0.5) - 1))]


def start_job(url: str, job: str, agents: int, nproc: int, tmp: Path) -> list[subprocess.Popen]:
    script = tmp / "sleeper.py"
    script.write_text(SLEEPER)
    procs = []
    for i in range(agents):
        out = open(tmp / f"agent{i}.out", "wb")  # noqa: SIM115 - the agent's for its life
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "elastic_agent.supervision.cli", "--redis", url,
             "--job-id", job, "--nnodes", str(agents), "--nproc-per-node", str(nproc),
             "--local-addr", "127.0.0.1", "--log-dir", str(tmp / "logs"), "-r", "3",
             "--rdzv-conf=last_call_timeout=2,join_timeout=300", str(script)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def stop_job(url: str, job: str, procs: list[subprocess.Popen]) -> None:
    r = make_client(url)
    r.xadd(JobKeys(job).commands, encode_command(Command("bench-stop", "stop", "bench@host")))
    deadline = time.monotonic() + 60
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    r.close()


async def latencies(url: str, job: str, ranks: int, requests: int) -> tuple[list[float], str]:
    client = make_async_client(url, blocking_ms=2000)
    try:
        deadline = time.monotonic() + 600
        while True:  # every rank up, its handler registered: one full answer
            _, found = await request_stacks(client, job, "bench@host", timeout=10)
            if len(found) == ranks and all(s.threads for s in found):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the job never answered with {ranks} ranks")
            await asyncio.sleep(1)  # workers still starting: ask again
        out = []
        line = ""
        for _ in range(requests):
            t = time.perf_counter()
            _, found = await request_stacks(client, job, "bench@host", timeout=10)
            groups = group_stacks(found)
            out.append(time.perf_counter() - t)
            assert sum(len(g.ranks) for g in groups) == ranks
            line = group_line(groups[0])
        return out, line
    finally:
        await client.aclose()


async def screen_latencies(url: str, job: str, requests: int) -> list[float]:
    from elastic_agent.coordination.transport.endpoints import parse_endpoint
    from elastic_console.tui.app import ConsoleApp
    from elastic_console.tui.widgets.stacks import StacksScreen

    app = ConsoleApp(job, endpoint=parse_endpoint(url), cursor_blink=False)
    out = []
    def until(done: Callable[[], bool], what: str) -> Awaitable[None]:
        async def wait() -> None:
            deadline = time.monotonic() + 120
            while not done():
                if time.monotonic() > deadline:
                    raise SystemExit(f"the console never showed {what}: {app.notes[-3:]}")
                await asyncio.sleep(0.005)  # Pilot has no event for "filled": look often
        return wait()

    async with app.run_test(size=(140, 40)):
        app.notes = []
        app.notify = lambda message, **kw: app.notes.append(message)  # type: ignore[method-assign]
        await until(lambda: app.loaded, "the job")  # the history is read before keys act
        for _ in range(requests):
            t = time.perf_counter()
            # As a terminal delivers it (Pilot's press also waits for the app to be idle).
            app.simulate_key("d")
            # The groups are in the screen's tree the moment its result is set (drawn at the
            # next frame).
            await until(lambda: isinstance(app.screen, StacksScreen)
                        and app.screen.result is not None, "the stacks")
            out.append(time.perf_counter() - t)
            app.simulate_key("escape")
            await until(lambda: not isinstance(app.screen, StacksScreen), "the screen closed")
    return out


def overhead(tmp: Path, runs: int, n: int, source: str) -> dict[str, list[float]]:
    """CPU seconds of the loop per run, for: ``python -u loop.py``; the agent's bootstrap
    without the handler (``zygote.py --worker``, no variable); and as the agent starts it
    (bootstrap and handler on a FIFO held open). Alternated, so drift hits all three."""
    loop = tmp / f"loop-{uuid.uuid4().hex[:6]}.py"
    loop.write_text(source)
    fifo = tmp / f"stacks-{uuid.uuid4().hex[:6]}.fifo"
    os.mkfifo(fifo, 0o600)
    reader = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # held open, as the agent does
    plain = [sys.executable, "-u", str(loop), str(n)]
    armed_env = {**os.environ, **probes.worker_vars(probes.DEFAULT_SIGNAL, fifo)}
    variants = {"plain": (plain, os.environ),
                "bootstrap only": (probes.boot_argv(plain), os.environ),
                "bootstrap + handler": (probes.boot_argv(plain), armed_env)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for _ in range(runs):
            for name, (argv, env) in variants.items():
                out = subprocess.run(argv, capture_output=True, text=True, env=env, check=True)
                times[name].append(float(out.stdout.strip().splitlines()[-1]))
    finally:
        os.close(reader)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64x8,256x32", help="RANKSxAGENTS,... (default 64x8,256x32)")
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--screen", action="store_true", help="also time the console's d key")
    p.add_argument("--overhead-runs", type=int, default=7)
    p.add_argument("--loop", type=int, default=5_000_000, help="iterations of the CPU loop")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="stacks-bench-"))
    server = RedisServer().start()
    try:
        print(f"stack collection latency ({a.requests} requests each; tiny sleeping workers; "
              f"{os.cpu_count()} cores)")
        for size in a.sizes.split(","):
            ranks, agents = (int(x) for x in size.split("x"))
            job = f"bench-{uuid.uuid4().hex[:6]}"
            where = tmp / job
            where.mkdir()
            t0 = time.monotonic()
            procs = start_job(server.url, job, agents, ranks // agents, where)
            try:
                lat, first = asyncio.run(latencies(server.url, job, ranks, a.requests))
                up = time.monotonic() - t0
                print(f"  {ranks:4d} ranks / {agents:2d} agents: request -> grouped stacks "
                      f"p50 {statistics.median(lat):.3f} s, p95 {pct(lat, 95):.3f} s, max "
                      f"{max(lat):.3f} s  (job up and answering after {up:.0f} s; first group: "
                      f"{first})")
                if a.screen:
                    scr = asyncio.run(screen_latencies(server.url, job, a.requests))
                    print(f"  {'':4s}{'':26s}key d -> groups on screen p50 "
                          f"{statistics.median(scr):.3f} s, p95 {pct(scr, 95):.3f} s")
            finally:
                stop_job(server.url, job, procs)
        if a.overhead_runs < 1:
            return
        print(f"worker overhead when unused ({a.loop:,} iterations of a CPU loop; CPU seconds, "
              f"median and best of {a.overhead_runs} alternated runs):")
        for where, source in LOOPS.items():
            times = overhead(tmp, a.overhead_runs, a.loop, source)
            base = statistics.median(times["plain"])
            cells = [f"{k} {statistics.median(v):.3f} s ({(statistics.median(v) - base) / base * 100:+.1f}%, "
                     f"best {min(v):.3f})" for k, v in times.items()]
            print(f"  loop {where}: " + "; ".join(cells))
    finally:
        server.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
