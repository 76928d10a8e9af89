"""Restart patterns (issue 22, part 3): a restart storm, a suspect node, rounds without
progress; leaving a suspect node out; the "do not requeue" exit status. The logic on its own,
then real agents, real workers, a real redis-server."""

from __future__ import annotations

import argparse
import json

import pytest

from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.round_records import decode_round_end
from elastic_agent.supervision.diagnosis.restart_patterns import (
    DO_NOT_REQUEUE,
    HISTORY_CAP,
    PatternSettings,
    RoundEnd,
    add_arguments,
    analyse,
    may_exclude,
    progressed,
    settings_from,
)
from elastic_console.job.state import JobView
from tests.agents import SCRIPTS, Agent
from tests.test_agent import FAST, agent_args, of_type
from tests.test_console_cli import console as cli

MIN = 60_000


def ends(*specs: tuple[int, int, tuple[str, ...], bool | None]) -> list[RoundEnd]:
    """Newest first, as the history list holds them: (round, ms, nodes, progressed)."""
    return [RoundEnd(r, ms, "failure", nodes, p) for r, ms, nodes, p in specs]


# -- the logic -----------------------------------------------------------------------------

def test_a_storm_is_n_restarts_within_the_window_and_no_fewer():
    s = PatternSettings(storm_restarts=3, storm_minutes=10)
    now = 100 * MIN
    three = ends((5, now, (), True), (4, now - 2 * MIN, (), True), (3, now - 9 * MIN, (), True))
    found = analyse(three, now, s)
    assert found.storm is not None and found.storm.restarts == 3 and found.storm.rounds == (5, 4, 3)
    # the third restart fell out of the window: no storm
    assert analyse([*three[:2], RoundEnd(3, now - 11 * MIN, "failure")], now, s).storm is None
    assert analyse(three, now, PatternSettings(storm_restarts=0)).storm is None  # off


def test_a_suspect_is_in_every_failure_of_the_last_k_rounds():
    s = PatternSettings(suspect_rounds=3, storm_restarts=0)
    h = ends((9, 9, ("b", "c"), True), (8, 8, ("b",), True), (7, 7, ("a", "b"), True),
             (6, 6, ("a",), True))
    found = analyse(h, 10, s)
    assert found.suspects == ("b",) and found.suspect_rounds == (9, 8, 7)
    # one round in between without it: no suspect
    assert analyse([h[0], RoundEnd(8, 8, "failure", ("a",)), *h[2:]], 10, s).suspects == ()
    assert analyse(h[:2], 10, s).suspects == ()  # fewer than K round ends
    assert analyse(ends((9, 9, (), None), *[(8, 8, ("b",), True)] * 3), 10, s).suspects == ()


def test_no_progress_needs_k_rounds_known_to_have_made_none():
    s = PatternSettings(no_progress_rounds=2, storm_restarts=0, suspect_rounds=0)
    assert analyse(ends((3, 3, (), False), (2, 2, (), False)), 4, s).no_progress_rounds == (3, 2)
    assert not analyse(ends((3, 3, (), False), (2, 2, (), True)), 4, s)
    assert not analyse(ends((3, 3, (), None), (2, 2, (), False)), 4, s)  # unknown: not flagged


def test_progress_of_the_round_after_the_grace_only():
    assert progressed("7 5000", 7, 1000, 2000)
    assert not progressed("7 2500", 7, 1000, 2000)  # start-up
    assert not progressed("6 9000", 7, 1000, 2000)  # an earlier round's mark
    for bad in (None, "", "7", "x 9000", "7 9e9", "7 -1", "7 " + "9" * 40):
        assert not progressed(bad, 7, 1000, 2000), bad


def test_a_node_is_left_out_only_while_the_job_has_nodes_to_spare():
    assert may_exclude(3, 2, 0) and not may_exclude(3, 2, 1) and not may_exclude(2, 2, 0)


