"""The exit barrier watches the job: a node whose workers finished does not sit out the
barrier timeout when another node fails meanwhile. Two real agents, a real redis-server."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import redis

from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from tests.agents import Agent, wait_until
from tests.test_agent import FAST, agent_args, of_type

# Node A's worker ends at once. Node B's worker, on the first attempt, waits for the test's
# go (A is at the barrier by then) and fails; on a later attempt it ends at once too.
WORKER = """\
import os, sys, time
from pathlib import Path

if os.environ["EB_ROLE"] == "fail" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    go = Path(os.environ["EB_GO"])
    while not go.exists():
        time.sleep(0.02)
    print("failing on purpose", file=sys.stderr, flush=True)
    sys.exit(3)
print("rank", os.environ["RANK"], "done", flush=True)
"""

BARRIER_TIMEOUT = 120
HANG_BOUND = 30  # seconds: far under the barrier timeout, far over the expected second or two


# The failing node's agent, with its publisher holding back its group_failed event: until a
# flush waits for it (the agent flushes it before it opens the next round), or else until the
# next round has both nodes (the waiting node left the barrier on the round's 'open' alone).
# This forces the race the flush exists for, both ways, instead of hoping for it: without the
# flush the next round always opens first. Bounded, so that a hold never hangs the test.
HELD_AGENT = """\
import asyncio, json, os, runpy, time

from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.supervision.records.publisher import StreamPublisher

_send = StreamPublisher._send


async def held_send(self, batch):
    held = [rec for rec in batch if rec.fields and rec.fields.get("type") == "group_failed"]
    if held:
        seq, rnd = held[0].seq, json.loads(held[0].fields["data"])["round"]
        keys = JobKeys(os.environ["EB_JOB"])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(target >= seq and not fut.done() for target, fut in self._waiters):
                break
            now = await self._client.hget(keys.rdzv_state, "round")
            if now and int(now) > rnd and await self._client.zcard(keys.rdzv_members) >= 2:
                break
            await asyncio.sleep(0.01)
    await _send(self, batch)


StreamPublisher._send = held_send
runpy.run_module("elastic_agent.supervision.cli", run_name="__main__", alter_sys=True)
"""


def start_pair(redis_url: str, job_id: str, tmp_path: Path, max_restarts: int,
               hold_group_failed: bool = False) -> tuple[Agent, Agent, Path]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    go = tmp_path / "go"
    args = agent_args(redis_url, job_id, "--nnodes", "2", "--nproc-per-node", "1",
                      "--max-restarts", str(max_restarts), "--exit-barrier-timeout",
                      str(BARRIER_TIMEOUT), FAST, str(script))
    a = Agent(args, tmp_path, "a", env={"EB_ROLE": "finish", "EB_GO": str(go)})
    command = None
    if hold_group_failed:
        held = tmp_path / "held_agent.py"
        held.write_text(HELD_AGENT)
        command = [sys.executable, str(held)]
    b = Agent(args, tmp_path, "b", env={"EB_ROLE": "fail", "EB_GO": str(go), "EB_JOB": job_id},
              command=command)
    return a, b, go


def fail_b_while_a_waits(a: Agent, b: Agent, go: Path) -> float:
    """Let B's worker fail once A waits at the barrier; seconds until A left it."""
    try:
        wait_until(lambda: "waiting at the exit barrier" in a.output, 60,
                   "node A at the exit barrier")
        assert "waiting at the exit barrier" not in b.output, "B's worker must still run"
        start = time.monotonic()
        go.touch()
        wait_until(lambda: "leaving the exit barrier" in a.output, BARRIER_TIMEOUT + 10,
                   "node A leaving the exit barrier")
        return time.monotonic() - start
    except AssertionError as exc:
        a.kill()
        b.kill()
        raise AssertionError(f"{exc}\n--- a ---\n{a.output[-3000:]}\n--- b ---\n"
                             f"{b.output[-3000:]}") from None


