"""An agent holds at most two Redis connections, whatever it is doing.

Counted from the server's side: on a redis-server of the test's own, ``INFO stats``
``total_connections_received`` before and after each phase of two real agents' lives (start
and rendezvous, running, stacks, restart, stop). A connection opened, used and closed within
a phase is counted as surely as one held (a sampler of the agents' sockets misses it). In a
healthy run an agent opens its reader and its writer once, so the whole life costs exactly
two per agent; ``CLIENT LIST`` names them. The cluster case samples the agent's sockets
(its writer talks to each master on a connection of its own).
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from collections import defaultdict

import psutil
import pytest
import redis

from elastic_agent.coordination.transport import stream_mux
from elastic_agent.coordination.transport.connection import make_async_client, make_client, priority
from elastic_agent.coordination.transport.stream_mux import StreamMux
from elastic_agent.coordination.wire.command_records import Command, encode_command
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.supervision.records.publisher import StreamPublisher
from elastic_agent.supervision.redis_bridge import SyncBridge
from tests.agents import SCRIPTS, Agent, wait_until
from tests.test_agent import FAST, agent_args, of_type, worker_pids
from tests.test_cluster import cluster, elsewhere  # noqa: F401 - the 3-master cluster fixture
from tests.waiting import wait_until_async

MAX_CONNECTIONS = 2


def redis_sockets(pid: int, port: int | set[int]) -> list[psutil._common.pconn]:
    ports = port if isinstance(port, set) else {port}
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return []
    return [c for c in conns if c.raddr and c.raddr.port in ports
            and c.status == psutil.CONN_ESTABLISHED]


class Sampler:
    """Counts each agent's Redis connections every 20 ms, per phase of the test."""

    def __init__(self, pids: list[int], port: int | set[int]) -> None:
        self.pids, self.port = pids, port
        self.phase = "start"
        self.most: dict[tuple[str, int], int] = defaultdict(int)
        self.samples: dict[str, int] = defaultdict(int)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            phase = self.phase
            for pid in self.pids:
                n = len(redis_sockets(pid, self.port))
                self.most[phase, pid] = max(self.most[phase, pid], n)
            self.samples[phase] += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


#: What an agent's start costs the server besides its two: the command line's reachability
#: check (one PING, cli.py) and the cluster probe (one INFO, transport/cluster.py), each on a
#: connection closed before the reader and the writer open.
START_PROBES = 2


