"""elastic-agent end to end: real agents, real workers, a real redis-server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.wire.command_records import Command, encode_command
from elastic_agent.coordination.wire.event_records import EventType, decode_event
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.log_records import decode_log_entries
from tests.agents import AGENT, EXAMPLES, SCRIPTS, Agent, alive, wait_until

FAST = "--rdzv-conf=last_call_timeout=1,heartbeat_timeout=2,keep_alive_interval=0.3,join_timeout=60"


def events(r: redis.Redis, job: str) -> list:
    """The job's events as a reader must see them: a repeated (node, seq) -- the duplicate a
    retried XADD can leave after an outage -- is dropped."""
    seen: set[tuple[str, int]] = set()
    out = []
    for i, f in r.xrange(JobKeys(job).events):
        e = decode_event(i, f)
        if e is None or (e.seq and (e.node, e.seq) in seen):
            continue
        seen.add((e.node, e.seq))
        out.append(e)
    return out


def of_type(r: redis.Redis, job: str, t: str) -> list:
    return [e for e in events(r, job) if e.type == t]


def worker_pids(r: redis.Redis, job: str) -> list[int]:
    return [p for e in of_type(r, job, EventType.WORKERS_STARTED) for p in e.data["pids"]]


def log_lines(r: redis.Redis, job: str) -> list[tuple[int, str, str]]:
    out = []
    for stream in r.smembers(JobKeys(job).log_streams):
        for i, f in r.xrange(stream):
            for b in decode_log_entries(i, f) or ():
                # finished lines: a live block's rows come again, final, in a later batch
                out += [(b.rank, b.stream, line) for line in b.lines[:len(b.lines) - b.live]]
    return out


def agent_args(redis_url: str, job: str, *extra: str) -> list[str]:
    return ["--redis", redis_url, "--job-id", job, "--local-addr", "127.0.0.1", *extra]


def test_two_agents_train_restart_once_and_end_identical(redis_url, r, job_id, tmp_path):
    dump = tmp_path / "params"
    args = agent_args(redis_url, job_id, "--nnodes", "2", "--nproc-per-node", "2",
                      "--max-restarts", "2", FAST, "--log-dir", str(tmp_path / "logs"),
                      str(EXAMPLES / "train.py"), "--steps", "6", "--crash-rank", "1",
                      "--crash-step", "3", "--checkpoint-dir", str(tmp_path / "ckpt"),
                      "--dump-params", str(dump))
    agents = [Agent(args, tmp_path, f"a{i}") for i in range(2)]
    codes = [a.wait(240) for a in agents]
    assert codes == [0, 0], "\n".join(a.output[-3000:] for a in agents)
    restarting = of_type(r, job_id, EventType.RESTARTING)
    assert [e.data["reason"] for e in restarting] == ["failure"]
    assert r.get(JobKeys(job_id).restarts) == b"1"
    failed = of_type(r, job_id, EventType.GROUP_FAILED)
    assert len(failed) == 1 and failed[0].data["root_cause"]["rank"] == 1
    cause = failed[0].data["root_cause"]
    assert "injected crash" in cause["message"]
    # The event carries the traceback as text, not torch's error-file structure around it.
    assert "py_callstack" not in json.dumps(cause), cause
    assert "InjectedCrash: injected crash: rank 1 at step 3" in (cause["traceback"] or ""), \
        "the @record error file was not read"
    # examples/train.py --dump-params: one record per rank of the last attempt.
    dumps = [json.loads(Path(f"{dump}.rank{k}").read_text()) for k in range(4)]
    for d in dumps:
        for key in ("sha256", "sum", "resumed", "resumed_from", "attempt", "world_size"):
            assert d.get(key) is not None, (key, d)
    assert [(d["rank"], d["world_size"], d["attempt"]) for d in dumps] == [
        (k, 4, 1) for k in range(4)]
    assert len({d["sha256"] for d in dumps}) == 1, dumps
    assert len({d["sum"] for d in dumps}) == 1, dumps
    # The crash came at step 3 with a checkpoint every 2 steps: every rank resumed from step 2.
    assert all(d["resumed"] and d["resumed_from"] == 2 for d in dumps), dumps
    assert len(of_type(r, job_id, EventType.JOB_SUCCEEDED)) == 1
    assert alive(worker_pids(r, job_id)) == []
    # Per-rank files, torch's layout: LOG_DIR/<JOB>_<random>/attempt_N/LOCAL_RANK/stdout.log,
    # one run directory per agent
    run_dirs = list((tmp_path / "logs").glob(f"{job_id}_*"))
    assert len(run_dirs) == 2, run_dirs
    assert all(list(d.glob("attempt_*/1/stdout.log")) for d in run_dirs), run_dirs


def test_lost_node_the_others_reform_and_finish_without_orphans(redis_url, r, job_id, tmp_path):
    args = agent_args(redis_url, job_id, "--nnodes", "2:3", "--nproc-per-node", "1",
                      "--max-restarts", "0", FAST, str(SCRIPTS / "sleeper.py"),
                      "--seconds", "4")
    agents = [Agent(args, tmp_path, f"a{i}") for i in range(3)]
    wait_until(lambda: any(e.data["world_size"] == 3
                           for e in of_type(r, job_id, EventType.RENDEZVOUS_COMPLETE)),
               60, "a round of three")
    wait_until(lambda: len(worker_pids(r, job_id)) == 3, 30, "three workers")
    victim = agents[2]
    victim_workers = [p.pid for p in victim.descendants()]
    os.kill(victim.pid, signal.SIGKILL)  # the host dies: no goodbye
    victim.wait(10)
    codes = [a.wait(90) for a in agents[:2]]
    assert codes == [0, 0], "\n".join(a.output[-3000:] for a in agents[:2])
    lost = of_type(r, job_id, EventType.NODE_LOST)
    assert len(lost) == 1
    assert [e.data["reason"] for e in of_type(r, job_id, EventType.RESTARTING)] == ["membership"]
    rounds = of_type(r, job_id, EventType.RENDEZVOUS_COMPLETE)
    assert rounds[-1].data["world_size"] == 2
    assert r.get(JobKeys(job_id).restarts) in (None, b"0"), "a lost node must not spend a restart"
    wait_until(lambda: alive(worker_pids(r, job_id) + victim_workers) == [], 10, "no orphans")


def test_redis_outage_restarts_no_worker_and_loses_no_line(private_redis, job_id, tmp_path):
    srv = private_redis
    srv.stop()
    srv.extra_args = ["--appendonly", "yes", "--appendfsync", "always"]
    srv.start()
    r = make_client(srv.url)
    args = agent_args(srv.url, job_id, "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                      str(SCRIPTS / "sleeper.py"), "--seconds", "5")
    agent = Agent(args, tmp_path, "a")
    wait_until(lambda: len(worker_pids(r, job_id)) == 2, 30, "workers")
    wait_until(lambda: len(log_lines(r, job_id)) > 10, 10, "first lines")
    srv.kill()
    outage_start = time.time()

    def printed_during_outage() -> list[str]:
        """Tick lines the workers wrote to their local files since Redis went away."""
        lines = []
        for f in (tmp_path / "logs").glob(f"{job_id}_*/attempt_0/*/stdout.log"):
            whole = f.read_text(errors="replace").split("\n")[:-1]  # the last may be partial
            lines += [t for t in whole
                      if t.startswith("tick ") and float(t.split("t=")[1]) > outage_start]
        return lines if len(lines) >= 40 else []

    # About a second of both workers' output, written while nothing could be published.
    during = wait_until(printed_during_outage, 10, "lines printed during the outage")
    srv.start()
    assert agent.wait(60) == 0, agent.output[-3000:]
    assert len(of_type(r, job_id, EventType.WORKERS_STARTED)) == 1
    assert not of_type(r, job_id, EventType.RESTARTING)
    ticks = [line for _, s, line in log_lines(r, job_id) if line.startswith("tick ")]
    assert set(during) <= set(ticks), "lines printed during the outage did not arrive"
    for rank in (0, 1):
        nums = [int(t.split()[1]) for t in ticks if f" rank {rank} " in t]
        assert nums == list(range(len(nums))), f"rank {rank}: lines lost or out of order"
    r.close()


def test_commands_signal_restart_stop_and_malformed(redis_url, r, job_id, tmp_path):
    args = agent_args(redis_url, job_id, "--nproc-per-node", "2", "--max-restarts", "3",
                      "--shutdown-timeout", "5", str(SCRIPTS / "sleeper.py"))
    agent = Agent(args, tmp_path, "a")
    keys = JobKeys(job_id)
    wait_until(lambda: len(worker_pids(r, job_id)) == 2, 30, "workers")

    def send(cmd_id: str, kind: str, **cmd_args) -> None:
        r.xadd(keys.commands, encode_command(Command(cmd_id, kind, "tester@host", args=cmd_args)))

    def ack(cmd_id: str):
        wait_until(lambda: any(e.data["command_id"] == cmd_id
                               for e in of_type(r, job_id, EventType.COMMAND_ACK)), 15,
                   f"ack of {cmd_id}")
        return next(e for e in of_type(r, job_id, EventType.COMMAND_ACK)
                    if e.data["command_id"] == cmd_id)

    r.xadd(keys.commands, {"v": "1", "id": "bad-1", "type": "explode", "args": "{}"})
    r.xadd(keys.commands, {"v": "1", "id": "bad-2", "type": "stop", "args": "not json"})
    send("bad-3", "signal", rank="one", signal="SIGTERM")
    for bad in ("bad-1", "bad-2", "bad-3"):
        assert ack(bad).data["status"] == "rejected"

    first = worker_pids(r, job_id)
    send("sig-1", "signal", rank=1, signal="SIGKILL")
    assert ack("sig-1").data["status"] == "accepted"
    wait_until(lambda: len(of_type(r, job_id, EventType.WORKERS_STARTED)) == 2, 30,
               "restart after the killed rank")
    exited = [e for e in of_type(r, job_id, EventType.WORKER_EXITED) if e.data["rank"] == 1]
    assert exited[0].data["signal"] == "SIGKILL"

    send("restart-1", "restart")
    assert ack("restart-1").data["status"] == "accepted"
    wait_until(lambda: len(of_type(r, job_id, EventType.WORKERS_STARTED)) == 3, 30,
               "restart by command")
    reasons = [e.data["reason"] for e in of_type(r, job_id, EventType.RESTARTING)]
    assert reasons == ["failure", "command"]
    assert r.get(keys.restarts) == b"1", "a restart command must not spend a restart"

    send("stop-1", "stop")
    assert agent.wait(30) == 143
    assert ack("stop-1").data["status"] == "accepted"
    assert len(of_type(r, job_id, EventType.JOB_STOPPED)) == 1
    assert alive(worker_pids(r, job_id)) == [] and alive(first) == []


def test_sigterm_to_an_agent_leaves_cleanly_and_the_other_reforms(redis_url, r, job_id, tmp_path):
    args = agent_args(redis_url, job_id, "--nnodes", "1:2", "--nproc-per-node", "1", FAST,
                      str(SCRIPTS / "sleeper.py"), "--seconds", "3")
    a, b = Agent(args, tmp_path, "a"), Agent(args, tmp_path, "b")
    wait_until(lambda: any(e.data["world_size"] == 2
                           for e in of_type(r, job_id, EventType.RENDEZVOUS_COMPLETE)),
               60, "a round of two")
    wait_until(lambda: len(worker_pids(r, job_id)) == 2, 30, "workers")
    b_workers = [p.pid for p in b.descendants()]
    os.kill(b.pid, signal.SIGTERM)
    assert b.wait(30) == 128 + signal.SIGTERM
    assert alive(b_workers) == []
    assert a.wait(60) == 0, a.output[-3000:]
    assert of_type(r, job_id, EventType.NODE_LEFT)
    assert r.hget(JobKeys(job_id).meta, "final_state") == b"succeeded"


def test_final_failure_prints_the_root_cause(redis_url, r, job_id, tmp_path):
    args = agent_args(redis_url, job_id, "--nproc-per-node", "2", "--max-restarts", "0",
                      str(SCRIPTS / "sleeper.py"), "--fail-rank", "1", "--fail-after", "0.1")
    agent = Agent(args, tmp_path, "a")
    assert agent.wait(60) == 1
    out = agent.output
    assert "sleeper.py FAILED" in out and "Root Cause" in out
    assert "rank      : 1 (local_rank: 1)" in out and "exitcode  : 3" in out
    # as torchrun's summary: no error file written is "<N/A>", and with --max-restarts 0 the
    # failure that found no restart left is not a restart used
    assert "error_file: <N/A>" in out and "restarts  : 0/0 used" in out, out
    failed = of_type(r, job_id, EventType.JOB_FAILED)
    assert len(failed) == 1 and failed[0].data["root_cause"]["rank"] == 1
    assert alive(worker_pids(r, job_id)) == []


def test_worker_output_is_kept_as_data(redis_url, r, job_id, tmp_path):
    args = agent_args(redis_url, job_id, "--nproc-per-node", "1",
                      str(SCRIPTS / "hostile_output.py"))
    agent = Agent(args, tmp_path, "a")
    assert agent.wait(60) == 0, agent.output[-2000:]
    lines = [line for _, _, line in log_lines(r, job_id)]
    # Plain output is data; output that erases the screen is rendered (records/screen.py):
    # the erase consumed, colours kept, other sequences (the title, if in the same read) removed.
    assert "\x1b]0;pwned\x07title" in lines or "title" in lines, lines[:3]
    assert "clear \x1b[31mred\x1b[0m [bold]markup[/bold]" in lines
    big = [line for line in lines if line.startswith("xxxx")]
    assert len(big) == 1 and "truncated" in big[0] and len(big[0]) < 20_000
    assert "after the big line" in lines


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "0", "x.py"], "--nnodes"),
    (["--nproc-per-node", "lots", "x.py"], "--nproc-per-node"),
    (["--max-restarts", "-1", "x.py"], "--max-restarts"),
    (["--redis", "http://h", "x.py"], "scheme"),
    (["--job-id", "j1"], "no training script"),
    (["--nnodes", "2", str(SCRIPTS / "sleeper.py")], "needs --job-id"),
    (["--job-id", "a{b}", str(SCRIPTS / "sleeper.py")], "invalid job id"),
    (["--tee", "9", str(SCRIPTS / "sleeper.py")], "--tee"),
    (["--rdzv-conf", "join_timeout=soon", str(SCRIPTS / "sleeper.py")], "join_timeout"),
    (["--local-ranks-filter", "one", str(SCRIPTS / "sleeper.py")], "--local-ranks-filter"),
    (["--shutdown-timeout", "soon", str(SCRIPTS / "sleeper.py")], "--shutdown-timeout"),
    (["--bogus-flag", "x.py"], "unrecognized"),
])
def test_bad_command_lines_get_one_line_and_status_2(argv, message):
    p = subprocess.run([*AGENT, *argv], capture_output=True, text=True, timeout=30,
                       env={**os.environ, "ELASTIC_JOB_ID": ""})
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_unreachable_redis_is_one_line(tmp_path):
    from elastic_agent.coordination.ports import free_port

    p = subprocess.run([*AGENT, "--redis", f"127.0.0.1:{free_port()}", str(SCRIPTS / "sleeper.py")],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 1
    assert p.stderr.strip().startswith("elastic-agent: error: cannot reach Redis at")
    assert len(p.stderr.strip().splitlines()) == 1


def test_rendezvous_progress_and_join_timeout(redis_url, job_id, tmp_path):
    args = agent_args(redis_url, job_id, "--nnodes", "2", "--rdzv-conf", "join_timeout=1.5",
                      str(SCRIPTS / "sleeper.py"))
    agent = Agent(args, tmp_path, "a")
    assert agent.wait(30) == 1
    out = agent.output
    assert "1 of 2..2 nodes joined; waiting for 1 more" in out
    assert "timed out after 1.5 s" in out and "Traceback" not in out


def test_agent_starts_without_torch():
    code = ("import sys, elastic_agent.supervision.cli, elastic_agent.supervision.elastic_agent; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_standalone_prints_the_attach_command(tmp_path):
    p = subprocess.run([*AGENT, "--standalone", "--job-id", "solo-1", "--nproc-per-node", "2",
                        str(EXAMPLES / "hello.py")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "elastic-console attach solo-1 --redis redis://127.0.0.1:" in p.stderr
    assert p.stdout.count("hello from rank") == 2


def test_a_failure_during_an_outage_waits_for_redis_then_restarts(private_redis, job_id,
                                                                   tmp_path):
    srv = private_redis
    srv.stop()
    srv.extra_args = ["--appendonly", "yes", "--appendfsync", "always"]
    srv.start()
    r = make_client(srv.url)
    args = agent_args(srv.url, job_id, "--nproc-per-node", "2", "--max-restarts", "1",
                      str(SCRIPTS / "sleeper.py"), "--seconds", "2", "--fail-rank", "0",
                      "--fail-after", "1.5")
    agent = Agent(args, tmp_path, "a")
    wait_until(lambda: len(worker_pids(r, job_id)) == 2, 30, "workers")
    srv.kill()
    wait_until(lambda: "rank 0 failing on purpose" in agent.output, 20, "the failure")
    wait_until(lambda: "Redis unreachable" in agent.output, 30, "the agent to wait for Redis")
    assert agent.proc.poll() is None, agent.output[-2000:]
    srv.start()
    assert agent.wait(90) == 0, agent.output[-3000:]
    assert [e.data["reason"] for e in of_type(r, job_id, EventType.RESTARTING)] == ["failure"]
    started = of_type(r, job_id, EventType.WORKERS_STARTED)
    assert len(started) == 2, [(e.id, e.data) for e in started]
    r.close()


def test_a_node_joining_below_max_reforms_without_spending_a_restart(redis_url, r, job_id,
                                                                     tmp_path):
    args = agent_args(redis_url, job_id, "--nnodes", "1:2", "--nproc-per-node", "1", FAST,
                      str(SCRIPTS / "sleeper.py"), "--seconds", "3")
    a = Agent(args, tmp_path, "a")
    wait_until(lambda: len(worker_pids(r, job_id)) == 1, 30, "a round of one")
    b = Agent(args, tmp_path, "b")
    assert a.wait(60) == 0 and b.wait(60) == 0, a.output[-2000:] + b.output[-2000:]
    rounds = of_type(r, job_id, EventType.RENDEZVOUS_COMPLETE)
    assert [e.data["world_size"] for e in rounds] == [1, 2]
    assert r.get(JobKeys(job_id).restarts) in (None, b"0")
    assert [e.data["reason"] for e in of_type(r, job_id, EventType.RESTARTING)] == ["membership"]
    started = of_type(r, job_id, EventType.WORKERS_STARTED)
    assert sorted(started[-1].data["ranks"] + started[-2].data["ranks"]) == [0, 1]


def test_resource_samples_are_kept_per_rank(redis_url, r, job_id, tmp_path):
    args = agent_args(redis_url, job_id, "--nproc-per-node", "2", str(SCRIPTS / "sleeper.py"),
                      "--seconds", "2.5")
    agent = Agent(args, tmp_path, "a")
    wait_until(lambda: r.hlen(JobKeys(job_id).resources) == 2, 20, "samples of both ranks")
    samples = {int(k): json.loads(v) for k, v in r.hgetall(JobKeys(job_id).resources).items()}
    assert set(samples) == {0, 1}
    assert all(s["rss"] > 1_000_000 and s["threads"] >= 1 and "cpu" in s
               for s in samples.values())
    assert agent.wait(30) == 0


def test_tee_prefix_and_local_ranks_filter_match_torchrun(tmp_path):
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    flags = ["--standalone", "--nproc-per-node", "2", "--tee", "3", "--local-ranks-filter", "1",
             "--log-dir", str(tmp_path), str(EXAMPLES / "hello.py")]
    ours = subprocess.run([*AGENT, *flags], capture_output=True, text=True, timeout=60)
    theirs = subprocess.run([torchrun, *flags], capture_output=True, text=True, timeout=60)
    assert ours.returncode == theirs.returncode == 0, ours.stderr + theirs.stderr
    assert ours.stdout == theirs.stdout == "[default1]:hello from rank 1 of 2\n"


@pytest.mark.parametrize("flags, expected", [
    (["-m", "platform"], "Linux"),
    (["--no-python", "/bin/echo", "hello", "from", "echo"], "hello from echo"),
])
def test_module_and_no_python_entrypoints(flags, expected, tmp_path):
    p = subprocess.run([*AGENT, "--standalone", "--nproc-per-node", "1", "--log-dir",
                        str(tmp_path), *flags], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert expected in p.stdout
