"""SLURM's variables as an agent under srun sees them (agent/supervision/hosting/slurm.py), and what
the command line makes of them: defaults only, explicit flags win, bad values one line + 2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from elastic_agent.coordination.ports import free_port
from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.transport.job_secret import JOB_SECRET_ENV, JobSecret
from elastic_agent.coordination.wire.keyspace import console_client_name
from elastic_agent.supervision.config import UsageError, parse_args
from elastic_agent.supervision.hosting import slurm_redis
from elastic_agent.supervision.hosting.slurm import (
    SlurmEnvError,
    expand_hostlist,
    gpus_per_node,
    read_step,
    redis_port,
)

HELLO = os.path.join(os.path.dirname(__file__), "..", "examples", "hello.py")


SECRET = "0123456789abcdef" * 4  # what examples/slurm.sbatch exports (openssl rand -hex 32)


def srun_env(**extra: str) -> dict[str, str]:
    """What slurmstepd gives task 1 of ``srun -N2 -n2`` (seen on the test cluster), from a
    batch script that exports the job's secret as examples/slurm.sbatch does."""
    env = {"SLURM_JOB_ID": "517542", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
           "SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "n[1-2]",
           "SLURMD_NODENAME": "n2", JOB_SECRET_ENV: SECRET}
    env.update(extra)
    return {k: v for k, v in env.items() if v != "<unset>"}


@pytest.mark.parametrize(("spec", "hosts"), [
    ("n1", ["n1"]),
    ("n[1-3,5],gpu07", ["n1", "n2", "n3", "n5", "gpu07"]),
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
    ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
    ("a,b[9-10].ib", ["a", "b9.ib", "b10.ib"]),
    ("n[7]", ["n7"]),
])
def test_hostlists_expand_in_order_with_their_padding(spec: str, hosts: list[str]) -> None:
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["", ",", "n[1-3", "n1-3]", "n[[1]]", "n[3-1]", "n[a-b]",
                                  "n[1-]", "n[-2]", "n[0-999999999]", "n[1-400],m[1-400]",
                                  "bad host", "n$(reboot)"])
def test_hostile_hostlists_are_refused_in_one_line(spec: str) -> None:
    with pytest.raises(SlurmEnvError) as err:
        expand_hostlist(spec, limit=500)
    assert "\n" not in str(err.value) and len(str(err.value)) < 200


def test_a_step_gives_the_job_id_the_node_count_and_the_first_node() -> None:
    step = read_step(srun_env())
    assert step is not None
    assert (step.elastic_job_id, step.nnodes, step.nodes) == ("slurm-517542.0", 2, ("n1", "n2"))
    assert not step.is_first_node and read_step(srun_env(SLURMD_NODENAME="n1")).is_first_node
    assert read_step(srun_env(SLURM_STEP_ID="3")).elastic_job_id == "slurm-517542.3"
    assert read_step(srun_env(SLURM_RESTART_COUNT="2")).restart_count == 2


def test_no_step_outside_srun() -> None:
    assert read_step({}) is None
    assert read_step({"SLURM_JOB_ID": "5", "SLURM_NNODES": "2"}) is None  # a batch shell


def test_the_redis_port_is_the_same_on_every_node_and_can_be_given() -> None:
    a, b = read_step(srun_env()), read_step(srun_env(SLURMD_NODENAME="n1", SLURM_NODEID="0"))
    assert redis_port(a, {}) == redis_port(b, {}) and 20000 <= redis_port(a, {}) < 32768
    assert redis_port(a, {}) != redis_port(read_step(srun_env(SLURM_STEP_ID="1")), {})
    assert redis_port(a, {"ELASTIC_SLURM_REDIS_PORT": "7000"}) == 7000
    # Below the ephemeral ports (32768-60999 on Linux), whatever the job: a port an outgoing
    # connection holds cannot be listened on.
    ports = {redis_port(read_step(srun_env(SLURM_JOB_ID=str(j))), {})
             for j in range(1, 100_000, 97)}
    assert min(ports) >= 20000 and max(ports) < 32768, (min(ports), max(ports))
    with pytest.raises(SlurmEnvError):
        redis_port(a, {"ELASTIC_SLURM_REDIS_PORT": "70000"})