def test_an_agent_opens_two_connections_through_rendezvous_run_stacks_restart_and_stop(
        private_redis, job_id, tmp_path):
    url = private_redis.url
    keys = JobKeys(job_id)
    # Nothing else uses this server: every connection it accepts after the test's own (the
    # first command below makes it) is an agent's (the sleeper workers never connect).
    r = make_client(url)
    own = r.client_id()
    received = int(r.info("stats")["total_connections_received"])
    opened: dict[str, int] = {}
    held: dict[str, list[tuple[int, str]]] = {}

    def phase(name: str) -> None:
        """What the server accepted since the last phase, and what it holds now."""
        nonlocal received
        now = int(r.info("stats")["total_connections_received"])
        opened[name], received = now - received, now
        held[name] = sorted((int(c["id"]), c["name"]) for c in r.client_list()
                            if int(c["id"]) != own)

    def names(pid: int) -> list[str]:
        return [f"elastic-agent:{_host()}:{pid}:reader", f"elastic-agent:{_host()}:{pid}:writer"]

    args = agent_args(url, job_id, "--nnodes", "2", "--nproc-per-node", "2",
                      "--max-restarts", "3", FAST, str(SCRIPTS / "sleeper.py"))
    first = Agent(args, tmp_path, "a")
    second = None
    try:
        # Alone in a round of two: it waits in the rendezvous (notify and joins streams).
        wait_until(lambda: "waiting for 1 more" in first.output, 30, "the first agent waiting")
        phase("first agent's start")
        second = Agent(args, tmp_path, "b")
        wait_until(lambda: len(worker_pids(r, job_id)) == 4, 60, "four workers")
        phase("second agent's start and the rendezvous")

        def send(cmd_id: str, kind: str) -> None:
            r.xadd(keys.commands, encode_command(Command(cmd_id, kind, "tester@host")))

        def acks(cmd_id: str, status: str) -> int:
            return sum(1 for e in of_type(r, job_id, EventType.COMMAND_ACK)
                       if e.data["command_id"] == cmd_id and e.data["status"] == status)

        send("stacks-1", "stacks")
        wait_until(lambda: acks("stacks-1", "done") == 2, 30, "both agents' stacks")
        phase("stacks")

        send("restart-1", "restart")
        wait_until(lambda: len(of_type(r, job_id, EventType.WORKERS_STARTED)) == 4, 60,
                   "both agents' workers started again")
        assert acks("restart-1", "accepted") == 2
        phase("restart")

        send("stop-1", "stop")
        assert first.wait(60) == 143 and second.wait(60) == 143
        phase("stop")
    finally:
        for agent in (first, second):
            if agent is not None:
                agent.kill()
        r.close()
    report = f"accepted per phase: {opened}; held at each phase's end: {held}"
    # Held: each agent its reader and writer, nothing else (the probes closed).
    assert [n for _, n in held["first agent's start"]] == names(first.pid), report
    assert sorted(n for _, n in held["second agent's start and the rendezvous"]) == sorted(
        names(first.pid) + names(second.pid)), report
    # The same two connections from then on: no reconnect hid a third one in the count.
    assert held["stacks"] == held["restart"] == held[
        "second agent's start and the rendezvous"], report
    assert held["stop"] == [], report  # agents that exited left nothing open
    # Accepted, each connection however short its life: an agent opens its two once (after
    # its start probes), and nothing while it runs, restarts or stops.
    assert opened == {"first agent's start": START_PROBES + MAX_CONNECTIONS,
                      "second agent's start and the rendezvous": START_PROBES + MAX_CONNECTIONS,
                      "stacks": 0, "restart": 0, "stop": 0}, report


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())


# -- the pieces: one connection per client, the multiplexer, the bridge ----------------------

def _client_names(r: redis.Redis, name: str) -> int:
    return sum(1 for c in r.client_list() if c["name"] == name)


