"""Training metrics on the agent's side: read from the workers' output, published with the
resource samples, kept as whole-run curves, turned into ``nan`` events, --on-nan and /metrics.

Real agents, real workers (examples/train.py prints ``step N loss X``; tests/scripts/
metrics_worker.py prints metrics torch-free, a NaN on demand, or hostile output) and a real
redis-server. The cost per node per interval is counted by that server
(``total_commands_processed``: the commands a client sent; the calls a script makes inside
are not commands sent, and are counted apart from ``INFO commandstats``).
"""

from __future__ import annotations

import asyncio
import collections
import io
import json
import math
import re
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from elastic_agent.coordination.transport.connection import make_async_client, make_client
from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.log_records import STDERR, STDOUT
from elastic_agent.coordination.wire.metric_records import (
    MAX_METRICS_ENTRY_BYTES,
    decode_latest,
    decode_metrics_entry,
)
from elastic_agent.coordination.wire.metric_series import decode_series
from elastic_agent.supervision.config import UsageError, parse_args
from elastic_agent.supervision.diagnosis import metrics_publish
from elastic_agent.supervision.diagnosis.metrics import MAX_NAMES, MetricsTracker
from elastic_agent.supervision.diagnosis.metrics_publish import (
    HISTORY_METRICS,
    NAN_EVENTS_PER_INTERVAL,
    MetricsPublisher,
)
from elastic_agent.supervision.hosting.standalone import RedisServer
from elastic_agent.supervision.records.events import ResourceSampler
from elastic_agent.supervision.records.log_config import LogConfig
from elastic_agent.supervision.records.logs import NodeLogs
from tests.agents import EXAMPLES, SCRIPTS, Agent, wait_until
from tests.test_agent import agent_args, of_type
from tests.test_health import RDZV, get, metric, served_port

WORKER = str(SCRIPTS / "metrics_worker.py")
FAST = "--rdzv-conf=last_call_timeout=1,heartbeat_timeout=30,keep_alive_interval=0.5,join_timeout=60"


def entries(r: redis.Redis, job: str) -> list[Any]:
    out = []
    for i, f in r.xrange(JobKeys(job).metrics):
        e = decode_metrics_entry(i.decode(), f)
        assert e is not None, f  # every entry an agent wrote decodes
        out.append(e)
    return out


