"""Redis Sentinel for real: a master, a replica and three sentinels on loopback, a real job run
through a ``redis+sentinel://`` endpoint, and the master killed (SIGKILL) under it.

The job must not notice beyond a gap in its log stream: same worker pids, no restart spent,
log lines and events going on through the new master, the console's CLI and its follow loop
working after the failover. The failover gap is measured and printed (``pytest -s`` shows it;
README.md quotes it); no log line may be lost or duplicated, as README.md says.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from elastic_agent.coordination.ports import free_port
from elastic_agent.coordination.store import RedisStore
from elastic_agent.coordination.transport.connection import (
    RedisUnavailableError,
    connect,
    describe_endpoint,
    make_async_client,
    make_client,
)
from elastic_agent.coordination.transport.endpoints import (
    EndpointError,
    parse_endpoint,
    redact,
    username_of,
    with_outside_password,
)
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.log_records import LogBatch, decode_log_entries
from elastic_agent.coordination.wire.protocol import stream_id_ms
from elastic_agent.supervision.hosting.standalone import RedisServer, find_redis_server
from elastic_console.job.client import JobClient
from tests.agents import SCRIPTS, Agent, alive, wait_until
from tests.test_agent import FAST, agent_args, events, of_type, worker_pids
from tests.test_tls_acl import make_ca_and_server_cert

SERVICE = "mymaster"
CONSOLE = [sys.executable, "-m", "elastic_console.cli"]
TICK = re.compile(r"tick (\d+) rank (\d+) ")


class Sentinels:
    """A master, one replica of it and three sentinels watching them, all on loopback."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        # No delay before a full sync: a replica still waiting for its first copy when the
        # master dies would be promoted empty.
        self.master = RedisServer(extra_args=["--repl-diskless-sync-delay", "0"])
        self.replica = RedisServer(extra_args=[
            "--replicaof", "127.0.0.1", str(self.master.port),
            "--repl-diskless-sync-delay", "0"])
        self.ports = [free_port() for _ in range(3)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.admins = [redis.Redis(port=p, decode_responses=True, socket_timeout=2)
                       for p in self.ports]

    def start(self) -> None:
        self.master.start()
        self.replica.start()
        for port in self.ports:
            conf = self.tmp / f"sentinel-{port}.conf"  # each its own: a sentinel rewrites its file
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndaemonize no\ndir {self.tmp}\n"
                f"logfile {self.tmp / f'sentinel-{port}.log'}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                # Short, so that an election that splits the votes is retried within seconds.
                f"sentinel failover-timeout {SERVICE} 3000\n")
            self.procs.append(subprocess.Popen(
                [find_redis_server(), str(conf), "--sentinel"], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))

    @property
    def url(self) -> str:
        return ("redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)
                + f"/{SERVICE}")

    def state(self, i: int) -> dict:
        try:
            return self.admins[i].sentinel_master(SERVICE)
        except (redis.RedisError, OSError):
            return {}

    def ready(self) -> bool:
        """Every sentinel knows the other two and the replica, and the replica is in sync."""
        for i in range(3):
            s = self.state(i)
            if s.get("num-other-sentinels") != 2 or s.get("num-slaves") != 1:
                return False
        return in_sync(self.master, self.replica)

    def master_port(self) -> int | None:
        """The master's port if every sentinel names the same one, else None."""
        names = set()
        for i in range(3):
            s = self.state(i)
            if not s or s.get("is_sdown") or s.get("is_odown"):
                return None
            names.add(int(s["port"]))
        return names.pop() if len(names) == 1 else None

    def close(self) -> None:
        for a in self.admins:
            a.close()
        for p in self.procs:
            p.kill()
            p.wait()
        self.master.cleanup()
        self.replica.cleanup()

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:]
                         for p in sorted(self.tmp.glob("sentinel-*.log")))


