"""Collectives below the Python stack (issue 22, part 1).

* The analysis (pure): a rank in another process group's collective, a rank one collective
  behind (hung in Python), mismatched sizes at one sequence id, ranks without a trace.
* Hostile records: the trace decoder is total and bounded.
* A real gloo hang (examples/collective_hang.py, 4 ranks on 2 agents): every rank blocks on
  the same ``all_reduce`` line, rank 1 in the pair group's. ``stacks`` shows one group (Python
  cannot tell); ``collectives --json`` names rank 1, answered by workers whose main thread is
  blocked inside a collective; a restart's ``workers_stopped`` events carry the analysis of
  the traces captured before the kill; a stall's ``stalled`` event carries the job-wide one.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator

import pytest
import redis

from elastic_agent.coordination.transport.connection import make_async_client
from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.coordination.wire.collective_replies import read_collective_replies
from elastic_agent.coordination.wire.collectives import RankTrace, analyse, event_record
from elastic_agent.coordination.wire.command_records import Command, encode_command
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.protocol import ProtocolError
from elastic_agent.coordination.wire.trace_records import (
    MAX_TRACE_BYTES,
    CollectiveEntry,
    CollectiveReply,
    CollectiveTrace,
    decode_collective_reply,
    decode_collective_trace,
    encode_collective_reply,
)
from tests.agents import EXAMPLES, Agent, wait_until
from tests.conftest import require
from tests.test_agent import of_type
from tests.test_console_cli import console

HANG = EXAMPLES / "collective_hang.py"


def entry(pg: str, seq: int, done: bool = True, size: int = 8, op: str = "gloo:all_reduce"):
    return CollectiveEntry(pg, seq, op, ((size,),), ((size,),), done)


def trace(rank: int, *entries: CollectiveEntry, groups: dict | None = None) -> RankTrace:
    return RankTrace(rank, "n0", "h0", CollectiveTrace(groups or {}, tuple(entries)))


# -- the analysis ----------------------------------------------------------------------------

def test_a_rank_in_another_groups_collective_is_the_suspect():
    groups = {"0": (0, 1, 2), "1": (1, 2)}
    history = [entry("0", s, size=4) for s in (1, 2, 3)]
    traces = [trace(0, *history, entry("0", 4, done=False), groups=groups),
              trace(1, *history, entry("1", 1, done=False), groups=groups),
              trace(2, *history, entry("0", 4, done=False), groups=groups)]
    a = analyse(traces)
    assert a["suspects"] == [1]
    world, pair = a["groups"]
    assert (world["pg"], world["waiting"], world["waited_for"], world["frontier"]) == (
        "0", [0, 2], [1], 4)
    # rank 2 never entered the pair's collective: a member by the registry, waited for there
    assert (pair["waiting"], pair["waited_for"]) == ([1], [2])
    assert world["positions"][0] == {"seq": 4, "op": "all_reduce", "in": [[8]], "out": [[8]],
                                     "done": False, "ranks": "0,2", "count": 2}
    assert a["mismatches"] == []


def test_a_rank_one_collective_behind_and_not_blocked_is_the_only_suspect():
    groups = {"0": tuple(range(8)), "1": (3, 4, 5, 6, 7)}
    traces = [trace(r, entry("0", 1), entry("0", 2, done=False), groups=groups)
              for r in (0, 2, 3)]
    traces.append(trace(1, entry("0", 1), groups=groups))  # finished #1, hung in Python since
    # ranks 4-7 wait in group 1 for rank 3, which waits in group 0 for rank 1: more ranks
    # wait for rank 3, but rank 1, blocked in no collective, is where the hang starts
    traces += [trace(r, entry("0", 1), entry("1", 1, done=False), groups=groups)
               for r in (4, 5, 6, 7)]
    a = analyse(traces)
    assert a["suspects"] == [1]
    assert [g["waited_for"] for g in a["groups"]] == [[1, 4, 5, 6, 7], [3]]


def test_mismatched_sizes_at_one_sequence_id_and_ranks_without_a_trace():
    traces = [trace(0, entry("0", 1, done=False, size=8)),
              trace(1, entry("0", 1, done=False, size=8)),
              trace(2, entry("0", 1, done=False, size=16)),
              RankTrace(3, "n1", "h1", CollectiveTrace(error="no answer within 2 s"))]
    a = analyse(traces)
    (m,) = a["mismatches"]
    assert (m["pg"], m["seq"]) == ("0", 1)
    assert [(v["in"], v["ranks"]) for v in m["variants"]] == [([[8]], "0-1"), ([[16]], "2")]
    assert a["errors"] == [{"rank": 3, "host": "h1", "error": "no answer within 2 s"}]
    assert (a["ranks"], a["answered"], a["suspects"]) == (4, 3, [])


def test_a_balanced_job_has_no_suspect_and_an_event_record_is_bounded():
    traces = [trace(r, entry("0", 7, done=False)) for r in range(600)]
    assert analyse(traces)["suspects"] == []
    traces[5] = trace(5, entry("0", 6))
    behind = [trace(r, entry("0", 6)) for r in range(300)] + traces[300:]
    rec = event_record(analyse(behind), "stall-x")
    assert rec["suspects"] == list(range(256)) and len(rec["groups"][0]["waiting"]) == 256
    assert len(json.dumps(rec)) < 100_000


# -- hostile records ---------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [
    b"[" * 100_000 + b"]" * 100_000,
    b"x" * (MAX_TRACE_BYTES + 1),
    b'{"entries": [{"pg": "0", "seq": true, "op": "x"}]}',
    b'{"entries": [{"pg": "0", "seq": 1, "op": "x", "in": [[-1]]}]}',
    b'{"groups": []}',
    b'{"error": 5}',
    b"[]",
])
def test_bad_traces_are_refused(raw):
    with pytest.raises(ProtocolError):
        decode_collective_trace(raw)


def test_replies_round_trip_and_hostile_ones_are_dropped():
    big = CollectiveTrace({"0": (0, 1)}, tuple(entry("0", s) for s in range(1, 3000)))
    fields = encode_collective_reply(CollectiveReply("c-1", "n", "h", 3, 42, big))
    assert len(fields["trace"]) <= MAX_TRACE_BYTES
    back = decode_collective_reply("1-0", fields)
    assert back is not None and back.rank == 3 and back.trace.cut
    assert back.trace.entries[-1] == entry("0", 2999)  # the newest are kept
    for bad in ({**fields, "rank": "-1"}, {**fields, "request": "a b"},
                {**fields, "trace": "{" * 70_000}, {**fields, "v": "99"},
                {k: v for k, v in fields.items() if k != "rank"}):
        assert decode_collective_reply("1-0", bad) is None


# -- a real gloo hang over two agents ----------------------------------------------------------

@pytest.fixture(scope="module")
def hung_job(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """examples/collective_hang.py, 4 ranks as 2 agents x 2; every rank blocked on the same
    line, rank 1 in the pair (1, 2)'s all_reduce. Yields the job id."""
    require("torch")
    tmp = tmp_path_factory.mktemp("chang")
    job = f"chang-{os.getpid()}-{int(time.time())}"
    args = ["--redis", redis_url, "--job-id", job, "--local-addr", "127.0.0.1",
            "--nnodes", "2", "--nproc-per-node", "2", "--log-dir", str(tmp / "logs"),
            "--shutdown-timeout", "2", "--stall-timeout", "4",
            "--rdzv-conf=last_call_timeout=1,heartbeat_timeout=5,keep_alive_interval=0.5",
            str(HANG)]
    agents = [Agent(args, tmp, f"a{i}", env={"ODD_RANK": "1"}) for i in range(2)]
    try:
        wait_until(lambda: "".join(a.output for a in agents).count("entering the last") >= 4,
                   120, "every rank at the last all_reduce")
        # The stall (4 s) is reported first: agents answer a burst of 4 requests, then one
        # every 5 s, and this module asks 4 times in all (the stall, the CLI twice, the screen)
        r = redis.Redis.from_url(redis_url)
        wait_until(lambda: of_type(r, job, EventType.STALLED), 60, "a stalled event")
        yield job
    finally:
        for a in agents:
            a.kill()


