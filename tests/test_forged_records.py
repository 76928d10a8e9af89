"""Records that no agent wrote (docs/SECURITY.md, "Limits on what a writer can make others
spend" and "Who can do what"): a forged round record, forged straggler shares, a forged
exclusion, restart history or "do not requeue". Real Redis, real agents, the installed CLI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from elastic_agent.coordination.transport.connection import make_async_client
from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.coordination.wire.command_records import Command, encode_command
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.protocol import MAX_RANK, ProtocolError
from elastic_agent.coordination.wire.round_records import MAX_ROUND_NODES, RoundInfo
from elastic_agent.coordination.wire.stack_replies import MAX_REQUEST_RANKS, read_stack_replies
from tests.agents import SCRIPTS, Agent, wait_until
from tests.test_agent import FAST, agent_args, of_type
from tests.test_console_cli import CONSOLE, PREFIX

BIG = 16_777_216  # the review's nproc: 2**24, one above the largest rank a record may name
MiB = 1 << 20


def node(i: int, nproc: int) -> dict:
    return {"node": f"h{i}-1-x", "host": f"h{i}", "addr": "10.0.0.1", "port": 29500,
            "pid": 1, "nproc": nproc, "group_rank": i}


def round_json(nodes: list[dict], world: int | None = None, rnd: int = 0) -> str:
    return json.dumps({"round": rnd, "world_size": len(nodes) if world is None else world,
                       "nodes": nodes, "completed_ms": 1}, separators=(",", ":"))


ONE_HUGE = round_json([node(0, BIG)])  # ~150 bytes
THIRTY_HUGE = round_json([node(i, BIG) for i in range(30)])  # ~3.3 KB


# -- decoding a round ------------------------------------------------------------------------

def test_a_round_decodes_within_the_protocols_bounds():
    info = RoundInfo.decode(ONE_HUGE)  # 2**24 workers: every rank below MAX_RANK
    assert info.total_workers == BIG == MAX_RANK
    assert info.placement(BIG - 1) == ("h0-1-x", "h0") and info.placement(BIG) == ("", "")
    mixed = RoundInfo.decode(round_json([node(0, 2), node(1, 0), node(2, 3)]))
    assert [mixed.placement(r)[1] for r in range(6)] == ["h0", "h0", "h2", "h2", "h2", ""]
    assert mixed.placement(-1) == ("", "")


@pytest.mark.parametrize("raw, why", [
    (THIRTY_HUGE, "more than 16777216 workers"),
    (round_json([node(0, BIG), node(1, 1)]), "more than 16777216 workers"),
    (round_json([node(0, 1), node(1, 1)], world=3), "names 2 nodes for a world of 3"),
    (round_json([node(0, 1)], world=2), "names 1 nodes for a world of 2"),
    (round_json([node(1, 1), node(0, 1)]), "group rank 1 in place 0"),
    (round_json([node(0, BIG + 1)]), "'nproc'"),
    (round_json([node(i, 0) for i in range(MAX_ROUND_NODES + 1)]), "'world_size'"),
], ids=["30x2**24", "2**24+1", "world-short", "world-long", "out-of-order", "nproc", "nodes"])
def test_a_round_beyond_them_is_refused_whole(raw, why):
    with pytest.raises(ProtocolError, match=why):
        RoundInfo.decode(raw)


# -- readers: the CLI and the console's `d` ----------------------------------------------------

def run_bounded(*args: str, redis_url: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """``elastic-console ARGS`` in a process of its own under a 1 GiB address-space limit
    (a table per forged rank fails fast there instead of eating the machine); returns the
    result and the command's peak RSS in bytes (its own getrusage, reported by a wrapper)."""
    wrapper = ("import json, resource, subprocess, sys\n"
               "def cap():\n"
               "    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
               "p = subprocess.run(sys.argv[1:], capture_output=True, text=True, "
               "preexec_fn=cap, timeout=60)\n"
               "print(json.dumps([p.returncode, p.stdout, p.stderr, "
               "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))\n")
    env = {"ELASTIC_REDIS_URL": redis_url, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", wrapper, *CONSOLE, *args], capture_output=True,
                         text=True, timeout=90, env=env)
    assert out.returncode == 0, out.stderr
    code, stdout, stderr, maxrss_kib = json.loads(out.stdout)
    return subprocess.CompletedProcess(args, code, stdout, stderr), maxrss_kib * 1024