def test_history_records_round_trip_and_hostile_ones_are_skipped():
    end = RoundEnd(4, 123, "lost", ("h-1-a",), None)
    assert RoundEnd.from_record(decode_round_end(end.to_json())) == end
    for bad in ('{"round": true, "ms": 1, "reason": "x"}', "[" * 10_000, '{"round": 1}',
                '{"round": 1, "ms": 1, "reason": "x", "progressed": "yes"}', "x" * 20_000,
                b"\xff\xfe"):
        assert decode_round_end(bad) is None, bad
    junk = decode_round_end('{"round": 1, "ms": 1, "reason": "x", "nodes": [1, "", "n"]}')
    assert junk is not None and junk["nodes"] == ["n"]


def _flags(*argv: str) -> PatternSettings:
    p = argparse.ArgumentParser()
    add_arguments(p.add_argument)
    return settings_from(p.parse_args(list(argv)))


def test_flags_and_their_bad_values():
    assert _flags() == PatternSettings()
    s = _flags("--restart-storm", "3/0.5", "--suspect-rounds", "0", "--exclude-suspect-nodes",
               "--on-restart-storm", "stop")
    assert (s.storm_restarts, s.storm_minutes, s.suspect_rounds, s.exclude_suspects,
            s.on_storm) == (3, 0.5, 0, True, "stop")
    assert _flags("--restart-storm", "0").storm_restarts == 0
    for argv in (["--restart-storm", "5"], ["--restart-storm", "x/1"],
                 ["--restart-storm", f"{HISTORY_CAP + 1}/5"], ["--restart-storm", "3/-1"],
                 ["--suspect-rounds", "-1"], ["--no-progress-rounds", "many"]):
        with pytest.raises(ValueError, match=argv[0]):
            _flags(*argv)


# -- real jobs -----------------------------------------------------------------------------

def test_a_restart_storm_is_reported_and_stop_ends_the_job_do_not_requeue(redis_url, r, job_id,
                                                                            tmp_path):
    args = agent_args(redis_url, job_id, "--nproc-per-node", "1", "--max-restarts", "10",
                      "--restart-storm", "3/5", "--on-restart-storm", "stop",
                      "--suspect-rounds", "0", FAST, str(SCRIPTS / "crash_loop.py"), "--crash",
                      "--after", "0.1")
    agent = Agent(args, tmp_path, "a")
    code = agent.wait(120)
    assert code == DO_NOT_REQUEUE, agent.output[-3000:]
    storms = of_type(r, job_id, EventType.RESTART_STORM)
    assert len(storms) == 1 and storms[0].data["restarts"] == 3, storms
    assert storms[0].data["rounds"] == [2, 1, 0] and storms[0].data["policy"] == "stop"
    # the job ended at the storm, well before --max-restarts
    assert len(of_type(r, job_id, EventType.RESTARTING)) == 2
    failed = of_type(r, job_id, EventType.JOB_FAILED)
    assert len(failed) == 1 and "restart storm" in failed[0].data["root_cause"]["message"]
    assert "restart storm: 3 restarts within 5 min" in agent.output
    assert r.llen(JobKeys(job_id).restart_history) == 3


def test_rounds_without_progress_are_reported(redis_url, r, job_id, tmp_path):
    args = agent_args(redis_url, job_id, "--nproc-per-node", "1", "--max-restarts", "1",
                      "--stall-timeout", "1", "--on-stall", "restart", "--no-progress-rounds",
                      "2", "--restart-storm", "0", FAST, str(SCRIPTS / "crash_loop.py"),
                      "--silent")
    agent = Agent(args, tmp_path, "a")
    assert agent.wait(120) == DO_NOT_REQUEUE, agent.output[-3000:]
    stuck = of_type(r, job_id, EventType.NO_PROGRESS)
    assert [e.data["rounds"] for e in stuck] == [[1, 0]], stuck