def test_collectives_json_names_the_rank_python_stacks_cannot(hung_job, redis_url):
    stacks = json.loads(console("stacks", hung_job, "--json", redis_url=redis_url).stdout)
    assert [g["ranks"] for g in stacks["groups"]] == [[0, 1, 2, 3]]  # one Python stack
    p = console("collectives", hung_job, "--json", redis_url=redis_url)
    assert p.returncode == 0, p.stderr
    a = json.loads(p.stdout)
    assert a["suspects"] == [1], a
    assert (a["ranks"], a["answered"]) == (4, 4)  # every rank answered, blocked as it is
    world = next(g for g in a["groups"] if g["size"] == 4)
    assert (world["waiting"], world["waited_for"]) == ([0, 2, 3], [1])
    pair = next(g for g in a["groups"] if g["size"] == 2)
    assert pair["waiting"] == [1]
    blocked = [p for g in a["groups"] for p in g["positions"] if not p["done"]]
    assert sum(p["count"] for p in blocked) == 4  # each rank is inside a collective
    text = console("collectives", hung_job, redis_url=redis_url)
    assert text.returncode == 0, text.stderr
    assert "suspects (the ranks the others wait for): 1 " in text.stdout


def test_the_stacks_screen_shows_the_suspect(hung_job, redis_url):
    from elastic_console.tui.widgets.stacks import StacksScreen
    from tests.test_console_app import console as app_for
    from tests.test_console_app import loaded, on_screen, run, screen_text
    from tests.waiting import wait_until_async

    async def body(pilot, app) -> None:
        await loaded(app, ranks=4)
        await pilot.press("d")
        await on_screen(app, StacksScreen)
        screen = app.screen
        await wait_until_async(lambda: screen.collective_lines, 30, "the collectives")
        assert screen.collective_lines[0].startswith(
            "suspects (the ranks the others wait for): 1 "), screen.collective_lines
        await wait_until_async(lambda: "the others wait for): 1" in screen_text(app), 5,
                               "drawn")

    run(app_for(redis_url, hung_job), body)


