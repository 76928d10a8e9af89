"""Redis connections per role (issue 21), the figures behind the README's sizing of
``maxclients``: an agent, a worker that uses the torch store on ``ELASTIC_REDIS_URL``, and an
attached console.

A private redis-server; one ``elastic-agent`` with ``--nproc`` workers that each build a
``TorchRedisStore`` from ``ELASTIC_REDIS_URL``, form a gloo group on it and all-reduce once;
then ``elastic-console attach`` (headless, ``run_test``) on the job for a few seconds. Each
process's established TCP connections to the Redis port are counted (most seen while
sampling), and Redis's own ``connected_clients`` beside them.

    python bench/connections.py                 # 2 workers
    python bench/connections.py --nproc 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import redis

from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.supervision.hosting.standalone import RedisServer

WORKER = '''
import os, time
import torch, torch.distributed as dist
from elastic_agent.coordination.torch_compat import TorchRedisStore
store = TorchRedisStore(os.environ["ELASTIC_REDIS_URL"], os.environ["ELASTIC_JOB_ID"], "pg",
                        timeout=120)
dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                        world_size=int(os.environ["WORLD_SIZE"]))
t = torch.ones(1)
dist.all_reduce(t)
dist.barrier()
print("store-ready", flush=True)
time.sleep(600)
'''


def sockets(pid: int, port: int) -> int:
    try:
        conns = psutil.Process(pid).net_connections("tcp")
    except psutil.Error:
        return 0
    return sum(1 for c in conns if c.raddr and c.raddr.port == port
               and c.status == psutil.CONN_ESTABLISHED)


def most_over(seconds: float, count: Callable[[], int]) -> int:
    most, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        most = max(most, count())
        time.sleep(0.02)
    return most


async def console_connections(url: str, job: str, port: int, seconds: float) -> int:
    from elastic_console.tui.app import ConsoleApp

    app = ConsoleApp(job, endpoint=parse_endpoint(url))
    mine = os.getpid()
    most = 0
    async with app.run_test(size=(160, 48)) as pilot:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await pilot.pause(0.05)
            most = max(most, sockets(mine, port) - 1)  # minus this script's own client
    return most


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=4.0, help="sampling time per role")
    args = ap.parse_args()
    server = RedisServer().start()
    tmp = Path(tempfile.mkdtemp(prefix="connections-bench-"))
    worker = tmp / "store_worker.py"
    worker.write_text(WORKER)
    job = f"conns-{os.getpid()}"
    out = tmp / "agent.out"
    agent = subprocess.Popen(
        [sys.executable, "-m", "elastic_agent.supervision.cli", "--redis", server.url,
         "--job-id", job, "--local-addr", "127.0.0.1", "--nproc-per-node", str(args.nproc),
         str(worker)], stdout=out.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    r = redis.Redis(port=server.port)
    try:
        deadline = time.monotonic() + 180
        while out.read_text(errors="replace").count("store-ready") < args.nproc:
            if time.monotonic() > deadline or agent.poll() is not None:
                print(out.read_text(errors="replace")[-3000:], file=sys.stderr)
                return 1
            time.sleep(0.1)
        workers = [p for p in psutil.Process(agent.pid).children(recursive=True)
                   if sockets(p.pid, server.port)]
        held = most_over(args.seconds, lambda: sockets(agent.pid, server.port))
        per_worker = [sockets(p.pid, server.port) for p in workers]
        clients = int(r.info("clients")["connected_clients"]) - 1
        print(f"agent ({args.nproc} workers)          {held}")
        print(f"workers using the torch store    {per_worker}")
        print(f"Redis connected_clients (job)    {clients}")
        print(f"elastic-console attach           "
              f"{asyncio.run(console_connections(server.url, job, server.port, args.seconds))}")
    finally:
        os.killpg(agent.pid, 9)
        agent.wait()
        r.close()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
