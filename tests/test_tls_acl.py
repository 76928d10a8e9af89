"""TLS and ACLs for real: a redis-server with a TLS port and a CA made here, the ACL lines of
docs/SECURITY.md applied verbatim, and a real job run by its agent user while a viewer and an
operator use the console's commands."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from elastic_agent.coordination.connection import make_client
from elastic_agent.coordination.ports import free_port
from elastic_agent.coordination.protocol import EventType
from elastic_agent.supervision.standalone import RedisServer
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