@pytest.mark.parametrize(("env", "gpus"), [
    ({}, None), ({"SLURM_GPUS_ON_NODE": "4"}, 4), ({"SLURM_GPUS_PER_NODE": "2"}, 2),
    ({"SLURM_GPUS_PER_NODE": "a100:2,v100:1"}, 3),
    ({"SLURM_GPUS_ON_NODE": "8", "SLURM_GPUS_PER_NODE": "2"}, 8),
    ({"SLURM_GPUS_ON_NODE": "0"}, None),
])
def test_gpus_per_node(env: dict[str, str], gpus: int | None) -> None:
    assert gpus_per_node(env) == gpus


def test_srun_fills_job_id_nodes_gpus_and_signals(tmp_path: object) -> None:
    cfg = parse_args([HELLO], srun_env(SLURM_GPUS_ON_NODE="2"))
    assert (cfg.job_id, cfg.rendezvous.min_nodes, cfg.rendezvous.max_nodes, cfg.nproc) == (
        "slurm-517542.0", 2, 2, 2)
    assert not cfg.job_id_generated and cfg.slurm is not None and cfg.slurm_redis
    assert signal.SIGUSR1 in cfg.signals_to_handle and signal.SIGTERM in cfg.signals_to_handle
    assert cfg.job_secret is not None and not cfg.job_secret.generated
    assert SECRET not in repr(cfg)


def test_a_step_of_several_nodes_without_redis_needs_the_jobs_secret() -> None:
    with pytest.raises(UsageError) as err:
        parse_args([HELLO], srun_env(**{JOB_SECRET_ENV: "<unset>"}))
    message = str(err.value)
    assert f"export {JOB_SECRET_ENV}=$(openssl rand -hex 32)" in message
    assert "--redis" in message and "\n" not in message
    # With a Redis of its own, no secret is needed; one node makes its own.
    assert parse_args(["--redis", "redis://h:1", HELLO],
                      srun_env(**{JOB_SECRET_ENV: "<unset>"})).job_secret is None
    one = parse_args([HELLO], srun_env(SLURM_NNODES="1", SLURM_STEP_NUM_NODES="1",
                                       SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1",
                                       SLURM_STEP_NODELIST="n1", SLURMD_NODENAME="n1",
                                       **{JOB_SECRET_ENV: "<unset>"}))
    assert one.job_secret is not None and one.job_secret.generated