@pytest.mark.asyncio
async def test_a_one_connection_client_runs_concurrent_commands_on_one_connection(
        redis_url, r, job_id):
    name = f"one-{job_id}"
    client = make_async_client(redis_url, one_connection=True, client_name=name)
    key = f"elastic:{{{job_id}}}:order"
    try:
        # A blocking command holds the connection while the others queue behind it.
        held = asyncio.ensure_future(client.execute_command("BLPOP", f"{key}:none", 0.3))
        await asyncio.sleep(0)  # the BLPOP takes the connection first

        async def push(tag: str) -> None:
            await client.rpush(key, tag)

        async def urgent() -> None:
            with priority():
                await client.rpush(key, "urgent")

        tasks = [asyncio.ensure_future(push(f"bulk-{i}")) for i in range(5)]
        tasks.append(asyncio.ensure_future(urgent()))
        pipes = []
        for i in range(3):
            pipe = client.pipeline(transaction=False)
            pipe.rpush(key, f"pipe-{i}")
            pipes.append(asyncio.ensure_future(pipe.execute()))
        await asyncio.gather(held, *tasks, *pipes)
        assert _client_names(r, name) == 1
        order = [v.decode() for v in r.lrange(key, 0, -1)]
        # Queued after five writes, the prioritised one went first; the rest in order.
        assert order == ["urgent", *(f"bulk-{i}" for i in range(5)),
                         *(f"pipe-{i}" for i in range(3))]
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_a_cancelled_waiter_does_not_keep_the_connection(redis_url, job_id):
    client = make_async_client(redis_url, one_connection=True)
    try:
        held = asyncio.ensure_future(client.execute_command("BLPOP", f"{job_id}:none", 0.2))
        await asyncio.sleep(0)
        waiter = asyncio.ensure_future(client.ping())
        await asyncio.sleep(0.05)
        waiter.cancel()
        await held
        assert await asyncio.wait_for(client.ping(), 5)
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_the_kept_connection_never_hands_a_cancelled_reply_to_the_next_command(
        redis_url, r, job_id):
    """A one-connection client keeps its connection out of the pool between commands, so
    redis-py's probe for unread data never runs: a command cancelled while it waits for its
    reply must leave no reply behind for the next one, and a killed connection comes back."""
    name = f"kept-{job_id}"
    client = make_async_client(redis_url, one_connection=True, client_name=name)
    key = f"elastic:{{{job_id}}}:kept"
    try:
        waiting = asyncio.ensure_future(client.execute_command("BLPOP", key, 5))
        await wait_until_async(lambda: any(c["name"] == name and c["cmd"] == "blpop"
                                           for c in r.client_list()), 5, "the BLPOP to block")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        r.rpush(key, "for-the-blpop")  # a reply the cancelled BLPOP would have got
        r.set(f"{key}:value", "mine")
        assert await client.get(f"{key}:value") == b"mine"
        assert r.lrange(key, 0, -1) == [b"for-the-blpop"]  # nobody popped it
        for c in r.client_list():
            if c["name"] == name:
                r.client_kill_filter(_id=c["id"])
        assert await client.get(f"{key}:value") == b"mine"  # reconnected, by the pool
        assert _client_names(r, name) == 1
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_a_write_to_a_server_that_stopped_reading_times_out_and_the_client_recovers(
        private_redis, job_id):
    """The lean write path (send_path.py) writes without waiting, and waits under the socket
    timeout only when the kernel would not take the bytes: a stopped server then fails the
    write as redis-py does (TimeoutError), and the client works once the server is back."""
    import os
    import signal

    from elastic_agent.coordination.transport.send_path import _LeanSend

    client = make_async_client(private_redis.url, socket_timeout=1.0, retries=0,
                               one_connection=True)
    try:
        await client.ping()
        assert issubclass(client.connection_pool.connection_class, _LeanSend)
        assert private_redis.proc is not None
        os.kill(private_redis.proc.pid, signal.SIGSTOP)
        try:
            started = asyncio.get_running_loop().time()
            with pytest.raises(redis.TimeoutError):
                await client.set(f"{job_id}:big", b"x" * (64 << 20))
            assert asyncio.get_running_loop().time() - started < 10  # the timeout, not a hang
        finally:
            os.kill(private_redis.proc.pid, signal.SIGCONT)
        assert await client.ping()
    finally:
        await client.aclose()


class Mux:
    """A StreamMux on its own two clients, for one test."""

    def __init__(self, redis_url: str, job_id: str, block_ms: int) -> None:
        self.writer = make_async_client(redis_url, one_connection=True)
        self.mux = StreamMux(make_async_client(redis_url, blocking_ms=block_ms, retries=0),
                             self.writer, JobKeys(job_id).wake("node"), block_ms=block_ms)

    async def __aenter__(self) -> StreamMux:
        self.mux.start()
        return self.mux

    async def __aexit__(self, *exc: object) -> None:
        await self.mux.aclose()
        await self.mux.client.aclose()
        await self.writer.aclose()


@pytest.mark.asyncio
async def test_a_reader_that_joins_a_blocked_read_is_served_without_waiting_for_its_block(
        redis_url, r, job_id):
    keys = JobKeys(job_id)
    first, second = keys.prefix + "s1", keys.prefix + "s2"
    async with Mux(redis_url, job_id, block_ms=60_000) as mux:
        a, b = mux.reader(), mux.reader()
        waiting = asyncio.ensure_future(a.xread({first: "0-0"}, block=30_000))
        await wait_until_async(lambda: first in mux.followed, 5, "the first stream followed")
        await asyncio.sleep(0.1)  # the XREAD over it is blocked now
        late = asyncio.ensure_future(b.xread({second: "0-0"}, block=30_000))
        await wait_until_async(lambda: second in mux.followed, 5, "the second stream followed")
        r.xadd(second, {"n": "1"})
        # Well under the 60 s BLOCK: the reader woke the read in flight.
        reply = await asyncio.wait_for(late, 5)
        assert [(k, [f for _, f in entries]) for k, entries in reply] == [
            (second.encode(), [{b"n": b"1"}])]
        assert not waiting.done()
        r.xadd(first, {"n": "2"})
        assert (await asyncio.wait_for(waiting, 5))[0][1][0][1] == {b"n": b"2"}
        assert r.ttl(keys.wake("node")) > 0  # the wake stream expires by itself