def test_a_failure_elsewhere_takes_the_waiting_node_into_the_restart(redis_url, r: redis.Redis,
                                                                     job_id, tmp_path):
    a, b, go = start_pair(redis_url, job_id, tmp_path, max_restarts=1)
    took = fail_b_while_a_waits(a, b, go)
    codes = [a.wait(HANG_BOUND), b.wait(HANG_BOUND)]
    out = f"--- a ---\n{a.output[-3000:]}\n--- b ---\n{b.output[-3000:]}"
    assert took < HANG_BOUND, f"A left the barrier after {took:.1f} s\n{out}"
    assert codes == [0, 0], out
    assert "leaving the exit barrier: the worker group failed" in a.output, out
    assert [e.data["reason"] for e in of_type(r, job_id, EventType.RESTARTING)] == ["failure"]
    # Both nodes ran the second round: the restart re-formed the whole group.
    rounds = {e.data["round"] for e in of_type(r, job_id, EventType.WORKERS_STARTED)}
    assert len(rounds) == 2, out
    assert len(of_type(r, job_id, EventType.WORKERS_STARTED)) == 4, out
    assert len(of_type(r, job_id, EventType.JOB_SUCCEEDED)) == 1


def test_the_waiting_node_learns_of_the_failure_before_the_next_round_opens(
        redis_url, r: redis.Redis, job_id, tmp_path):
    """The failing node writes its group_failed before it opens the next round (a flush),
    so the waiting node leaves the barrier on the failure, with its reason, even when that
    event would otherwise have been sent after the round's 'open' (held back here)."""
    a, b, go = start_pair(redis_url, job_id, tmp_path, max_restarts=1, hold_group_failed=True)
    took = fail_b_while_a_waits(a, b, go)
    codes = [a.wait(HANG_BOUND), b.wait(HANG_BOUND)]
    out = f"--- a ---\n{a.output[-3000:]}\n--- b ---\n{b.output[-3000:]}"
    assert took < HANG_BOUND, f"A left the barrier after {took:.1f} s\n{out}"
    assert codes == [0, 0], out
    assert "leaving the exit barrier: the worker group failed" in a.output, out
    assert "leaving the exit barrier (reform)" not in a.output, out
    assert [e.data["reason"] for e in of_type(r, job_id, EventType.RESTARTING)] == ["failure"]
    # In Redis's own time: the failure was written no later than the next round opened.
    failed = of_type(r, job_id, EventType.GROUP_FAILED)
    opens = [i for i, f in r.xrange(JobKeys(job_id).rdzv_notify) if f.get(b"e") == b"open"]
    assert len(failed) == 1 and len(opens) == 1, (failed, opens)
    assert _ms(failed[0].id) <= _ms(opens[0]), (failed[0].id, opens[0])


def _ms(entry_id: str | bytes) -> int:
    return int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])


def test_a_final_failure_elsewhere_ends_the_waiting_node_with_the_job(redis_url, r: redis.Redis,
                                                                      job_id, tmp_path):
    a, b, go = start_pair(redis_url, job_id, tmp_path, max_restarts=0)
    took = fail_b_while_a_waits(a, b, go)
    codes = [a.wait(HANG_BOUND), b.wait(HANG_BOUND)]
    out = f"--- a ---\n{a.output[-3000:]}\n--- b ---\n{b.output[-3000:]}"
    assert took < HANG_BOUND, f"A left the barrier after {took:.1f} s\n{out}"
    assert codes == [1, 1], out
    # The waiting node ends with the job's state and its root cause, not with a success.
    assert "FAILED" in a.output and "succeeded" not in a.output, out
    assert "exitcode  : 3" in a.output, out
    assert len(of_type(r, job_id, EventType.JOB_FAILED)) == 1
    assert of_type(r, job_id, EventType.JOB_SUCCEEDED) == []
