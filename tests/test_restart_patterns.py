"""Restart patterns (issue 22, part 3): a restart storm, a suspect node, rounds without
progress; leaving a suspect node out; the "do not requeue" exit status. The logic on its own,
then real agents, real workers, a real redis-server. The exit status is asserted as the
literal 93 that docs/AGENT.md promises scheduler wrappers, never as the imported constant."""

from __future__ import annotations

import argparse
import json

import pytest

from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.round_records import decode_round_end
from elastic_agent.supervision.diagnosis.metrics import MetricsTracker
from elastic_agent.supervision.diagnosis.metrics_publish import MetricsPublisher
from elastic_agent.supervision.diagnosis.restart_patterns import (
    HISTORY_CAP,
    STEP_ROUNDS,
    Decision,
    PatternSettings,
    RoundEnd,
    add_arguments,
    analyse,
    decode_steps,
    may_exclude,
    merge_steps,
    progressed,
    settings_from,
    step_fields,
    step_progress,
    verified_history,
)
from elastic_console.job.state import JobView
from tests.agents import EXAMPLES, SCRIPTS, Agent
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


def test_progress_by_steps_is_a_new_highest_step():
    # the round's highest step against every earlier round's (and the folded ones')
    assert step_progress(0, {0: 4}) == (True, 4)
    assert step_progress(1, {0: 4, 1: 4}) == (False, 4)  # a resume that only redid steps
    assert step_progress(1, {0: 4, 1: 3}) == (False, 3)
    assert step_progress(2, {0: 9, 1: 4, 2: 8}) == (False, 8)  # below round 0's best
    assert step_progress(2, {0: 4, 1: 8, 2: 12}) == (True, 12)
    assert step_progress(3, {0: 4}) == (False, None)  # steps known, none printed this round
    assert step_progress(5, {5: 10}, base=12) == (False, 10)
    assert step_progress(5, {5: 13, 6: 99}, base=12) == (True, 13)  # a later round: not before
    assert step_progress(3, {}) == (None, None)  # no step ever: the stall rule decides
    assert step_progress(3, {4: 1}) == (None, None)
    assert merge_steps({1: 4, 2: 3}, {2: 5, 3: 1}) == {1: 4, 2: 5, 3: 1}


def test_the_steps_read_are_bounded_and_hostile_values_skipped():
    fields = step_fields(100)
    assert fields[0] == "base" and len(fields) == STEP_ROUNDS + 1 and fields[-1] == "100"
    assert step_fields(2) == ["base", "0", "1", "2"]
    assert decode_steps(2, [b"7", b"4", None, b"9"]) == ({0: 4, 2: 9}, 7)
    assert decode_steps(2, [b"-1", b"4.5", b"x", b"9" * 17]) == ({}, None)
    assert decode_steps(2, [b"9007199254740992", b"\xff", "3", b" 3"]) == ({1: 3}, None)
    assert decode_steps(2, [b"1"]) == ({}, None)  # not the reply to these fields
    assert decode_steps(2, None) == ({}, None)


def _publisher(r, job_id: str, node: str = "n-1-a") -> tuple[MetricsTracker, MetricsPublisher]:
    tracker = MetricsTracker()
    return tracker, MetricsPublisher(tracker, job_id, node, lambda *a, **k: None)


def _publish(r, pub: MetricsPublisher) -> int:
    pipe = r.pipeline(transaction=False)
    _, queued = pub.ride(pipe)
    pub.landed(pipe.execute(raise_on_error=False) if queued else [])
    return queued


