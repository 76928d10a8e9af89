"""The exit barrier watches the job: a node whose workers finished does not sit out the
barrier timeout when another node fails meanwhile. Two real agents, a real redis-server."""

from __future__ import annotations

import time
from pathlib import Path

import redis

from elastic_agent.coordination.wire.event_records import EventType
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


def start_pair(redis_url: str, job_id: str, tmp_path: Path,
               max_restarts: int) -> tuple[Agent, Agent, Path]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    go = tmp_path / "go"
    args = agent_args(redis_url, job_id, "--nnodes", "2", "--nproc-per-node", "1",
                      "--max-restarts", str(max_restarts), "--exit-barrier-timeout",
                      str(BARRIER_TIMEOUT), FAST, str(script))
    a = Agent(args, tmp_path, "a", env={"EB_ROLE": "finish", "EB_GO": str(go)})
    b = Agent(args, tmp_path, "b", env={"EB_ROLE": "fail", "EB_GO": str(go)})
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
