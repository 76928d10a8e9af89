"""TLS and ACLs for real: a redis-server with a TLS port and a CA made here, the ACL lines of
docs/SECURITY.md applied verbatim, and a real job run by its agent user while a viewer and an
operator use the console's commands."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from elastic_agent.coordination.ports import free_port
from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.supervision.hosting.standalone import RedisServer
from tests.agents import ROOT, SCRIPTS, Agent, wait_until
from tests.test_agent import FAST, of_type, worker_pids

CONSOLE = [sys.executable, "-m", "elastic_console.cli"]
PASSWORDS = {"AGENT_PASSWORD": "agent-pw-1", "OPERATOR_PASSWORD": "operator-pw-2",
             "VIEWER_PASSWORD": "viewer-pw-3"}


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca_and_server_cert(d: Path) -> None:
    """A CA of the test's own and a server certificate for 127.0.0.1 signed by it."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.crt", "-days", "2", "-subj", "/CN=elastic-console test CA", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
             "server.csr", "-subj", "/CN=127.0.0.1", cwd=d)
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "ext", cwd=d)
    # A second CA that signed nothing here: a client trusting it must refuse the server.
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out",
             "other.crt", "-days", "2", "-subj", "/CN=some other CA", cwd=d)


class TlsRedis:
    def __init__(self, server: RedisServer, tls_port: int, certs: Path) -> None:
        self.server, self.tls_port, self.certs = server, tls_port, certs

    def url(self, user: str = "", ca: str = "ca.crt") -> str:
        who = f"{user}@" if user else ""
        return f"rediss://{who}127.0.0.1:{self.tls_port}?ssl_ca_certs={self.certs / ca}"


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    certs = tmp_path_factory.mktemp("certs")
    make_ca_and_server_cert(certs)
    tls_port = free_port()
    # The plain port stays for the fixture's own admin connection (and the readiness check).
    server = RedisServer(extra_args=[
        "--tls-port", str(tls_port), "--tls-cert-file", str(certs / "server.crt"),
        "--tls-key-file", str(certs / "server.key"), "--tls-ca-cert-file", str(certs / "ca.crt"),
        "--tls-auth-clients", "no"]).start()
    yield TlsRedis(server, tls_port, certs)
    server.cleanup()


def acl_lines() -> list[str]:
    """The ACL lines of docs/SECURITY.md, exactly as documented."""
    text = (ROOT / "docs" / "SECURITY.md").read_text()
    (block,) = re.findall(r"```acl\n(.*?)```", text, re.S)
    return [line for line in block.splitlines() if line.strip()]


def apply_acls(admin: redis.Redis, job: str) -> None:
    for line in acl_lines():
        for placeholder, value in PASSWORDS.items():
            line = line.replace(placeholder, value)
        args = shlex.split(line.replace("JOB", job))
        assert args[:2] == ["ACL", "SETUSER"]
        admin.execute_command(*args)


