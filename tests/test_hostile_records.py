"""Hostile records: whatever is written into a job's keys, no reader dies, every bad record is
skipped and counted, a bad command is refused with its reason, and a valid stop still stops."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import redis

from elastic_agent.coordination.wire.command_records import (
    Command,
    CommandType,
    decode_command,
    encode_command,
)
from elastic_agent.coordination.wire.event_records import (
    MAX_EVENT_DATA_BYTES,
    EventType,
    decode_event,
    encode_event,
)
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.log_records import decode_log_batch
from elastic_agent.coordination.wire.protocol import (
    MAX_JSON_DEPTH,
    ProtocolError,
    decode_counter,
    decode_json,
)
from elastic_agent.coordination.wire.round_records import NodeDescription, RoundInfo
from tests.agents import SCRIPTS, Agent, wait_until
from tests.test_agent import FAST, agent_args, of_type, worker_pids
from tests.test_console_cli import console as _console

DEEP = "[" * 100_000 + "]" * 100_000
DEEP_SMALL = "[" * 5_000 + "]" * 5_000  # under the size bounds: only the nesting is wrong
DEEP_OBJ = '{"a":' * 100 + "1" + "}" * 100  # decodes, but deeper than any record
CONSOLE = [sys.executable, "-m", "elastic_console.cli"]


# -- decoders: total on any input ------------------------------------------------------------

@pytest.mark.parametrize("data", [DEEP, DEEP_SMALL, DEEP_OBJ, "x" * (MAX_EVENT_DATA_BYTES + 1),
                                  "[1]", "nope"], ids=["deep", "deep-small", "deep-obj", "huge",
                                                       "list", "not-json"])
def test_an_event_whose_data_is_hostile_is_skipped(data):
    fields = {"v": "1", "type": EventType.WORKER_EXITED, "node": "n", "seq": "1", "data": data}
    assert decode_event("1-0", fields) is None


@pytest.mark.parametrize("v", ["", "0", "2", "1.0", "-1", "9" * 40, "true"])
def test_records_of_an_unknown_version_are_skipped(v):
    ev = {"v": v, "type": EventType.JOB_SUCCEEDED, "node": "n", "seq": "1", "data": "{}"}
    assert decode_event("1-0", ev) is None
    log = {b"v": v.encode(), b"node": b"n", b"rank": b"0", b"s": b"out", b"lines": b"x"}
    assert decode_log_batch("1-0", log) is None
    assert "version" in decode_command("1-0", {"v": v, "id": "c", "type": "stop"})


def test_well_formed_records_still_decode():
    ev = decode_event("5-0", encode_event(EventType.JOB_SUCCEEDED, "n", {"a": [1, {"b": 2}]}, 3))
    assert ev is not None and ev.data == {"a": [1, {"b": 2}]} and ev.seq == 3
    log = decode_log_batch("5-0", {b"v": b"1", b"node": b"n", b"rank": b"7", b"s": b"err",
                                   b"lines": b"a\nb"})
    assert log is not None and log.rank == 7 and log.lines == ["a", "b"]
    cmd = decode_command("5-0", encode_command(Command("c-1", CommandType.SIGNAL, "me",
                                                       args={"rank": 3, "signal": "SIGKILL"})))
    assert isinstance(cmd, Command) and cmd.args["rank"] == 3


@pytest.mark.parametrize("rank", [b"-1", b"99999999999", b"one", b"", b"1" * 5000])
def test_a_log_entry_with_a_bad_rank_is_skipped(rank):
    assert decode_log_batch("1-0", {b"v": b"1", b"node": b"n", b"rank": rank, b"s": b"out",
                                    b"lines": b"x"}) is None


@pytest.mark.parametrize(("args", "reason"), [
    (DEEP, "bytes"),
    (DEEP_SMALL, "not valid JSON"),
    (DEEP_OBJ, "nested more than"),
    ("x" * 100_000, "bytes"),
    ('{"rank": true}', "non-negative integer"),
    ('{"rank": -1}', "non-negative integer"),
    ('{"rank": 1.0}', "non-negative integer"),
    ('{"rank": 0, "signal": "SIGSTOP"}', "signal must be one of"),
    ("[]", "not an object"),
], ids=["deep", "deep-small", "deep-obj", "huge", "bool", "negative", "float", "sigstop", "list"])
def test_a_hostile_signal_command_is_refused_with_its_reason(args, reason):
    got = decode_command("1-0", {"v": "1", "id": "c-9", "type": "signal", "args": args})
    assert isinstance(got, str) and reason in got
    assert len(got) < 200  # the reason is shown to people: it never quotes the record


def test_command_ids_and_issuers_are_bounded():
    assert "longer than" in decode_command("1-0", {"v": "1", "id": "x" * 129, "type": "stop"})
    assert "longer than" in decode_command("1-0", {"v": "1", "id": "c", "type": "stop",
                                                   "issuer": "x" * 10_000})


@pytest.mark.parametrize("raw", [DEEP, "{}", '{"nodes": []}', '{"nodes": [1]}',
                                 '{"round": true, "world_size": 1, "nodes": [{"node": "a", '
                                 '"addr": "h", "port": 1, "group_rank": 0}]}'],
                         ids=["deep", "empty", "no-nodes", "bad-node", "bool-round"])
def test_rendezvous_records_refuse_junk_with_a_protocol_error(raw):
    with pytest.raises(ProtocolError):
        RoundInfo.decode(raw)
    with pytest.raises(ProtocolError):
        NodeDescription.decode(raw)


@pytest.mark.parametrize("raw", [b"abc", b"-1", b"1" * 40, b""])
def test_a_counter_that_is_not_a_count_is_a_protocol_error(raw):
    with pytest.raises(ProtocolError, match="repair or delete"):
        decode_counter(raw, "k")
    assert decode_counter(None, "k") == 0 and decode_counter(b"4", "k") == 4


# -- a live agent ------------------------------------------------------------------------------

def _ack(r: redis.Redis, job: str, cmd_id: str):
    def find():
        return next((e for e in of_type(r, job, EventType.COMMAND_ACK)
                     if e.data["command_id"] == cmd_id), None)
    wait_until(lambda: find() is not None, 20, f"the ack of {cmd_id}")
    return find()


def test_a_live_agent_survives_hostile_commands_and_a_valid_stop_still_stops(
        redis_url, r, job_id, tmp_path):
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "2", FAST,
                             str(SCRIPTS / "sleeper.py")), tmp_path, "a")
    keys = JobKeys(job_id)
    wait_until(lambda: len(worker_pids(r, job_id)) == 2, 30, "workers")
    first = worker_pids(r, job_id)

    r.xadd(keys.commands, {"v": "1", "id": "deep", "type": "signal", "args": DEEP_SMALL})
    r.xadd(keys.commands, {"v": "1", "id": "bool", "type": "signal",
                           "args": json.dumps({"rank": True, "signal": "SIGTERM"})})
    r.xadd(keys.commands, {"v": "1", "id": "high", "type": "signal",
                           "args": json.dumps({"rank": 99, "signal": "SIGKILL"})})
    r.xadd(keys.commands, {"v": "1", "id": "neg", "type": "signal",
                           "args": json.dumps({"rank": -1, "signal": "SIGKILL"})})
    r.xadd(keys.commands, {"v": "7", "id": "future", "type": "stop"})
    r.xadd(keys.commands, {"v": "1", "type": "stop"})  # no id: ignored, acked under "?"
    r.xadd(keys.events, {"v": "1", "type": EventType.WORKER_EXITED, "node": "evil", "seq": "1",
                         "data": DEEP})
    for cid, why in (("deep", "JSON"), ("bool", "non-negative integer"),
                     ("high", "not in the job (world size 2)"),
                     ("neg", "non-negative integer"), ("future", "version")):
        ack = _ack(r, job_id, cid)
        assert ack.data["status"] == "rejected" and why in ack.data["reason"], ack.data
    # Nothing was sent to a worker and no restart was spent.
    assert worker_pids(r, job_id) == first and r.get(keys.restarts) is None

    # The command stream replaced by a string silences nothing for good.
    r.delete(keys.commands)
    r.set(keys.commands, "not a stream")
    # A read already blocked on the old stream ends only at its BLOCK timeout (5 s) on 7.0.
    wait_until(lambda: "cannot be read" in agent.output, 20, "the agent's warning")
    r.delete(keys.commands)
    r.xadd(keys.commands, encode_command(Command("stop-1", CommandType.STOP,
                                                 "\x1b]0;PWNED\x07\x1b[2J mallory")))
    assert agent.wait(30) == 143, agent.output[-3000:]
    assert _ack(r, job_id, "stop-1").data["status"] == "accepted"
    out = agent.output
    assert "\x1b" not in out and "\x07" not in out
    assert "stopped by \\x1b]0;PWNED\\x07\\x1b[2J mallory" in out
    assert "Traceback" not in out


def test_only_a_member_of_the_round_can_be_the_root_cause(redis_url, r, job_id, tmp_path):
    keys = JobKeys(job_id)
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "2", "--max-restarts", "0",
                             FAST, str(SCRIPTS / "sleeper.py"), "--fail-rank", "1",
                             "--fail-after", "2"), tmp_path, "a")
    wait_until(lambda: len(worker_pids(r, job_id)) == 2, 30, "workers")
    rnd = of_type(r, job_id, EventType.WORKERS_STARTED)[0].data["round"]
    # Written before the real failure, so it is the earliest: a forged root cause.
    forged = {"rank": 0, "exit_code": 9, "round": rnd, "host": "\x1b[31mforged-host",
              "message": "forged failure"}
    r.xadd(keys.events, encode_event(EventType.WORKER_EXITED, "intruder-1-2", forged, 1))
    r.xadd(keys.events, {"v": "1", "type": EventType.WORKER_EXITED, "node": "x", "seq": "2",
                         "data": DEEP})
    assert agent.wait(60) == 1
    out = agent.output
    assert "forged" not in out, out[-3000:]
    assert "rank      : 1 (local_rank: 1)" in out
    failed = of_type(r, job_id, EventType.JOB_FAILED)
    assert failed and failed[0].data["root_cause"]["rank"] == 1


# -- the CLI and the console against a job full of junk ----------------------------------------



def _junk_job(r: redis.Redis, job: str) -> None:
    """A finished job whose streams hold one good record of each kind among hostile ones."""
    keys = JobKeys(job)
    r.zadd("elastic:jobs", {job: 1})
    r.zadd("elastic:jobs", {"not a {valid} id": 2})
    r.hset(keys.meta, mapping={"min_nodes": "1", "max_nodes": "x", "created_ms": "[]"})
    r.xadd(keys.events, encode_event(EventType.NODE_JOINED, "n1", {"host": "h\x1b[2J", "round": 0}, 1))
    for data in (DEEP, DEEP_OBJ, "[]"):
        r.xadd(keys.events, {"v": "1", "type": EventType.GROUP_FAILED, "node": "n1", "seq": "2",
                             "data": data})
    r.xadd(keys.events, {"v": "99", "type": EventType.JOB_SUCCEEDED, "node": "n1", "data": "{}"})
    r.xadd(keys.events, encode_event(EventType.WORKER_EXITED, "n1", {
        "rank": True, "exit_code": "\x1b]0;PWNED\x07", "round": [DEEP[:50]]}, 3))
    r.xadd(keys.events, encode_event(EventType.JOB_SUCCEEDED, "n1", {}, 4))
    good = keys.logs("n1")
    r.xadd(good, {"v": "1", "node": "n1", "rank": "0", "s": "out",
                  "lines": "hello \x1b[31mred\x1b]0;PWNED\x07"})
    r.xadd(good, {"v": "1", "node": "n1", "rank": "true", "s": "out", "lines": "bad rank"})
    r.set(keys.logs("n2"), "a string where a stream should be")
    r.set("foreign-key", "x")
    r.sadd(keys.log_streams, good, keys.logs("n2"), "foreign-key")


def test_every_subcommand_reads_a_job_full_of_junk(redis_url, r, job_id):
    _junk_job(r, job_id)
    for args in (["ls"], ["status", job_id], ["status", job_id, "--json"], ["events", job_id],
                 ["events", job_id, "--json"], ["logs", job_id]):
        p = _console(*args, "--redis", redis_url)
        assert p.returncode == 0, (args, p.stderr)
        assert "Traceback" not in p.stderr and "WRONGTYPE" not in p.stderr, (args, p.stderr)
        assert "\x1b" not in p.stdout and "\x07" not in p.stdout, (args, p.stdout)
    ls = _console("ls", "--redis", redis_url).stdout
    assert any(job_id in line and "succeeded" in line for line in ls.splitlines()), ls
    status = _console("status", job_id, "--redis", redis_url).stdout
    assert "succeeded" in status and "skipped   " in status, status
    logs = _console("logs", job_id, "--redis", redis_url).stdout
    assert "[rank 0] hello red\\x1b]0;PWNED\\x07" in logs, logs
    assert "bad rank" not in logs


def test_the_console_reader_survives_junk_and_shows_the_count(redis_url, r, job_id):
    import asyncio

    from elastic_agent.coordination.transport.endpoints import parse_endpoint
    from elastic_console.tui.app import ConsoleApp

    _junk_job(r, job_id)

    async def run() -> None:
        app = ConsoleApp(job_id, endpoint=parse_endpoint(redis_url))
        async with app.run_test(size=(160, 48)) as pilot:
            async def until(cond, what: str) -> None:
                for _ in range(300):
                    if cond():
                        return
                    await pilot.pause(0.05)
                raise AssertionError(f"timed out waiting for {what}")

            await until(lambda: app.loaded, "the history")
            assert app.view.state == "succeeded"
            await until(lambda: app.view.skipped >= 5, "the skipped count")
            await until(lambda: "unreadable record" in (app.header._shown or ""),
                        "the count in the header")
            # New junk and a new good line after the attach: the reader goes on.
            keys = JobKeys(job_id)
            r.xadd(keys.events, {"v": "1", "type": EventType.NODE_LOST, "node": "n1",
                                 "seq": "9", "data": DEEP})
            r.xadd(keys.logs("n1"), {"v": "1", "node": "n1", "rank": "0", "s": "out",
                                     "lines": "after the junk"})
            await until(lambda: any("after the junk" in line[3]
                                    for line in app.view.tail(50)), "the new line")
            assert not app.reader_error

    asyncio.run(run())


@pytest.mark.parametrize("job", ["job\n", "a b", "j{x}", "", "-j", "x" * 129, "j:1"])
def test_a_job_id_that_could_break_the_key_layout_is_refused(job):
    from elastic_agent.coordination.wire.keyspace import InvalidJobIdError, validate_job_id

    with pytest.raises(InvalidJobIdError):
        validate_job_id(job)


def test_the_agents_closing_summary_escapes_the_root_cause(redis_url, r, job_id, tmp_path):
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "1", "--max-restarts", "0",
                             FAST, str(SCRIPTS / "hostile_crash.py")), tmp_path, "a")
    assert agent.wait(60) == 1
    out = agent.output
    assert "FAILED" in out and "Root Cause" in out, out[-3000:]
    summary = out[out.index("Root Cause"):]
    assert "\x1b" not in summary and "\x07" not in summary, summary
    assert "\\x1b]0;PWNED\\x07" in summary


def test_the_cli_keeps_colours_on_a_terminal_and_resets_them_at_each_line_end(redis_url, r, job_id):
    import pty

    _junk_job(r, job_id)
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_REDIS_URL"}
    controller, terminal = pty.openpty()
    with subprocess.Popen([*CONSOLE, "logs", job_id, "--redis", redis_url], stdout=terminal,
                          stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env) as proc:
        os.close(terminal)
        chunks = []
        while True:
            try:
                data = os.read(controller, 65536)
            except OSError:  # EIO: the other side closed
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(30) == 0
    os.close(controller)
    lines = b"".join(chunks).decode().splitlines()
    (line,) = [x for x in lines if "hello" in x]
    assert line == "[rank 0] hello \x1b[31mred\\x1b]0;PWNED\\x07\x1b[0m", repr(line)


@pytest.mark.parametrize("raw", [str, str.encode])
def test_json_is_refused_one_level_past_the_depth_bound_whatever_its_brackets(raw):
    """decode_json skips its walk for text with at most MAX_JSON_DEPTH brackets (each level
    needs one): brackets inside strings cost a walk, never a wrong answer."""
    deep = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert decode_json(raw(deep), "x", 1000) == json.loads(deep)
    quoted = '{"s": "' + "[" * 40 + '", "t": ' + deep + "}"  # 33 levels, 73 brackets
    with pytest.raises(ProtocolError, match="nested more than"):
        decode_json(raw(quoted), "x", 1000)
    flat = '{"s": "' + "{" * 40 + '"}'
    assert decode_json(raw(flat), "x", 1000) == {"s": "{" * 40}