def test_a_round_with_progress_is_not(redis_url, r, job_id, tmp_path):
    # One round end is enough to flag here, but its worker printed for 1.5 s before failing
    # (sleeper.py fails in its first attempt only: the job then succeeds).
    args = agent_args(redis_url, job_id, "--nproc-per-node", "1", "--max-restarts", "1",
                      "--stall-timeout", "1", "--no-progress-rounds", "1", "--restart-storm",
                      "0", "--suspect-rounds", "0", FAST, str(SCRIPTS / "sleeper.py"),
                      "--seconds", "3", "--fail-rank", "0", "--fail-after", "1.5")
    agent = Agent(args, tmp_path, "a")
    assert agent.wait(120) == 0, agent.output[-3000:]
    assert len(of_type(r, job_id, EventType.GROUP_FAILED)) == 1
    assert of_type(r, job_id, EventType.NO_PROGRESS) == []


def _suspect_job(redis_url: str, job_id: str, tmp_path, *extra: str) -> list[Agent]:
    args = agent_args(redis_url, job_id, "--nnodes", "2:3", "--nproc-per-node", "1",
                      "--max-restarts", "2", "--suspect-rounds", "2", "--restart-storm", "0",
                      *extra, FAST, str(SCRIPTS / "crash_loop.py"), "--crash", "--only-flagged",
                      "--after", "0.5", "--done-at-world", "2")
    return [Agent(args, tmp_path, f"a{i}", env={"CRASH_HERE": "1"} if i == 2 else None)
            for i in range(3)]


def _crashing_node(r, job_id: str) -> str:
    nodes = {e.node for e in of_type(r, job_id, EventType.WORKER_EXITED)
             if e.data.get("exit_code") == 3}
    assert len(nodes) == 1, nodes
    return nodes.pop()


def test_a_suspect_node_is_named(redis_url, r, job_id, tmp_path):
    agents = _suspect_job(redis_url, job_id, tmp_path)
    codes = [a.wait(180) for a in agents]
    outs = "\n".join(a.output[-2500:] for a in agents)
    # it crashed in every round: the job failed with a suspect named, and nobody requeues it
    assert codes == [DO_NOT_REQUEUE] * 3, outs
    suspects = of_type(r, job_id, EventType.SUSPECT_NODE)
    crashing = _crashing_node(r, job_id)
    assert [e.data["suspect_node"] for e in suspects] == [crashing, crashing], outs
    assert [e.data["rounds"] for e in suspects] == [[1, 0], [2, 1]]
    assert not any(e.data["excluded"] for e in suspects)
    assert of_type(r, job_id, EventType.NODE_EXCLUDED) == []


def test_exclude_suspect_nodes_reforms_the_job_without_it(redis_url, r, job_id, tmp_path):
    agents = _suspect_job(redis_url, job_id, tmp_path, "--exclude-suspect-nodes")
    codes = [a.wait(180) for a in agents]
    outs = "\n".join(a.output[-2500:] for a in agents)
    assert codes == [0, 0, DO_NOT_REQUEUE], outs
    crashing = _crashing_node(r, job_id)
    suspects = of_type(r, job_id, EventType.SUSPECT_NODE)
    assert [(e.data["suspect_node"], e.data["excluded"]) for e in suspects] == [(crashing, True)]
    left = of_type(r, job_id, EventType.NODE_EXCLUDED)
    assert [e.node for e in left] == [crashing]
    assert "--exclude-suspect-nodes leaves it out" in agents[2].output
    rounds = of_type(r, job_id, EventType.RENDEZVOUS_COMPLETE)
    assert rounds[-1].data["world_size"] == 2
    assert crashing not in {n["node"] for n in rounds[-1].data["nodes"]}
    assert len(of_type(r, job_id, EventType.JOB_SUCCEEDED)) == 1


# -- the console ---------------------------------------------------------------------------

