"""How late a store wait that times out returns: TorchRedisStore beside torch's own stores.

A wait on a key nobody sets, with a timeout of 1, 10, 50 and 250 ms; the overshoot is the time
it took minus its timeout. torch's barrier tracing (``torch.distributed.elastic.utils.store``)
waits 10 ms, then 1 ms per rank, so a store whose short waits come back 100 ms late fails it.
Redis checks a blocked command's own timeout on its ``hz`` tick (10 a second by default):
the store must end its waits itself. The private redis-server runs with ``--hz`` (default 10,
Redis's default).

    python bench/store_wait_bench.py                  # 40 waits per timeout, hz 10
    python bench/store_wait_bench.py --waits 100 --hz 100
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

# TCPStore logs a warning line for every wait that times out.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch.distributed as dist

from elastic_agent.coordination.ports import free_port
from elastic_agent.coordination.torch_compat import TorchRedisStore
from elastic_agent.supervision.hosting.standalone import RedisServer

TIMEOUTS_MS = (1, 10, 50, 250)


def overshoots(wait: Callable[[timedelta], None], timeout_ms: int, n: int) -> list[float]:
    """Milliseconds past ``timeout_ms`` each of ``n`` timed-out waits returned."""
    late = []
    for _ in range(n):
        started = time.perf_counter()
        try:
            wait(timedelta(milliseconds=timeout_ms))
        except dist.DistStoreError:
            pass
        else:
            raise SystemExit("a wait on a key nobody sets returned without timing out")
        late.append((time.perf_counter() - started) * 1000 - timeout_ms)
    return late


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--waits", type=int, default=40, help="waits per timeout and store")
    parser.add_argument("--hz", type=int, default=10, help="the redis-server's hz")
    args = parser.parse_args()

    server = RedisServer(extra_args=["--hz", str(args.hz)]).start()
    tcp = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))
    ours = TorchRedisStore(server.url, "store-wait-bench", "bench", timeout=30)
    stores: dict[str, Callable[[timedelta], None]] = {
        "TorchRedisStore wait": lambda t: ours.wait(["never"], t),
        "TorchRedisStore get": lambda t: _get_within(ours, t),
        "HashStore wait": (lambda h: lambda t: h.wait(["never"], t))(dist.HashStore()),
        "TCPStore wait": lambda t: tcp.wait(["never"], t),
    }
    try:
        print(f"redis-server hz {args.hz}; {args.waits} waits per row; overshoot past the "
              f"timeout, ms (median / p95)")
        print(f"{'store':<22}" + "".join(f"{f'{t} ms':>16}" for t in TIMEOUTS_MS))
        for name, wait in stores.items():
            cells = []
            for timeout_ms in TIMEOUTS_MS:
                late = overshoots(wait, timeout_ms, args.waits)
                cells.append(f"{statistics.median(late):6.1f} / {p95(late):6.1f}")
            print(f"{name:<22}" + "".join(f"{c:>16}" for c in cells))
    finally:
        ours.close()
        server.cleanup()


def _get_within(store: TorchRedisStore, timeout: timedelta) -> None:
    # get takes the store's timeout, as torch's get does.
    store.set_timeout(timeout)
    store.get("never")


if __name__ == "__main__":
    main()