@pytest.mark.parametrize("bad", ["short", "x" * 2000, "a" * 40 + "\x1b[2J", "a" * 40 + " b"])
def test_an_unusable_secret_is_one_line_that_never_quotes_it(bad: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_args([HELLO], srun_env(**{JOB_SECRET_ENV: bad}))
    message = str(err.value)
    assert JOB_SECRET_ENV in message and "openssl rand" in message
    assert bad.strip()[:8] not in message and "\n" not in message and "\x1b" not in message


def test_explicit_flags_win_over_slurm() -> None:
    cfg = parse_args(["--job-id", "mine", "--nnodes", "1:3", "--nproc-per-node", "3",
                      "--redis", "redis://h:1", "--signals-to-handle", "SIGTERM", HELLO],
                     srun_env(SLURM_GPUS_ON_NODE="8"))
    assert (cfg.job_id, cfg.rendezvous.min_nodes, cfg.rendezvous.max_nodes, cfg.nproc) == (
        "mine", 1, 3, 3)
    assert not cfg.slurm_redis and cfg.signals_to_handle == (signal.SIGTERM,)
    env = srun_env(ELASTIC_JOB_ID="from-env", ELASTIC_REDIS_URL="redis://h:2")
    cfg = parse_args([HELLO], env)
    assert cfg.job_id == "from-env" and not cfg.slurm_redis
    # Garbage SLURM variables do not matter when nothing is taken from them.
    cfg = parse_args(["--job-id", "j", "--nnodes", "2", HELLO], srun_env(SLURM_NNODES="x",
                                                                        SLURM_STEP_NUM_NODES="x"))
    assert cfg.slurm is None and cfg.rendezvous.max_nodes == 2


def test_outside_slurm_the_defaults_are_unchanged() -> None:
    cfg = parse_args([HELLO], {})
    assert (cfg.rendezvous.max_nodes, cfg.nproc, cfg.slurm, cfg.slurm_redis) == (1, 1, None, False)
    assert signal.SIGUSR1 not in cfg.signals_to_handle


@pytest.mark.parametrize("bad", [
    {"SLURM_JOB_ID": "12; rm -rf /"}, {"SLURM_STEP_ID": "-1"}, {"SLURM_JOB_ID": "0"},
    {"SLURM_STEP_NUM_NODES": "two", "SLURM_NNODES": "two"},
    {"SLURM_STEP_NUM_NODES": "<unset>", "SLURM_NNODES": "<unset>"},
    {"SLURM_STEP_NODELIST": "n[1-3]"},  # 3 names, 2 nodes
    {"SLURM_STEP_NODELIST": "n[1-2"}, {"SLURMD_NODENAME": "n1\x1b[2J"},
    {"SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4"},  # two agents per node
    {"SLURM_GPUS_PER_NODE": "a100:lots"}, {"SLURM_GPUS_ON_NODE": "1e3"},
    {"SLURM_RESTART_COUNT": "x"}, {"SLURM_NNODES": "9" * 40, "SLURM_STEP_NUM_NODES": "<unset>"},
])
def test_hostile_slurm_values_are_one_clear_line(bad: dict[str, str]) -> None:
    with pytest.raises(UsageError) as err:
        parse_args([HELLO], srun_env(**bad))
    message = str(err.value)
    assert "\n" not in message and "\x1b" not in message and len(message) < 300


def test_the_cli_exits_2_with_one_line_on_a_bad_slurm_variable() -> None:
    env = {**os.environ, **srun_env(SLURM_NNODES="lots", SLURM_STEP_NUM_NODES="lots")}
    proc = subprocess.run([sys.executable, "-m", "elastic_agent.supervision.cli", HELLO],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "SLURM_STEP_NUM_NODES" in lines[0] and "--nnodes" in lines[0]


def test_a_node_waiting_for_the_first_nodes_redis_gives_up_in_one_line() -> None:
    port = free_port()  # nothing listens there: the first node never started its Redis
    started = time.monotonic()
    secret = JobSecret(SECRET)
    with pytest.raises(RuntimeError) as err:
        slurm_redis.wait_for(slurm_redis.agent_url("127.0.0.1", port, secret, "slurm-1.0"),
                             "n1", "slurm-1.0", secret, timeout=0.5)
    assert time.monotonic() - started < 5
    message = str(err.value)
    assert "\n" not in message and "n1" in message and "--redis" in message


def test_the_hosting_agent_waits_for_the_other_agents_not_for_consoles(private_redis) -> None:
    """The first node's Redis stays up while another agent still holds a connection (it
    writes its last records after the host's agent is done), not for a console."""
    agent = make_client(private_redis.url)
    agent.ping()
    console = make_client(private_redis.url)
    console.client_setname(console_client_name("j"))
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (slurm_redis.wait_for_peers_to_leave(
        private_redis, "j", timeout=20), done.set()))
    waiter.start()
    try:
        assert not done.wait(0.5)  # a stretch in which it must not return
        agent.close()
        assert done.wait(10), "the wait did not end once the other agent left"
    finally:
        agent.close()
        waiter.join(25)
        console.close()
