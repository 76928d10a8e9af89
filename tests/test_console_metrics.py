"""Training metrics in the console: the fold (console/job/metrics.py), the client that reads
them, the rank table's STEP columns, the header's progress, the metrics view, `metrics` and
`status --json`.

Records are written as an agent writes them (the wire's encoders, the real keys): the events,
the resource samples with their latest fields, the metrics stream, the history hash. Stream ids
are explicit (fixed server times) so that the snapshots are the same on every run. Hostile
records (a flood of names, numbers of any size, a foreign history) are bounded and counted.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
import sys
import time
import tracemalloc
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.coordination.wire.event_records import EventType, decode_event, encode_event
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.metric_records import MAX_NAMES as WIRE_NAMES
from elastic_agent.coordination.wire.metric_records import (
    MetricsEntry,
    decode_metrics_entry,
    encode_metrics_entry,
)
from elastic_agent.coordination.wire.metric_series import Series
from elastic_console.job.client import JobClient
from elastic_console.job.follow import METRICS_SLICE
from elastic_console.job.metrics import (
    MAX_CHOSEN,
    MAX_CURVE_METRICS,
    MAX_LATEST_RANKS,
    MAX_NAMES,
    MAX_PENDING_STEPS,
    JobMetrics,
)
from elastic_console.job.model import RankState
from elastic_console.job.state import JobView, Skipped
from elastic_console.tui.widgets import rank_rows
from elastic_console.tui.widgets.metric_chart import MetricChart
from elastic_console.tui.widgets.metrics_screen import MetricsScreen, RankPrompt
from tests.test_console_app import App, on_screen, run, screen_text
from tests.waiting import wait_until_async

T0 = 1_700_000_000_000
CONSOLE = [sys.executable, "-m", "elastic_console.cli"]
PREFIX = "elastic-console: error: "
NODES = {"a-1-x": ("gpu-a", [0, 1]), "b-2-y": ("gpu-b", [2, 3])}


# -- records as an agent writes them --------------------------------------------------------------


def loss(step: int, rank: int, attempt: int = 0) -> float:
    """The loss a rank prints at a step (a resumed attempt prints the same, a hair lower)."""
    return round(2.0 * math.exp(-step / 30) + 0.02 * rank - 0.001 * attempt, 4)


def entry(node: str, attempt: int, ranks: dict[int, list[tuple[int, int, dict[str, float]]]],
          ms: int) -> MetricsEntry:
    """A decoded metrics entry written at server ms ``ms`` (as the reader gets it)."""
    e = decode_metrics_entry(f"{ms}-0", encode_metrics_entry(node, attempt, ranks))
    assert e is not None
    return e


def step_ms(attempt: int, step: int) -> int:
    """When a step is printed: attempt 0 from T0+10 s, attempt 1 (resumed at 40) from +18 s;
    one step every 100 ms."""
    return T0 + 10_000 + step * 100 if attempt == 0 else T0 + 18_000 + (step - 40) * 100


ATTEMPTS = ((0, range(0, 60)), (1, range(40, 100)))
STREAM_FROM = 30  # the stream's oldest entry (the older ones were trimmed)...
HISTORY_STEPS = range(0, 45)  # ...and the history hash: attempt 0 up to its last write,
HISTORY_SKEW = 7  # its times a few ms off the stream's (the agent timed them its own way)


LAG = 95  # rank 3's last step of attempt 1: it lags


def stream_entries() -> list[tuple[int, str, int, dict[int, list[tuple[int, int, dict]]]]]:
    """(entry ms, node, attempt, ranks) of the metrics stream: five steps a node an entry,
    attempt 0 from step 30 (the older entries were trimmed), then attempt 1, where rank 3
    stops at step LAG."""
    out = []
    for attempt, steps in ATTEMPTS:
        steps = [s for s in steps if s >= STREAM_FROM or attempt]
        for i in range(0, len(steps), 5):
            chunk = steps[i:i + 5]
            ms = step_ms(attempt, chunk[-1]) + 50
            for node, (_, ranks) in NODES.items():
                points = {r: [(s, ms - step_ms(attempt, s), {"loss": loss(s, r, attempt),
                                                              "lr": 0.001})
                              for s in chunk if not (r == 3 and attempt and s > LAG)]
                          for r in ranks}
                out.append((ms, node, attempt, {r: p for r, p in points.items() if p}))
    return sorted(out, key=lambda e: e[0])


def history_hash() -> dict[str, str]:
    """What the host of rank 0 wrote: rank 0's and the aggregate's loss over attempt 0's
    first steps (the last ones are in the stream too: the curve takes them once)."""
    series = {name: Series() for name in ("rank0/loss", "min/loss", "median/loss", "max/loss")}
    for s in HISTORY_STEPS:
        values = [loss(s, r) for r in range(4)]
        ms = step_ms(0, s) - HISTORY_SKEW
        series["rank0/loss"].add(s, ms, values[0], 0)
        series["min/loss"].add(s, ms, min(values), 0)
        series["median/loss"].add(s, ms, (values[1] + values[2]) / 2, 0)
        series["max/loss"].add(s, ms, max(values), 0)
    return {name: s.encode() for name, s in series.items()}


def sample(rank: int, node: str, step: int, total: int | None = 200, rate: float = 2.0,
           **values: float) -> str:
    """A rank's resource sample with the latest fields of its metrics."""
    return json.dumps({"rank": rank, "node": node, "pid": 4000 + rank, "cpu": 50.0 + rank,
                       "rss": 100 << 20, "threads": 4, "ts": 1.0 + rank, "step": step,
                       "total": total, "rate": rate, "m": {"loss": loss(step, rank), **values}})