def test_the_view_keeps_the_patterns_of_the_latest_round_end_only():
    from tests.test_console_state import ev, two_nodes_running

    v = JobView("j")
    two_nodes_running(v)
    v.apply_event(ev(EventType.GROUP_FAILED, "a-1-x", round=0, root_cause={"rank": 0}))
    v.apply_event(ev(EventType.RESTART_STORM, "a-1-x", restarts=5, minutes=30, limit=5,
                     rounds=[0], round=0, policy="observe"))
    v.apply_event(ev(EventType.SUSPECT_NODE, "a-1-x", suspect_node="b-2-y\x1b[2J", host="b",
                     rounds=[0, 1, 2], excluded=True, why="x", round=0))
    v.apply_event(ev(EventType.NO_PROGRESS, "a-1-x", rounds=[2, 1, 0], round=0))
    v.apply_event(ev(EventType.SUSPECT_NODE, "a-1-x", suspect_node=7))  # malformed: ignored
    assert list(v.patterns.values()) == [
        "restart storm: 5 restarts within 30.0 min",
        "suspect node b (b-2-y\\x1b[2J): in every failure of the last 3 rounds; left out of "
        "the job",
        "no progress: the last 3 rounds ended before any"]
    assert [e.kind for e in v.timeline][-3:] == ["pattern"] * 3
    v.apply_event(ev(EventType.NODE_EXCLUDED, "b-2-y", host="b", reason="suspect"))
    assert v.nodes["b-2-y"].status == "left"
    # the next round end: its claimer names what still holds; nothing here
    v.apply_event(ev(EventType.GROUP_FAILED, "a-1-x", round=1, root_cause={"rank": 1}))
    assert v.patterns == {}


def test_a_storm_shows_a_banner_in_the_console(redis_url, r, job_id, tmp_path):
    from tests.test_console_app import App, console, loaded, run, screen_text

    args = agent_args(redis_url, job_id, "--nproc-per-node", "1", "--max-restarts", "2",
                      "--restart-storm", "2/5", "--suspect-rounds", "0", FAST,
                      str(SCRIPTS / "crash_loop.py"), "--crash", "--after", "0.1")
    agent = Agent(args, tmp_path, "a")
    assert agent.wait(120) == DO_NOT_REQUEUE, agent.output[-3000:]
    app: App = console(redis_url, job_id)

    async def body(pilot, app: App) -> None:
        await loaded(app, ranks=1)
        await pilot.pause()
        assert app.banner.display
        assert "restart storm: 3 restarts within 5.0 min" in screen_text(app)

    run(app, body)
    status = cli("status", job_id, "--json", redis_url=redis_url)
    # crashing 0.1 s into each round, before any progress (default --stall-timeout 300):
    # the three rounds also ended without progress
    assert json.loads(status.stdout)["patterns"] == [
        "restart storm: 3 restarts within 5.0 min",
        "no progress: the last 3 rounds ended before any"]
    human = cli("status", job_id, redis_url=redis_url).stdout
    assert "pattern   restart storm: 3 restarts within 5.0 min" in human


def test_a_lost_node_is_in_its_round_end(redis_url, r, job_id, tmp_path):
    """A node whose heartbeats stop is in that round's failure: with --suspect-rounds 1 it is
    named at once (and the re-form spends no restart, as before)."""
    import os
    import signal

    from tests.agents import wait_until

    args = agent_args(redis_url, job_id, "--nnodes", "2:3", "--nproc-per-node", "1",
                      "--max-restarts", "0", "--suspect-rounds", "1", FAST,
                      str(SCRIPTS / "crash_loop.py"), "--done-at-world", "2")
    agents = [Agent(args, tmp_path, f"a{i}") for i in range(3)]
    wait_until(lambda: len(of_type(r, job_id, EventType.WORKERS_STARTED)) == 3, 60,
               "three nodes' workers")
    victim = agents[2]
    victim_node = next(e.node for e in of_type(r, job_id, EventType.NODE_JOINED)
                       if e.data["pid"] == victim.pid)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)
    codes = [a.wait(90) for a in agents[:2]]
    assert codes == [0, 0], "\n".join(a.output[-3000:] for a in agents[:2])
    suspects = of_type(r, job_id, EventType.SUSPECT_NODE)
    assert [(e.data["suspect_node"], e.data["rounds"]) for e in suspects] == [(victim_node, [0])]
    assert r.get(JobKeys(job_id).restarts) in (None, b"0")