def in_sync(master: RedisServer, replica: RedisServer) -> bool:
    try:
        with redis.Redis(port=master.port, decode_responses=True, socket_timeout=2) as m, \
                redis.Redis(port=replica.port, decode_responses=True, socket_timeout=2) as r:
            mi, ri = m.info("replication"), r.info("replication")
    except (redis.RedisError, OSError):
        return False
    return (ri.get("master_link_status") == "up"
            and ri.get("slave_repl_offset") == mi.get("master_repl_offset"))


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[Sentinels]:
    cluster = Sentinels(tmp_path)
    try:
        cluster.start()
        wait_until(cluster.ready, 60, "three sentinels that see each other and the replica")
        yield cluster
    finally:
        cluster.close()


# -- reading the job back ------------------------------------------------------------------


def log_batches(r: redis.Redis, job: str) -> list[LogBatch]:
    out = []
    for stream in r.smembers(JobKeys(job).log_streams):
        for i, f in r.xrange(stream):
            out += decode_log_entries(i, f) or []
    return out


def ticks(batches: list[LogBatch]) -> dict[int, list[int]]:
    """rank -> the sleeper's tick numbers, in stream order, duplicates kept: the finished lines
    a reader ends with. A batch's live block is not one of them (the next batch's first lines
    replace it): a tick printed as two writes, its text and then its newline (the workers run
    with PYTHONUNBUFFERED), is shipped as a live row if the newline comes late, then as a
    finished line."""
    out: dict[int, list[int]] = {}
    for b in batches:
        for rank, tick in finished_ticks(b):
            out.setdefault(rank, []).append(tick)
    return out


def finished_ticks(b: LogBatch) -> Iterator[tuple[int, int]]:
    """(rank, tick) of each finished line of ``b`` that is a tick (its live block left out)."""
    for line in b.lines[:len(b.lines) - b.live]:
        m = TICK.match(line)
        if m:
            yield int(m.group(2)), int(m.group(1))


def holding_duplicates(batches: list[LogBatch]) -> list[tuple[str, int, int, int, list[str]]]:
    """The batches (id, rank, seq, live rows, lines) holding a tick seen twice: a failure's
    explanation."""
    where: dict[tuple[int, int], list[LogBatch]] = {}
    for b in batches:
        for key in finished_ticks(b):
            where.setdefault(key, []).append(b)
    return [(b.id, b.rank, b.seq, b.live, b.lines) for held in where.values() if len(held) > 1
            for b in held]


def missing(numbers: list[int]) -> int:
    """Ticks absent between the first and the last one seen (the sleeper's are consecutive)."""
    seen = set(numbers)
    return (max(seen) - min(seen) + 1 - len(seen)) if seen else 0


class ProbeReaders:
    """Readers blocked on one stream that retry forever (``retries=-1``, as a reader that must
    ride out any outage would), one sync and one asyncio, each in a thread of its own."""

    KEY = "sentinel-test:probe"

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: dict[str, list[str]] = {"sync": [], "async": []}
        self.errors: list[BaseException] = []
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._sync, daemon=True),
                        threading.Thread(target=lambda: asyncio.run(self._async()), daemon=True)]
        for t in self.threads:
            t.start()

    def _sync(self) -> None:
        client = make_client(self.url, blocking_ms=1000, retries=-1)
        last = "0-0"
        try:
            while not self.done.is_set():
                for _, entries in client.xread({self.KEY: last}, block=1000) or []:
                    for eid, fields in entries:
                        last = eid.decode()
                        self.seen["sync"].append(fields[b"v"].decode())
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            client.close()

    async def _async(self) -> None:
        client = make_async_client(self.url, blocking_ms=1000, retries=-1)
        last = "0-0"
        try:
            while not self.done.is_set():
                for _, entries in await client.xread({self.KEY: last}, block=1000) or []:
                    for eid, fields in entries:
                        last = eid.decode()
                        self.seen["async"].append(fields[b"v"].decode())
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            await client.aclose()

    def saw(self, value: str) -> bool:
        return all(value in seen for seen in self.seen.values())

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(10)