def write_job(r: redis.Redis, job: str, *, samples: bool = True, history: bool = True) -> None:
    """Job ``job``'s records: two nodes of two ranks; rank 3 fails at step 59 and the job
    resumes from its step-40 checkpoint (round 1) up to step 99; rank 3 lags at step 95."""
    k = JobKeys(job)
    r.hset(k.meta, mapping={"min_nodes": "2", "max_nodes": "2", "max_restarts": "3",
                            "created_ms": str(T0), "nproc_per_node": "2"})
    nodes = [{"node": n, "host": h, "group_rank": i, "nproc": 2}
             for i, (n, (h, _)) in enumerate(NODES.items())]
    seq = iter(range(1, 1000))
    events: list[tuple[int, str, str, dict[str, Any]]] = []
    for i, (node, (host, _)) in enumerate(NODES.items()):
        events.append((T0 + 1 + i, EventType.NODE_JOINED, node, {"host": host, "nproc": 2}))
    for rnd, at in ((0, T0 + 100), (1, T0 + 17_000)):
        events.append((at, EventType.RENDEZVOUS_COMPLETE, "a-1-x",
                       {"round": rnd, "world_size": 4, "nodes": nodes}))
        for j, (node, (host, ranks)) in enumerate(NODES.items()):
            events.append((at + 10 + j, EventType.WORKERS_STARTED, node,
                           {"round": rnd, "attempt": rnd, "restart_count": rnd, "ranks": ranks,
                            "local_ranks": [0, 1], "host": host,
                            "pids": [4000 + rnd * 10 + x for x in ranks]}))
    events.append((T0 + 16_000, EventType.WORKER_EXITED, "b-2-y",
                   {"rank": 3, "local_rank": 1, "pid": 4003, "exit_code": 1, "host": "gpu-b",
                    "message": "RuntimeError: boom"}))
    events.append((T0 + 16_500, EventType.RESTARTING, "a-1-x",
                   {"reason": "failure", "restarts_used": 1, "max_restarts": 3}))
    for ms, etype, node, data in sorted(events, key=lambda e: e[0]):
        r.xadd(k.events, encode_event(etype, node, data, next(seq)), id=f"{ms}-0")
    for ms, node, attempt, ranks in stream_entries():
        r.xadd(k.metrics, encode_metrics_entry(node, attempt, ranks),
               id=f"{ms}-{int(node == 'b-2-y')}", maxlen=5000, approximate=True)
    if history:
        r.hset(k.metrics_history, mapping=history_hash())
    if samples:
        r.hset(k.resources, mapping={
            str(rank): sample(rank, node, LAG if rank == 3 else 99)
            for node, (_, ranks) in NODES.items() for rank in ranks})


@pytest.fixture
def metrics_job(r: redis.Redis) -> str:
    job = f"metrics-{uuid.uuid4().hex[:8]}"
    write_job(r, job)
    return job


def console_cli(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CONSOLE, "--redis", redis_url, *args], capture_output=True,
                          text=True, timeout=60)


def one_error_line(p: subprocess.CompletedProcess[str]) -> str:
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(PREFIX), p.stderr
    return lines[0]


def folded(entries: list[tuple[int, str, int, dict]] | None = None) -> JobMetrics:
    m = JobMetrics()
    for ms, node, attempt, ranks in entries if entries is not None else stream_entries():
        m.apply_entry(entry(node, attempt, ranks, ms))
    return m


# -- the fold -----------------------------------------------------------------------------------


