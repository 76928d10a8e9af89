"""Rendezvous time, Redis backend against torch's c10d backend, in one run.

N simulated nodes (threads, as in torch's own tests) each get a handler from torch's
registry -- ``get_rendezvous_handler(RendezvousParameters(backend=...))`` -- and call
``next_rendezvous()`` once; the figure is the time from the first thread's start until every
node holds its rank. "redis" runs on a fresh redis-server on loopback; "c10d" is torch's
DynamicRendezvousHandler on a TCPStore on loopback.

    python bench/rendezvous_bench.py [--nodes 4,16,64,256] [--c10d-timeout 120]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
import uuid

from elastic_agent.coordination.ports import free_port
from elastic_agent.supervision.hosting.standalone import RedisServer


def rendezvous_time(backend: str, endpoint: str, n: int, timeout: float) -> float | None:
    """Seconds until all ``n`` nodes hold a rank; None if they did not within ``timeout``."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    run_id = f"bench-{backend}-{n}-{uuid.uuid4().hex[:6]}"
    ranks: list[int] = []
    handlers = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def node() -> None:
        try:
            params = RendezvousParameters(
                backend=backend, endpoint=endpoint, run_id=run_id, min_nodes=n, max_nodes=n,
                join_timeout=str(int(timeout)), local_addr="127.0.0.1",
            )
            handler = get_rendezvous_handler(params)
            with lock:
                handlers.append(handler)
            info = handler.next_rendezvous()
            with lock:
                ranks.append(info.rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=node, daemon=True) for _ in range(n)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    deadline = started + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    took = time.perf_counter() - started
    complete = len(ranks) == n and sorted(ranks) == list(range(n))
    for h in handlers:
        with contextlib.suppress(Exception):  # clean-up only
            h.shutdown()
    if errors and not complete:
        print(f"  {backend} N={n}: {type(errors[0]).__name__}: {errors[0]}", file=sys.stderr)
    return took if complete else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="4,16,64,256", help="comma-separated node counts")
    parser.add_argument("--repeat", type=int, default=1, help="runs per figure (median)")
    parser.add_argument("--c10d-timeout", type=float, default=120.0,
                        help="give up on a c10d run after this many seconds")
    parser.add_argument("--redis-timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.nodes.split(",")]

    print(f"{'N':>5} {'redis (s)':>10} {'c10d (s)':>10} {'redis/c10d':>11}")
    ok = True
    with RedisServer() as server:
        endpoint = f"127.0.0.1:{server.port}"
        for n in counts:
            redis_runs = [rendezvous_time("redis", endpoint, n, args.redis_timeout)
                          for _ in range(args.repeat)]
            c10d_runs = [rendezvous_time("c10d", f"127.0.0.1:{free_port()}", n, args.c10d_timeout)
                         for _ in range(args.repeat)]
            r = _median(redis_runs)
            c = _median(c10d_runs)
            rs = f"{r:10.3f}" if r is not None else f"{'>' + format(args.redis_timeout, 'g'):>10}"
            cs = f"{c:10.3f}" if c is not None else f"{'>' + format(args.c10d_timeout, 'g'):>10}"
            if r is not None and c is not None:
                ratio = f"{r / c:11.3f}"
            elif r is not None:
                ratio = f"{'<' + format(r / args.c10d_timeout, '.3f'):>11}"
            else:
                ratio = f"{'n/a':>11}"
            print(f"{n:>5} {rs} {cs} {ratio}", flush=True)
            ok = ok and r is not None
    return 0 if ok else 1


def _median(values: list[float | None]) -> float | None:
    done = [v for v in values if v is not None]
    return statistics.median(done) if len(done) == len(values) else None


if __name__ == "__main__":
    sys.exit(main())
