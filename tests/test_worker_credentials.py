"""What Redis credentials a worker holds: none of the agent's, or the workers' own.

A worker is the user's training script and whatever it loads: it never inherits the agent's
password (``REDISCLI_AUTH``, ``ELASTIC_REDIS_PASSWORD_FILE``, a password in the URL), and its
``ELASTIC_REDIS_URL`` names the server with no credentials unless the agent was given the
workers' own in ``ELASTIC_WORKER_REDIS_URL`` (docs/SECURITY.md, "What a worker holds"; the
Kubernetes manifests' case is in tests/test_kubernetes.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from elastic_agent.coordination.transport.endpoints import parse_endpoint, without_credentials
from elastic_agent.supervision.hosting.standalone import RedisServer
from elastic_agent.supervision.launch.worker_env import (
    AGENT_SECRET_ENV,
    RankAssignment,
    WorkerSpec,
    worker_env,
    zygote_env,
)
from tests.agents import ROOT, Agent

ADMIN_PASSWORD = "admin-pw-" + uuid.uuid4().hex
WORKER_PASSWORD = "worker-pw-" + uuid.uuid4().hex


@pytest.mark.parametrize(("url", "bare"), [
    ("redis://u:p@h:1/0?db=2&password=x&socket_connect_timeout=3",
     "redis://h:1/0?db=2&socket_connect_timeout=3"),
    ("redis://:p%40q@h:6379", "redis://h:6379"),
    ("rediss://ec:pw@h:6380?ssl_ca_certs=/a/b.pem&username=z",
     "rediss://h:6380?ssl_ca_certs=/a/b.pem"),
    ("unix://u:pw@/tmp/r.sock?db=1", "unix:///tmp/r.sock?db=1"),
    ("redis+sentinel://u:pw@a:1,b:2/svc?db=1&sentinel_password=s&sentinel_username=t",
     "redis+sentinel://a:1,b:2/svc?db=1"),
    ("redis+cluster://u:p@h:7000", "redis+cluster://h:7000"),
    ("redis://u:pa@wo?rd@h:6379?password=a%26b", "redis://h:6379"),
    ("redis://h:1", "redis://h:1"),
])
def test_a_url_without_credentials_names_the_same_server(url: str, bare: str) -> None:
    assert without_credentials(parse_endpoint(url).url) == bare
    assert parse_endpoint(bare).url == bare  # still an endpoint the workers can parse


def _spec(tmp_path: Path, **kw: object) -> WorkerSpec:
    return WorkerSpec(nproc=2, entrypoint=["python", "train.py"], run_id="j", job_id="j",
                      log_dir=tmp_path, redis_url="redis://h:6379", **kw)


def test_a_worker_and_its_zygote_never_inherit_the_agents_credentials(tmp_path: Path) -> None:
    base = {"REDISCLI_AUTH": "agent-secret", "ELASTIC_REDIS_PASSWORD_FILE": "/run/pw",
            "ELASTIC_WORKER_REDIS_URL": "redis://w:worker-secret@h:6379", "HOME": "/home/u",
            "PATH": "/usr/bin"}
    assert set(AGENT_SECRET_ENV) >= {"REDISCLI_AUTH", "ELASTIC_REDIS_PASSWORD_FILE",
                                     "ELASTIC_WORKER_REDIS_URL"}
    spec = _spec(tmp_path)
    assignment = RankAssignment(group_rank=0, group_world_size=1, world_size=2, base_rank=0,
                                master_addr="127.0.0.1", master_port=29500)
    for env in (worker_env(spec, assignment, 1, base), zygote_env(spec, base)):
        assert not set(AGENT_SECRET_ENV) & set(env), sorted(env)
        assert not [v for v in env.values() if "secret" in v or v == "/run/pw"], env
        assert env["HOME"] == "/home/u" and env["PATH"] == "/usr/bin"  # the rest is inherited
    assert worker_env(spec, assignment, 1, base)["ELASTIC_REDIS_URL"] == "redis://h:6379"


# -- a real agent on a Redis with passwords ----------------------------------------------------

@pytest.fixture(scope="module")
def guarded() -> Iterator[RedisServer]:
    """A Redis whose default user needs a password (an admin's, as a simple deployment's)."""
    server = RedisServer().start()  # its readiness PING needs no password: set it after
    admin = redis.Redis(host=server.host, port=server.port)
    admin.config_set("requirepass", ADMIN_PASSWORD)
    admin.close()
    yield server
    server.cleanup()


def _worker_role(job: str) -> list[str]:
    """docs/SECURITY.md's ec-worker-JOB line, as ACL SETUSER arguments, for ``job``."""
    text = (ROOT / "docs" / "SECURITY.md").read_text()
    (block,) = re.findall(r"```acl\n(.*?)```", text, re.S)
    (line,) = [x for x in block.splitlines() if x.startswith("ACL SETUSER ec-worker-JOB ")]
    return shlex.split(line.replace("WORKER_PASSWORD", WORKER_PASSWORD).replace("JOB", job))


