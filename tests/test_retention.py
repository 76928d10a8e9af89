"""A job's records leave Redis: --retention after the job ended (or its agents vanished), at
once with `elastic-console rm`; `ls` shows finished and lost jobs until then."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis

from elastic_agent.coordination.rendezvous.drivers import RedisRendezvous
from elastic_agent.coordination.rendezvous.types import RendezvousSettings
from elastic_agent.coordination.store import RedisStore
from elastic_agent.coordination.transport.connection import make_async_client
from elastic_agent.coordination.wire.keyspace import JOBS_INDEX, JobKeys
from elastic_agent.supervision.config import parse_args
from elastic_agent.supervision.records.retention import JobRetention, parse_duration, running_ttl
from elastic_console.cli import main as console
from elastic_console.job.client import JobClient
from elastic_console.job.state import JobView
from tests.agents import SCRIPTS, Agent, wait_until

FAST = "--rdzv-conf=last_call_timeout=1,heartbeat_timeout=2,keep_alive_interval=0.3,join_timeout=60"


def _keys(r: redis.Redis, job: str) -> list[bytes]:
    """Every key of the job: its slot's, and its log streams (elsewhere: a test may SCAN)."""
    return [*r.scan_iter(match=JobKeys(job).all_key_patterns()[0], count=1000),
            *r.scan_iter(match=f"elastic:log:{{{job}/*", count=1000)]


def _agent(redis_url: str, job: str, tmp: Path, script: list[str], *extra: str,
           env: dict[str, str] | None = None) -> Agent:
    return Agent(["--redis", redis_url, "--job-id", job, "--nproc-per-node", "1", FAST,
                  "--log-dir", str(tmp / "logs"), *extra, *script], tmp, "agent", env=env)