def test_fold_keeps_each_ranks_latest_rank_0s_curve_and_the_aggregate_per_step():
    m = folded()
    m.settle(math.inf)
    assert m.metric_names() == ["loss", "lr"] and m.curve_metrics() == ["loss", "lr"]
    # Each rank's newest point: attempt 1's step 99 (rank 3's: LAG).
    for rank in range(4):
        latest = m.latest[rank]
        last = LAG if rank == 3 else 99
        assert (latest.step, latest.attempt) == (last, 1)
        assert m.values_of(rank) == {"loss": loss(last, rank, 1), "lr": 0.001}
    rank0 = m.curve("loss", "rank0")
    expected = [(s, a, loss(s, 0, a)) for a, steps in ATTEMPTS for s in steps
                if s >= STREAM_FROM or a]
    assert [(p.step, p.attempt, p.value) for p in rank0] == expected
    assert all(p.ms == step_ms(p.attempt, p.step) for p in rank0)  # entry time minus age
    # The aggregate: min rank 0, max rank 3, median between ranks 1 and 2, at every step
    # (past LAG, of ranks 0-2: max rank 2, median rank 1).
    def full(s: int, a: int) -> bool:
        return not (a and s > LAG)

    for source, value in (("min", lambda s, a: loss(s, 0, a)),
                          ("max", lambda s, a: loss(s, 3 if full(s, a) else 2, a)),
                          ("median", lambda s, a: (loss(s, 1, a) + loss(s, 2, a)) / 2
                           if full(s, a) else loss(s, 1, a))):
        got = [(p.step, p.attempt, round(p.value, 6)) for p in m.curve("loss", source)]
        assert got == [(s, a, round(value(s, a), 6)) for s, a, _ in expected], source
    assert m.summary().slowest == 3
    assert m.late == 0 and m.names_dropped == 0
    assert m.entries == len(stream_entries()) and m.cost_per_entry_us() > 0


def test_redone_steps_are_marked_and_restarts_are_markers():
    """After a resume from step 40, attempt 1's steps 40-59 were trained before: redone;
    60 on are not. A `restarting` event folded by the JobView is a marker at its time."""
    view = JobView("j")
    for ms, node, attempt, ranks in stream_entries():
        view.apply(entry(node, attempt, ranks, ms))
    view.apply_event(_event(T0 + 16_500, EventType.RESTARTING, "a-1-x", reason="failure",
                            restarts_used=1))
    redone = {(p.attempt, p.step): p.redone for p in view.metrics.curve("loss", "rank0")}
    assert all(redone[(1, s)] for s in range(40, 60))
    assert not any(redone[(1, s)] for s in range(60, 100))
    assert not any(v for (a, _), v in redone.items() if a == 0)
    assert [(mk.ms, mk.reason) for mk in view.metrics.markers] == [(T0 + 16_500, "failure")]


_seq = iter(range(1, 1 << 30))


def _event(ms: int, etype: str, node: str, **data: Any) -> Any:
    e = decode_event(f"{ms}-0", encode_event(etype, node, data, next(_seq)))
    assert e is not None
    return e


def test_history_comes_before_the_live_curve_and_foreign_fields_are_counted():
    m = folded()
    hist = history_hash()
    m.apply_history({**{k.encode(): v.encode() for k, v in hist.items()},
                     b"rank0/bad name": hist["rank0/loss"],  # not a metric name
                     b"other/loss": hist["rank0/loss"],  # not a series the agents write
                     b"max/lr": b"[" * 100_000 + b"]" * 100_000,  # not a series at all
                     })
    assert m.history_bad == 3 and set(m.history) == set(hist)
    steps = [(p.attempt, p.step) for p in m.curve("loss", "rank0")]
    assert steps == [(0, s) for s in range(60)] + [(1, s) for s in range(40, 100)]
    m.settle(math.inf)
    median = m.curve("loss", "median")
    assert [p.step for p in median[:61]] == [*range(60), 40]
    assert median[0].value == pytest.approx((loss(0, 1) + loss(0, 2)) / 2)
    # A job grown past what the console folds whole: its aggregate is the agents' alone (the
    # live one, of some ranks only from now on, would cut the history short).
    m.live_aggregate = False
    assert [p.step for p in m.curve("loss", "median")] == list(HISTORY_STEPS)


def test_samples_give_total_rate_progress_and_the_slowest_rank():
    view = JobView("j")
    view.apply_resources({rank: json.loads(sample(rank, "a-1-x", 95 if rank == 3 else 99))
                          for rank in range(4)})
    m = view.metrics
    assert m.any_step and m.latest[3].step == 95 and m.latest[0].total == 200
    s = m.summary()
    assert s.slowest == 3 and (s.low, s.high) == (95, 99)
    p = s.progress
    assert p is not None and (p.step, p.total, p.rank, p.basis) == (95, 200, 3, "slowest rank")
    assert p.eta_s == pytest.approx((200 - 95) / 2.0)
    # Only rank 0 knows the total (Hugging Face's bar is rank 0's): "rank 0" says so.
    view2 = JobView("j")
    view2.apply_resources({0: json.loads(sample(0, "a-1-x", 10, total=40, rate=4.0)),
                           1: json.loads(sample(1, "a-1-x", 10, total=None))})
    p2 = view2.metrics.summary().progress
    assert p2 is not None and (p2.rank, p2.basis, p2.step, p2.total) == (0, "rank", 10, 40)
    assert view2.metrics.summary().slowest is None  # every rank at the same step
    # A sample with malformed metric fields is counted, not folded.
    view2.apply_resources({2: {"ts": 5.0, "step": "ten", "m": {"loss": 1.0}}})
    assert view2.metrics.samples_bad == 1 and 2 not in view2.metrics.latest