def test_the_stall_event_carries_the_analysis(hung_job, redis_url):
    r = redis.Redis.from_url(redis_url)
    (ev,) = wait_until(lambda: of_type(r, hung_job, EventType.STALLED), 60, "a stalled event")
    c = ev.data["collectives"]
    assert c["suspects"] == [1] and c["answered"] == 4, c


def test_a_restart_captures_the_traces_before_the_kill(hung_job, redis_url):
    r = redis.Redis.from_url(redis_url)
    r.xadd(JobKeys(hung_job).commands,
           encode_command(Command("restart-c", "restart", "tester@host", args={})))

    def stopped() -> list:
        return [e for e in of_type(r, hung_job, EventType.WORKERS_STOPPED)
                if e.data.get("reason") == "restart"]
    wait_until(lambda: len(stopped()) == 2, 60, "both agents' workers_stopped")
    (request,) = {e.data["collectives"]["request"] for e in stopped()}
    # each node's event names what its own ranks show; the published traces, job-wide,
    # name rank 1
    assert any(e.data["collectives"]["suspects"] == [1] for e in stopped())

    async def published() -> list:
        client = make_async_client(parse_endpoint(redis_url), blocking_ms=2000)
        try:
            return await read_collective_replies(client, hung_job, request, range(4), 10)
        finally:
            await client.aclose()
    assert analyse(asyncio.run(published()))["suspects"] == [1]


def test_flight_recorder_flag():
    from elastic_agent.supervision.config import UsageError, parse_args
    from elastic_agent.supervision.diagnosis.recorder import DEFAULT_ENTRIES, worker_env

    base = ["--standalone", str(HANG)]
    assert parse_args(base).flight_recorder == DEFAULT_ENTRIES
    assert parse_args(["--flight-recorder", "0", *base]).flight_recorder == 0
    for bad in ("-1", "x", "2000000"):
        with pytest.raises(UsageError):
            parse_args(["--flight-recorder", bad, *base])
    assert worker_env(500, {}) == {"TORCH_FR_BUFFER_SIZE": "500"}
    assert worker_env(500, {"TORCH_FR_BUFFER_SIZE": "9"}) == {}  # the user's wins
    assert worker_env(0, {}) == {}



# -- slow ranks (part 2) -----------------------------------------------------------------------

STRAGGLER = EXAMPLES / "straggler.py"


def straggler_job(redis_url: str, tmp, job: str, slow_rank: int, seconds: float) -> list[Agent]:
    args = ["--redis", redis_url, "--job-id", job, "--local-addr", "127.0.0.1",
            "--nnodes", "2", "--nproc-per-node", "2", "--log-dir", str(tmp / "logs"),
            "--shutdown-timeout", "2", "--straggler-interval", "4",
            "--rdzv-conf=last_call_timeout=1,heartbeat_timeout=5,keep_alive_interval=0.5",
            str(STRAGGLER)]
    env = {"SLOW_RANK": str(slow_rank), "SECONDS": str(seconds), "STEP_S": "0.05"}
    return [Agent(args, tmp, f"s{i}", env=env) for i in range(2)]