@pytest.mark.asyncio
async def test_a_muxed_read_answers_as_redis_does(redis_url, r, job_id):
    keys = JobKeys(job_id)
    s1, s2 = keys.prefix + "a", keys.prefix + "b"
    ids1 = [r.xadd(s1, {"i": str(i)}) for i in range(7)]
    ids2 = [r.xadd(s2, {"i": str(i)}) for i in range(3)]
    plain = redis.Redis.from_url(redis_url, protocol=2)
    async with Mux(redis_url, job_id, block_ms=1_000) as mux:
        reader = mux.reader()
        for after1, after2, count in (("0-0", "0-0", None), (ids1[2], ids2[0], 2),
                                      (ids1[4], ids2[2], None), (ids1[0], "0-0", 3),
                                      ("$", ids2[1], None)):
            streams = {s1: after1, s2: after2}
            want = plain.xread({k: v for k, v in streams.items() if v != "$"}, count=count)
            got = await reader.xread(streams, count=count, block=100)
            assert got == want, (streams, count)
        # "$" waits for what comes next; nothing comes: an empty reply after the block.
        assert await reader.xread({s1: "$"}, block=200) == []
        # Several readers at their own ids on the same stream.
        other = mux.reader()
        assert (await other.xread({s1: ids1[5]}, block=100))[0][1] == plain.xread(
            {s1: ids1[5]})[0][1]
        with pytest.raises(redis.ResponseError):
            await reader.xread({s1: "not-an-id"}, block=100)
    plain.close()


@pytest.mark.asyncio
async def test_a_key_that_is_no_stream_fails_only_its_readers(redis_url, r, job_id):
    keys = JobKeys(job_id)
    bad, good = keys.prefix + "bad", keys.prefix + "good"
    r.set(bad, "not a stream")
    async with Mux(redis_url, job_id, block_ms=500) as mux:
        victim, bystander = mux.reader(), mux.reader()
        reading = asyncio.ensure_future(bystander.xread({good: "0-0"}, block=20_000))
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            await victim.xread({bad: "0-0"}, block=20_000)
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):  # and again, not stuck
            await victim.xread({bad: "0-0"}, block=20_000)
        r.xadd(good, {"ok": "1"})
        assert (await asyncio.wait_for(reading, 5))[0][1][0][1] == {b"ok": b"1"}
        r.delete(bad)
        eid = r.xadd(bad, {"back": "1"})  # repaired: read again
        reply = await asyncio.wait_for(victim.xread({bad: "0-0"}, block=5_000), 5)
        assert reply == [[bad.encode(), [(eid, {b"back": b"1"})]]]


def test_the_sync_bridge_forwards_scripts_and_pipelines_from_a_thread(redis_url, r, job_id):
    key = f"elastic:{{{job_id}}}:bridge"

    async def scenario() -> SyncBridge:
        client = make_async_client(redis_url, one_connection=True)
        bridge = SyncBridge(client, priority=True)  # built before the loop runs, as the agent's
        script = bridge.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
        bridge.attach(asyncio.get_running_loop())
        try:
            def in_thread() -> tuple[int, list, bytes]:
                added = script(keys=[key], args=[5])
                pipe = bridge.pipeline(transaction=False)
                pipe.incr(key)
                pipe.get(key)
                return added, pipe.execute(), bridge.get(key)

            assert await asyncio.to_thread(in_thread) == (5, [6, b"6"], b"6")
            with pytest.raises(RuntimeError, match="own event loop"):
                bridge.get(key)  # from the loop itself it would wait for itself
            bridge.close()  # the agent's client stays open
            assert await client.get(key) == b"6"
        finally:
            await client.aclose()
        return script

    script = asyncio.run(scenario())
    with pytest.raises(redis.ConnectionError):
        script(keys=[key], args=[1])  # the loop is gone: an outage to the caller


