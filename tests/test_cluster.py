"""Redis Cluster: a real three-master cluster on loopback, every client pointed at a node that
does not own the job's slot (as a user of ``redis-cli -c`` would name any node).

* Two agents run a job through it with the console attached (the Textual app, then the CLI's
  restart, status, logs, events, ls and rm), and retention finds the job's keys on their node.
* A job's log streams spread over the masters (``elastic:log:{JOB/TAG}:NODE``), and every
  reader (the console's client, ``logs``, retention, ``rm``) follows them there.
* TorchRedisStore across two processes, and the ``redis`` torchrun rendezvous handler.
* The endpoint forms: auto-detected ``redis://``, explicit ``redis+cluster://``, and the hint
  a cluster node gives a client that took it for a single server.
"""

from __future__ import annotations

import asyncio
import io
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

from elastic_agent.coordination.torch_compat import TorchRedisStore
from elastic_agent.coordination.transport.cluster import is_cluster
from elastic_agent.coordination.transport.connection import explain_error, make_async_client, make_client
from elastic_agent.coordination.transport.endpoints import EndpointError, parse_endpoint
from elastic_agent.coordination.wire import log_records
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JOBS_INDEX, LOG_SHARDS, JobKeys, log_shard_tags
from elastic_agent.coordination.wire.log_records import LogBatch, encode_log_batch
from elastic_agent.supervision.records.log_shipping import make_logs_drop_marker
from elastic_agent.supervision.records.logs import NodeLogs, WorkerLogs
from elastic_agent.supervision.records.publisher import StreamPublisher
from elastic_agent.supervision.records.retention import JobRetention
from elastic_console.job.client import BLOCK_MS, JobClient
from elastic_console.tui.app import ConsoleApp
from tests.agents import SCRIPTS, Agent
from tests.cluster import Cluster, cluster_port
from tests.test_agent import FAST, agent_args, of_type, worker_pids
from tests.test_console_app import loaded, run, ticks
from tests.waiting import wait_until, wait_until_async

CONSOLE = [sys.executable, "-m", "elastic_console.cli"]


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
        # ... and the log streams, outside that slot, theirs through the job's set.
        streams = [m.decode() for m in r.smembers(JobKeys(job).log_streams)]
        assert len(streams) == 2 and all(r.pttl(s) > 0 for s in streams), streams
        p = cli(url, "rm", job)
        assert p.returncode == 0 and p.stdout.startswith(f"removed job {job} ("), p.stdout
        direct = redis.Redis(port=owner.port, protocol=2)
        try:
            assert list(direct.scan_iter(match=f"elastic:{{{job}}}:*")) == []
        finally:
            direct.close()
        assert r.zscore(JOBS_INDEX, job) is None
        assert r.exists(*streams) == 0
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
    gone = f"redis+cluster://127.0.0.1:{cluster_port()}"
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
    # Log streams in several slots: each cancellation lands among per-slot reads.
    keys = JobKeys(job)
    seed = make_client(url)
    for i in range(6):
        stream = keys.logs(f"node-{i}")
        seed.xadd(stream, encode_log_batch(LogBatch(f"node-{i}", i, 0, 0, "out", 1, ["x"])))
        seed.sadd(keys.log_streams, stream)
    assert len({key_slot(keys.logs(f"node-{i}").encode()) for i in range(6)}) > 1
    seed.close()

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
            # ... and follows every slot's streams again: a new line on each is read.
            seen: set[int] = set()

            async def after() -> None:
                async for piece in client.follow_many():
                    seen.update(b.rank for b in piece
                                if isinstance(b, LogBatch) and b.lines == ["after"])
                    if len(seen) == 6:
                        return

            _, logs = await client.history(max_events=0)  # the cursors: follow goes on after
            assert len(logs) == 6
            task = asyncio.ensure_future(after())
            writer = make_client(url)
            for i in range(6):
                writer.xadd(keys.logs(f"node-{i}"), encode_log_batch(
                    LogBatch(f"node-{i}", i, 0, 0, "out", 2, ["after"])))
            writer.close()
            await asyncio.wait_for(task, 15)
        finally:
            await client.close()

    asyncio.run(body())


# -- a job's log streams over the cluster's masters -------------------------------------------

SPREAD_NODES = 12


class _Fleet:
    """Simulated nodes of one job, each with the agent's real log pipeline (``NodeLogs`` and a
    ``StreamPublisher`` of its own, through the cluster): one worker each, fed lines by hand."""

    def __init__(self, url: str, job: str, tmp_path: Path) -> None:
        self.url, self.job, self.tmp_path = url, job, tmp_path
        self.nodes: list[tuple[StreamPublisher, NodeLogs, WorkerLogs]] = []

    async def start(self, n: int) -> None:
        for i in range(n):
            node = f"node-{i}"
            pub = StreamPublisher(self.url, make_drop_marker=make_logs_drop_marker(self.job, node))
            await pub.start()
            logs = NodeLogs(publisher=pub, job_id=self.job, node_id=node,
                            stdout=io.BytesIO(), stderr=io.BytesIO())
            worker = logs.open_worker(directory=self.tmp_path / node, role="w", rank=i,
                                      local_rank=0, attempt=0)
            self.nodes.append((pub, logs, worker))

    def say(self, text: str) -> None:
        for i, (_, _, worker) in enumerate(self.nodes):
            worker.feed(log_records.STDOUT, f"{text} from rank {i}\n".encode())

    @property
    def streams(self) -> list[str]:
        return [logs.stream_key for _, logs, _ in self.nodes]

    async def close(self) -> None:
        for pub, _, worker in self.nodes:
            worker.close()
            await pub.close()