class Follower:
    """``JobClient.follow`` in a thread of its own, as the console runs it, keeping records."""

    def __init__(self, url: str, job: str) -> None:
        self.url, self.job = url, job
        self.records: list[object] = []
        self.error: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete,
                                        args=(self._main(),), daemon=True)
        self._thread.start()

    async def _main(self) -> None:
        self._task = asyncio.current_task()
        client = JobClient(self.url, self.job)
        try:
            await client.history()
            async for rec in client.follow():
                self.records.append(rec)
        except asyncio.CancelledError:
            pass
        except BaseException as exc:  # reported by the test, not lost in a thread
            self.error = exc
        finally:
            await client.close()

    def batches(self) -> list[LogBatch]:
        return [r for r in list(self.records) if isinstance(r, LogBatch)]

    def stop(self) -> None:
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()


def console(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CONSOLE, *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


# -- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("typed, url, shown", [
    ("redis+sentinel://h1,h2:26380,[::1]:7/mymaster",
     "redis+sentinel://h1:26379,h2:26380,[::1]:7/mymaster",
     "redis+sentinel://h1:26379,h2:26380,[::1]:7/mymaster"),
    # A raw password holding "/", "#", "@", ":" and a space: the userinfo runs to the "@"
    # that leaves a valid host list behind it.
    ("redis+sentinel://ops:a/b#c@d: e@10.0.0.1:26379,10.0.0.2/svc-1?db=3",
     "redis+sentinel://ops:a%2Fb%23c%40d:%20e@10.0.0.1:26379,10.0.0.2:26379/svc-1?db=3",
     "redis+sentinel://ops:***@10.0.0.1:26379,10.0.0.2:26379/svc-1?db=3"),
    # An "@" in a query password: kept percent-encoded, so the display masks exactly it.
    ("rediss+sentinel://:pw-1@h/svc?ssl_ca_certs=/ca.pem&sentinel_password=x@y%26z",
     "rediss+sentinel://:pw-1@h:26379/svc?ssl_ca_certs=/ca.pem&sentinel_password=x%40y%26z",
     "rediss+sentinel://:***@h:26379/svc?ssl_ca_certs=/ca.pem&sentinel_password=***"),
])
def test_sentinel_urls_parse_and_never_show_a_password(typed: str, url: str, shown: str):
    ep = parse_endpoint(typed)
    assert (ep.url, ep.display, str(ep)) == (url, shown, shown)
    assert "pw-1" not in redact(f"lost {ep.url} and {typed}")
    again = parse_endpoint(ep.url)  # what a worker reads back from ELASTIC_REDIS_URL
    assert again.url == ep.url


@pytest.mark.parametrize("typed, why", [
    ("redis+sentinel://h1:26379", "service"),
    ("redis+sentinel://h1:26379/", "service"),
    ("redis+sentinel://h1:0/svc", "port"),
    ("redis+sentinel://h1,,h2/svc", "expected"),
    ("redis+sentinel://h1/svc?db=two", "db"),
    ("redis+sentinel://h1/svc#frag", "expected"),
    # A raw "&" ends a query password early: what follows it is no option.
    ("rediss+sentinel://:pw-1@h/svc?sentinel_password=x@y&z", "written %26"),
])
def test_bad_sentinel_urls_say_why(typed: str, why: str):
    with pytest.raises(EndpointError, match=why):
        parse_endpoint(typed)


def test_sentinel_password_from_outside():
    ep = parse_endpoint("redis+sentinel://ops@h1,[::1]:2/svc")
    assert username_of(ep) == "ops"
    filled = with_outside_password(ep, environ={"REDISCLI_AUTH": "out/side@pw"})
    assert filled.url == "redis+sentinel://ops:out%2Fside%40pw@h1:26379,[::1]:2/svc"
    assert filled.display == "redis+sentinel://ops:***@h1:26379,[::1]:2/svc"
    assert with_outside_password(filled, environ={"REDISCLI_AUTH": "other"}) == filled


