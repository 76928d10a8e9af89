"""Redis Cluster: a real three-master cluster on loopback, every client pointed at a node that
does not own the job's slot (as a user of ``redis-cli -c`` would name any node).

* Two agents run a job through it with the console attached (the Textual app, then the CLI's
  restart, status, logs, events, ls and rm), and retention finds the job's keys on their node.
* TorchRedisStore across two processes, and the ``redis`` torchrun rendezvous handler.
* The endpoint forms: auto-detected ``redis://``, explicit ``redis+cluster://``, and the hint
  a cluster node gives a client that took it for a single server.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot
from textual.pilot import Pilot

from elastic_agent.coordination.connection import (
    EndpointError,
    explain_error,
    is_cluster,
    make_client,
    parse_endpoint,
)
from elastic_agent.coordination.ports import port_is_free
from elastic_agent.coordination.protocol import JOBS_INDEX, EventType, JobKeys
from elastic_agent.coordination.torch_compat import TorchRedisStore
from elastic_agent.supervision.standalone import RedisServer
from elastic_console.app import ConsoleApp
from elastic_console.client import BLOCK_MS, JobClient
from tests.agents import SCRIPTS, Agent
from tests.test_agent import FAST, agent_args, of_type, worker_pids
from tests.test_console_app import loaded, run, ticks
from tests.waiting import wait_until, wait_until_async

CONSOLE = [sys.executable, "-m", "elastic_console.cli"]
SLOTS = 16384


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free and exists as well."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 55000)
        if port_is_free(port) and port_is_free(port + 10000):
            return port
    raise AssertionError("no free port pair for a cluster node")


class Cluster:
    """Three masters, node ``i`` owning slots ``[starts[i], starts[i + 1])``."""

    def __init__(self) -> None:
        self.nodes = [RedisServer(port=_cluster_port(), extra_args=["--cluster-enabled", "yes",
                                              "--cluster-config-file", "nodes.conf",
                                              "--cluster-node-timeout", "5000"])
                      for _ in range(3)]
        self.starts = [0, 5461, 10923, SLOTS]

    def start(self) -> Cluster:
        for node in self.nodes:
            node.start()
        clients = [redis.Redis(port=n.port, protocol=2) for n in self.nodes]
        try:
            # What `redis-cli --cluster create ... --cluster-replicas 0` does, without
            # needing redis-cli: each node takes its slots, then they meet.
            for i, c in enumerate(clients):
                c.execute_command("CLUSTER", "ADDSLOTS",
                                  *range(self.starts[i], self.starts[i + 1]))
            for c in clients[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port)

            def ready() -> bool:
                for c in clients:
                    info = c.execute_command("CLUSTER", "INFO").decode()
                    if ("cluster_state:ok" not in info or "cluster_known_nodes:3" not in info
                            or len(c.execute_command("CLUSTER", "SLOTS")) != 3):
                        return False
                return True

            wait_until(ready, 30, "the cluster to form")
        finally:
            for c in clients:
                c.close()
        return self

    def url(self, i: int) -> str:
        return self.nodes[i].url

    def owner(self, key: str) -> int:
        slot = key_slot(key.encode())
        return next(i for i in range(3) if self.starts[i] <= slot < self.starts[i + 1])

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c.start()
    finally:
        c.cleanup()


def elsewhere(cluster: Cluster, job_id: str, avoid: tuple[int, ...] = (0,)) -> str:
    """A job id whose slot no node in ``avoid`` owns (by default the entry node 0): every
    command must be redirected."""
    for n in range(100):
        job = f"{job_id}-{n}"
        if cluster.owner(JobKeys(job).meta) not in avoid:
            return job
    raise AssertionError(f"no job id outside the slots of nodes {avoid}")


def cli(url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ELASTIC_REDIS_URL": url}
    return subprocess.run([*CONSOLE, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, stdin=subprocess.DEVNULL)


def test_a_two_node_job_through_a_cluster_with_the_console_attached(cluster, job_id, tmp_path):
    url = cluster.url(0)
    # The job's keys on the one node that is neither the entry node nor the jobs index's:
    # ls and rm then read and write across three masters.
    job = elsewhere(cluster, job_id, avoid=(0, cluster.owner(JOBS_INDEX)))
    owner = cluster.nodes[cluster.owner(JobKeys(job).meta)]
    index_node = cluster.nodes[cluster.owner(JOBS_INDEX)]
    r = make_client(url)
    assert is_cluster(r), "a node's redis:// address must give a cluster client"
    args = agent_args(url, job, "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "0",
                      FAST, str(SCRIPTS / "sleeper.py"), "--seconds", "5")
    # Each node has its own settings: a wrong eviction policy on nodes other than the one
    # named must still be seen (the agents' warning asks every primary).
    others = [redis.Redis(port=n.port, protocol=2) for n in cluster.nodes[1:]]
    for o in others:
        o.config_set("maxmemory-policy", "allkeys-lru")
    agents = [Agent(args, tmp_path, f"a{i}") for i in range(2)]
    try:
        wait_until(lambda: len(worker_pids(r, job)) == 2, 30, "two workers")
        for o in others:
            o.config_set("maxmemory-policy", "noeviction")
        assert all("maxmemory-policy is allkeys-lru" in a.output for a in agents), (
            agents[0].output[-2000:])

        # The live console: history and live lines of both ranks; its connections carry its
        # name on the node that holds the job (CLIENT SETNAME through the cluster client).
        app = ConsoleApp(job, endpoint=parse_endpoint(url), cursor_blink=False)

        async def body(pilot: Pilot[int], app: ConsoleApp) -> None:
            await loaded(app, ranks=2)
            await wait_until_async(lambda: len(ticks(app, 0)) > 3 and len(ticks(app, 1)) > 3,
                                   15, "live lines of both ranks")
            named = redis.Redis(port=owner.port, protocol=2)
            try:
                names = {c.get("name") for c in named.client_list()}
            finally:
                named.close()
            assert f"elastic-console:{job}" in names, names

        run(app, body)

        p = cli(url, "restart", job, "--yes")
        assert p.returncode == 0, p.stdout + p.stderr
        assert p.stdout.splitlines()[-1] == "all 2 agents accepted the restart command", p.stdout
        wait_until(lambda: len(worker_pids(r, job)) == 4, 30, "the workers to start again")
        codes = [a.wait(60) for a in agents]
        assert codes == [0, 0], "\n".join(a.output[-3000:] for a in agents)
        assert len(of_type(r, job, EventType.JOB_SUCCEEDED)) == 1

        status = json.loads(cli(url, "status", job, "--json").stdout)
        assert status["state"] == "succeeded"
        assert [x["restarts"] for x in status["ranks"]] == [1, 1]
        logs = cli(url, "logs", job, "--tail", "100000")
        assert logs.returncode == 0, logs.stderr
        # Both attempts of both ranks, read back through the cluster.
        assert logs.stdout.count("worker rank=0 ") == 2, logs.stdout[-2000:]
        assert logs.stdout.count("worker rank=1 ") == 2 and "tick 0 rank 1" in logs.stdout
        events = cli(url, "events", job)
        assert events.returncode == 0 and "job_succeeded" in events.stdout, events.stderr
        listed = cli(url, "ls")
        assert listed.returncode == 0 and any(
            line.split()[:2] == [job, "succeeded"] for line in listed.stdout.splitlines()), (
            listed.stdout + listed.stderr)

        # The index entry sits on its own node, written there through the cluster client.
        on_index_node = redis.Redis(port=index_node.port, protocol=2)
        try:
            assert on_index_node.zscore(JOBS_INDEX, job) is not None
        finally:
            on_index_node.close()

        # Retention scanned the node that owns the job's slot: its keys got their TTL.
        assert 0 < r.pttl(JobKeys(job).meta) <= 7 * 86400 * 1000
        assert r.pttl(JobKeys(job).events) > 0
        p = cli(url, "rm", job)
        assert p.returncode == 0 and p.stdout.startswith(f"removed job {job} ("), p.stdout
        direct = redis.Redis(port=owner.port, protocol=2)
        try:
            assert list(direct.scan_iter(match=f"elastic:{{{job}}}:*")) == []
        finally:
            direct.close()
        assert r.zscore(JOBS_INDEX, job) is None
    finally:
        for o in others:
            o.config_set("maxmemory-policy", "noeviction")
            o.close()
        for a in agents:
            a.kill()
        r.close()


_CHILD = textwrap.dedent("""
    import sys
    from elastic_agent.coordination.torch_compat import TorchRedisStore
    s = TorchRedisStore(sys.argv[1], sys.argv[2], "peers", timeout=30)
    s.set("from_child", b"hello")
    s.add("count", 1)
    s.wait(["from_parent"])
    print(s.get("from_parent").decode(), s.add("count", 0), flush=True)
    s.close()