def test_a_jobs_log_streams_spread_over_the_masters_and_every_reader_follows_them(
        cluster, job_id, tmp_path):
    """Twelve nodes' log streams land on more than one master, none in the job's slot; the
    console's client (history and follow), ``logs``, retention (lease and final pass) and
    ``rm`` find every one of them through the job's set, and an old-shape stream
    (``elastic:{JOB}:logs:NODE``) named in the set too."""
    url = cluster.url(0)
    job = elsewhere(cluster, job_id)
    keys = JobKeys(job)
    r = make_client(url)
    legacy = keys.legacy_logs("old-node")
    r.xadd(legacy, encode_log_batch(LogBatch("old-node", 99, 0, 0, "out", 1, ["an old line"])))
    r.sadd(keys.log_streams, legacy)
    fleet = _Fleet(url, job, tmp_path)

    async def body() -> None:
        await fleet.start(SPREAD_NODES)
        fleet.say("history")
        await wait_until_async(lambda: all(r.xlen(s) for s in fleet.streams), 15,
                               "every node's first entry")
        streams = fleet.streams
        masters = {cluster.owner(s) for s in streams}
        assert len(masters) > 1, f"every log stream on one master: {streams}"
        assert not {key_slot(s.encode()) for s in streams} & {key_slot(keys.meta.encode())}
        assert {m.decode() for m in r.smembers(keys.log_streams)} == {*streams, legacy}

        # The console's client: the history of every node, then lines each node writes
        # afterwards, followed on every master at once (one XREAD per slot).
        client = JobClient(url, job)
        try:
            _, history = await client.history(max_events=0)
            assert {b.rank for b in history} == {*range(SPREAD_NODES), 99}
            seen: set[int] = set()

            async def follow() -> None:
                async for piece in client.follow_many():
                    seen.update(b.rank for b in piece if isinstance(b, LogBatch)
                                and b.lines[0].startswith("live"))
                    if len(seen) == SPREAD_NODES:
                        return

            task = asyncio.ensure_future(follow())
            fleet.say("live")
            await asyncio.wait_for(task, 20)
        finally:
            await client.close()

        # Retention: the lease gives the streams a TTL, the final pass the retention.
        retention = JobRetention(make_async_client(url), job, "node-0", 3600.0)
        await retention.expire_all(7200.0, renewal=True)
        assert all(7000 * 1000 < r.pttl(s) <= 7200 * 1000 for s in streams), (
            [r.pttl(s) for s in streams])
        r.hset(keys.meta, mapping={"final_state": "succeeded"})
        await retention.finish()
        assert all(0 < r.pttl(s) <= 3600 * 1000 for s in [*streams, legacy])

    try:
        asyncio.run(body())
        logs = cli(url, "logs", job, "--tail", "1000")
        assert logs.returncode == 0, logs.stderr
        for i in range(SPREAD_NODES):
            assert f"history from rank {i}" in logs.stdout and f"live from rank {i}" in logs.stdout
        assert "an old line" in logs.stdout
        p = cli(url, "rm", job)
        assert p.returncode == 0, p.stdout + p.stderr
        assert r.exists(*fleet.streams, legacy, keys.log_streams, keys.meta) == 0
    finally:
        asyncio.run(fleet.close())
        r.close()


def test_log_stream_names_spread_over_slot_ranges_and_readers_accept_only_the_jobs():
    """No cluster needed: the 16 tags of a job cover the 16 ranges of slots (so masters that
    split the slots evenly share them evenly), nodes spread over the tags, and the name check
    readers apply to the job's set accepts this job's streams only (``rm`` deletes them)."""
    keys = JobKeys("job-42")
    tags = log_shard_tags("job-42")
    assert [key_slot(f"x{{{t}}}".encode()) // 1024 for t in tags] == list(range(LOG_SHARDS))
    assert {t.split("/")[0] for t in tags} == {"job-42"}
    streams = [keys.logs(f"host-{i}-{i * 7919:06x}") for i in range(256)]
    per_tag = [sum(key_slot(s.encode()) // 1024 == t for s in streams) for t in range(16)]
    assert min(per_tag) > 0 and max(per_tag) < 3 * 256 / 16, per_tag
    meta = key_slot(keys.meta.encode())
    assert all(key_slot(s.encode()) != meta for s in streams)
    assert all(keys.is_log_stream(s) for s in streams)
    assert keys.is_log_stream(keys.legacy_logs("old-node"))
    for foreign in ["elastic:log:{job-4/1}:n", "elastic:log:{job-421/1}:n",
                    "elastic:log:{job-42}:n", "elastic:log:{job-42/}:n",
                    "elastic:log:{job-42/1}:", "elastic:log:{job-42/1:n",
                    "elastic:log:{job-42/a b}:n", "elastic:{job-42}:meta",
                    "elastic:{job-42}:logs:", "elastic:{job-421}:logs:n", "foreign-key",
                    "elastic:log:{job-42/1}:" + "n" * 257, JobKeys("job-421").logs("n")]:
        assert not keys.is_log_stream(foreign), foreign
    assert keys.streams_elsewhere([s.encode() for s in streams[:3]]
                                  + [keys.legacy_logs("x"), "foreign-key"]) == sorted(streams[:3])