def test_each_round_keeps_its_highest_step_in_redis(r, job_id):
    """The metrics script call raises the round's step (never lowers it), a bar's step
    without metrics counts, a count of step-less lines does not, and the oldest rounds fold
    into ``base`` so that the hash stays within the claimer's one HMGET."""
    key = JobKeys(job_id).metrics_steps
    a, pa = _publisher(r, job_id, "a-1-x")
    b, pb = _publisher(r, job_id, "b-2-y")
    pa.start_attempt(0, holds_rank0=True)
    pb.start_attempt(0, holds_rank0=False)
    a.feed(0, "stdout", b"step 3 loss 0.5\nstep 4 loss 0.4\n")
    b.feed(8, "stdout", b"step 6 loss 0.5\n")
    assert _publish(r, pa) == 1 and _publish(r, pb) == 1
    assert r.hgetall(key) == {b"0": b"6"}
    a.feed(0, "stdout", b"step 5 loss 0.3\n")  # below the round's highest: not lowered
    assert _publish(r, pa) == 1 and r.hgetall(key) == {b"0": b"6"}
    assert _publish(r, pa) == 0  # nothing new: nothing sent
    b.feed(8, "stderr", b"\r 70%|###   | 7/10 [00:01<00:00,  5.1it/s]")  # a bare bar
    assert _publish(r, pb) == 1 and r.hget(key, "0") == b"7"
    # the next round starts from a checkpoint: its own field, and round 0's last steps
    a.feed(0, "stdout", b"step 9 loss 0.2\n")
    pa.start_attempt(1, holds_rank0=True)
    a.feed(0, "stdout", b"step 4 loss 0.4\n")
    assert _publish(r, pa) == 1
    assert r.hgetall(key) == {b"0": b"9", b"1": b"4"}
    assert pa.steps_reached() == {0: 9, 1: 4}
    # lines without a step are counted for the curves, but a count is no step
    c, pc = _publisher(r, job_id, "c-3-z")
    pc.start_attempt(1, holds_rank0=False)
    c.feed(16, "stdout", b"loss=0.5\nloss=0.4\nloss=0.3\nloss=0.2\nloss=0.1\n")
    assert _publish(r, pc) == 1 and pc.steps_reached() == {}
    assert r.hget(key, "1") == b"4"
    # a long job: the rounds beyond STEP_ROUNDS fold into base (the highest of them)
    for rnd in range(2, STEP_ROUNDS + 6):
        pa.start_attempt(rnd, holds_rank0=True)
        a.feed(0, "stdout", f"step {100 - rnd} loss 0.1\n".encode())
        assert _publish(r, pa) == 1
    held = r.hgetall(key)
    assert len(held) == STEP_ROUNDS and held[b"base"] == b"98"  # round 2's 98
    assert b"6" not in held and b"7" in held and str(STEP_ROUNDS + 5).encode() in held
    highs, base = decode_steps(STEP_ROUNDS + 5, r.hmget(key, step_fields(STEP_ROUNDS + 5)))
    assert base == 98 and len(highs) == STEP_ROUNDS - 1  # every round held, in one HMGET


def test_a_steps_key_of_the_wrong_type_costs_the_steps_not_the_points(r, job_id):
    keys = JobKeys(job_id)
    r.set(keys.metrics_steps, "not a hash")
    a, pa = _publisher(r, job_id)
    pa.start_attempt(0, holds_rank0=True)
    a.feed(0, "stdout", b"step 3 loss 0.5\n")
    assert _publish(r, pa) == 1
    assert r.xlen(keys.metrics) == 1 and r.get(keys.metrics_steps) == b"not a hash"


def test_a_node_is_left_out_only_while_the_job_has_nodes_to_spare():
    assert may_exclude(3, 2, 0) and not may_exclude(3, 2, 1) and not may_exclude(2, 2, 0)


def test_history_records_round_trip_and_hostile_ones_are_skipped():
    end = RoundEnd(4, 123, "lost", ("h-1-a",), None, "c-2-b")
    assert RoundEnd.from_record(decode_round_end(end.to_json())) == end
    stepped = RoundEnd(4, 123, "failure", (), False, "c-2-b", 1200)
    assert RoundEnd.from_record(decode_round_end(stepped.to_json())) == stepped
    for step in ("7", -1, 1.5, True, 1 << 53):  # not a step: the record stays, without it
        d = decode_round_end(json.dumps({"round": 1, "ms": 1, "reason": "x", "step": step}))
        assert d is not None and d["step"] is None, step
    assert decode_round_end('{"round": 1, "ms": 1, "reason": "x"}')["by"] == ""
    assert decode_round_end('{"round": 1, "ms": 1, "reason": "x", "by": 7}') is None
    for bad in ('{"round": true, "ms": 1, "reason": "x"}', "[" * 10_000, '{"round": 1}',
                '{"round": 1, "ms": 1, "reason": "x", "progressed": "yes"}', "x" * 20_000,
                b"\xff\xfe"):
        assert decode_round_end(bad) is None, bad
    junk = decode_round_end('{"round": 1, "ms": 1, "reason": "x", "nodes": [1, "", "n"]}')
    assert junk is not None and junk["nodes"] == ["n"]


def test_only_round_ends_their_rounds_claimer_wrote_count():
    """The claimer's own entry first, then older rounds, each claimed (the meta's
    ``restart_claim:<r>`` or ``reform_claim:<r>``) by the node the entry names."""
    h = [RoundEnd(9, 900, "failure", ("x",), True, "a"),
         RoundEnd(8, 800, "lost", ("x",), True, "b"),      # claimed by b: kept
         RoundEnd(7, 700, "failure", ("x",), True, "evil"),  # the claim says a: dropped
         RoundEnd(6, 600, "failure", ("x",), True, ""),    # nobody: dropped
         RoundEnd(12, 600, "failure", ("x",), True, "a"),  # a round to come: dropped
         RoundEnd(5, 9_999, "failure", ("x",), True, "a"),  # after now: dropped
         RoundEnd(5, 500, "failure", ("x",), True, "a"),   # kept
         RoundEnd(5, 400, "failure", ("x",), True, "a")]   # the same round again: dropped
    assert [e.claim_field for e in h[:2]] == ["restart_claim:9", "reform_claim:8"]
    claims = [b"a", b"b", b"a", None, b"a", b"a", b"a", b"a"]
    kept, dropped = verified_history(h, claims, 9, 1_000)
    assert [e.round for e in kept] == [9, 8, 5] and dropped == 5