@pytest.mark.asyncio
async def test_a_heartbeat_waits_for_one_small_batch_not_for_a_backlog(redis_url, r, job_id):
    """The publisher shares the writer's connection: a prioritised command (the agent's
    heartbeats, the rendezvous) waits for the pipeline in flight, capped in bytes, and goes
    ahead of the rest of the backlog."""
    client = make_async_client(redis_url, one_connection=True)
    publisher = StreamPublisher(lambda: client, close_client=False)
    stream, line = JobKeys(job_id).logs("n"), "x" * 16_000
    for i in range(1_500):  # 24 MB waiting, as after an outage
        publisher.publish(stream, {"i": str(i), "l": line}, maxlen=10_000)
    try:
        await publisher.start()
        await wait_until_async(lambda: publisher.sent > 0, 30, "the backlog flowing")
        sent = publisher.sent
        with priority():
            await client.set(f"{stream}:beat", 1)
        sent_while_waiting = publisher.sent - sent
        await asyncio.wait_for(publisher.flush(), 60)
        # 256 KiB batches of 16 kB records: the beat waited for the one in flight at most.
        assert sent_while_waiting <= 2 * 17, sent_while_waiting
        assert publisher.sent == 1_500
    finally:
        await publisher.close()
        await client.aclose()
        r.delete(stream)


@pytest.mark.asyncio
async def test_a_stream_nobody_reads_any_more_is_dropped_and_a_late_reader_misses_nothing(
        redis_url, r, job_id, monkeypatch):
    keys = JobKeys(job_id)
    stream = keys.prefix + "s"
    monkeypatch.setattr(stream_mux, "BUFFER", 5)  # a reader that falls behind its buffer
    async with Mux(redis_url, job_id, block_ms=200) as mux:
        mux.idle_s = 0.5
        reader = mux.reader()
        assert await reader.xread({stream: "0-0"}, block=50) == []
        ids = [r.xadd(stream, {"i": str(i)}) for i in range(20)]
        # The reader does not read: the multiplexer buffers the newest 5 only ...
        await wait_until_async(lambda: stream not in mux.followed
                               or mux.followed[stream] == ids[-1].decode(), 5, "the 20 read")
        # ... and a read from before them is answered from Redis, exactly.
        reply = await reader.xread({stream: "0-0"}, block=50)
        assert [eid for eid, _ in reply[0][1]] == ids
        # Nobody asks for it any more: it leaves the XREAD after idle_s.
        await wait_until_async(lambda: stream not in mux.followed, 5, "the stream dropped")
        r.xadd(stream, {"i": "late"})
        reply = await reader.xread({stream: ids[-1]}, block=2_000)  # followed again
        assert [f for _, f in reply[0][1]] == [{b"i": b"late"}]


def test_on_a_cluster_the_agent_holds_one_reader_and_a_writer_per_master(
        cluster, job_id, tmp_path):  # noqa: F811 - the fixture imported above
    """The documented exception: a cluster client talks to each master on its own connection.
    The job's slot is on a node other than the one named, as a random job's would be."""
    url = cluster.url(0)
    job = elsewhere(cluster, job_id)
    ports = {n.port: i for i, n in enumerate(cluster.nodes)}
    r = make_client(url)
    agent = Agent(agent_args(url, job, "--nproc-per-node", "2", FAST,
                             str(SCRIPTS / "sleeper.py"), "--seconds", "20"), tmp_path, "a")
    sampler = Sampler([agent.pid], set(ports))
    try:
        wait_until(lambda: len(worker_pids(r, job)) == 2, 60, "two workers")
        sampler.phase = "running"
        wait_until(lambda: sampler.samples["running"] >= 100, 30, "samples while running")
        mine = {f"{c.laddr.ip}:{c.laddr.port}" for c in redis_sockets(agent.pid, set(ports))}
        held = sorted((ports[n.port], c["name"].rsplit(":", 1)[-1])
                      for n in cluster.nodes
                      for c in redis.Redis(port=n.port).client_list() if c["addr"] in mine)
    finally:
        sampler.stop()
        agent.kill()
    most = sampler.most["running", agent.pid]
    owner = cluster.owner(JobKeys(job).meta)
    assert [node for node, role in held if role == "reader"] == [owner], held
    writers = [node for node, role in held if role == "writer"]
    assert len(writers) == len(set(writers)) and owner in writers, held
    assert most <= len(cluster.nodes) + 1, (most, held)