def cli(*args: str, password: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_REDIS_URL"}
    env["REDISCLI_AUTH"] = password
    return subprocess.run([*CONSOLE, *args], capture_output=True, text=True, timeout=60,
                          env=env, stdin=subprocess.DEVNULL)


def test_a_job_over_tls_with_the_documented_acl_roles(tls_redis: TlsRedis, tmp_path):
    job = "tls-acl-1"
    admin = make_client(tls_redis.server.url)
    apply_acls(admin, job)
    agent_user = f"ec-agent-{job}"
    env = {"REDISCLI_AUTH": PASSWORDS["AGENT_PASSWORD"]}
    agent = Agent(["--redis", tls_redis.url(agent_user), "--job-id", job, "--local-addr",
                   "127.0.0.1", "--nproc-per-node", "2", FAST, str(SCRIPTS / "sleeper.py")],
                  tmp_path, "a", env=env)
    try:
        wait_until(lambda: len(worker_pids(admin, job)) == 2, 60, "workers started over TLS")
        viewer = tls_redis.url("ec-viewer")
        operator = tls_redis.url("ec-operator")
        vpw, opw = PASSWORDS["VIEWER_PASSWORD"], PASSWORDS["OPERATOR_PASSWORD"]

        for args in (["ls"], ["status", job], ["events", job], ["logs", job, "--tail", "3"]):
            p = cli(*args, "--redis", viewer, password=vpw)
            assert p.returncode == 0, (args, p.stderr)
        assert "tick" in cli("logs", job, "--redis", viewer, password=vpw).stdout

        refused = cli("restart", job, "--yes", "--redis", viewer, password=vpw)
        assert refused.returncode != 0
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and "may not" in lines[0] and "Traceback" not in refused.stderr, (
            refused.stderr)
        assert vpw not in refused.stderr

        done = cli("restart", job, "--yes", "--redis", operator, password=opw)
        assert done.returncode == 0, done.stderr
        try:
            wait_until(lambda: len(of_type(admin, job, EventType.WORKERS_STARTED)) == 2, 30,
                       "the restart by the operator")
        except AssertionError as exc:
            said = [x for x in agent.output.splitlines() if "elastic-agent" in x]
            raise AssertionError(f"{exc}\n{done.stdout}\n" + "\n".join(said[-30:])) from None

        # The agent's user reaches nothing of another job.
        mine = redis.Redis.from_url(
            f"rediss://{agent_user}:{PASSWORDS['AGENT_PASSWORD']}@127.0.0.1:{tls_redis.tls_port}"
            f"?ssl_ca_certs={tls_redis.certs / 'ca.crt'}")
        assert mine.hget(f"elastic:{{{job}}}:meta", "max_restarts") is not None
        with pytest.raises(redis.exceptions.NoPermissionError):
            mine.get("elastic:{another-job}:meta")
        mine.close()

        stop = cli("stop", job, "--yes", "--redis", operator, password=opw)
        assert stop.returncode == 0, stop.stderr
        assert agent.wait(60) == 143, agent.output[-3000:]
        assert "Traceback" not in agent.output
    finally:
        if agent.proc.poll() is None:
            agent.kill()
            agent.wait(10)


def test_a_certificate_that_does_not_verify_is_one_clear_line(tls_redis: TlsRedis):
    p = cli("ls", "--redis", tls_redis.url(ca="other.crt"), password="")
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "certificate verify failed" in lines[0], p.stderr
    assert "Traceback" not in p.stderr


def test_a_jobs_agent_user_can_list_its_job_but_never_hide_another(tls_redis: TlsRedis):
    """The job index is shared by every job. With the documented ACL a job's agent user may
    add to it (ZADD) and nothing else: it cannot remove another job's entry. What ZADD still
    allows (fake entries, another entry's date) the readers answer: only jobs with records
    are listed, the read is bounded, and `ls` says in one line when entries were not read."""
    from elastic_console.job.client import INDEX_READ_MAX

    admin = make_client(tls_redis.server.url)
    job, other = "idx-a", "idx-b"
    admin.delete("elastic:jobs")
    apply_acls(admin, job)
    now_ms = int(admin.time()[0]) * 1000
    admin.hset(f"elastic:{{{other}}}:meta", mapping={"created_ms": now_ms - 60_000,
                                                     "final_state": "succeeded"})
    admin.zadd("elastic:jobs", {other: now_ms - 60_000})
    agent_url = (f"rediss://ec-agent-{job}:{PASSWORDS['AGENT_PASSWORD']}@127.0.0.1:"
                 f"{tls_redis.tls_port}?ssl_ca_certs={tls_redis.certs / 'ca.crt'}")
    mine = redis.Redis.from_url(agent_url)
    try:
        # What an agent does: list its own job (after its meta).
        mine.hset(f"elastic:{{{job}}}:meta", "created_ms", now_ms)
        assert mine.zadd("elastic:jobs", {job: now_ms}, nx=True) == 1
        for command in (["ZREM", "elastic:jobs", other], ["DEL", "elastic:jobs"],
                        ["UNLINK", "elastic:jobs"], ["ZPOPMIN", "elastic:jobs"],
                        ["ZREMRANGEBYSCORE", "elastic:jobs", "-inf", "+inf"],
                        ["EXPIRE", "elastic:jobs", "1"],
                        ["RENAME", "elastic:jobs", f"elastic:{{{job}}}:x"],
                        ["EVAL", "return redis.call('DEL', KEYS[1])", "1", "elastic:jobs"]):
            with pytest.raises(redis.exceptions.NoPermissionError):
                mine.execute_command(*command)
        assert admin.zscore("elastic:jobs", other) is not None
        # What it can still do: move the other job's entry last, add fakes, some dated in
        # the future (which no agent writes: it lists its job at the server's TIME).
        mine.zadd("elastic:jobs", {other: 0}, xx=True)
        fakes = 5_000
        for start in range(0, fakes, 1_000):
            mine.zadd("elastic:jobs", {f"fake-{i}": now_ms - 100_000 + i
                                       for i in range(start, start + 1_000)})
        mine.zadd("elastic:jobs", {f"future-{i}": now_ms + 3_600_000 for i in range(10)})
    finally:
        mine.close()

    def ls(user: str, password: str) -> tuple[list[str], str]:
        p = cli("ls", "--json", "--redis", tls_redis.url(user), password=password)
        assert p.returncode == 0, p.stderr
        return [j["job"] for j in json.loads(p.stdout)], p.stderr

    viewer = ("ec-viewer", PASSWORDS["VIEWER_PASSWORD"])
    listed, said = ls(*viewer)
    assert listed == [job, other], listed  # the fakes are no jobs; the other job is still there
    notes = [line for line in said.splitlines() if "note:" in line]
    assert len(notes) == 1 and "10 were not read" in notes[0], said

    # A flood beyond what one list reads: the other job, moved last, is pushed out of the
    # list, and `ls` says so (never silently).
    mine = redis.Redis.from_url(agent_url)
    try:
        for start in range(fakes, INDEX_READ_MAX + 1_000, 1_000):
            mine.zadd("elastic:jobs", {f"fake-{i}": now_ms - 100_000 + i
                                       for i in range(start, start + 1_000)})
    finally:
        mine.close()
    listed, said = ls(*viewer)
    assert other not in listed
    assert "were not read" in said and "docs/SECURITY.md" in said, said
    # The remedy: a user allowed to prune (here the default user) lists, and the entries
    # without a job it read are gone; the other job is listed again by the next reader.
    before = admin.zcard("elastic:jobs")
    p = subprocess.run([*CONSOLE, "ls", "--redis", tls_redis.server.url], capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    assert admin.zcard("elastic:jobs") <= before - INDEX_READ_MAX + 2
    listed, _ = ls(*viewer)
    assert listed[-1] == other, listed
    admin.close()