def printed(path: Path) -> dict[int, float]:
    """step -> loss as a worker printed them (``step N loss X``) in its stdout.log."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"step (\d+) loss (\S+)(?: .*)?", line)
        if m:
            out[int(m[1])] = float(m[2])
    return out


# -- the hook ---------------------------------------------------------------------------------

class Seen:
    """An observer that keeps what it is given (the agent's is the MetricsTracker)."""

    def __init__(self, fail: bool = False) -> None:
        self.chunks: list[tuple[int, str, bytes]] = []
        self.fail = fail

    def feed(self, rank: int, stream: str, data: bytes) -> None:
        self.chunks.append((rank, stream, data))
        if self.fail:
            raise RuntimeError("a broken observer")


@pytest.mark.parametrize("fail", [False, True], ids=["observer", "broken-observer"])
def test_the_observer_sees_every_raw_chunk_and_never_costs_the_output(tmp_path, fail):
    seen = Seen(fail)
    logs = NodeLogs(LogConfig(), stdout=io.BytesIO(), stderr=io.BytesIO(), observer=seen)
    w = logs.open_worker(directory=tmp_path / "0", role="default", rank=5, local_rank=0,
                         attempt=0)
    chunks = [(STDOUT, b"step 1 loss 0.5\n"), (STDERR, b"\r 1/4 [00:01<00:03, 1.0it/s]"),
              (STDERR, b"\r 2/4 [00:02<00:02, 1.0it/s]"), (STDOUT, b"no newline")]
    for stream, data in chunks:
        w.feed(stream, data)
    w.close()
    # every chunk as written, bar frames included (before any line is cut); a broken observer
    # is dropped after its first failure, and the output still reaches its files
    assert seen.chunks == ([(5, s, d) for s, d in chunks] if not fail else
                           [(5, *chunks[0])])
    assert (tmp_path / "0" / "stdout.log").read_bytes() == b"step 1 loss 0.5\nno newline"
    assert (tmp_path / "0" / "stderr.log").read_bytes() == chunks[1][1] + chunks[2][1]


# -- publishing: what a node costs Redis -------------------------------------------------------

@pytest.fixture
def server() -> Any:
    s = RedisServer().start()
    yield s
    s.cleanup()


class Monitor:
    """Every command the server runs, as MONITOR shows it: a client's own, or a script's
    (``client_type`` "lua"). ``mark()`` cuts the record into the spans between marks."""

    def __init__(self, url: str) -> None:
        self._client = make_client(url)
        self._r = make_client(url)
        self.seen: list[tuple[str, str]] = []
        self._mon = self._client.monitor().__enter__()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        self.mark()

    def _read(self) -> None:
        for cmd in self._mon.listen():
            self.seen.append((cmd["client_type"], cmd["command"]))
            if cmd["command"] == "ECHO monitor-end":
                return

    def mark(self, name: str = "mark") -> None:
        self._r.echo(f"monitor-{name}")

    def spans(self) -> list[tuple[list[str], list[str]]]:
        """(commands clients sent, commands scripts ran) between consecutive marks."""
        self.mark("end")
        self._thread.join(10)
        out: list[tuple[list[str], list[str]]] = []
        for kind, cmd in self.seen:
            if cmd.startswith("ECHO monitor-"):
                out.append(([], []))
            elif out:
                out[-1][kind == "lua"].append(cmd.split(" ", 1)[0].upper())
        return out[:-1]


def test_a_node_costs_one_command_more_an_interval_and_only_with_points(server, job_id):
    """Per node per interval: the resource samples' HSET as before; one script call more
    when the node's ranks printed points since the last interval, none otherwise. The
    script's own calls are bounded by the node's ranks and the 8 curve names, not the job."""
    r = make_client(server.url)
    mon = Monitor(server.url)

    async def run() -> None:
        client = make_async_client(parse_endpoint(server.url))
        await client.ping()  # the connection's own handshake, before anything is counted
        now = [1000.0]
        tracker = MetricsTracker(clock=lambda: now[0])
        pub = MetricsPublisher(tracker, job_id, "node-a", lambda *a, **k: None,
                               clock=lambda: now[0])
        plain = ResourceSampler(client, job_id, "node-b")  # a node without the rider
        sampler = ResourceSampler(client, job_id, "node-a", rider=pub)
        pub.start_attempt(0, holds_rank0=True)
        samples = {0: {"rank": 0, "cpu": 1.0}, 1: {"rank": 1, "cpu": 2.0}}

        async def interval(s: ResourceSampler, feed: list[tuple[int, bytes]],
                           alive: bool = True) -> None:
            for rank, data in feed:
                tracker.feed(rank, "stdout", data)
            mon.mark()
            await s.publish({k: dict(v) for k, v in samples.items()} if alive else {})

        await interval(plain, [])  # the baseline: one HSET
        await interval(sampler, [])  # no metrics printed: the same
        many = b"".join(f"step {s} loss {1 / (s + 1):.4f} lr 0.1 acc 0.5\n".encode()
                        for s in range(40))
        await interval(sampler, [(0, many), (1, many)])  # points: one call more
        await interval(sampler, [(0, b"step 40 loss 0.01\n")])  # by the script's hash now
        now[0] += metrics_publish.HISTORY_EVERY_S  # the curves are due: they wait for points
        await interval(sampler, [(0, b"a line with nothing in it\n")])  # no new point
        # the workers exited (no samples): a rank's last point still goes, its state once
        await interval(sampler, [(0, b"step 41 loss 0.005\n")], alive=False)
        await interval(sampler, [], alive=False)
        mon.mark()
        await sampler.final()  # the agent exits: the curves go alone
        await client.aclose()

    asyncio.run(run())
    spans = mon.spans()[1:]
    sent = [sorted(c) for c, _ in spans]
    assert sent == [["HSET"], ["HSET"], ["EVAL", "HSET"], ["EVALSHA", "HSET"], ["HSET"],
                    ["EVALSHA", "HSET"], [], ["HSET"]], spans
    assert r.hlen(JobKeys(job_id).metrics_history) == 12  # rank0, min, median, max x 3 names
    inner = [collections.Counter(lua) for _, lua in spans]
    # Inside the script: one XADD, a ZADD and a PEXPIRE per curve name with values (loss, lr,
    # acc here); the host of rank 0 reads each set by index (ZCARD, 3 ZRANGE by index), and
    # the curves' history once (HLEN, HKEYS: no hash yet); the round's highest step is
    # raised (HGET, HSET; HLEN: the round's first, the hash's size).
    assert inner[2] == {"XADD": 1, "ZADD": 3, "PEXPIRE": 3, "ZCARD": 3, "ZRANGE": 9,
                        "HLEN": 2, "HKEYS": 1, "HGET": 1, "HSET": 1}, inner[2]
    # every rank's latest values again (rank 1's too): the sets stay fresh while points come
    assert inner[3] == {"XADD": 1, "ZADD": 3, "PEXPIRE": 3, "ZCARD": 3, "ZRANGE": 9,
                        "HGET": 1, "HSET": 1}, inner[3]
    assert not inner[0] and not inner[1] and not inner[4] and not inner[6] and not inner[7]
    e = entries(r, job_id)
    assert [len(x.points) for x in e] == [80, 1, 1]
    assert {p.step for p in e[0].points if p.rank == 1} == set(range(40))
    latest = json.loads(r.hget(JobKeys(job_id).resources, "0"))
    assert decode_latest(latest) is not None and latest["step"] == 41 and "cpu" not in latest
    latest = json.loads(r.hget(JobKeys(job_id).resources, "1"))
    assert latest["step"] == 39 and latest["cpu"] == 2.0  # its last sample: nothing new
    assert r.zscore(JobKeys(job_id).metrics_latest("loss", 0), "1") == pytest.approx(0.025)
    assert 0 < r.pttl(JobKeys(job_id).metrics_latest("loss", 0)) <= metrics_publish.LATEST_TTL_MS


def test_points_survive_a_lost_script_and_an_outage(private_redis, job_id):
    """A Redis restarted (its scripts gone) or out: the points of those intervals are sent
    with the next one that goes through (bounded), at their own steps."""
    r = make_client(private_redis.url)

    def steps() -> list[int]:
        with make_client(private_redis.url) as c:
            return sorted(p.step for e in entries(c, job_id) for p in e.points)

    async def run() -> None:
        client = make_async_client(parse_endpoint(private_redis.url), retries=0)
        tracker = MetricsTracker()
        pub = MetricsPublisher(tracker, job_id, "n", lambda *a, **k: None)
        sampler = ResourceSampler(client, job_id, "n", rider=pub)
        pub.start_attempt(0, holds_rank0=False)
        tracker.feed(0, "stdout", b"step 1 loss 0.5\n")
        await sampler.publish({})
        r.script_flush()
        tracker.feed(0, "stdout", b"step 2 loss 0.4\n")
        await sampler.publish({})  # NOSCRIPT: kept
        assert steps() == [1]
        tracker.feed(0, "stdout", b"step 3 loss 0.3\n")
        await sampler.publish({})  # sent again, with the script's text
        assert steps() == [1, 2, 3]
        private_redis.stop()  # no persistence: what it held is gone with it
        tracker.feed(0, "stdout", b"step 4 loss 0.2\n")
        await sampler.publish({})  # refused: kept
        private_redis.start()
        tracker.feed(0, "stdout", b"step 5 loss 0.1\n")
        await sampler.publish({})  # a new server knows no script: the text goes again
        assert steps() == [4, 5]
        await client.aclose()

    asyncio.run(run())


def test_nan_events_are_bounded_per_interval_and_once_per_rank(redis_url, job_id):
    """8 ranks turn NaN at once, each printing more non-finite values: one event per rank,
    at most 4 a node an interval (the rest in the next ones); with --on-nan stop, the first
    ends the job and its event is out at once, budget or not."""
    async def run(policy: str) -> tuple[list[list[dict[str, Any]]], MetricsPublisher]:
        emitted: list[dict[str, Any]] = []
        tracker = MetricsTracker()
        pub = MetricsPublisher(tracker, job_id, "n", lambda t, **d: emitted.append(d),
                               on_nan=policy)
        pub.start_attempt(3, holds_rank0=False)
        for rank in range(8):
            tracker.feed(rank, "stdout", f"step {10 + rank} loss nan\nstep 99 loss inf\n".encode())
        seen = [list(emitted)]
        client = make_async_client(parse_endpoint(redis_url))
        for _ in range(2):  # two intervals: queued, never sent (no Redis needed)
            pub.ride(client.pipeline(transaction=False))
            seen.append(list(emitted))
        await client.aclose()
        return seen, pub

    (now, first, second), pub = asyncio.run(run("observe"))
    assert len(now) == NAN_EVENTS_PER_INTERVAL and len(first) == 8 and second == first
    assert pub.stop is None
    assert [(d["rank"], d["step"], d["metric"], d["value"], d["attempt"]) for d in first] == [
        (rank, 10 + rank, "loss", "nan", 3) for rank in range(8)]
    (now, *_), pub = asyncio.run(run("stop"))
    assert pub.stop is not None and pub.stop.result()["rank"] == 0
    assert now[0]["rank"] == 0 and now[0]["policy"] == "stop"
    assert len(now) == 1 + NAN_EVENTS_PER_INTERVAL


def test_a_later_host_of_rank0_continues_the_curves(server, job_id):
    """The host of rank 0 writes its curves; another agent hosting rank 0 in a later round
    reads them once and goes on: the steps redone after a resume are marked as such."""
    r = make_client(server.url)

    async def host(round_: int, steps: range, final: bool) -> MetricsPublisher:
        client = make_async_client(parse_endpoint(server.url))
        tracker = MetricsTracker()
        pub = MetricsPublisher(tracker, job_id, f"node-{round_}", lambda *a, **k: None)
        sampler = ResourceSampler(client, job_id, f"node-{round_}", rider=pub)
        pub.start_attempt(round_, holds_rank0=True)
        for s in steps:
            tracker.feed(0, "stdout", f"step {s} loss {1 / (s + 1):.4f}\n".encode())
            tracker.feed(1, "stdout", f"step {s} loss {2 / (s + 1):.4f}\n".encode())
            if s != steps[-1]:  # the last step is printed just before the agent exits
                await sampler.publish({})
        if final:
            await sampler.final()
        await client.aclose()
        return pub

    asyncio.run(host(0, range(0, 6), final=True))
    stored = r.hgetall(JobKeys(job_id).metrics_history)
    assert set(stored) == {b"rank0/loss", b"min/loss", b"median/loss", b"max/loss"}
    pub = asyncio.run(host(1, range(4, 9), final=True))
    rank0 = decode_series(r.hget(JobKeys(job_id).metrics_history, "rank0/loss"))
    pts = [(step, value, attempt) for step, _ms, value, _lo, _hi, attempt in rank0.points()]
    assert pts == [(s, round(1 / (s + 1), 4), 0) for s in range(6)] + [
        (s, round(1 / (s + 1), 4), 1) for s in range(4, 9)]
    assert rank0.redone(5, 1) and not rank0.redone(6, 1)
    top = decode_series(r.hget(JobKeys(job_id).metrics_history, "max/loss"))
    assert all(math.isclose(v, 2 / (s + 1), rel_tol=1e-3) for s, _ms, v, *_ in top.points())
    assert pub.series["min/loss"].latest().value == pytest.approx(1 / 9, rel=1e-3)


def test_the_points_printed_just_before_a_restart_keep_their_attempt(server, job_id):
    """Points not yet published when the next attempt starts go with the next interval's, in
    their own attempt's entry; rank 0's curve has them in that attempt, and the steps the
    next attempt trains again are redone."""
    r = make_client(server.url)

    async def run() -> MetricsPublisher:
        client = make_async_client(parse_endpoint(server.url))
        tracker = MetricsTracker()
        pub = MetricsPublisher(tracker, job_id, "n", lambda *a, **k: None)
        sampler = ResourceSampler(client, job_id, "n", rider=pub)
        pub.start_attempt(0, holds_rank0=True)
        tracker.feed(0, "stdout", b"step 0 loss 1.0\nstep 1 loss 0.9\nstep 2 loss 0.8\n")
        pub.start_attempt(4, holds_rank0=True)  # a restart before the next interval
        tracker.feed(0, "stdout", b"step 1 loss 0.95\nstep 2 loss 0.85\n")
        await sampler.publish({})
        await sampler.final()
        await client.aclose()
        return pub

    pub = asyncio.run(run())
    assert [(e.attempt, [p.step for p in e.points]) for e in entries(r, job_id)] == [
        (0, [0, 1, 2]), (4, [1, 2])]
    rank0 = decode_series(r.hget(JobKeys(job_id).metrics_history, "rank0/loss"))
    assert [(s, v, a) for s, _ms, v, _lo, _hi, a in rank0.points()] == [
        (0, 1.0, 0), (1, 0.9, 0), (2, 0.8, 0), (1, 0.95, 4), (2, 0.85, 4)]
    assert rank0.redone(1, 4) and pub.series["rank0/loss"].redone(2, 4)


def test_curves_are_kept_for_at_most_8_names_loss_first(redis_url, job_id):
    tracker = MetricsTracker()
    pub = MetricsPublisher(tracker, job_id, "n", lambda *a, **k: None)

    async def run() -> list[Any]:
        pub.start_attempt(0, holds_rank0=True)
        names = " ".join(f"m{i:02d}={i}" for i in range(20))
        tracker.feed(0, "stdout", f"step 1 {names} train_loss=1 val_loss=2 lr=3\n".encode())
        client = make_async_client(parse_endpoint(redis_url))
        pipe = client.pipeline(transaction=False)
        pub.ride(pipe)  # queued, never sent
        await client.aclose()
        return [args for args, _options in pipe.command_stack]

    (script, *_) = asyncio.run(run())
    assert pub._names == ["train_loss", "val_loss", "lr", "m00", "m01", "m02", "m03", "m04"]
    assert len(pub._names) == HISTORY_METRICS
    # the stream, the history, the rounds' steps, and 8 latest sets
    assert script[0] == "EVAL" and script[2] == 3 + HISTORY_METRICS
    assert script[6:14] == tuple(JobKeys(job_id).metrics_latest(n, 0) for n in pub._names)


# -- a real agent ------------------------------------------------------------------------------

def test_the_points_land_at_the_steps_printed_across_a_restart(redis_url, r, job_id, tmp_path):
    """examples/train.py, 2 ranks, rank 1 crashes at step 3 and both resume from the last
    checkpoint: every loss each rank printed is in the metrics stream at its step, in the
    attempt it was printed in; rank 0's curve has both attempts, the resumed steps redone."""
    logs = tmp_path / "logs"
    agent = Agent(agent_args(redis_url, job_id, "--nnodes", "1", "--nproc-per-node", "2",
                             "--max-restarts", "1", FAST, "--log-dir", str(logs),
                             str(EXAMPLES / "train.py"), "--steps", "10", "--sleep", "0.25",
                             "--crash-rank", "1", "--crash-step", "5",
                             "--checkpoint-dir", str(tmp_path / "ckpt")), tmp_path, "agent")
    assert agent.wait(240) == 0, agent.output[-3000:]
    rounds = [e.data["round"] for e in of_type(r, job_id, EventType.WORKERS_STARTED)]
    assert len(rounds) == 2
    got: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
    for e in entries(r, job_id):
        for p in e.points:
            got[(e.attempt, p.rank)][p.step] = p.values["loss"]
    for attempt in rounds:
        for rank in (0, 1):
            (out,) = logs.glob(f"*/attempt_{attempt}/{rank}/stdout.log")
            assert got[(attempt, rank)] == printed(out), (attempt, rank)
    assert max(got[(rounds[0], 1)]) == 4 and min(got[(rounds[1], 1)]) < 5  # resumed before it
    history = r.hgetall(JobKeys(job_id).metrics_history)
    rank0 = decode_series(history[b"rank0/loss"])
    assert [(s, v, a) for s, _ms, v, _lo, _hi, a in rank0.points()] == [
        (s, v, a) for a in rounds for s, v in sorted(got[(a, 0)].items())]
    first_resumed = min(got[(rounds[1], 0)])
    assert rank0.redone(first_resumed, rounds[1])
    # the spread across ranks: min and max are values a rank printed; the median of the two
    # ranks is the mean of the middle two, as the console's
    every = {v for pts in got.values() for v in pts.values()}
    spread = [decode_series(history[f"{k}/loss".encode()]) for k in ("min", "median", "max")]
    for lo, mid, hi in zip(*(list(s.points()) for s in spread)):
        assert lo[0] == mid[0] == hi[0] and lo[2] <= mid[2] <= hi[2]
        assert {lo[2], hi[2]} <= every
        assert mid[2] == pytest.approx((lo[2] + hi[2]) / 2, rel=1e-9)
    sample = json.loads(r.hget(JobKeys(job_id).resources, "1"))
    assert sample["step"] == 9 and decode_latest(sample).values["loss"] == got[(rounds[1], 1)][9]
    assert r.ttl(JobKeys(job_id).metrics) > 0 and r.ttl(JobKeys(job_id).metrics_history) > 0


@pytest.mark.parametrize("policy", ["stop", "observe"])
def test_a_nan_is_an_event_and_with_on_nan_stop_the_end(redis_url, r, job_id, tmp_path, policy):
    go = tmp_path / "go"
    flags = ["--on-nan", "stop"] if policy == "stop" else []
    agent = Agent(agent_args(redis_url, job_id, "--nnodes", "1", "--nproc-per-node", "2",
                             *flags, FAST, "--log-dir", str(tmp_path / "logs"), WORKER,
                             "steps", "8", "--nan-rank", "1", "--nan-step", "5",
                             "--go", str(go)), tmp_path, "agent")
    try:
        if policy == "observe":
            wait_until(lambda: of_type(r, job_id, EventType.NAN), 60, "the nan event")
            # the job goes on: its workers wait for the go file, then finish
            go.touch()
        code = agent.wait(90)
    finally:
        agent.kill()
    (nan,) = of_type(r, job_id, EventType.NAN)  # once, though rank 1 printed nan 3 times
    assert {k: nan.data[k] for k in ("rank", "step", "metric", "value", "policy")} == {
        "rank": 1, "step": 5, "metric": "loss", "value": "nan", "policy": policy}
    assert nan.data["node"] == nan.node and nan.data["attempt"] == 0
    if policy == "observe":
        assert code == 0, agent.output[-3000:]
        assert of_type(r, job_id, EventType.JOB_SUCCEEDED)
        return
    assert code == 1, agent.output[-3000:]
    (failed,) = of_type(r, job_id, EventType.JOB_FAILED)
    cause = failed.data["root_cause"]
    assert (cause["reason"], cause["rank"], cause["step"], cause["metric"]) == (
        "nan", 1, 5, "loss"), cause
    assert "rank 1 printed loss = nan at step 5" in agent.output
    assert r.hget(JobKeys(job_id).meta, "final_state") == b"failed"
    assert "done" not in (next((tmp_path / "logs").glob("*/attempt_0/1/stdout.log"))).read_text()


def test_metrics_are_prometheus_gauges_per_local_rank(redis_url, job_id, tmp_path):
    go = tmp_path / "go"
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "2",
                             "--health-check-port", "0", RDZV, "--log-dir",
                             str(tmp_path / "logs"), WORKER, "steps", "7", "--go", str(go)),
                  tmp_path, "agent")
    try:
        port = served_port(agent)

        def settled() -> str | None:
            text = get(port, "/metrics")[2]
            ok = all(metric(text, f'elastic_worker_step{{local_rank="{i}",rank="{i}"}}') == 6
                     for i in (0, 1))
            return text if ok else None

        text = wait_until(settled, 60, "the workers' steps in /metrics")
        assert metric(text, 'elastic_worker_metric{local_rank="1",name="loss",rank="1"}') == (
            pytest.approx(1 / 8, abs=1e-4))
        assert metric(text, 'elastic_worker_metric{local_rank="0",name="lr",rank="0"}') == 0.1
        assert "# TYPE elastic_worker_steps_per_second gauge" in text
        go.touch()
        assert agent.wait(60) == 0, agent.output[-3000:]
    finally:
        agent.kill()