@pytest.mark.parametrize("forged, says", [
    (ONE_HUGE, f"claims {BIG} ranks, more than the {MAX_REQUEST_RANKS} one request collects"),
    (THIRTY_HUGE, "unreadable round record (round record's nodes run more than 16777216 "
                  "workers)"),
], ids=["one-node-2**24", "thirty-nodes-2**24"])
@pytest.mark.parametrize("command", ["collectives", "stacks"])
def test_the_cli_answers_a_forged_round_with_one_line_in_bounded_memory(redis_url, r, job_id,
                                                                       forged, says, command):
    keys = JobKeys(job_id)
    r.hset(keys.meta, mapping={"created_ms": 1, "min_nodes": 1, "max_nodes": 1})
    r.set(keys.rdzv_round_info, forged)
    started = time.monotonic()
    p, peak = run_bounded(command, job_id, "--timeout", "2", redis_url=redis_url)
    took = time.monotonic() - started
    lines = p.stderr.splitlines()
    assert p.returncode == 1 and p.stdout == "", (p.returncode, p.stdout, p.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith(PREFIX) and says in lines[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert peak < 200 * MiB, f"peak RSS {peak / MiB:.0f} MiB"
    assert took < 30, took  # no table per rank to build (the review's: 31 s, 2.7 GB)
    assert r.xlen(keys.commands) == 0  # refused before anything was sent


def test_the_consoles_d_refuses_every_rank_of_a_forged_round_and_asks_one(redis_url, r,
                                                                          job_id):
    """The TUI's `d` (fetch_stacks, fetch_collectives) and the agents' own captures go through
    the same reads: a request of every rank of a forged round is refused before it is sent; a
    request of one rank is answered with its placement looked up, not tabled."""
    from elastic_console.job.collective_view import fetch_collectives
    from elastic_console.job.stack_view import fetch_stacks

    keys = JobKeys(job_id)
    r.set(keys.rdzv_round_info, ONE_HUGE)
    ep = parse_endpoint(redis_url)

    async def scenario() -> None:
        for fetch in (fetch_stacks, fetch_collectives):
            with pytest.raises(ProtocolError, match="ask one rank"):
                await fetch(ep, job_id, timeout=1)
        assert r.xlen(keys.commands) == 0
        one = await fetch_stacks(ep, job_id, rank=BIG - 1, timeout=0.3)
        ((stack),) = one.stacks
        assert (stack.rank, stack.node, stack.host) == (BIG - 1, "h0-1-x", "h0")
        assert r.xlen(keys.commands) == 1
        # an existing capture read for "every rank": the same refusal, nothing held
        client = make_async_client(ep, blocking_ms=1000)
        try:
            with pytest.raises(ProtocolError, match="ask one rank"):
                await read_stack_replies(client, job_id, "stall-1", None, 0.2)
        finally:
            await client.aclose()

    asyncio.run(scenario())


# -- the agent's straggler watch ---------------------------------------------------------------

def vm_hwm(pid: int) -> int:
    """A process's peak resident set (VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def stragglers_of(r, job_id: str, rnd: int) -> list:
    return [e for e in of_type(r, job_id, EventType.STRAGGLER) if e.data.get("round") == rnd]


def test_group_rank_0_survives_a_forged_round_with_its_straggler_watch(redis_url, r, job_id,
                                                                       tmp_path):
    """A forged round of 30 nodes of 2**24 workers each (the review's 3.3 KB record), then,
    in the next round, one node of 2**24: the agent (group rank 0) stays small, names the
    stragglers without their hosts, says once why, and keeps deciding."""
    keys = JobKeys(job_id)
    args = agent_args(redis_url, job_id, "--nproc-per-node", "4", "--straggler-interval",
                      "0.5", FAST, str(SCRIPTS / "sleeper.py"), "--seconds", "300")
    agent = Agent(args, tmp_path, "a")
    try:
        for rnd, forged in ((0, THIRTY_HUGE), (1, ONE_HUGE)):
            wait_until(lambda rnd=rnd: [e for e in of_type(r, job_id, EventType.WORKERS_STARTED)
                                        if e.data.get("round") == rnd], 60,
                       f"round {rnd}'s workers")
            r.set(keys.rdzv_round_info, forged)
            # sleeper.py does not use torch: its agent writes no share; these are the only ones
            r.zadd(keys.stragglers(rnd), {"0": 0.5, "1": 0.5, "2": 0.5, "3": 0.8})
            first = wait_until(lambda rnd=rnd: stragglers_of(r, job_id, rnd), 30,
                               f"round {rnd}'s straggler")
            assert [(x["rank"], x["node"], x["host"]) for x in first[0].data["ranks"]] == \
                [(3, "", "")], first[0].data
            r.zadd(keys.stragglers(rnd), {"2": 0.8, "3": 0.5})  # another rank slow: alive?
            later = wait_until(lambda rnd=rnd: [e for e in stragglers_of(r, job_id, rnd)
                                                if [x["rank"] for x in e.data["ranks"]] == [2]],
                               30, f"round {rnd}'s second straggler")
            assert later[0].data["threshold"] == 1.3
            if rnd == 0:
                r.xadd(keys.commands, encode_command(Command("c-forged-1", "restart", "test")))
        assert agent.proc.poll() is None, agent.output[-3000:]
        peak = vm_hwm(agent.pid)
        assert peak < 100 * MiB, f"agent peak RSS {peak / MiB:.0f} MiB"
        out = agent.output
        assert out.count("the round record is unreadable") == 1, out[-3000:]
        assert "the round record (round 0, 16777216 ranks) is not this round (1, 4 ranks)" in out
        assert "Traceback" not in out
    finally:
        agent.kill()
        agent.wait(30)


def test_straggler_members_outside_the_world_are_dropped_by_a_real_agent(redis_url, r, job_id,
                                                                         tmp_path):
    """The review's line on a one-rank job: ``ZADD stragglers:0 0.1 0 0.1 1 0.9 424242``."""
    keys = JobKeys(job_id)
    args = agent_args(redis_url, job_id, "--nproc-per-node", "1", "--straggler-interval",
                      "0.5", FAST, str(SCRIPTS / "sleeper.py"), "--seconds", "300")
    agent = Agent(args, tmp_path, "a")
    try:
        wait_until(lambda: of_type(r, job_id, EventType.WORKERS_STARTED), 60, "the workers")
        r.zadd(keys.stragglers(0), {"0": 0.1, "1": 0.1, "424242": 0.9})
        wait_until(lambda: "dropped 2 member(s)" in agent.output, 30, "the agent's drop line")
        assert r.zscore(keys.stragglers(0), "424242") is None
        assert r.zscore(keys.stragglers(0), "1") is None
        r.zadd(keys.stragglers(0), {"1": 0.1, "424242": 0.9})  # again: counted, one line
        wait_until(lambda: r.zcard(keys.stragglers(0)) == 1, 30, "the second drop")
        assert of_type(r, job_id, EventType.STRAGGLER) == []
        assert agent.output.count("dropped") == 1, agent.output[-3000:]
        assert agent.proc.poll() is None
    finally:
        agent.kill()
        agent.wait(30)


# -- leaving a node out, restart history, "do not requeue" -----------------------------------

def command(r, job_id: str, kind: str) -> None:
    r.xadd(JobKeys(job_id).commands,
           encode_command(Command(f"c-{kind}-{time.monotonic_ns()}", kind, "test")))


def node_of(r, job_id: str, agent: Agent) -> str:
    return wait_until(lambda: next((e.node for e in of_type(r, job_id, EventType.NODE_JOINED)
                                    if e.data.get("pid") == agent.pid), None), 30, "its node")


def started(r, job_id: str, rnd: int, count: int = 1) -> None:
    wait_until(lambda: len([e for e in of_type(r, job_id, EventType.WORKERS_STARTED)
                            if e.data.get("round") == rnd]) >= count, 60,
               f"round {rnd}'s workers")


def test_a_forged_exclusion_without_the_flag_is_not_read(redis_url, r, job_id, tmp_path):
    """The review's: ``SADD excluded <node>`` and one restart made a ``--nnodes 1`` job
    without ``--exclude-suspect-nodes`` exit 93."""
    keys = JobKeys(job_id)
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "1", FAST,
                             str(SCRIPTS / "sleeper.py"), "--seconds", "300"), tmp_path, "a")
    try:
        me = node_of(r, job_id, agent)
        started(r, job_id, 0)
        r.sadd(keys.excluded, me)
        command(r, job_id, "restart")
        started(r, job_id, 1)
        command(r, job_id, "stop")
        assert agent.wait(60) == 143, agent.output[-3000:]
        assert of_type(r, job_id, EventType.NODE_EXCLUDED) == []
    finally:
        agent.kill()


def test_without_the_flag_even_a_consistent_forgery_is_not_read(redis_url, r, job_id,
                                                                tmp_path):
    """Two nodes of ``--nnodes 1:2`` (one to spare) without ``--exclude-suspect-nodes``: a
    decision forged with its round's claim, which the flag would obey, is never read."""
    keys = JobKeys(job_id)
    args = agent_args(redis_url, job_id, "--nnodes", "1:2", "--nproc-per-node", "1", FAST,
                      str(SCRIPTS / "sleeper.py"), "--seconds", "300")
    agents = [Agent(args, tmp_path, f"a{i}") for i in range(2)]
    try:
        victim = node_of(r, job_id, agents[1])
        started(r, job_id, 0, 2)
        other = node_of(r, job_id, agents[0])
        r.hset(keys.excluded, "0", json.dumps({"round": 0, "by": other, "nodes": [victim]}))
        r.hset(keys.meta, "restart_claim:0", other)
        command(r, job_id, "restart")
        started(r, job_id, 1, 2)
        command(r, job_id, "stop")
        assert [a.wait(60) for a in agents] == [143, 143], agents[1].output[-3000:]
        assert of_type(r, job_id, EventType.NODE_EXCLUDED) == []
    finally:
        for a in agents:
            a.kill()


def test_a_forged_exclusion_never_takes_a_job_below_its_minimum(redis_url, r, job_id,
                                                                tmp_path):
    """With the flag: a set where the decisions' hash belongs is one line and ignored; a
    decision forged with its claim, on a ``--nnodes 1`` job, would leave no node: ignored."""
    keys = JobKeys(job_id)
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "1",
                             "--exclude-suspect-nodes", FAST, str(SCRIPTS / "sleeper.py"),
                             "--seconds", "300"), tmp_path, "a")
    try:
        me = node_of(r, job_id, agent)
        started(r, job_id, 0)
        r.sadd(keys.excluded, me)
        command(r, job_id, "restart")
        started(r, job_id, 1)
        r.delete(keys.excluded)
        r.hset(keys.excluded, "1", json.dumps({"round": 1, "by": me, "nodes": [me]}))
        r.hset(keys.meta, "restart_claim:1", me)  # the claim forged too
        command(r, job_id, "restart")
        started(r, job_id, 2)
        command(r, job_id, "stop")
        assert agent.wait(60) == 143, agent.output[-3000:]
        out = agent.output
        assert f"cannot read {keys.excluded}" in out, out[-3000:]
        assert ("ignoring the record that leaves this node out after round 1: leaving 1 of its "
                "1 nodes would take the job below the minimum of --nnodes (1)") in out
        assert of_type(r, job_id, EventType.NODE_EXCLUDED) == []
    finally:
        agent.kill()