def test_hostile_entries_cannot_grow_the_fold():
    """A worker printing a new metric name every line, numbers of any size, ranks beyond any
    job, steps near 2**62: names, ranks and open steps stay bounded and are counted."""
    m = JobMetrics()
    tracemalloc.start()
    n = 0
    for i in range(2_000):
        names = {f"m{i}_{j}": (1e308 if j % 3 == 0 else -math.inf if j % 3 == 1 else math.nan)
                 for j in range(WIRE_NAMES - 1)}
        names["loss"] = 1e-308
        ranks = {(i * 7919) % (1 << 24): [((1 << 62) - i, 5, names)], 0: [(i, 5, names)]}
        # A new attempt every entry: more attempts than a curve has buckets.
        m.apply_entry(entry("n", i, ranks, T0 + i))
        n += len(names) * 2
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(m.names) == MAX_NAMES and m.names_dropped > n // 2
    assert len(m.curve_metrics()) == MAX_CURVE_METRICS and "loss" in m.curve_metrics()
    assert len(m._pending) <= MAX_PENDING_STEPS
    assert len(m.latest) <= 2_000 and peak < 64 << 20, peak
    # Past the bound of ranks kept: counted.
    m2 = JobMetrics()
    for i in range(0, MAX_LATEST_RANKS + 100, 256):
        m2.apply_entry(entry("n", 0, {r: [(1, 0, {"loss": 1.0})] for r in range(i, i + 256)},
                             T0 + i))
    assert len(m2.latest) == MAX_LATEST_RANKS and m2.ranks_dropped >= 100
    # Names the wire refuses never reach the fold: the entry is not decoded.
    bad = encode_metrics_entry("n", 0, {0: [(1, 0, {"loss": 1.0})]})
    bad["ranks"] = bad["ranks"].replace("loss", "lo[red]ss")
    assert decode_metrics_entry(f"{T0}-0", bad) is None


def test_late_points_and_chosen_ranks():
    m = JobMetrics()
    m.apply_entry(entry("a", 0, {0: [(10, 0, {"loss": 1.0})], 5: [(10, 0, {"loss": 3.0})]}, T0))
    m.settle(T0 + 10_000)
    m.apply_entry(entry("b", 0, {6: [(10, 0, {"loss": 9.0})]}, T0 + 10_001))  # step 10 settled
    assert m.late == 1
    assert [p.value for p in m.curve("loss", "max")] == [3.0]
    for rank in range(1, MAX_CHOSEN + 2):
        m.choose(rank)
    assert m.chosen == list(range(2, MAX_CHOSEN + 2))  # the first chosen made room
    m.apply_entry(entry("a", 0, {3: [(11, 0, {"loss": 0.5})]}, T0 + 20_000))
    assert [p.step for p in m.curve("loss", "rank3")] == [11]
    m.backfill(3, [entry("a", 0, {3: [(9, 0, {"loss": 0.7})]}, T0 - 1000)])
    assert [p.step for p in m.curve("loss", "rank3")] == [9, 11]


def test_quiet_stops_at_the_ranks_exit():
    rs = RankState(3, last_line_ms=T0)
    assert rank_rows.row_values(rs, T0 + 65_000)[-1] == "1m05s"
    view = JobView("j")
    view.apply_event(_event(T0, EventType.WORKERS_STARTED, "n", ranks=[3], local_ranks=[0],
                            pids=[9], host="h"))
    view.ranks[3].last_line_ms = T0 + 1_000
    view.apply_event(_event(T0 + 5_000, EventType.WORKER_EXITED, "n", rank=3, pid=9,
                            exit_code=0))
    done = view.ranks[3]
    assert done.state == "exited"
    for now in (T0 + 6_000, T0 + 600_000):  # time goes on; its QUIET does not
        assert rank_rows.row_values(done, now)[-1] == "4s"
        assert rank_rows.node_values([done], now)[-1] == "4s"
    view.apply_event(_event(T0 + 700_000, EventType.WORKERS_STARTED, "n", ranks=[3],
                            local_ranks=[0], pids=[10], host="h"))
    assert rank_rows.row_values(view.ranks[3], T0 + 710_000)[-1] != "4s"  # running again


def test_nan_event_is_in_the_timeline_and_the_first_is_kept():
    view = JobView("j")
    view.apply_event(_event(T0 + 20, EventType.NAN, "b", rank=5, step=12, metric="loss",
                            value="inf", host="h[red]", attempt=0, policy="observe"))
    view.apply_event(_event(T0 + 10, EventType.NAN, "a", rank=2, step=11, metric="loss",
                            value="nan", host="h2", attempt=0))
    assert view.first_nan is not None and view.first_nan["rank"] == 2
    assert [e.kind for e in view.timeline][-2:] == ["nan", "nan"]
    assert "rank 5 on h[red]: loss became inf at step 12" in view.timeline[-2].text