def _ls(redis_url: str, capsys: pytest.CaptureFixture[str]) -> dict[str, dict]:
    capsys.readouterr()
    assert console(["ls", "--json", "--redis", redis_url]) == 0
    return {j["job"]: j for j in json.loads(capsys.readouterr().out)}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = console(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_durations(tmp_path: Path) -> None:
    assert parse_duration("7d") == 7 * 86400
    assert parse_duration("12h") == 12 * 3600
    assert parse_duration("30m") == 1800
    assert parse_duration("90") == parse_duration("90s") == 90
    assert parse_duration("0") == 0
    for bad in ("", "7x", "-1d", "d", "1e9d"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    base = ["--standalone", "--log-dir", str(tmp_path), str(SCRIPTS / "chatty.py")]
    assert parse_args(base).retention_s == 7 * 86400
    assert parse_args(["--retention", "12h", *base]).retention_s == 12 * 3600


def test_a_finished_job_expires_after_its_retention(redis_url: str, r: redis.Redis, job_id: str,
                                                     tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    agent = _agent(redis_url, job_id, tmp_path, [str(SCRIPTS / "chatty.py")],
                   "--retention", "6s", env={"CHATTY_LINES": "5"})
    assert agent.wait(60) == 0, agent.output
    keys = _keys(r, job_id)
    assert JobKeys(job_id).meta.encode() in keys and JobKeys(job_id).events.encode() in keys
    assert any(k.startswith(b"elastic:log:") for k in keys), keys  # its node's log stream
    ttls = {k: r.pttl(k) for k in keys}
    assert all(0 < t <= 6000 for t in ttls.values()), ttls  # every key, whatever wrote it
    listed = _ls(redis_url, capsys)[job_id]
    assert listed["state"] == "succeeded" and 0 < listed["expires_in_s"] <= 6
    code, out, _ = _run(["status", job_id, "--redis", redis_url], capsys)
    assert code == 0 and "expires   in " in out, out

    async def console_view() -> JobView:  # what the attached console's header shows
        client = JobClient(redis_url, job_id)
        try:
            view = JobView(job_id)
            view.apply_meta(await client.meta())
            return view
        finally:
            await client.close()

    view = asyncio.run(console_view())
    assert view.is_final and 0 < (view.expires_in_ms or 0) <= 6000
    wait_until(lambda: not _keys(r, job_id), 30, "the job's keys expired")
    assert job_id not in _ls(redis_url, capsys)  # ... and ls forgets it,
    assert r.zscore(JOBS_INDEX, job_id) is None  # index entry included


def test_a_job_whose_agents_vanished_expires_too(redis_url: str, r: redis.Redis, job_id: str,
                                                 tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    agent = _agent(redis_url, job_id, tmp_path, [str(SCRIPTS / "sleeper.py")],
                   "--retention", "4s")
    try:
        wait_until(lambda: "round 0 complete" in agent.output, 30, "the job started")
        wait_until(lambda: r.pttl(JobKeys(job_id).events) > 0, 10, "the lease covered the job")
    finally:
        agent.kill()  # SIGKILL: no last pass, nobody renews the lease
    # A key the job made after the last renewal (a new round's store, the stacks stream):
    # no TTL, and no agent left to give it one; `ls` sweeps it once it sees the job lost.
    late = JobKeys(job_id).store("late-round")
    r.set(late, "x")
    # ... or a node's log stream, outside the job's slot: found through the job's set.
    late_stream = JobKeys(job_id).logs("late-node")
    r.xadd(late_stream, {"v": "1"})
    r.sadd(JobKeys(job_id).log_streams, late_stream)

    def lost() -> dict | None:
        listed = _ls(redis_url, capsys).get(job_id)
        assert listed is not None, "the job expired before ls saw it lost"
        return listed if listed["state"] == "lost" else None

    listed = wait_until(lost, 10, "ls shows the job lost")
    assert listed["expires_in_s"] is not None and listed["lost_for_s"] is not None
    wait_until(lambda: r.pttl(late) > 0 and r.pttl(late_stream) > 0, 5, "the late keys swept")
    wait_until(lambda: not _keys(r, job_id), 30, "the lost job's keys expired")
    assert job_id not in _ls(redis_url, capsys)


def test_rm_removes_a_finished_job(redis_url: str, r: redis.Redis, job_id: str, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    agent = _agent(redis_url, job_id, tmp_path, [str(SCRIPTS / "chatty.py")],
                   env={"CHATTY_LINES": "5"})
    assert agent.wait(60) == 0, agent.output
    assert r.pttl(JobKeys(job_id).meta) > 6 * 86400 * 1000  # the default: 7 days
    code, out, err = _run(["rm", job_id, "--redis", redis_url], capsys)
    assert code == 0, err
    assert "removed job" in out
    assert not _keys(r, job_id) and r.zscore(JOBS_INDEX, job_id) is None
    code, _, err = _run(["rm", job_id, "--redis", redis_url], capsys)
    assert code == 1 and "no job" in err


def test_rm_of_a_running_job_needs_force_and_stops_it(redis_url: str, r: redis.Redis,
                                                      job_id: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    agent = _agent(redis_url, job_id, tmp_path, [str(SCRIPTS / "sleeper.py")])
    try:
        wait_until(lambda: "round 0 complete" in agent.output, 30, "the job started")
        wait_until(lambda: _ls(redis_url, capsys)[job_id]["state"] == "running", 10, "running")
        code, _, err = _run(["rm", job_id, "--redis", redis_url], capsys)
        assert code == 1 and "--force" in err and len(err.strip().splitlines()) == 1, err
        assert agent.proc.poll() is None and r.exists(JobKeys(job_id).meta)
        code, out, err = _run(["rm", "--force", job_id, "--redis", redis_url], capsys)
        assert code == 0, err
        assert "removed job" in out
        assert agent.wait(30) == 143
    finally:
        agent.kill()
    # What the agent wrote while it ended (after rm) is not left behind either.
    assert not _keys(r, job_id), _keys(r, job_id)
    assert job_id not in _ls(redis_url, capsys)


def test_the_last_pass_of_an_agent_of_a_removed_job_leaves_nothing(
        redis_url: str, r: redis.Redis, job_id: str) -> None:
    """An agent still ending when `rm` removed its job (a record flushed late) deletes what
    it wrote back, rather than keeping it for a retention with no index entry."""
    k = JobKeys(job_id)
    r.xadd(k.events, {"v": "1"})  # written after rm: no meta any more
    r.zadd(JOBS_INDEX, {job_id: 1})  # an entry as old as can be, of a job that is gone

    async def last_pass() -> None:
        client = make_async_client(redis_url)
        try:
            await JobRetention(client, job_id, "n1", 3600).finish()
        finally:
            await client.aclose()

    asyncio.run(last_pass())
    assert not _keys(r, job_id)
    assert r.zscore(JOBS_INDEX, job_id) is None  # the index lost it too


def test_a_completed_round_deletes_the_store_of_the_round_before(
        redis_url: str, r: redis.Redis, job_id: str) -> None:
    k = JobKeys(job_id)
    node = RedisRendezvous(redis_url, job_id, RendezvousSettings(min_nodes=1, max_nodes=1),
                           local_addr="127.0.0.1")
    try:
        assert node.next_rendezvous().round == 0
        with RedisStore(redis_url, job_id, "r0") as store:
            store.set("exit/0/done", b"1")
        assert r.exists(k.store("r0"), k.store_notify("r0")) == 2
        assert node.next_rendezvous().round == 1
        with RedisStore(redis_url, job_id, "r1") as store:
            store.set("exit/0/done", b"1")
        assert r.exists(k.store("r0"), k.store_notify("r0")) == 0  # one namespace per job,
        assert r.exists(k.store("r1"), k.store_notify("r1")) == 2  # not one per round
    finally:
        node.shutdown()


def test_a_renewal_leaves_ttls_that_others_chose_alone(redis_url: str, r: redis.Redis,
                                                       job_id: str) -> None:
    k = JobKeys(job_id)
    r.hset(k.meta, "created_ms", 1)
    r.set(k.prefix + "stall:0", b"1", px=60_000)  # a claim with a lease of its own
    r.set(k.prefix + "claim", b"1", px=1_500)

    async def renew() -> None:
        client = make_async_client(redis_url)
        try:
            await JobRetention(client, job_id, "n1", 4).expire_all(running_ttl(4), renewal=True)
        finally:
            await client.aclose()

    asyncio.run(renew())
    assert 6_000 < r.pttl(k.meta) <= 7_000  # the lease: retention + 3 intervals
    assert r.pttl(k.prefix + "stall:0") > 50_000
    assert r.pttl(k.prefix + "claim") <= 1_500