""")


def test_torch_store_and_rendezvous_handler_through_a_cluster(cluster, job_id):
    url = cluster.url(0)
    job = elsewhere(cluster, job_id)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, url, job], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    store = TorchRedisStore(url, job, "peers", timeout=30)
    try:
        store.wait(["from_child"])
        assert store.get("from_child") == b"hello"
        store.add("count", 1)
        store.set("from_parent", b"hi")
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        assert out.split() == ["hi", "2"]
    finally:
        child.kill()
        store.close()

    # The torchrun plugin's handler (what `torchrun --rdzv-backend redis` builds).
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    handler = get_rendezvous_handler(RendezvousParameters(
        backend="redis", endpoint=url.removeprefix("redis://"), run_id=job, min_nodes=1,
        max_nodes=1, local_addr="127.0.0.1", last_call_timeout="0.5", join_timeout="20"))
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    info.store.set("k", b"v")
    assert info.store.get("k") == b"v"
    handler.set_closed()
    assert handler.shutdown()


def test_endpoint_forms(cluster, redis_url, job_id):
    explicit = make_client("redis+cluster://" + cluster.url(1).removeprefix("redis://"))
    try:
        assert is_cluster(explicit)
        key = JobKeys(elsewhere(cluster, job_id, avoid=(1,))).meta
        explicit.hset(key, "k", "v")
        assert explicit.hget(key, "k") == b"v"
    finally:
        explicit.close()
    single = make_client(redis_url)
    assert not is_cluster(single), "a single server stays a single server"
    single.close()
    with pytest.raises(EndpointError, match=r"database|db"):
        make_client("redis+cluster://" + cluster.url(1).removeprefix("redis://") + "/3")
    # A client that took a node for a single server is told what to write instead.
    plain = redis.Redis(port=cluster.nodes[0].port)
    try:
        with pytest.raises(redis.ResponseError) as caught:
            plain.get(JobKeys(elsewhere(cluster, job_id)).meta)
    finally:
        plain.close()
    said = str(explain_error(caught.value, cluster.url(0)))
    assert "MOVED" in said and "redis+cluster://" in said, said
    # An explicit cluster nobody answers for: one clear line, as for a single server.
    gone = f"redis+cluster://127.0.0.1:{_cluster_port()}"
    p = cli(gone, "ls")
    assert p.returncode == 1 and p.stderr.startswith("elastic-console: error: cannot reach Redis"), (
        p.stderr)
    assert len(p.stderr.splitlines()) == 1, p.stderr


def test_an_acl_user_with_a_password_file_reaches_every_node(cluster, tmp_path: Path, job_id):
    """The endpoint's credentials go to every node the slot map names, not only the first:
    the default user is off on every node meanwhile, so nothing works without them."""
    job = elsewhere(cluster, job_id)
    password = "s3cret:@x"
    ops = [redis.Redis(port=n.port, protocol=2) for n in cluster.nodes]
    try:
        for a in ops:
            a.execute_command("ACL", "SETUSER", "ops", "on", f">{password}", "~*", "+@all")
            a.execute_command("AUTH", "ops", password)
            a.execute_command("ACL", "SETUSER", "default", "off")
        secret = tmp_path / "pw"
        secret.write_text(password + "\n")
        ep = f"redis://ops@127.0.0.1:{cluster.nodes[0].port}"
        env = {k: v for k, v in os.environ.items() if k != "ELASTIC_REDIS_URL"}
        seed = make_client(f"redis://ops:s3cret%3A%40x@127.0.0.1:{cluster.nodes[0].port}")
        assert is_cluster(seed)
        seed.hset(JobKeys(job).meta, mapping={"created_ms": 1, "max_restarts": 0})
        seed.zadd(JOBS_INDEX, {job: 1})
        seed.close()
        p = subprocess.run([*CONSOLE, "--redis", ep, "--redis-password-file", str(secret), "ls"],
                           capture_output=True, text=True, timeout=60, env=env,
                           stdin=subprocess.DEVNULL)
        assert p.returncode == 0, p.stderr
        assert any(line.split()[:1] == [job] for line in p.stdout.splitlines()), p.stdout
        assert "s3cret" not in p.stdout + p.stderr
        # A wrong password: one clear line, no traceback, nothing leaked.
        p = subprocess.run([*CONSOLE, "--redis", ep, "ls"], capture_output=True, text=True,
                           timeout=60, env={**env, "REDISCLI_AUTH": "wrong-one"},
                           stdin=subprocess.DEVNULL)
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "password" in p.stderr, p.stderr
        assert "wrong-one" not in p.stderr
    finally:
        for a in ops:
            a.execute_command("ACL", "SETUSER", "default", "on")
        tidy = make_client(cluster.url(0))
        tidy.delete(JobKeys(job).meta)
        tidy.zrem(JOBS_INDEX, job)
        tidy.close()
        for a in ops:
            a.execute_command("ACL", "DELUSER", "ops")
            a.close()


def test_follow_through_a_cluster_ends_when_cancelled_at_random_moments(cluster, job_id):
    """The cluster client keeps the per-turn cancellation check working (FIELD-NOTES): a
    follow cancelled at any moment ends, and the next one still reads."""
    url = cluster.url(0)
    job = elsewhere(cluster, job_id)

    async def body() -> None:
        client = JobClient(url, job)
        rng = random.Random(11)

        async def consume() -> None:
            async for _ in client.follow():
                pass

        try:
            for i in range(30):
                task = asyncio.ensure_future(consume())
                await asyncio.sleep(rng.random() * 0.06)  # a random moment to cancel at
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=BLOCK_MS / 1000 + 5)
                assert done, f"cancellation {i} was lost: follow ran on"
            assert await client.meta() == {}, "the client still answers after the cancellations"
        finally:
            await client.close()

    asyncio.run(body())