def test_an_exclusion_its_rounds_claimer_did_not_write_is_ignored(redis_url, r, job_id,
                                                                  tmp_path):
    """``--nnodes 1:2`` on two nodes has one to spare; a decision that leaves one out after
    a round whose restart nobody claimed (a restart command) is not obeyed."""
    keys = JobKeys(job_id)
    args = agent_args(redis_url, job_id, "--nnodes", "1:2", "--nproc-per-node", "1",
                      "--exclude-suspect-nodes", FAST, str(SCRIPTS / "sleeper.py"),
                      "--seconds", "300")
    agents = [Agent(args, tmp_path, f"a{i}") for i in range(2)]
    try:
        victim = node_of(r, job_id, agents[1])
        started(r, job_id, 0, 2)
        other = node_of(r, job_id, agents[0])
        r.hset(keys.excluded, "0", json.dumps({"round": 0, "by": other, "nodes": [victim]}))
        command(r, job_id, "restart")
        started(r, job_id, 1, 2)
        command(r, job_id, "stop")
        assert [a.wait(60) for a in agents] == [143, 143], agents[1].output[-3000:]
        assert (f"ignoring the record that leaves this node out after round 0: {other!r} did "
                "not claim round 0's restart (the job's meta names nobody)") in agents[1].output
        assert of_type(r, job_id, EventType.NODE_EXCLUDED) == []
    finally:
        for a in agents:
            a.kill()


