"""Chaos, the short version of ``bench/chaos.py``: real agents, one real Redis restarted empty,
the console app attached headless, worker and agent SIGKILLs and restart commands; then the
same checks as the bench, asserted one by one on its result.

Scale: 4 agents x 3 workers (12 workers, not 128) over 40 s of episodes. At 16 x 8 a single
restart of the job takes 8-13 s on these 2 cores (``bench/chaos.py``'s figures), so the full
scale cannot show every kind of fault within CI's ~75 s; 4 agents still lose one and re-form
with 3, and 3 workers per agent let one episode kill several workers on several agents.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
try:
    import chaos
finally:
    sys.path.remove(str(ROOT / "bench"))

# The last call outlasts the slowest agent's way back into a re-forming round: the stacks
# it captures first (2 s at most) and its workers' stop (--shutdown-timeout 3 s at most), with
# a second to spare. With --nnodes 3:4 a round that completed without it (a 1 s last call did)
# leaves it waiting, and the job re-forms once more for it: one command, two rounds, and
# "rounds gained" off by one. A round whose every live member came back completes at once, so
# this costs nothing when all are quick.
RDZV = "last_call_timeout=6,heartbeat_timeout=3,keep_alive_interval=0.5,join_timeout=120"


def short_config(seed: int) -> chaos.Config:
    return chaos.Config(agents=4, workers=3, duration=40, seed=seed, episodes=6, rdzv_conf=RDZV,
                        settle_timeout=40, exit_timeout=30, shutdown_timeout=3, verbose=True)


def seed_with_every_rule() -> int:
    """The first seed whose schedule empties Redis after a restart of the workers and after
    the agent kill, with a worker kill after it: each rule of ``chaos.compare`` for what the
    empty Redis lost (ranks' restarts, a node gone before, the root cause) then has work."""
    for seed in range(1000):
        kinds = chaos.plan(short_config(seed), random.Random(seed))
        redis_at = kinds.index("restart_redis")
        if (kinds.index("kill_agent") < redis_at and "kill_workers" in kinds[redis_at:]
                and "command" in kinds[:redis_at]):
            return seed
    raise AssertionError("no such seed")


def test_plan_is_the_seeds_and_has_every_fault() -> None:
    for seed in range(20):
        cfg = short_config(seed)
        kinds = chaos.plan(cfg, random.Random(seed))
        assert kinds == chaos.plan(cfg, random.Random(seed))
        assert len(kinds) == 6
        assert kinds.count("kill_agent") == 1 and kinds.count("restart_redis") == 1
        assert kinds.count("kill_workers") >= 1 and kinds.count("command") >= 1


def _state(nodes: dict, ranks: list, root_cause: object) -> dict:
    return {"job": "j", "state": "succeeded", "round": 5, "nodes": nodes, "ranks": ranks,
            "root_cause": root_cause, "restarts_used": 2}


def test_compare_applies_only_the_rules_of_what_redis_lost() -> None:
    gone = {"host": "h", "status": "lost", "group_rank": None}
    alive = {"host": "h", "status": "joined", "group_rank": 0}
    rank = {"rank": 0, "pid": 7, "state": "exited", "restarts": 4}
    cause = {"rank": 0, "pid": 6}
    console = _state({"old": gone, "n1": alive}, [rank], cause)
    # status --json after the empty Redis: no trace of the node lost before it, restarts counted
    # from the restored announcement (the console had seen 3 when Redis went), and no failure
    # since, so no root cause.
    status = _state({"n1": alive}, [{**rank, "restarts": 1}], None)
    lost = chaos.BeforeRedis(restarts={0: 3}, members={"n1"}, root_cause=cause)
    assert chaos.compare(console, status, lost) == []
    without_rules = chaos.compare(console, status, None)
    assert any(d.startswith("node old") for d in without_rules)
    assert any(d.startswith("rank 0: restarts") for d in without_rules)
    assert any(d.startswith("root_cause") for d in without_rules)
    # The rules excuse nothing else: a node of the round Redis lost must still match, and so
    # must every other field.
    assert chaos.compare(console, _state({}, [{**rank, "restarts": 1}], None), lost) == [
        "node n1: console={'host': 'h', 'status': 'joined', 'group_rank': 0} status=None"]
    bad = chaos.compare(console, {**status, "ranks": [{**rank, "restarts": 1, "pid": 8}]}, lost)
    assert bad == ["rank 0: pid console=7 status=8"]
    assert chaos.compare(console, {**status, "restarts_used": 1}, lost) == [
        "restarts_used: console=2 status=1"]
    # A failure after the Redis restart: the root causes must be equal.
    lost.failures_after = 1
    assert chaos.compare(console, status, lost) == ["root_cause: console={\"rank\": 0, \"pid\": 6} "
                                                    "status=null"]


@pytest.mark.timeout(150)
def test_chaos_short_run() -> None:
    cfg = short_config(seed_with_every_rule())
    result = chaos.run(cfg)
    table = result.table()
    print(table)
    failed = [c for c in result.checks if not c.ok]
    assert not failed, table

    kills, commands = result.of("kill_workers"), result.of("command")
    assert len(result.of("kill_agent")) == 1 and len(result.of("restart_redis")) == 1
    assert kills and commands and len(result.episodes) == 6
    assert all(e.recovery_s is not None and e.console_lag_s is not None for e in result.episodes)
    assert all(1 <= len(e.killed) <= 3 for e in kills)
    # One restart per kill episode, however many workers it killed.
    assert result.check("kill episodes -> restart counter (Redis)").observed == len(kills)
    assert result.check("  restarts_used (status --json)").observed == len(kills)
    assert result.check("  group_failed rounds").observed == [e.round_before for e in kills]
    assert result.check("  root cause is a killed rank").observed == len(kills)
    assert result.check("agent kills -> restarting(membership)").observed == 1
    assert result.check("  nodes lost").observed == [result.of("kill_agent")[0].node]
    assert result.check("restart commands -> restarting(command) ids").observed == sorted(
        e.command_id for e in commands)
    assert all(e.accepted == e.expected_acks > 0 for e in commands)
    assert result.check("rounds gained (kills + agent kills + commands)").observed == (
        len(kills) + 1 + len(commands))
    survivors = (cfg.agents - 1) * cfg.workers
    assert result.check("  final world size").observed == survivors
    assert result.check("  ranks whose console restarts grew by that").observed == survivors
    # The empty Redis: same round, same workers, the job put back.
    redis_ep = result.of("restart_redis")[0]
    assert redis_ep.round_after == redis_ep.round_before
    assert redis_ep.pids_after == redis_ep.pids_before
    for where in ("Redis", "the log files", "the console"):
        assert result.check(f"last line in {where}").observed == survivors
    for where in ("Redis", "the console"):
        assert result.check(f"final attempt's lines in {where} (= files)").observed == survivors
    assert result.check("orphan processes").observed == []
    assert result.check(f"agents stuck (none may exceed {cfg.exit_timeout:g} s)").observed == []
    codes = result.check("agent exit codes (killed: -9)").observed
    assert sorted(codes.values()) == [-9] + [0] * (cfg.agents - 1)
    # The console equals status --json, and only thanks to the rules: Redis really lost history.
    assert result.status_json["state"] == result.console_json["state"] == "succeeded"
    assert chaos.compare(result.console_json, result.status_json, result.lost) == []
    assert chaos.compare(result.console_json, result.status_json, None) != []
    # How long it took is a figure (bench/chaos.py prints "N s wall" in its table), not a
    # check: only the timeout above bounds this test, and only to catch a hang.