WORKER = r"""
import hashlib, json, os, sys
import redis
from elastic_agent.coordination.store import RedisStore

# The URL's hash, not the URL: the agent's output must show no password, a worker's included.
out = {"env": sorted(k for k in os.environ if "REDIS" in k or "AUTH" in k),
       "url": hashlib.sha256(os.environ["ELASTIC_REDIS_URL"].encode()).hexdigest()}
job, rank = os.environ["ELASTIC_JOB_ID"], os.environ["RANK"]
try:
    store = RedisStore(os.environ["ELASTIC_REDIS_URL"], job, "probe", timeout=30)
    store.set(f"rank{rank}", b"here")
    store.wait([f"rank{1 - int(rank)}"])
    out["store"] = store.get(f"rank{1 - int(rank)}").decode()
    store.close()
except Exception as exc:
    out["store"] = type(exc).__name__
client = redis.Redis.from_url(os.environ["ELASTIC_REDIS_URL"])
for what, command in (("config_set", ["CONFIG", "SET", "maxmemory-policy", "noeviction"]),
                      ("stop_own_job", ["XADD", "elastic:{%s}:commands" % job, "*", "a", "b"]),
                      ("read_events", ["XRANGE", "elastic:{%s}:events" % job, "-", "+"])):
    try:
        client.execute_command(*command)
        out[what] = "done"
    except redis.RedisError as exc:
        out[what] = type(exc).__name__
print("WORKER " + json.dumps(out), flush=True)
"""


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _run(server: RedisServer, tmp_path: Path, job: str, env: dict[str, str]) -> list[dict]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    agent = Agent(["--redis", f"redis://{server.host}:{server.port}", "--job-id", job,
                   "--local-addr", "127.0.0.1", "--nproc-per-node", "2",
                   "--shutdown-timeout", "5", str(script)],
                  tmp_path, "agent", env={"REDISCLI_AUTH": ADMIN_PASSWORD, **env})
    code = agent.wait(120)
    out = agent.output
    assert code == 0, out[-3000:]
    assert ADMIN_PASSWORD not in out and WORKER_PASSWORD not in out, out[-3000:]
    reports = [json.loads(x.split("WORKER ", 1)[1]) for x in out.splitlines() if "WORKER " in x]
    assert len(reports) == 2, out[-3000:]
    return reports


def test_workers_of_an_agent_with_an_admin_password_hold_none(guarded: RedisServer,
                                                              tmp_path: Path) -> None:
    job = f"wc-{uuid.uuid4().hex[:8]}"
    for report in _run(guarded, tmp_path, job, {"ELASTIC_WORKER_REDIS_URL": ""}):
        assert report["env"] == ["ELASTIC_REDIS_URL"], report
        assert report["url"] == _sha(f"redis://{guarded.host}:{guarded.port}"), report
        # The server wants a password the worker does not have: nothing at all.
        assert report["store"] == "RedisUnavailableError", report  # refused: no password
        assert {report[k] for k in ("config_set", "stop_own_job", "read_events")} == {
            "AuthenticationError"}, report


def test_workers_given_their_own_user_reach_their_store_and_nothing_else(
        guarded: RedisServer, tmp_path: Path) -> None:
    """ELASTIC_WORKER_REDIS_URL, docs/SECURITY.md's ec-worker-JOB role: the torch store's keys
    work (two ranks meet through the store), commands, events and admin are refused."""
    job = f"wc-{uuid.uuid4().hex[:8]}"
    admin = redis.Redis(host=guarded.host, port=guarded.port, password=ADMIN_PASSWORD)
    try:
        admin.execute_command("ACL", *_worker_role(job)[1:])
    finally:
        admin.close()
    url = f"redis://ec-worker-{job}:{WORKER_PASSWORD}@{guarded.host}:{guarded.port}"
    for report in _run(guarded, tmp_path, job, {"ELASTIC_WORKER_REDIS_URL": url}):
        assert report["env"] == ["ELASTIC_REDIS_URL"], report
        assert report["url"] == _sha(url), report
        assert report["store"] == "here", report
        assert {report[k] for k in ("config_set", "stop_own_job", "read_events")} == {
            "NoPermissionError"}, report


def test_a_bad_worker_url_is_one_line_and_exit_2(tmp_path: Path) -> None:
    agent = Agent(["--redis", "redis://127.0.0.1:1", "--job-id", "wc-bad", "x.py"], tmp_path,
                  "agent", env={"ELASTIC_WORKER_REDIS_URL": "http://u:s3cret-pw@h:1"})
    assert agent.wait(30) == 2
    lines = agent.output.strip().splitlines()
    assert len(lines) == 1 and "ELASTIC_WORKER_REDIS_URL" in lines[0], lines
    assert "s3cret-pw" not in agent.output and "Traceback" not in agent.output
