"""The `redis` rendezvous backend through torch: the registry, the handler contract, two real
torchrun processes forming one 4-worker job, and two whose workers finish seconds apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elastic_agent.coordination.torch_compat import TorchRedisStore
from tests.waiting import wait_until

SCRIPTS = Path(__file__).parent / "scripts"


def params(redis_url: str, job: str, n: int = 1, **conf: str) -> RendezvousParameters:
    endpoint = redis_url.removeprefix("redis://")
    return RendezvousParameters(backend="redis", endpoint=endpoint, run_id=job,
                                min_nodes=n, max_nodes=n, local_addr="127.0.0.1", **conf)


def test_registry_creates_the_redis_handler(redis_url: str, job_id: str) -> None:
    handler = get_rendezvous_handler(params(redis_url, job_id, last_call_timeout="1.5",
                                            join_timeout="20", heartbeat_timeout="4",
                                            keep_alive_interval="0.5"))
    assert isinstance(handler, RendezvousHandler)
    assert handler.get_backend() == "redis" and handler.get_run_id() == job_id
    s = handler.core.settings
    assert (s.last_call_timeout, s.join_timeout, s.heartbeat_timeout,
            s.keep_alive_interval) == (1.5, 20, 4, 0.5)
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert info.bootstrap_store_info.master_addr == "127.0.0.1"
    assert isinstance(info.store, TorchRedisStore)
    info.store.set("k", b"v")
    assert info.store.get("k") == b"v"
    assert handler.num_nodes_waiting() == 0 and not handler.use_agent_store
    handler.set_closed()
    assert handler.is_closed()
    with pytest.raises(RendezvousClosedError):
        get_rendezvous_handler(params(redis_url, job_id)).next_rendezvous()
    assert handler.shutdown()


def test_bad_rdzv_conf_value_is_a_clear_error(redis_url: str, job_id: str) -> None:
    with pytest.raises(ValueError, match="last_call_timeout='soon' is not a number"):
        get_rendezvous_handler(params(redis_url, job_id, last_call_timeout="soon"))


def test_two_torchrun_processes_run_one_four_worker_job(redis_url: str, job_id: str,
                                                        tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    out = tmp_path / "report"
    endpoint = redis_url.removeprefix("redis://")
    cmd = [str(torchrun), "--rdzv-backend", "redis", "--rdzv-endpoint", endpoint,
           "--rdzv-id", job_id, "--nnodes", "2", "--nproc-per-node", "2",
           "--local-addr", "127.0.0.1", "--rdzv-conf", "join_timeout=60",
           str(SCRIPTS / "report_env.py"), str(out)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-3000:]
    reports = [json.loads((tmp_path / f"report.{r}").read_text()) for r in range(4)]
    assert sorted(int(r["RANK"]) for r in reports) == [0, 1, 2, 3]
    assert {r["WORLD_SIZE"] for r in reports} == {"4"}
    assert {r["TORCHELASTIC_RUN_ID"] for r in reports} == {job_id}
    assert {r["sum"] for r in reports} == {6.0}  # gloo all_reduce across both torchruns
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in reports}) == 1


def test_nodes_that_finish_apart_exit_together_without_a_restart(redis_url: str, job_id: str,
                                                                 tmp_path: Path) -> None:
    """torchrun's agent shuts its handler down when it ends, after an exit barrier (1 s here).
    The worker of group rank 0 finishes at once; the other node's worker finishes 3 s after
    rank 0's torchrun has exited. That node must see a closed rendezvous, not a node waiting to
    join: no restart of its worker group, no new rendezvous that nobody comes to (join timeout
    20 s, then exit 1)."""
    log, go = tmp_path / "runs", tmp_path / "go"
    endpoint = redis_url.removeprefix("redis://")
    cmd = [sys.executable, str(SCRIPTS / "torchrun_exit_barrier.py"),
           "--rdzv-backend", "redis", "--rdzv-endpoint", endpoint, "--rdzv-id", job_id,
           "--nnodes", "2", "--nproc-per-node", "1", "--local-addr", "127.0.0.1",
           "--rdzv-conf", "join_timeout=20,last_call_timeout=1",
           str(SCRIPTS / "finish_apart.py"), str(log), str(go), "3"]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "EXIT_BARRIER_TIMEOUT": "1"}
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for _ in range(2)]
    outputs: dict[int, str] = {}
    ended: dict[int, float] = {}

    def reap(i: int) -> None:
        outputs[i] = procs[i].communicate(timeout=120)[0].decode(errors="replace")
        ended[i] = time.time()  # the workers' clock: they note time.time()

    reapers = [threading.Thread(target=reap, args=(i,)) for i in range(2)]
    for t in reapers:
        t.start()

    def runs() -> list[list[str]]:
        return [line.split() for line in log.read_text().splitlines()] if log.exists() else []

    first = wait_until(lambda: [int(f[2]) for f in runs() if f[:2] == ["finish", "0"]],
                       timeout=90, what="rank 0 finished")[0]
    (a,) = [i for i, p in enumerate(procs) if p.pid == first]
    reapers[a].join(60)
    assert a in ended, "rank 0's torchrun did not exit"
    go.touch()
    for t in reapers:
        t.join()
    for p in procs:
        assert p.returncode == 0, "\n".join(outputs.values())[-4000:]
    for text in outputs.values():
        assert "will restart worker group" not in text, text[-4000:]
    starts = sorted(int(f[1]) for f in runs() if f[0] == "start")
    finishes = {int(f[1]): float(f[3]) for f in runs() if f[0] == "finish"}
    assert starts == [0, 1], runs()  # each worker ran once
    assert sorted(finishes) == [0, 1] and {f[4] for f in runs() if f[0] == "finish"} == {"2"}
    assert finishes[1] - ended[a] >= 3  # the other node's worker outlived rank 0's torchrun
    # Seconds here are the worker's and torchrun's own exits (torch's finalization alone took
    # 1.4-5 s on this loaded 2-core host, c10d's runs too). The bound catches a wait in a
    # rendezvous (20 s, then exit 1), not a slow exit.
    assert max(ended.values()) - finishes[1] < 15, (ended, finishes)