# -- the client ----------------------------------------------------------------------------------


def test_client_reads_recent_entries_and_history_then_follows_the_stream(
        r: redis.Redis, redis_url: str, metrics_job: str):
    k = JobKeys(metrics_job)
    r.xadd(k.metrics, {"v": "1", "node": "x", "attempt": "0", "ranks": "[[0, [[1, 0, 5]]]]"},
           id=f"{T0 + 29_000}-0")  # malformed: skipped and counted

    async def main() -> None:
        client = JobClient(parse_endpoint(redis_url), metrics_job)
        try:
            await client.history(max_events=100, max_log_entries_per_stream=0)
            recent = await client.metrics_recent()
            assert len(recent) == len(stream_entries()) and client.skipped == 1
            assert recent[0].id < recent[-1].id  # oldest first
            hist = await client.metrics_history(["loss"])
            assert set(hist) == set(history_hash())
            view = JobView(metrics_job)
            view.apply_many(recent)
            view.metrics.apply_history(hist)
            # Live: the next entry comes through follow, after the cursor.
            ms = T0 + 40_000
            for i in range(5):
                r.xadd(k.metrics, encode_metrics_entry(
                    "a-1-x", 1, {0: [(100 + i, 10, {"loss": 0.01})]}), id=f"{ms}-{i}")
            r.xadd(k.metrics, {"v": "1", "node": "x"}, id=f"{ms + 1}-0")  # malformed
            got: list[Any] = []
            lists: list[int] = []
            async for records in client.follow_many():
                got += records
                lists.append(sum(isinstance(x, MetricsEntry) for x in records))
                if any(isinstance(x, Skipped) for x in got):
                    break
            entries = [x for x in got if isinstance(x, MetricsEntry)]
            assert [(e.points[0].step, e.points[0].ms) for e in entries] == [
                (100 + i, ms - 10) for i in range(5)]
            # A few entries a list: the consumer gets the keys back between them.
            assert max(lists) <= METRICS_SLICE
            view.apply_many(got)
            assert view.metrics.latest[0].step == 104
            assert view.metrics.curve("loss", "rank0")[-1].value == 0.01
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_flooded_history_hash_is_read_only_for_known_metrics(r: redis.Redis, redis_url: str,
                                                               job_id: str):
    k = JobKeys(job_id)
    write_job(r, job_id, history=False)
    r.hset(k.metrics_history, mapping={f"rank0/x{i}": "{}" for i in range(5_000)})
    r.hset(k.metrics_history, mapping={**history_hash(), "max/loss": "x" * (300 * 1024)})

    async def main() -> dict[str, bytes]:
        client = JobClient(parse_endpoint(redis_url), job_id)
        try:
            out = await client.metrics_history(["loss"])
            assert client.skipped >= 5_000 - 64
            return out
        finally:
            await client.close()

    got = asyncio.run(main())
    assert set(got) == {"rank0/loss", "min/loss", "median/loss"}  # the huge one left out


# -- the CLI -----------------------------------------------------------------------------------