def test_decisions_round_trip_and_hostile_ones_are_refused():
    d = Decision(3, "c-1-a", ("n-1-x", "n-2-y"), "why")
    assert Decision.decode(d.to_json()) == d
    for bad in ("x", "[]", '{"round": 3}', '{"round": "3", "by": "a"}',
                '{"round": 3, "by": ""}', '{"round": 3, "by": "a", "nodes": [1]}',
                '{"round": 3, "by": "a", "nodes": "n"}', "[" * 10_000,
                json.dumps({"round": 3, "by": "a", "nodes": ["n"] * 65}), "x" * 20_000):
        assert Decision.decode(bad) is None, bad[:80]


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
    assert code == 93, agent.output[-3000:]
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
    assert agent.wait(120) == 93, agent.output[-3000:]
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


def _train_job(redis_url: str, job_id: str, tmp_path, crash_steps: str, *flags: str) -> Agent:
    """examples/train.py on one node of two ranks, checkpointing every 2 steps, rank 1
    crashing at the n-th of ``crash_steps`` in attempt n."""
    args = agent_args(redis_url, job_id, "--nproc-per-node", "2", "--restart-storm", "0",
                      "--suspect-rounds", "0", *flags, FAST, str(EXAMPLES / "train.py"),
                      "--steps", "16", "--checkpoint-every", "2", "--crash-rank", "1",
                      "--crash-step", crash_steps, "--checkpoint-dir", str(tmp_path / "ckpt"))
    return Agent(args, tmp_path, "a")


def _round_ends(r, job_id: str) -> list[tuple[int, bool | None, int | None]]:
    raw = r.lrange(JobKeys(job_id).restart_history, 0, -1)
    return [(d["round"], d["progressed"], d["step"]) for d in map(decode_round_end, raw)]


def test_crashing_at_the_same_step_every_round_is_no_progress(redis_url, r, job_id, tmp_path):
    """Each attempt resumes from the checkpoint at step 4, redoes step 4 and crashes at step 5:
    output and CPU every time, but never a step beyond the first round's. Stall detection is
    off (no output or CPU rule): the steps alone say so."""
    agent = _train_job(redis_url, job_id, tmp_path, "5,5,5,5", "--stall-timeout", "0",
                       "--max-restarts", "2", "--no-progress-rounds", "2")
    assert agent.wait(240) == 93, agent.output[-3000:]
    assert agent.output.count("resumed from step 4") == 4  # two ranks, two resumes
    stuck = of_type(r, job_id, EventType.NO_PROGRESS)
    assert [e.data["rounds"] for e in stuck] == [[2, 1]], (stuck, _round_ends(r, job_id))
    assert _round_ends(r, job_id) == [(2, False, 4), (1, False, 4), (0, True, 4)]
    assert r.hgetall(JobKeys(job_id).metrics_steps) == {b"0": b"4", b"1": b"4", b"2": b"4"}


def test_steps_that_advance_between_crashes_are_progress(redis_url, r, job_id, tmp_path):
    """Crashes at steps 5, 9 and 13, each attempt resuming from the last checkpoint: every
    round takes the job further. Each round ends within seconds of its start, before any
    output or CPU would count as progress (two stall samples, 10 s with the default
    --stall-timeout): without the steps the output-or-CPU rule would flag round 0 already."""
    agent = _train_job(redis_url, job_id, tmp_path, "5,9,13", "--max-restarts", "3",
                       "--no-progress-rounds", "1")
    assert agent.wait(240) == 0, agent.output[-3000:]
    assert of_type(r, job_id, EventType.NO_PROGRESS) == [], _round_ends(r, job_id)
    assert _round_ends(r, job_id) == [(2, True, 12), (1, True, 8), (0, True, 4)]
    assert r.hgetall(JobKeys(job_id).metrics_steps) == {
        b"0": b"4", b"1": b"8", b"2": b"12", b"3": b"15"}


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
    assert codes == [93] * 3, outs
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
    assert codes == [0, 0, 93], outs
    crashing = _crashing_node(r, job_id)
    suspects = of_type(r, job_id, EventType.SUSPECT_NODE)
    assert [(e.data["suspect_node"], e.data["excluded"]) for e in suspects] == [(crashing, True)]
    left = of_type(r, job_id, EventType.NODE_EXCLUDED)
    assert [e.node for e in left] == [crashing]
    # which round's restart decided it, and who claimed that restart (and said so)
    (claimer,) = {e.node for e in suspects}
    assert left[0].data["decided_by"] == claimer
    assert left[0].data["round"] == suspects[0].data["round"]
    claim = r.hget(JobKeys(job_id).meta, f"restart_claim:{left[0].data['round']}")
    assert claim == claimer.encode()
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
    assert agent.wait(120) == 93, agent.output[-3000:]
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
