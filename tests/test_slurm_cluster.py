"""elastic-agent under a real SLURM: a two-node cluster on this host (tests/slurm.py: munged,
slurmctld, ``slurmd -N n1`` and ``-N n2``), jobs started with srun and sbatch as a user would.

Never skipped: a machine without SLURM fails here saying how to get it (make test installs
it through scripts/ensure-tools.sh).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from elastic_agent.coordination.protocol import JobKeys
from tests.agents import EXAMPLES, ROOT
from tests.slurm import SlurmCluster

AGENT = [sys.executable, "-m", "elastic_agent.supervision.cli"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    c = SlurmCluster().start()  # raises (the tests fail) when SLURM cannot run here
    c.env.update({"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
                  "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
                  "ELASTIC_STANDALONE_LINGER": "0"})
    c.env.pop("ELASTIC_REDIS_URL", None)
    yield c
    c.cleanup()


def srun(cluster: SlurmCluster, *args: str, env: dict[str, str] | None = None,
         timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return cluster.run("srun", "-N2", "-n2", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
                       *AGENT, *args, check=False, timeout=timeout, env=env or {},
                       cwd=str(ROOT))


def hellos(out: str) -> set[tuple[int, int]]:
    return {(int(r), int(w)) for r, w in re.findall(r"hello from rank (\d+) of (\d+)", out)}


def test_srun_forms_one_job_of_world_4_with_a_given_redis(cluster: SlurmCluster,
                                                         redis_url: str,
                                                         r: redis.Redis) -> None:
    proc = srun(cluster, "--nproc-per-node", "2", str(EXAMPLES / "hello.py"),
                env={"ELASTIC_REDIS_URL": redis_url})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert hellos(proc.stdout) == {(rank, 4) for rank in range(4)}, proc.stdout
    job = re.search(r"slurm-\d+\.0", proc.stdout + proc.stderr)
    assert job is not None, proc.stdout + proc.stderr
    assert r.hget(JobKeys(job.group()).meta, "final_state") == b"succeeded"


def test_srun_with_no_redis_at_all_hosts_one_on_the_first_node(cluster: SlurmCluster) -> None:
    proc = srun(cluster, "--nproc-per-node", "2", str(EXAMPLES / "hello.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert hellos(proc.stdout) == {(rank, 4) for rank in range(4)}, proc.stdout + proc.stderr
    attach = re.findall(r"elastic-console attach (slurm-\d+\.0) --redis redis://127\.0\.0\.1:\d+",
                        proc.stderr)
    assert len(attach) == 1, proc.stderr  # printed once, by the node that hosts it
    assert "single point of failure" in proc.stderr