def test_metrics_json_is_history_then_stream_with_attempts_and_redone(redis_url, metrics_job):
    p = console_cli(redis_url, "metrics", metrics_job, "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert (out["metric"], out["rank"]) == ("loss", 0)
    got = [(x["step"], x["attempt"], x["value"], x["redone"]) for x in out["points"]]
    assert got == [(s, a, loss(s, 0, a), a == 1 and s < 60)
                   for a, steps in ATTEMPTS for s in steps]
    assert all(x["ms"] == step_ms(x["attempt"], x["step"]) - (
        HISTORY_SKEW if x["step"] < STREAM_FROM and not x["attempt"] else 0)
        for x in out["points"])
    # Another rank (the stream's points), another metric.
    p = console_cli(redis_url, "metrics", metrics_job, "--rank", "3", "--metric", "lr", "--json")
    out = json.loads(p.stdout)
    assert out["rank"] == 3 and out["metric"] == "lr"
    assert {x["value"] for x in out["points"]} == {0.001}
    assert len(out["points"]) == 30 + (LAG - 40 + 1)
    # The aggregate: median with min and max.
    p = console_cli(redis_url, "metrics", metrics_job, "--aggregate", "--json")
    out = json.loads(p.stdout)
    first = out["points"][0]
    assert out["rank"] is None and first["step"] == 0
    assert (first["min"], first["max"]) == (loss(0, 0), loss(0, 3))
    assert first["value"] == pytest.approx((loss(0, 1) + loss(0, 2)) / 2)


def test_metrics_csv_and_table(redis_url, metrics_job):
    p = console_cli(redis_url, "metrics", metrics_job, "--csv")
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and lines[0] == "step,ms,value,attempt,redone"
    assert lines[1] == f"0,{step_ms(0, 0) - HISTORY_SKEW},{loss(0, 0):.7g},0,0"
    assert lines[-1] == f"99,{step_ms(1, 99)},{loss(99, 0, 1):.7g},1,0"
    assert len(lines) == 1 + 120
    p = console_cli(redis_url, "metrics", metrics_job)
    assert p.returncode == 0 and "loss: rank 0, 120 points" in p.stdout
    assert re.search(r"\n45\s+\S+\s+\S+\s+1\s+redone\n", p.stdout)


def test_metrics_errors_are_one_line(redis_url, r, metrics_job, job_id):
    p = console_cli(redis_url, "metrics", metrics_job, "--metric", "accuracy")
    assert p.returncode == 1 and "no metric 'accuracy': its metrics are loss, lr" in one_error_line(p)
    p = console_cli(redis_url, "metrics", "no-such-job")
    assert p.returncode == 1 and "no job 'no-such-job'" in one_error_line(p)
    p = console_cli(redis_url, "metrics", metrics_job, "--metric", "lo[red]ss")
    assert p.returncode == 2 and "is not a metric name" in one_error_line(p)
    p = console_cli(redis_url, "metrics", metrics_job, "--rank", "-1")
    assert p.returncode == 2 and one_error_line(p)
    p = console_cli(redis_url, "metrics", metrics_job, "--rank", "7")
    assert p.returncode == 1 and "rank 7 printed no point of 'loss'" in one_error_line(p)
    p = console_cli(redis_url, "metrics", metrics_job, "--json", "--csv")
    assert p.returncode == 2 and one_error_line(p)
    r.xadd(JobKeys(job_id).events, encode_event(EventType.NODE_JOINED, "n", {"host": "h"}, 1))
    p = console_cli(redis_url, "metrics", job_id)
    assert p.returncode == 1 and "has no training metrics yet" in one_error_line(p)


def test_status_json_has_each_ranks_step_rate_total_and_metrics(redis_url, r, metrics_job):
    k = JobKeys(metrics_job)
    r.hset(k.resources, "1", json.dumps({"rank": 1, "node": "a-1-x", "ts": 9.0, "step": 99,
                                         "total": 200, "rate": 2.5,
                                         "m": {"loss": "nan", "lr": 0.001}}))
    r.xadd(k.events, encode_event(EventType.NAN, "a-1-x", {
        "rank": 1, "step": 99, "metric": "loss", "value": "nan", "host": "gpu-a",
        "attempt": 1, "policy": "observe"}, 999))
    p = console_cli(redis_url, "status", metrics_job, "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)  # strict JSON: a NaN would be refused below
    json.loads(p.stdout, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    ranks = {x["rank"]: x for x in out["ranks"]}
    assert (ranks[3]["step"], ranks[3]["total"], ranks[3]["rate"]) == (95, 200, 2.0)
    assert ranks[3]["metrics"] == {"loss": loss(95, 3)}
    assert ranks[1]["metrics"] == {"loss": "nan", "lr": 0.001} and ranks[1]["rate"] == 2.5
    assert out["nan"]["rank"] == 1 and out["nan"]["metric"] == "loss"
    p = console_cli(redis_url, "status", metrics_job)
    assert "STEP" in p.stdout and "nan       rank 1 on gpu-a: loss became nan" in p.stdout


# -- the console ---------------------------------------------------------------------------------


def attached(redis_url: str, job: str, **kw: Any) -> App:
    return App(job, endpoint=parse_endpoint(redis_url), utc=True, clock=lambda: T0 + 60_000,
               **kw)


async def ready(app: App) -> None:
    await wait_until_async(lambda: app.loaded and app.rank_table.row_count == 4
                           and app.view.metrics.latest.get(3) is not None
                           and app.view.metrics.latest[3].rate is not None
                           and app.rank_table.steps, 20, "the job and its metrics")


def test_rank_table_steps_slowest_and_sort_and_header_progress(redis_url, metrics_job):
    app = attached(redis_url, metrics_job)

    async def body(pilot: Any, app: App) -> None:
        await ready(app)
        table = app.rank_table
        await pilot.resize_terminal(80, 24)
        await wait_until_async(lambda: "step" in table.columns and "local" not in table.columns,
                               5, "the columns fitted")
        assert table.columns == ("rank", "host", "state", "restarts", "exit", "line", "step",
                                 "rate")
        assert table.virtual_size.width <= table.scrollable_content_region.width
        header = table.render_line(0).text
        assert "STEP" in header and "STEPS/S" in header and "QUIET" in header
        await wait_until_async(lambda: table.shown_row(3) is not None
                               and table.shown_row(3)[-1] == rank_rows.SLOWEST, 5, "slowest")
        row3 = table.render_line(4)
        step_cell = next(seg for seg in row3 if seg.text.strip() == "95")
        assert step_cell.style.reverse and step_cell.style.bold  # it stands out
        assert not any(seg.style and seg.style.reverse for seg in table.render_line(2)
                       if seg.text.strip() == "99")
        text = screen_text(app)
        assert "step 95/200 47%  ETA 52s (slowest rank 3)" in text
        # `o` up to STEP: rank 3 (the lowest step) first.
        while table.sort_column != "step":
            await pilot.press("o")
        assert table.order()[0] == 3 and "sorted by step" in screen_text(app)

    run(app, body)


def test_the_metrics_view_keys(redis_url, metrics_job):
    app = attached(redis_url, metrics_job)

    async def body(pilot: Any, app: App) -> None:
        await ready(app)
        await pilot.press("m")
        await on_screen(app, MetricsScreen)
        screen = app.screen
        assert isinstance(screen, MetricsScreen)
        chart = screen.query_one("#chart-0", MetricChart)
        await wait_until_async(lambda: chart.metric == "loss" and chart.has_points
                               and chart.ready, 10, "drawn")
        text = screen_text(app)
        assert "loss" in text and "rank 0" in text and "median" in text and "min-max" in text
        assert "redone" in text and "restart" in text and "step" in text
        assert chart.redone and chart.restarted
        await pilot.press("n")
        await wait_until_async(lambda: chart.metric == "lr", 5, "the next metric")
        await pilot.press("t")
        await wait_until_async(lambda: "22:13:" in screen_text(app), 5, "by time")
        await pilot.press("a", "0")
        await wait_until_async(lambda: not chart.has_points, 5, "no curve chosen")
        await pilot.press("0", "a", "p")
        await wait_until_async(lambda: chart.metric == "loss" and chart.has_points, 5, "back")
        await pilot.press("c")
        await on_screen(app, RankPrompt)
        await pilot.press("3", "enter")
        await wait_until_async(lambda: any(label == "rank 3" for label, _ in chart.labels), 10,
                               "rank 3's past read from the stream")
        assert app.view.metrics.chosen == [3]
        assert len(app.view.metrics.curve("loss", "rank3")) == 30 + (LAG - 40 + 1)
        await pilot.press("x")
        await wait_until_async(lambda: not app.view.metrics.chosen, 5, "cleared")
        await pilot.press("escape")
        await on_screen(app, MetricsScreen, shown=False)
        assert app.screen is app.main_screen

    run(app, body)


def test_the_metrics_view_with_no_metrics_says_how_they_come(redis_url, r, job_id):
    write_job(r, job_id, samples=False, history=False)
    r.delete(JobKeys(job_id).metrics)
    app = attached(redis_url, job_id)

    async def body(pilot: Any, app: App) -> None:
        await wait_until_async(lambda: app.loaded, 20, "loaded")
        assert not app.rank_table.steps and "step" not in app.rank_table.columns
        await pilot.press("m")
        await on_screen(app, MetricsScreen)
        await wait_until_async(lambda: "No training metrics yet" in screen_text(app), 5, "hint")

    run(app, body)


def _snapshot_app(redis_url: str, job: str) -> App:
    return attached(redis_url, job)


async def _open_metrics(pilot: Any) -> None:
    app = pilot.app
    await ready(app)
    await pilot.press("m")
    await on_screen(app, MetricsScreen)
    charts = list(app.screen.query(MetricChart))
    await wait_until_async(lambda: charts[0].has_points and all(
        c.ready for c in charts if c.parent is not None and c.parent.display), 10, "drawn")
    await pilot.pause()


def test_snapshot_metrics_80x24(snap_compare: Callable[..., bool], redis_url, metrics_job):
    assert snap_compare(_snapshot_app(redis_url, metrics_job), terminal_size=(80, 24),
                        run_before=_open_metrics)


def test_snapshot_metrics_120x40(snap_compare: Callable[..., bool], redis_url, metrics_job):
    assert snap_compare(_snapshot_app(redis_url, metrics_job), terminal_size=(120, 40),
                        run_before=_open_metrics)


# -- the browser view ------------------------------------------------------------------------------

_CSI = re.compile(rb"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[@-Z\\-_])")


def test_the_metrics_view_in_the_browser(r, redis_url, metrics_job, tmp_path: Path):
    """`serve`: chromium loads the console, `m` opens the metrics view, the chart is drawn
    (its legend and axis reach the page through the websocket)."""
    from playwright.sync_api import sync_playwright

    from tests.test_console_serve import CONSOLE as SERVE_CONSOLE
    from tests.test_console_serve import chromium

    proc = subprocess.Popen([str(SERVE_CONSOLE), "--redis", redis_url, "serve", metrics_job,
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the URL line, printed once it listens
        m = re.search(r"at (http://127\.0\.0\.1:\d+/\S+)", line)
        assert m, f"no URL printed: {line!r} {proc.poll()}"
        received: list[bytes] = []

        def screen() -> str:
            return _CSI.sub(b"", b"".join(received)).decode("utf-8", "replace")

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium(),
                                         args=["--no-sandbox", "--disable-gpu"])
            try:
                page = browser.new_page()
                page.on("websocket", lambda ws: ws.on(
                    "framereceived", lambda payload: received.append(
                        payload if isinstance(payload, bytes) else payload.encode())))
                assert page.goto(m.group(1)).status == 200

                def wait_for(pattern: str, timeout: float = 20) -> None:
                    deadline = time.monotonic() + timeout
                    while time.monotonic() < deadline:
                        if re.search(pattern, screen()):
                            return
                        page.wait_for_timeout(50)  # playwright delivers frames while it waits
                    raise AssertionError(f"{pattern!r} never shown; got {screen()[-2000:]!r}")

                wait_for(r"STEPS/S")  # the rank table's training columns
                received.clear()
                page.locator(".textual-terminal").click()
                page.keyboard.press("m")
                wait_for(r"Metrics")
                wait_for(r"min-max")
                wait_for(r"redone")
                wait_for(r"step")
            finally:
                browser.close()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_big_jobs_console_decodes_only_rank_0s_and_the_chosen_ranks_nodes(
        redis_url, r, metrics_job, monkeypatch: pytest.MonkeyPatch):
    """Past METRICS_ALL_RANKS ranks the reader decodes the entries of rank 0's node (and the
    chosen ranks') only; the aggregate is then the agents' history; each rank's latest comes
    from its resource sample."""
    from elastic_console.tui import feed

    monkeypatch.setattr(feed, "METRICS_ALL_RANKS", 2)  # the 4-rank job counts as big
    app = attached(redis_url, metrics_job)

    async def body(pilot: Any, app: App) -> None:
        await ready(app)
        m = app.view.metrics
        assert app.client is not None and app.client.metrics_nodes == {"a-1-x"}
        assert not m.live_aggregate
        assert len(m.curve("loss", "rank0")) == 120
        assert [p.step for p in m.curve("loss", "median")] == list(HISTORY_STEPS)
        assert m.latest[3].step == LAG and m.latest[3].attempt == -1  # from its sample only
        ms = T0 + 50_000
        for seq, (node, ranks) in enumerate((("b-2-y", [2, 3]), ("a-1-x", [0, 1]))):
            r.xadd(JobKeys(metrics_job).metrics, encode_metrics_entry(
                node, 1, {x: [(200, 0, {"loss": 0.5})] for x in ranks}), id=f"{ms}-{seq}")
        await wait_until_async(lambda: m.latest[0].step == 200, 10, "rank 0's node's entry")
        assert m.latest[2].step == 99 and app.view.client_skipped == 0  # b's: not decoded
        await pilot.press("m")
        await on_screen(app, MetricsScreen)
        await pilot.press("c")
        await on_screen(app, RankPrompt)
        await pilot.press("3", "enter")
        await wait_until_async(lambda: app.client.metrics_nodes == {"a-1-x", "b-2-y"}, 5,
                               "rank 3's node read too")

    run(app, body)


def test_a_metrics_key_of_another_type_is_skipped_and_counted(redis_url, r, metrics_job):
    k = JobKeys(metrics_job)
    r.delete(k.metrics, k.metrics_history)
    r.set(k.metrics, "not a stream")
    r.set(k.metrics_history, "not a hash")

    async def main() -> None:
        client = JobClient(parse_endpoint(redis_url), metrics_job)
        try:
            await client.history(max_events=100, max_log_entries_per_stream=0)
            assert await client.metrics_recent() == [] and client.skipped == 1
            assert await client.metrics_history(["loss"]) == {} and client.skipped == 2
            r.xadd(k.events, encode_event(EventType.NODE_LEFT, "a-1-x", {"host": "gpu-a"},
                                          500))
            async for records in client.follow_many():  # the events still come
                if any(getattr(x, "type", "") == EventType.NODE_LEFT for x in records):
                    break
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_long_curve_is_thinned_to_the_charts_width_and_keeps_its_spikes():
    from elastic_console.job.metrics import CurvePoint
    from elastic_console.tui.widgets.metric_chart import ChartOptions, Series, _thin, build_chart

    pts = [CurvePoint(s, T0 + s, 1.0 + (s % 7) / 100, 0, 0, 0, False) for s in range(20_000)]
    pts[12_345] = pts[12_345]._replace(value=100.0)  # one spike in twenty thousand points
    thin = _thin(pts, 80)
    assert len(thin) <= 160 and any(p.value == 100.0 for p in thin)
    assert [p.step for p in thin] == sorted(p.step for p in thin)
    text = build_chart([Series("rank 0", (0, 200, 0), pts)], ChartOptions(), [], 80, 20,
                       "clear").plain
    assert "100" in text.split("\n")[0] + text.split("\n")[1]  # the y axis reaches the spike
