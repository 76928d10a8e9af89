"""Issue 24, findings 3, 4, 6 and 7: what one writer of a job's keys can make a reader or an
agent spend. A malformed command is acked, never a reader restart; stacks requests are
limited on both sides and never sent by a read-only console; the console's fold keeps a
bounded number of ranks and nodes whatever the events say; every stream read is paged."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_agent.coordination.wire.command_records import (
    Command,
    CommandType,
    decode_command,
    encode_command,
)
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.protocol import is_rank
from elastic_agent.supervision import loops
from elastic_agent.supervision.records.commands import STACKS_BURST, RateLimit
from tests.agents import Agent
from tests.test_agent import of_type
from tests.waiting import wait_until, wait_until_async

# -- finding 6: a malformed signal command --------------------------------------------------------


@pytest.mark.parametrize("sig", [[], {}, ["SIGTERM"], 9, None, True],
                         ids=["list", "object", "list-of-name", "number", "null", "bool"])
def test_a_signal_that_is_not_a_name_is_refused_not_raised(sig):
    got = decode_command("1-0", {"v": "1", "id": "c-1", "type": "signal",
                                 "args": json.dumps({"rank": 0, "signal": sig})})
    assert isinstance(got, str) and "signal must be one of" in got


def _valid_commands() -> st.SearchStrategy[dict[str, str]]:
    rank = st.integers(0, 1 << 20)
    args = st.one_of(
        st.tuples(st.just(CommandType.STOP), st.just({})),
        st.tuples(st.just(CommandType.RESTART), st.just({})),
        st.tuples(st.just(CommandType.SIGNAL), st.fixed_dictionaries(
            {"rank": rank, "signal": st.sampled_from(sorted(CommandType.SIGNALS))})),
        st.tuples(st.just(CommandType.STACKS), st.just({}) | st.fixed_dictionaries({"rank": rank})),
        st.tuples(st.just(CommandType.COLLECTIVES),
                  st.just({}) | st.fixed_dictionaries({"rank": rank})),
    )
    return args.map(lambda ta: encode_command(Command(f"c-{ta[0]}-1", ta[0], "me@host",
                                                      args=ta[1])))


json_junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8)


@st.composite
def mutated_commands(draw: st.DrawFn) -> tuple[dict[str, str], str]:
    """A valid command, then one mutation: an args value replaced by any JSON value, an args
    key added, a field replaced by junk, or the command left valid (the control)."""
    fields = dict(draw(_valid_commands()))
    how = draw(st.sampled_from(["args-value", "args-key", "field", "none"]))
    args = json.loads(fields["args"])
    if how == "args-value" and args:
        args[draw(st.sampled_from(sorted(args)))] = draw(json_junk)
    elif how == "args-key":
        args[draw(st.sampled_from(["rank", "signal", "x"]))] = draw(json_junk)
    elif how == "field":
        name = draw(st.sampled_from(["v", "id", "type", "issuer", "target", "args"]))
        fields[name] = draw(st.text(max_size=20) | json_junk.map(json.dumps))
    if how != "field":
        fields["args"] = json.dumps(args)
    return fields, how


def test_the_command_decoder_is_total_on_mutated_valid_commands():
    """Fuzz: valid records, then mutated. Counts prove the interesting branches are reached."""
    seen: Counter[str] = Counter()

    @settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
    @given(mutated_commands())
    def check(case: tuple[dict[str, str], str]) -> None:
        fields, how = case
        for f in (fields, {k.encode(): v.encode() for k, v in fields.items()}):
            got = decode_command("1-0", f)  # raising here is the bug this test looks for
            assert isinstance(got, (str, Command))
        if isinstance(got, str):
            seen["refused " + how] += 1
            return
        seen["decoded " + got.type] += 1
        if got.type == CommandType.SIGNAL:
            assert is_rank(got.args["rank"])
            assert type(got.args.get("signal", "SIGTERM")) is str
            assert got.args.get("signal", "SIGTERM") in CommandType.SIGNALS
        if got.type == CommandType.STACKS and got.args.get("rank") is not None:
            assert is_rank(got.args["rank"])

    check()
    print("decode_command on mutated valid commands:", dict(sorted(seen.items())))
    # Every kind of command decodes, and each kind of mutation is refused, often enough.
    for kind in CommandType.ALL:
        assert seen["decoded " + kind] >= 20, seen
    for how in ("args-value", "args-key", "field"):
        assert seen["refused " + how] >= 20, seen


# -- finding 6: the reader's back-off ------------------------------------------------------------


def test_keep_running_backs_off_only_while_nothing_gets_done(monkeypatch):
    """Failures without progress double the wait; one good pass starts it again from the
    first delay (before: 5 s after each later failure, for the agent's whole life)."""
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(loops.asyncio, "sleep", sleep)
    done = [0]
    # Four failures with nothing done, then good passes, each followed by a failure.
    plan = iter([False, False, False, False, True, True, True])

    async def loop() -> None:
        step = next(plan, None)
        if step is None:
            return
        if step:
            done[0] += 1
        raise TypeError("unhashable type: 'list'")

    asyncio.run(asyncio.wait_for(loops.keep_running(
        "command reader", loop, lambda _: None, first_delay=0.1, max_delay=0.8,
        progress=lambda: done[0]), 10))
    assert waits == [0.1, 0.2, 0.4, 0.8, 0.1, 0.1, 0.1]


def test_the_rate_limit_allows_a_burst_then_one_per_interval():
    now = [0.0]
    limit = RateLimit(3, 5.0, clock=lambda: now[0])
    assert [limit.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limit.take() == pytest.approx(5.0)
    now[0] = 4.0
    assert limit.take() == pytest.approx(1.0)
    now[0] = 5.0
    assert limit.take() == 0.0 and limit.take() > 0
    now[0] = 1000.0  # idle for long: the burst again, never more
    assert [limit.take() == 0.0 for _ in range(4)] == [True, True, True, False]


# -- a live agent --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Agent]]:
    """One running job of 2 sleeper workers."""
    from tests.test_console_app import sleeper_job, stop_agent
    job_id = f"bounds-{uuid.uuid4().hex[:8]}"
    agent = sleeper_job(redis_url, job_id, tmp_path_factory.mktemp("bounds"))
    yield job_id, agent
    stop_agent(agent)


def _acks(r: redis.Redis, job: str) -> dict[str, dict[str, Any]]:
    return {e.data["command_id"]: e.data for e in of_type(r, job, EventType.COMMAND_ACK)}


def test_bad_signal_commands_are_acked_and_do_not_restart_the_reader(live, r):
    job_id, agent = live
    keys = JobKeys(job_id)
    for i in range(6):
        r.xadd(keys.commands, {"v": "1", "id": f"bad-{i}", "type": "signal",
                               "args": json.dumps({"rank": 0, "signal": [] if i % 2 else {}})})
    r.xadd(keys.commands, encode_command(Command("good-1", CommandType.SIGNAL, "t@h",
                                                 args={"rank": 7, "signal": "SIGTERM"})))
    wait_until(lambda: "good-1" in _acks(r, job_id), 30, "the good command's ack")
    acks = _acks(r, job_id)
    for i in range(6):
        assert acks[f"bad-{i}"]["status"] == "rejected", acks.get(f"bad-{i}")
        assert "signal must be one of" in acks[f"bad-{i}"]["reason"]
    assert "not in the job (world size 2)" in acks["good-1"]["reason"]
    assert "command reader failed" not in agent.output


def test_an_agent_answers_a_burst_of_stacks_requests_then_refuses(live, r):
    job_id, _ = live
    keys = JobKeys(job_id)
    ids = [f"flood-{uuid.uuid4().hex[:6]}-{i}" for i in range(12)]
    for cid in ids:
        r.xadd(keys.commands, encode_command(Command(cid, CommandType.STACKS, "t@h")))
    wait_until(lambda: set(ids) <= _acks(r, job_id).keys(), 30, "every stacks request's ack")
    acks = _acks(r, job_id)
    done = [c for c in ids if acks[c]["status"] == "done"]
    refused = [c for c in ids if acks[c]["status"] == "rejected"]
    assert 1 <= len(done) <= STACKS_BURST and len(done) + len(refused) == len(ids), acks
    assert all("too many stacks requests" in acks[c]["reason"] for c in refused)
    published = {f[b"request"].decode() for _, f in r.xrange(keys.stacks)}
    assert not published & set(refused)  # nothing signalled or published for them


def test_a_read_only_console_sends_no_stacks_request(live, redis_url, r):
    from elastic_console.tui.widgets.stacks import StacksScreen
    from tests.test_console_app import commands_sent, console, loaded, run
    job_id, _ = live
    before = commands_sent(r, job_id)
    app = console(redis_url, job_id, read_only=True)

    async def body(pilot: Any, app: Any) -> None:
        await loaded(app, ranks=2)
        await pilot.press("d")
        await pilot.pause()
        assert not isinstance(app.screen, StacksScreen)
        message, severity = app.notes[-1]
        assert message.startswith("read-only (--read-only)") and severity == "warning"

    run(app, body)
    assert commands_sent(r, job_id) == before


def test_a_console_asks_at_most_once_per_interval(live, redis_url, r, monkeypatch):
    from elastic_console.job import stack_view
    from elastic_console.tui.widgets.stacks import StacksScreen
    from tests.test_console_app import commands_sent, console, loaded, on_screen, run
    job_id, _ = live
    monkeypatch.setattr(stack_view, "ASK_INTERVAL_S", 600.0)  # the test's own pace cannot race it
    before = commands_sent(r, job_id)
    app = console(redis_url, job_id)
    requests: list[str] = []

    async def body(pilot: Any, app: Any) -> None:
        await loaded(app, ranks=2)
        for _ in range(2):
            await pilot.press("d")
            await on_screen(app, StacksScreen)
            screen = app.screen
            await wait_until_async(lambda s=screen: s.result is not None or s.error, 30,
                                   "the stacks")
            assert screen.result is not None, screen.error
            requests.append(screen.result.request)
            await pilot.press("escape")
            await on_screen(app, StacksScreen, shown=False)

    run(app, body)
    assert requests[0] == requests[1]  # the second press showed the first answer again
    assert commands_sent(r, job_id) == before + 2  # one stacks, one collectives (issue 22)


# -- finding 7: the agent reads the event stream a page at a time ---------------------------------


def _peak_rss_kib(pid: int) -> int:
    """VmHWM: the process's peak resident set so far (kernel-kept, no sampling to miss)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


FORGED_EVENTS = 300
FORGED_BYTES = 900 * 1024


def test_big_forged_events_leave_the_agents_memory_bounded_and_its_root_cause_right(
        redis_url, r, job_id, tmp_path):
    from elastic_agent.coordination.wire.event_records import encode_event
    from tests.agents import SCRIPTS
    from tests.test_agent import FAST, agent_args, worker_pids
    keys = JobKeys(job_id)
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "2", "--max-restarts", "1",
                             FAST, str(SCRIPTS / "sleeper.py"), "--fail-rank", "1",
                             "--fail-after", "10"), tmp_path, "a")
    try:
        wait_until(lambda: len(worker_pids(r, job_id)) == 2, 60, "workers")
        rnd = of_type(r, job_id, EventType.WORKERS_STARTED)[0].data["round"]
        before = _peak_rss_kib(agent.pid)
        # Failures of this round, by a node that is not in it, each ~900 KiB: all earlier than
        # the real failure, so the agent reads past every one of them to find it.
        big = "x" * FORGED_BYTES
        pipe = r.pipeline(transaction=False)
        for i in range(FORGED_EVENTS):
            pipe.xadd(keys.events, encode_event(EventType.WORKER_EXITED, "intruder-1-2", {
                "rank": 0, "exit_code": 9, "round": rnd, "message": big}, i + 1))
        forged_ids = pipe.execute()
        wait_until(lambda: of_type(r, job_id, EventType.GROUP_FAILED), 60, "the failure")
        (failed,) = of_type(r, job_id, EventType.GROUP_FAILED)
        assert failed.data["root_cause"]["rank"] == 1, failed.data["root_cause"]
        assert failed.data["root_cause"]["node"] != "intruder-1-2"
        real_exit = next(e for e in of_type(r, job_id, EventType.WORKER_EXITED)
                         if e.node != "intruder-1-2" and e.data.get("exit_code") == 3)
        assert _id(forged_ids[-1].decode()) < _id(real_exit.id), \
            "the forged events must come before the real failure for this test to mean anything"
        grown_mib = (_peak_rss_kib(agent.pid) - before) / 1024
        print(f"agent peak RSS {before / 1024:.0f} MiB -> +{grown_mib:.0f} MiB after "
              f"{FORGED_EVENTS} forged events of {FORGED_BYTES // 1024} KiB")
        # Before paging: +275 MiB (every forged event held at once). A page is at most
        # 32 entries (~29 MiB here); the ceiling leaves room for the decoder's copies.
        assert grown_mib < 100, f"the agent's peak RSS grew {grown_mib:.0f} MiB"
    finally:
        agent.kill()
        agent.wait(30)
        r.delete(keys.events)  # 270 MB: not for the other tests' readers of this server


def test_pages_read_every_entry_once_in_order(r, job_id):
    from elastic_agent.supervision.records import pages
    key = JobKeys(job_id).events
    ids = [r.xadd(key, {"i": str(i)}).decode() for i in range(100)]

    async def read() -> tuple[list[str], list[str], list[str]]:
        import redis.asyncio as aioredis
        client = aioredis.Redis(connection_pool=aioredis.ConnectionPool(
            **r.connection_pool.connection_kwargs))
        try:
            every = [e[0].decode() async for e in pages.forward(client, key, "-", page=7)]
            some = [e[0].decode() async for e in pages.forward(client, key, ids[50], page=7,
                                                                limit=10)]
            newest = [e[0].decode() async for e in pages.backward(client, key, page=7,
                                                                   limit=15)]
            return every, some, newest
        finally:
            await client.aclose()

    every, some, newest = asyncio.run(read())
    assert every == ids and some == ids[50:60] and newest == ids[::-1][:15]


# -- finding 3: the console's fold keeps a bounded number of ranks --------------------------------

RANKS_PER_EVENT = 140_000  # under 1 MiB of JSON each, as in the report


def _forge_job(r: redis.Redis, job: str, *, world: int | None) -> None:
    """A running job whose event stream holds three forged ``workers_started`` events of 140k
    ranks each (different ranks in each), after a real-looking round of ``world`` ranks."""
    from elastic_agent.coordination.wire.event_records import encode_event
    keys = JobKeys(job)
    r.zadd("elastic:jobs", {job: 1})
    r.hset(keys.meta, mapping={"min_nodes": 1, "max_nodes": 1, "max_restarts": 0,
                               "created_ms": 1})
    seq = 0
    if world is not None:
        seq += 1
        r.xadd(keys.events, encode_event(EventType.RENDEZVOUS_COMPLETE, "n-1-a", {
            "round": 1, "world_size": world,
            "nodes": [{"node": "n-1-a", "host": "h", "group_rank": 0, "nproc": world}]}, seq))
    for k in range(3):
        ranks = list(range(k * RANKS_PER_EVENT, (k + 1) * RANKS_PER_EVENT))
        fields = encode_event(EventType.WORKERS_STARTED, "evil-1-a",
                              {"ranks": ranks, "restart_count": 0}, seq + k + 1)
        assert len(fields["data"]) < 1024 * 1024 and "truncated" not in fields["data"]
        r.xadd(keys.events, fields)


def _run_measured(*args: str, redis_url: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """The CLI in a child that reports its own peak RSS (KiB) on its last stderr line: VmHWM,
    which starts afresh at exec (ru_maxrss would keep the forking test process's peak)."""
    code = ("import atexit, sys\n"
            "def peak():\n"
            "    with open('/proc/self/status') as f:\n"
            "        kib = next(l.split()[1] for l in f if l.startswith('VmHWM:'))\n"
            "    print('maxrss', kib, file=sys.stderr, flush=True)\n"
            "atexit.register(peak)\n"
            "from elastic_console.cli import main\n"
            f"sys.exit(main({list(args)!r}))\n")
    env = {**os.environ, "ELASTIC_REDIS_URL": redis_url}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env)
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("maxrss "), p.stderr[-2000:]
    return p, int(last.split()[1])


@pytest.mark.parametrize("world", [4, None], ids=["world-known", "world-unknown"])
def test_forged_rank_lists_leave_status_and_ls_bounded(redis_url, r, job_id, world):
    from elastic_agent.coordination.transport.endpoints import parse_endpoint
    from elastic_console.job.client import JobClient
    from elastic_console.job.model import MAX_VIEW_RANKS
    _forge_job(r, job_id, world=world)
    bound = world if world is not None else MAX_VIEW_RANKS

    async def fold() -> int:  # the same fold status runs: count the rank entries it keeps
        from elastic_console.commands.common import _load_view
        client = JobClient(parse_endpoint(redis_url), job_id)
        try:
            return len((await _load_view(client, resources=True)).ranks)
        finally:
            await client.close()

    assert asyncio.run(fold()) == bound
    status, status_kib = _run_measured("status", job_id, "--json", redis_url=redis_url)
    assert status.returncode == 0, status.stderr[-2000:]
    shown = json.loads(status.stdout)
    assert len(shown["ranks"]) == bound
    assert all(0 <= x["rank"] < bound for x in shown["ranks"])
    ls, ls_kib = _run_measured("ls", "--json", redis_url=redis_url)
    assert ls.returncode == 0, ls.stderr[-2000:]
    assert any(j["job"] == job_id for j in json.loads(ls.stdout))
    print(f"world {world}: status peak RSS {status_kib // 1024} MiB, ls {ls_kib // 1024} MiB")
    # Before: 899 MB for status. The ceiling is a bound (32,768 rank entries cost ~55 MiB),
    # not a speed or size goal.
    assert status_kib < 400 * 1024 and ls_kib < 400 * 1024


def _ev(t: str, data: dict[str, Any], seq: int, node: str = "evil-1-a") -> Any:
    from elastic_agent.coordination.wire.event_records import Event
    return Event(t, node, data, f"{1000 + seq}-0", seq=seq)


def test_every_list_and_text_of_an_event_is_bounded_in_the_fold():
    """The other records that could make the view grow: nodes, log rings, resource samples,
    acks, timeline text, and the fingerprints of events without a sequence number."""
    from elastic_agent.coordination.wire.log_records import LogBatch
    from elastic_console.job.model import MAX_DETAIL_CHARS, MAX_NOTE_CHARS, MAX_VIEW_NODES, MAX_VIEW_RANKS
    from elastic_console.job.state import JobView
    view = JobView("j")
    nodes = [{"node": f"n{i}", "host": "h" * 5000, "group_rank": i} for i in range(20_000)]
    view.apply_event(_ev(EventType.RENDEZVOUS_COMPLETE, {"round": 1, "world_size": 1 << 40,
                                                         "nodes": nodes}, 1))
    assert len(view.nodes) == MAX_VIEW_NODES and view.world_size is None
    assert max(len(n.host) for n in view.nodes.values()) <= 256
    for rank in range(MAX_VIEW_RANKS + 500):
        view.apply_logs(LogBatch("n0", rank, 0, 0, "out", 1, ["x"], f"{rank + 1}-0"))
    view.apply_resources({str(r): {"cpu": 1.0} for r in range(MAX_VIEW_RANKS, MAX_VIEW_RANKS + 50)})
    assert len(view.logs) == MAX_VIEW_RANKS and len(view.ranks) == MAX_VIEW_RANKS
    for i in range(MAX_VIEW_NODES + 100):
        view.apply_event(_ev(EventType.COMMAND_ACK, {"command_id": "c", "status": "done",
                                                     "reason": "r" * 100_000}, 10 + i, f"n-{i}"))
    assert len(view.acks_for("c")) == MAX_VIEW_NODES
    assert max(len(a[2]) for a in view.acks_for("c")) < MAX_NOTE_CHARS + 100
    view.apply_event(_ev(EventType.WORKER_EXITED, {
        "rank": 0, "exit_code": 1, "message": "m" * 500_000,
        "error_file": {"message": {"extraInfo": {"py_callstack": "t" * 900_000 + "\nValueError"}}}},
        20_000))
    entry = view.timeline[-1]
    assert len(entry.text) < MAX_NOTE_CHARS + 200 and len(entry.detail) < MAX_DETAIL_CHARS + 200
    assert entry.detail.endswith("ValueError")  # a traceback keeps its last line
    # Events without seq are remembered by a digest, not by their (up to 1 MiB) data.
    for i in range(600):
        view.apply_event(_ev(EventType.NODE_LEFT, {"reason": "z" * 100_000, "i": i}, 0))
    assert max(len(k[2]) for k in view._recent_events) <= 64


def test_a_console_reads_big_forged_events_a_page_at_a_time_within_a_budget(redis_url, r,
                                                                            job_id):
    """History: the newest events are kept until their data passes the budget; the rest are
    left out and counted, and the follow cursor is still the newest entry."""
    from elastic_agent.coordination.transport.endpoints import parse_endpoint
    from elastic_agent.coordination.wire.event_records import encode_event
    from elastic_console.job import client as client_module
    from elastic_console.job.client import JobClient
    keys = JobKeys(job_id)
    r.hset(keys.meta, "created_ms", 1)
    big = "x" * (900 * 1024)
    pipe = r.pipeline(transaction=False)
    for i in range(80):
        pipe.xadd(keys.events, encode_event(EventType.NODE_LEFT, "evil-1-a",
                                            {"reason": big, "i": i}, i + 1))
    ids = [x.decode() for x in pipe.execute()]

    async def read() -> tuple[list[Any], int, str]:
        c = JobClient(parse_endpoint(redis_url), job_id)
        try:
            events, _ = await c.history(max_events=10_000, max_log_entries_per_stream=0)
            return events, c.skipped, c._last_ids[keys.events]
        finally:
            await c.close()

    try:
        events, skipped, cursor = asyncio.run(read())
    finally:
        r.delete(keys.events)  # 72 MB: not for the other tests' readers of this server
    per_budget = client_module.HISTORY_EVENT_BYTES // len(big)
    assert per_budget <= len(events) <= per_budget + client_module.EVENTS_PAGE
    assert [e.data["i"] for e in events] == list(range(80 - len(events), 80))  # the newest
    assert skipped >= 1 and cursor == ids[-1]
