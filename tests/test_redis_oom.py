"""Redis at maxmemory: an agent rides it out like an outage, and warns about eviction policies.

Each test runs its own redis-server (a maxmemory and a policy are server-wide settings).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from elastic_agent.coordination.transport import pressure
from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.supervision.hosting.standalone import RedisServer
from tests.agents import SCRIPTS, Agent, wait_until

FAST = "--rdzv-conf=last_call_timeout=1,heartbeat_timeout=4,keep_alive_interval=0.5,join_timeout=60"
MAXMEMORY = 160 * 1024 * 1024


@pytest.fixture
def full_redis() -> Iterator[tuple[RedisServer, redis.Redis]]:
    """A server at maxmemory (noeviction), held there by ballast keys the test can free."""
    server = RedisServer(extra_args=["--maxmemory", str(MAXMEMORY),
                                     "--maxmemory-policy", "noeviction"]).start()
    client = make_client(server.url)
    chunk = b"b" * (1024 * 1024)
    i = 0
    try:
        while True:  # fill until Redis refuses: whatever the allocator's overhead
            client.set(f"ballast:{i}", chunk)
            i += 1
    except redis.OutOfMemoryError:
        pass
    yield server, client
    client.close()
    server.cleanup()


def _events(r: redis.Redis, job: str) -> list:
    """The job's events as a reader sees them: a batch re-sent from its first refused record
    on may write the records after it twice (same node and seq), which readers drop."""
    from tests.test_agent import events

    return events(r, job)


def _oom_warnings(output: str) -> list[str]:
    return [line for line in output.splitlines() if "out of memory" in line]


def test_a_chatty_job_at_maxmemory_succeeds_once_memory_returns(
        full_redis: tuple[RedisServer, redis.Redis], job_id: str, tmp_path: Path) -> None:
    server, r = full_redis
    # 2 ranks x 100k lines of ~420 bytes: more than the publisher's 64 MiB buffer holds, so
    # lines are dropped while Redis refuses them.
    agent = Agent(["--redis", server.url, "--job-id", job_id, "--nproc-per-node", "2", FAST,
                   "--exit-barrier-timeout", "60", "--log-dir", str(tmp_path / "logs"),
                   str(SCRIPTS / "chatty.py")], tmp_path, "agent",
                  env={"CHATTY_LINES": "100000", "CHATTY_WIDTH": "400"})
    try:
        wait_until(lambda: "waiting at the exit barrier" in agent.output, 60,
                   "the workers finished while Redis was full")
        assert _oom_warnings(agent.output), agent.output[-3000:]
        r.delete(*r.keys("ballast:*"))  # memory returns
        code = agent.wait(60)
    finally:
        agent.kill()
    out = agent.output
    assert code == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    warnings = _oom_warnings(out)
    assert 1 <= len(warnings) <= 2, warnings
    assert any("accepts writes again" in w for w in out.splitlines()), out[-3000:]
    assert r.hget(JobKeys(job_id).meta, "final_state") == b"succeeded"
    evs = _events(r, job_id)
    dropped = [e for e in evs if e.type == EventType.LOGS_DROPPED]
    assert dropped and sum(e.data["count"] for e in dropped) > 0
    assert [e.type for e in evs].count(EventType.JOB_SUCCEEDED) == 1


def test_an_eviction_policy_is_warned_about_once(job_id: str, tmp_path: Path) -> None:
    with RedisServer(extra_args=["--maxmemory", "100mb",
                                 "--maxmemory-policy", "allkeys-lru"]) as server:
        agent = Agent(["--redis", server.url, "--job-id", job_id, "--nproc-per-node", "1", FAST,
                       "--log-dir", str(tmp_path / "logs"), str(SCRIPTS / "chatty.py")],
                      tmp_path, "agent", env={"CHATTY_LINES": "3"})
        assert agent.wait(60) == 0, agent.output
    lines = [line for line in agent.output.splitlines() if "maxmemory-policy" in line]
    assert len(lines) == 1, agent.output
    assert "allkeys-lru" in lines[0] and "noeviction" in lines[0]


def test_a_server_hovering_at_its_limit_is_one_episode(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Refusals with a small write accepted now and then (a server at its limit) are one
    episode: one warning as it starts, one when writes have gone through for a while."""
    clock = [1000.0]
    monkeypatch.setattr(pressure.time, "monotonic", lambda: clock[0])
    report = pressure.OomReport()
    report.count_dropped(lambda: 7)
    with caplog.at_level(logging.WARNING, logger=pressure.__name__):
        for _ in range(600):  # ten minutes: a refusal, then an accepted write, each second
            report.refused()
            clock[0] += 0.5
            report.accepted()
            clock[0] += 0.5
        assert len(caplog.records) == 1 and "out of memory" in caplog.records[0].message
        clock[0] += pressure.SETTLE_S
        report.accepted()
        report.accepted()
    assert len(caplog.records) == 2
    assert "accepts writes again after 602.0 s" in caplog.records[1].message
    assert "600 refused writes" in caplog.records[1].message