def test_a_rank_that_computes_1_6x_longer_is_named(redis_url, r, job_id, tmp_path):
    require("torch")
    agents = straggler_job(redis_url, tmp_path, job_id, 3, 120)
    try:
        ev = wait_until(lambda: of_type(r, job_id, EventType.STRAGGLER), 90,
                        "a straggler event")[0]
        (slow,) = ev.data["ranks"]
        assert slow["rank"] == 3 and slow["host"] and slow["node"], ev.data
        assert 1.3 <= slow["ratio"] <= 2.5, ev.data  # 1.6x, measured on a loaded machine
        assert ev.data["window_s"] == 4
        assert ev.data["threshold"] == 1.3  # the documented threshold, not the imported one
        assert "dropped" not in ev.data  # only the agents wrote the set
        status = console("status", job_id, redis_url=redis_url)
        assert f"stragglers rank 3 on {slow['host']} ({slow['ratio']:g}x slower)" in \
            status.stdout, status.stdout
        got = json.loads(console("status", job_id, "--json", redis_url=redis_url).stdout)
        assert [x["rank"] for x in got["stragglers"]] == [3]
        assert {x["rank"]: x["state"] for x in got["ranks"]}[3] == "slow"
        asyncio.run(_console_shows_the_straggler(redis_url, job_id))
    finally:
        for a in agents:
            a.kill()


def test_a_balanced_job_names_no_straggler(redis_url, r, job_id, tmp_path):
    require("torch")
    agents = straggler_job(redis_url, tmp_path, job_id, -1, 30)
    try:
        codes = [a.wait(150) for a in agents]
        assert codes == [0, 0], [a.output[-2000:] for a in agents]
        assert "step 200" in "".join(a.output for a in agents)  # it ran for a while
        assert of_type(r, job_id, EventType.STRAGGLER) == []
    finally:
        for a in agents:
            a.kill()


async def _console_shows_the_straggler(redis_url: str, job_id: str) -> None:
    from elastic_console.tui.app import ConsoleApp
    from tests.test_stall import screen_text
    from tests.waiting import wait_until_async

    app = ConsoleApp(job_id, endpoint=parse_endpoint(redis_url), cursor_blink=False)
    async with app.run_test(size=(140, 40)):
        await wait_until_async(lambda: app.loaded and any(
            e.kind == "straggler" for e in app.timeline.entries), 20, "the timeline entry")
        entry = next(e for e in app.timeline.entries if e.kind == "straggler")
        assert entry.text.startswith("straggler: rank 3 on "), entry.text
        assert app.view.ranks[3].state == "slow"
        await wait_until_async(lambda: "slow" in screen_text(app), 5, "the rank table")


def test_the_console_state_marks_stragglers_and_survives_hostile_data():
    from elastic_agent.coordination.wire.event_records import decode_event, encode_event
    from elastic_console.job.state import JobView

    v = JobView("job-s")
    seq = iter(range(1, 100))

    def ev(ms: int, etype: str, **data: object) -> None:
        e = decode_event(f"{ms}-0", encode_event(etype, "n-1-x", data, next(seq)))
        assert e is not None
        v.apply_event(e)

    ev(1000, EventType.WORKERS_STARTED, ranks=[0, 1, 2, 3], local_ranks=[0, 1, 2, 3],
       pids=[10, 11, 12, 13], host="h", restart_count=0)
    ev(2000, EventType.STRAGGLER, window_s=15, ranks=[
        {"rank": True, "ratio": 2}, {"rank": 1, "ratio": "x"}, "junk", {"rank": -4, "ratio": 2},
        {"rank": 3, "ratio": 1.6, "host": "h\x1b[2J"}, {"rank": 2, "ratio": 1.41, "node": "m-9-z"}])
    assert v.stragglers == [{"rank": 2, "host": "m", "ratio": 1.41},
                            {"rank": 3, "host": "h\\x1b[2J", "ratio": 1.6}]
    assert [v.ranks[r].state for r in range(4)] == ["running", "running", "slow", "slow"]
    assert v.timeline[-1].kind == "straggler" and "rank 2 on m (1.41x" in v.timeline[-1].text
    ev(3000, EventType.STRAGGLER, window_s=15, ranks=[{"rank": 3, "ratio": 1.5, "host": "h"}])
    assert [v.ranks[r].state for r in range(4)] == ["running", "running", "running", "slow"]
    ev(4000, EventType.STRAGGLER, window_s=15, ranks=[])
    assert v.stragglers == [] and v.ranks[3].state == "running"
    assert v.timeline[-1].text == "no straggler any more"