def test_hostile_output_keeps_the_agent_and_redis_bounded(redis_url, r, job_id, tmp_path):
    """A worker printing a million distinct metric names with numbers of any size, then a
    number 10 MB long: the agent's memory and the job's metric keys in Redis stay bounded."""
    lines = 1_000_000
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "1", RDZV, "--log-dir",
                             str(tmp_path / "logs"), WORKER, "hostile", str(lines)),
                  tmp_path, "agent")
    peak = 0
    proc = psutil.Process(agent.pid)
    try:
        while agent.proc.poll() is None:
            try:
                peak = max(peak, proc.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)  # the sampling period of the agent's RSS
        assert agent.wait(120) == 0, agent.output[-3000:]
    finally:
        agent.kill()
    keys = JobKeys(job_id)
    metric_keys = [k.decode() for k in r.scan_iter(match=keys.prefix.replace("{", "\\{")
                                                   .replace("}", "\\}") + "metrics*")]
    sizes = {k: r.memory_usage(k) for k in metric_keys}
    es = entries(r, job_id)
    names = {n for e in es for p in e.points for n in p.values}
    sample = decode_latest(json.loads(r.hget(keys.resources, "0") or b"{}")) if r.hget(
        keys.resources, "0") else None
    print(f"\nhostile output ({lines} lines): agent peak RSS {peak / 2**20:.1f} MiB; "
          f"metric keys {len(metric_keys)}, {sum(sizes.values()) / 1024:.1f} KiB; "
          f"stream entries {len(es)}; names {len(names)}")
    assert len(names) <= MAX_NAMES
    assert all(len(json.dumps([p.values for p in e.points])) < MAX_METRICS_ENTRY_BYTES for e in es)
    assert len(metric_keys) <= 2 + HISTORY_METRICS, metric_keys
    assert sum(sizes.values()) < 4 * 2**20, sizes
    # names refused are counted (as of the last sample before the worker's exit)
    assert sample is not None and sample.dropped > lines // 2 and len(sample.values) == MAX_NAMES
    assert peak < 200 * 2**20, f"agent RSS peaked at {peak / 2**20:.0f} MiB"
    (nan,) = of_type(r, job_id, EventType.NAN)  # 1e999: one event, not a million
    assert nan.data["value"] == "inf"


def test_on_nan_is_a_choice():
    assert parse_args([WORKER], {}).on_nan == "observe"
    assert parse_args(["--on-nan", "stop", WORKER], {}).on_nan == "stop"
    with pytest.raises(UsageError, match="invalid choice"):
        parse_args(["--on-nan", "panic", WORKER], {})