def test_endpoint_form_display_and_store(sentinels: Sentinels, job_id: str):
    ep = parse_endpoint(sentinels.url.replace("://", "://ops:s3cr%t@") + "?db=0")
    assert ep.display == sentinels.url.replace("://", "://ops:***@") + "?db=0"
    assert "s3cr%t" not in redact(f"failed on {ep.url}")
    with pytest.raises(ValueError, match="service"):
        parse_endpoint("redis+sentinel://127.0.0.1:26379")
    client = make_client(sentinels.url)
    try:
        assert client.ping()
        assert describe_endpoint(client) == sentinels.url
        master = client.connection_pool.get_master_address()
        assert int(master[1]) == sentinels.master.port
    finally:
        client.close()
    # The c10d store (what torch's process groups use) by construction, blocking get included.
    store = RedisStore(sentinels.url, job_id, "sentinel")
    try:
        def set_late() -> None:
            other = store.clone()  # its own connections, as another rank's would be
            try:
                other.set("late", b"here")
            finally:
                other.close()

        setter = threading.Timer(0.3, set_late)
        setter.start()
        assert store.get("late") == b"here"
        setter.join()
        assert store.add("n", 2) == 2
    finally:
        store.close()


def test_tls_and_both_passwords(tmp_path: Path):
    """``rediss+sentinel://``: TLS to the sentinel and to the master; the userinfo is the
    master's password, ``sentinel_password=`` the sentinel's own; neither is ever shown."""
    make_ca_and_server_cert(tmp_path)
    tls = ["--tls-cert-file", str(tmp_path / "server.crt"),
           "--tls-key-file", str(tmp_path / "server.key"),
           "--tls-ca-cert-file", str(tmp_path / "ca.crt"), "--tls-auth-clients", "no"]
    master_tls = free_port()
    master = RedisServer(extra_args=["--tls-port", str(master_tls), *tls]).start()
    # Only now: RedisServer's readiness check is a PING without a password.
    with redis.Redis(port=master.port) as admin:
        admin.config_set("requirepass", "master-pw-1")
    port, sentinel_tls = free_port(), free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text("\n".join([
        f"port {port}", f"tls-port {sentinel_tls}", "bind 127.0.0.1", f"dir {tmp_path}",
        *(f"{tls[i].lstrip('-')} {tls[i + 1]}" for i in range(0, len(tls), 2)),
        "tls-replication yes", "requirepass sentinel-pw-2",
        f"sentinel monitor {SERVICE} 127.0.0.1 {master_tls} 1",
        f"sentinel auth-pass {SERVICE} master-pw-1", ""]))
    proc = subprocess.Popen([find_redis_server(), str(conf), "--sentinel"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    base = (f"rediss+sentinel://:master-pw-1@127.0.0.1:{sentinel_tls}/{SERVICE}"
            f"?ssl_ca_certs={tmp_path / 'ca.crt'}")
    try:
        ep = parse_endpoint(base + "&sentinel_password=sentinel-pw-2")
        assert "pw-" not in ep.display and "pw-" not in redact(f"at {ep.url}: refused")

        def up() -> bool:
            try:
                connect(ep).close()
                return True
            except RedisUnavailableError:
                return False

        wait_until(up, 30, "the master through the TLS sentinel")
        with connect(ep) as client:
            assert client.set("k", "v") and client.get("k") == b"v"
            assert int(client.connection_pool.get_master_address()[1]) == master_tls
        with pytest.raises(RedisUnavailableError, match="sentinel_password=") as err:
            connect(base)
        assert "pw-" not in str(err.value)
        with pytest.raises(RedisUnavailableError, match="TLS") as err:
            connect(ep.url.replace("ca.crt", "other.crt"))
        assert "pw-" not in str(err.value)
    finally:
        proc.kill()
        proc.wait()
        master.cleanup()


def test_a_demotion_under_clients_is_retried_not_returned(sentinels: Sentinels):
    """A master turned replica while reachable (here by hand, behind the sentinels' back, and
    back a moment later): the reads it was blocking are cut ("UNBLOCKED ... master ->
    replica?") and a write is refused (READONLY). Both are outages for our clients to retry,
    not answers to hand to the caller: readers and writer get their entry once it is back."""
    url = sentinels.url
    elsewhere = RedisServer().start()
    admin = redis.Redis(port=sentinels.master.port, decode_responses=True)
    results: dict[str, object] = {}

    def record(name: str, call: Callable[[], object]) -> None:
        try:
            results[name] = call()
        except BaseException as exc:
            results[name] = exc

    def read_sync() -> object:
        with make_client(url, blocking_ms=20_000) as client:
            return client.xread({"cut": "0-0"}, block=20_000)

    async def read_async() -> object:
        client = make_async_client(url, blocking_ms=20_000)
        try:
            return await client.xread({"cut": "0-0"}, block=20_000)
        finally:
            await client.aclose()

    def write() -> object:
        with make_client(url, retries=30) as client:
            return client.xadd("cut", {"v": "1"})

    threads = [threading.Thread(target=record, args=("sync", read_sync), daemon=True),
               threading.Thread(target=record, args=("async", lambda: asyncio.run(read_async())),
                                daemon=True)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: admin.info("clients")["blocked_clients"] == 2, 30, "two blocked reads")
        admin.replicaof("127.0.0.1", elsewhere.port)
        threads.append(threading.Thread(target=record, args=("write", write), daemon=True))
        threads[-1].start()
        # Both reads are blocked again, on the replica the old master now is.
        wait_until(lambda: admin.info("clients")["blocked_clients"] == 2, 30, "the reads back")
        errors = admin.info("errorstats")
        assert "errorstat_UNBLOCKED" in errors
        wait_until(lambda: "errorstat_READONLY" in admin.info("errorstats"), 30,
                   "the write refused as READONLY")
        admin.replicaof("no", "one")
        for t in threads:
            t.join(30)
        assert isinstance(results.get("write"), bytes), results
        for name in ("sync", "async"):
            reply = results.get(name)
            assert isinstance(reply, list) and reply[0][1][0][1] == {b"v": b"1"}, results
    finally:
        admin.close()
        elsewhere.cleanup()


def test_agent_job_rides_out_a_master_failover(sentinels: Sentinels, tmp_path: Path,
                                                job_id: str):
    url = sentinels.url
    r = make_client(url)  # every check below reads through the sentinels, as a console would
    args = agent_args(url, job_id, "--nnodes", "1", "--nproc-per-node", "2",
                      "--max-restarts", "3", FAST, str(SCRIPTS / "sleeper.py"),
                      "--seconds", "600")
    agent = Agent(args, tmp_path, "agent")
    follower: Follower | None = None
    probes = ProbeReaders(url)
    try:
        wait_until(lambda: len(worker_pids(r, job_id)) == 2, 60, "two workers")
        pids = worker_pids(r, job_id)
        wait_until(lambda: all(len(t) >= 20 for t in ticks(log_batches(r, job_id)).values())
                   and len(ticks(log_batches(r, job_id))) == 2, 30, "ticks from both ranks")
        follower = Follower(url, job_id)
        wait_until(lambda: follower.batches(), 30, "the console's follow loop reading lines")
        r.xadd(ProbeReaders.KEY, {"v": "before"})
        wait_until(lambda: probes.saw("before"), 30, "the blocked readers to start")
        restarts = r.get(JobKeys(job_id).restarts)
        rounds = len(of_type(r, job_id, EventType.RENDEZVOUS_COMPLETE))
        wait_until(lambda: in_sync(sentinels.master, sentinels.replica), 30, "replica in sync")

        killed_ms = time.time() * 1000
        sentinels.master.kill()
        wait_until(lambda: sentinels.master_port() == sentinels.replica.port, 60,
                   f"the sentinels to promote the replica:\n{sentinels.logs()}")
        promoted_s = time.time() - killed_ms / 1000

        def after_kill() -> list[LogBatch]:
            return [b for b in log_batches(r, job_id) if stream_id_ms(b.id) >= killed_ms]

        # Two seconds of ticks after the first new line: the flow goes on, not one batch.
        wait_until(lambda: after_kill() and all(
            max(t) - min(t) >= 40 for t in ticks(after_kill()).values())
            and len(ticks(after_kill())) == 2, 60,
            f"log lines on the new master:\n{agent.output[-3000:]}")
        gap_s = min(stream_id_ms(b.id) for b in after_kill()) / 1000 - killed_ms / 1000
        r.xadd(ProbeReaders.KEY, {"v": "after"})
        wait_until(lambda: probes.saw("after"), 30,
                   f"readers blocked on the dead master to read from the new one "
                   f"(seen {probes.seen}, errors {probes.errors!r})")
        assert not probes.errors, probes.errors

        assert agent.proc.poll() is None, agent.output[-3000:]
        assert worker_pids(r, job_id) == pids
        assert alive(pids) == pids
        assert r.get(JobKeys(job_id).restarts) == restarts
        assert len(of_type(r, job_id, EventType.RENDEZVOUS_COMPLETE)) == rounds
        assert not of_type(r, job_id, EventType.RESTARTING)
        assert not of_type(r, job_id, EventType.NODE_LOST)

        # What a reader shows: a batch written twice (an XADD retried after its reply was
        # lost with the master) is one batch, known by its sequence number.
        stored = log_batches(r, job_id)
        shown = list({(b.node, b.rank, b.stream, b.attempt, b.seq): b for b in stored}.values())
        copies = len(stored) - len(shown)
        per_rank = ticks(shown)
        lost = {rank: missing(t) for rank, t in per_rank.items()}
        duplicated = {rank: len(t) - len(set(t)) for rank, t in per_rank.items()}

        p = console("status", job_id, "--redis", url)
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"job       {job_id}: running" in p.stdout, p.stdout
        assert all(str(pid) in p.stdout for pid in pids), p.stdout

        # The console's follow loop reconnected by itself and goes on with new lines.
        wait_until(lambda: any(stream_id_ms(b.id) >= killed_ms for b in follower.batches()),
                   30, f"the follow loop to see new lines (error: {follower.error!r})")
        assert follower.error is None, repr(follower.error)
        followed = {rank: missing(t) for rank, t in ticks(follower.batches()).items()}

        print(f"\nSentinel failover (SIGKILL of the master): all sentinels agree after "
              f"{promoted_s:.2f} s, "
              f"first new log line on the new master {gap_s:.2f} s after the kill; "
              f"log lines lost per rank {lost}, duplicated {duplicated} "
              f"({copies} batches stored twice); lost as the console followed {followed}")
        assert gap_s < 60  # a hang, not a speed goal
        # README.md: no line lost or duplicated (the replica was in sync at the kill).
        assert lost == {0: 0, 1: 0} and duplicated == {0: 0, 1: 0}, (
            lost, duplicated, holding_duplicates(shown))
        assert followed == {0: 0, 1: 0}, followed

        # Events go on too: a stop command, acknowledged and carried out through the new master.
        p = console("stop", job_id, "-y", "--timeout", "30", "--redis", url)
        assert p.returncode == 0, p.stdout + p.stderr
        assert agent.wait(60) == 128 + signal.SIGTERM, agent.output[-3000:]
        late = [e for e in events(r, job_id) if stream_id_ms(e.id) >= killed_ms]
        assert {EventType.COMMAND_ACK, EventType.JOB_STOPPED} <= {e.type for e in late}
    finally:
        probes.stop()
        if follower is not None:
            follower.stop()
        if agent.proc.poll() is None:
            agent.kill()
            agent.wait(10)
        r.close()


def test_clients_follow_a_manual_failover(sentinels: Sentinels):
    """``SENTINEL FAILOVER`` leaves the old master up: it goes on acknowledging writes until
    Sentinel demotes it (about 10 s here), and those writes vanish with its data set. Clients
    that re-ask the sentinels every MASTER_CHECK_S (and retry through a demotion) move early."""
    url = sentinels.url
    writer = make_client(url)
    reader = make_client(url, blocking_ms=2000, retries=-1)
    old = sentinels.master.port
    acked: list[tuple[float, int]] = []
    seen: list[int] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        last = "0-0"
        while not done.is_set():
            try:
                reply = reader.xread({"mf": last}, block=500, count=500)
            except redis.RedisError as exc:
                errors.append(exc)
                return
            for _, entries in reply or []:
                for eid, fields in entries:
                    last = eid.decode()
                    seen.append(int(fields[b"i"]))

    async def read_async(out: list[int]) -> None:
        client = make_async_client(url, blocking_ms=2000, retries=-1)
        last = "0-0"
        try:
            while not done.is_set():
                reply = await client.xread({"mf": last}, block=500, count=500)
                for _, entries in reply or []:
                    for eid, fields in entries:
                        last = eid.decode()
                        out.append(int(fields[b"i"]))
        finally:
            await client.aclose()

    seen_async: list[int] = []

    def run_async() -> None:
        try:
            asyncio.run(read_async(seen_async))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read, daemon=True),
               threading.Thread(target=run_async, daemon=True)]
    for t in threads:
        t.start()
    try:
        i = 0
        for i in range(50):
            writer.xadd("mf", {"i": i})
            acked.append((time.monotonic(), i))

        def failover() -> bool:
            try:
                return bool(sentinels.admins[0].execute_command("SENTINEL", "FAILOVER", SERVICE))
            except redis.ResponseError as exc:  # NOGOODSLAVE until the sentinel rates it
                if "NOGOODSLAVE" not in str(exc):
                    raise
                return False

        wait_until(failover, 30, "a sentinel to accept SENTINEL FAILOVER")
        switched: float | None = None
        demoted = False
        deadline = time.monotonic() + 60
        while not demoted or time.monotonic() < (switched or 0) + 3:
            assert time.monotonic() < deadline, f"no failover:\n{sentinels.logs()}"
            i += 1
            writer.xadd("mf", {"i": i})  # must never raise: the retries ride it out
            acked.append((time.monotonic(), i))
            if switched is None and sentinels.master_port() == sentinels.replica.port:
                switched = time.monotonic()
            if not demoted:
                with redis.Redis(port=old, decode_responses=True) as o:
                    demoted = o.role()[0] == "slave"
            time.sleep(0.005)  # the write loop's pace, not a wait: its writes are what is counted
        assert switched is not None
        final = {int(f[b"i"]) for _, f in writer.xrange("mf")}
        wait_until(lambda: set(seen) >= final and set(seen_async) >= final, 30,
                   f"the blocked readers to catch up (errors {errors!r})")
    finally:
        done.set()
        for t in threads:
            t.join(10)
        writer.close()
        reader.close()
    assert not errors, errors
    assert int(writer.connection_pool.get_master_address()[1]) == sentinels.replica.port
    lost = [(t, n) for t, n in acked if n not in final]
    late = [n for t, n in lost if t > switched + 2.0]
    print(f"\nmanual failover: {len(lost)} acknowledged writes lost, the last "
          f"{max((t for t, _ in lost), default=switched) - switched:+.2f} s from the switch")
    # Without the periodic check they run on until the old master is demoted.
    assert not late, f"{len(late)} writes acknowledged by the old master after the switch"