def test_a_hostile_or_silent_worker_on_the_recorder_socket(tmp_path):
    from elastic_agent.supervision.diagnosis.recorder import to_trace
    from elastic_agent.supervision.launch.probes import NOT_LINKED, RecorderLink
    from tests.waiting import wait_until_async

    async def scenario() -> None:
        link = await RecorderLink.listen(tmp_path / "w.fr")
        try:
            assert await link.ask("trace", 0.2) == NOT_LINKED  # no worker yet
            reader, writer = await asyncio.open_unix_connection(str(tmp_path / "w.fr"))
            await wait_until_async(lambda: link._conn is not None, 5, "the accept")
            answer = asyncio.ensure_future(link.ask("trace", 2))
            assert await reader.readline() == b"trace\n"
            writer.write(b"\x00\x00\x00\x07garbage")
            assert to_trace(await answer).error.startswith("unreadable trace from the worker")
            assert await link.ask("trace", 0.2) == "no answer within 0.2 s"  # silent: dropped
            assert await link.ask("trace", 0.2) == NOT_LINKED
            writer.close()
            reader, writer = await asyncio.open_unix_connection(str(tmp_path / "w.fr"))
            await wait_until_async(lambda: link._conn is not None, 5, "the accept")
            answer = asyncio.ensure_future(link.ask("sample", 2))
            await reader.readline()
            writer.write(b"\xff\xff\xff\xff")  # 4 GiB announced
            assert "at most 65536" in await answer
            writer.close()
        finally:
            link.close()
        assert not (tmp_path / "w.fr").exists()

    asyncio.run(scenario())


def test_straggler_checks_cost_redis_the_same_per_node_at_any_size(private_redis):
    """Counted, never timed (INFO commandstats of a server of the test's own): each node's
    write, and group rank 0's decision, must not grow with the job's size."""
    from elastic_agent.supervision.diagnosis.stragglers import StragglerWatch

    sync = redis.Redis.from_url(private_redis.url)

    def counts() -> tuple[int, int]:
        stats = sync.info("commandstats")
        return (sum(int(v["calls"]) for v in stats.values()),
                int(sync.info("stats")["total_net_output_bytes"]))

    async def job(nodes: int) -> tuple[float, int, int]:
        client = make_async_client(parse_endpoint(private_redis.url))
        watch = StragglerWatch(client, f"scale-{nodes}", 5.0, lambda *a, **k: None)
        watch.world = nodes * 8  # what the agent's own rendezvous says
        try:
            await client.ping()  # the connection's own setup, before counting
            c0, _ = counts()
            for node in range(nodes):  # 8 ranks a node, all alike: nobody is named
                await watch.write(0, {node * 8 + i: 0.5 for i in range(8)})
            c1, b1 = counts()
            await watch.decide(0)
            c2, b2 = counts()
        finally:
            await client.aclose()
        return ((c1 - c0 - 2) / nodes, c2 - c1 - 2, b2 - b1)  # (the two counts: INFO x2)

    small, large = asyncio.run(job(64)), asyncio.run(job(2048))
    assert small[0] == large[0] == 2  # ZADD + PEXPIRE per node and interval
    assert small[1] == large[1] == 3  # ZCARD, the median, the top 16
    assert large[2] <= small[2] * 1.35, (small, large)


def test_the_console_state_names_the_collectives_suspects_of_a_stall():
    from elastic_agent.coordination.wire.event_records import decode_event, encode_event
    from elastic_console.job.state import JobView

    v = JobView("job-s")
    for i, (ms, etype, data) in enumerate([
            (1000, EventType.WORKERS_STARTED, {"ranks": [0, 1, 2], "local_ranks": [0, 1, 2],
                                               "pids": [10, 11, 12], "host": "h",
                                               "restart_count": 0}),
            (5000, EventType.STALLED, {"request": "c-a", "idle_s": 9.0, "policy": "observe",
                                       "round": 0, "odd_ranks": [], "groups": [
                                           {"ranks": [0, 1, 2], "hosts": ["h"],
                                            "summary": "all_reduce ← main"}],
                                       "collectives": {"request": "c-b", "suspects": [1, True]}}),
            (6000, EventType.STALLED, {"request": "c-c", "idle_s": 9.0, "policy": "observe",
                                       "round": 0, "odd_ranks": [], "groups": [],
                                       "collectives": "junk"})], 1):
        e = decode_event(f"{ms}-0", encode_event(etype, "n-1-x", data, i))
        assert e is not None
        v.apply_event(e)
    first, second = list(v.timeline)[-2:]
    assert first.text.endswith("; collectives wait for rank 1"), first.text
    assert "collectives" not in second.text
