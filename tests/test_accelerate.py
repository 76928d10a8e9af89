"""`accelerate launch` on the `redis` rendezvous backend, as docs/TORCHRUN.md tells it: one
machine, and two (two launchers on this host), on the CPU. accelerate runs
``torch.distributed.run`` in-process and gives it no ``--rdzv-endpoint`` (one machine, or two
with ``--same_network``): the plugin finds Redis in ``$ELASTIC_REDIS_URL``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import accelerate  # noqa: F401  (the test extra; a missing one fails here, not in a launch)

from elastic_agent.coordination.ports import free_port
from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.wire.keyspace import JobKeys

SCRIPTS = Path(__file__).parent / "scripts"
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))


def launch_env(redis_url: str, job_id: str, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    return {**env,
            "ELASTIC_REDIS_URL": redis_url,
            "PET_RDZV_ID": job_id,  # torchrun's --rdzv-id, which accelerate has no flag for
            "HF_HOME": str(tmp_path / "hf"),  # no accelerate config of the user's
            "GLOO_SOCKET_IFNAME": "lo"}


def accelerate_launch(*args: str) -> list[str]:
    return [ACCELERATE, "launch", "--multi_gpu", "--rdzv_backend", "redis",
            "--mixed_precision", "no", "--dynamo_backend", "no", *args,
            str(SCRIPTS / "accelerate_all_reduce.py")]


def check_one_job(out: Path, job_id: str, redis_url: str, ranks: int) -> None:
    reports = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(ranks)]
    assert [r["rank"] for r in reports] == list(range(ranks))
    assert {r["world"] for r in reports} == {ranks}
    assert {r["sum"] for r in reports} == {ranks * (ranks + 1) / 2}  # every rank in one sum
    assert {r["distributed_type"] for r in reports} == {"DistributedType.MULTI_CPU"}
    assert {r["run_id"] for r in reports} == {job_id}
    r = make_client(redis_url)
    try:
        # The launchers met in this Redis, and closed the job's rendezvous as they ended.
        assert r.hget(JobKeys(job_id).rdzv_state, "closed") == b"1"
    finally:
        r.close()


def test_one_machine(redis_url: str, job_id: str, tmp_path: Path) -> None:
    out = tmp_path / "report"
    cmd = accelerate_launch("--num_processes", "2", "--num_machines", "1",
                            "--main_process_port", "0")
    done = subprocess.run([*cmd, str(out)], env=launch_env(redis_url, job_id, tmp_path),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    text = done.stdout.decode(errors="replace")
    assert done.returncode == 0, text[-4000:]
    check_one_job(out, job_id, redis_url, 2)


def test_two_machines(redis_url: str, job_id: str, tmp_path: Path) -> None:
    """Two launchers, machine ranks 0 and 1. ``--same_network`` makes accelerate pass its main
    process address as torchrun's master address (unused by an elastic backend) instead of
    as the rendezvous endpoint; machine 0 checks that port is free, so it could never be
    the Redis server's."""
    out = tmp_path / "report"
    port = str(free_port("127.0.0.1"))
    env = launch_env(redis_url, job_id, tmp_path)
    procs = [subprocess.Popen(
        [*accelerate_launch("--num_processes", "2", "--num_machines", "2",
                            "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
                            "--main_process_port", port, "--same_network"), str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in (0, 1)]
    outputs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-4000:]
    check_one_job(out, job_id, redis_url, 2)