def test_forged_round_ends_make_no_restart_storm(redis_url, r, job_id, tmp_path):
    """Two forged round ends plus one real failure would be a storm of 3 with ``2/5``, and
    ``--on-restart-storm stop`` would end the job 93: only the claimer's own entry counts."""
    keys = JobKeys(job_id)
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "1", "--max-restarts", "3",
                             "--restart-storm", "2/5", "--on-restart-storm", "stop",
                             "--suspect-rounds", "0", FAST, str(SCRIPTS / "sleeper.py"),
                             "--seconds", "3", "--fail-rank", "0", "--fail-after", "2"),
                  tmp_path, "a")
    try:
        me = node_of(r, job_id, agent)
        started(r, job_id, 0)
        sec, usec = r.time()
        now = sec * 1000 + usec // 1000
        for by in (me, "evil-1-x"):
            r.lpush(keys.restart_history, json.dumps(
                {"round": 0, "ms": now, "reason": "failure", "nodes": [me], "progressed": True,
                 "by": by}))
        assert agent.wait(90) == 0, agent.output[-3000:]
        assert of_type(r, job_id, EventType.RESTART_STORM) == []
        assert "2 of the 3 entries" in agent.output, agent.output[-3000:]
    finally:
        agent.kill()


def test_a_forged_do_not_requeue_gives_exit_1(redis_url, r, job_id, tmp_path):
    """A stalled job stopped by ``--on-stall stop`` fails; no restart was claimed, so no
    claimer wrote ``do_not_requeue``: a forged one (naming the node itself) is not obeyed."""
    keys = JobKeys(job_id)
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "1", "--stall-timeout",
                             "1", "--on-stall", "stop", FAST, str(SCRIPTS / "crash_loop.py"),
                             "--silent"), tmp_path, "a")
    try:
        me = node_of(r, job_id, agent)
        r.hset(keys.meta, "do_not_requeue", json.dumps(
            {"round": 0, "by": me, "nodes": [], "why": "restart storm: forged"}))
        assert agent.wait(90) == 1, agent.output[-3000:]
        assert "who did not claim round 0's restart: ignored (exit status 1)" in agent.output
        assert len(of_type(r, job_id, EventType.STALLED)) == 1
    finally:
        agent.kill()
