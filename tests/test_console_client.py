"""JobClient against a real redis-server (and a real agent where behaviour needs one)."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator

import pytest
import redis

from elastic_agent.coordination.transport.connection import RedisUnavailableError, make_client
from elastic_agent.coordination.wire.event_records import Event, EventType, encode_event
from elastic_agent.coordination.wire.keyspace import JOBS_INDEX, JobKeys
from elastic_agent.coordination.wire.log_records import LogBatch, encode_log_batch
from elastic_console.job import client as client_module
from elastic_console.job import follow as follow_module
from elastic_console.job.client import HISTORY_STREAMS_PER_READ, ConnectionChange, JobClient
from elastic_console.job.state import Skipped
from tests.agents import SCRIPTS, Agent, wait_until
from tests.waiting import wait_until_async


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


class Collector:
    """Consumes ``client.follow()`` in a task, keeping every record."""

    def __init__(self, agen: AsyncIterator[object]) -> None:
        self.records: list[object] = []
        self._agen = agen
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        async for rec in self._agen:
            self.records.append(rec)

    def of(self, kind: type) -> list:
        return [r for r in self.records if isinstance(r, kind)]

    async def stop(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


def add_event(r: redis.Redis, job: str, event_type: str, node: str = "a-1-x", **data) -> str:
    return r.xadd(JobKeys(job).events, encode_event(event_type, node, data)).decode()


def add_logs(r: redis.Redis, job: str, node: str, rank: int, seq: int, *lines: str,
             register: bool = True) -> str:
    keys = JobKeys(job)
    if register:
        r.sadd(keys.log_streams, keys.logs(node))
    b = LogBatch(node=node, rank=rank, local_rank=0, attempt=0, stream="out", seq=seq,
                 lines=list(lines))
    return r.xadd(keys.logs(node), encode_log_batch(b)).decode()


def test_history_then_follow_continues_with_no_gap_and_no_duplicate(redis_url, r, job_id):
    old_events = [add_event(r, job_id, EventType.NODE_JOINED, host=f"h{i}") for i in range(5)]
    old_logs = [add_logs(r, job_id, "a-1-x", 0, i + 1, f"old {i}") for i in range(3)]
    old_logs += [add_logs(r, job_id, "b-2-y", 1, i + 1, f"old b {i}") for i in range(2)]
    # More streams than history reads at once, written round-robin: the merge spans groups.
    many = [f"n{i}-{i}-z" for i in range(2 * HISTORY_STREAMS_PER_READ + 1)]
    old_logs += [add_logs(r, job_id, node, 2 + i, k + 1, f"old {node} {k}")
                 for k in range(2) for i, node in enumerate(many)]

    async def main() -> None:
        client = JobClient(redis_url, job_id)
        try:
            events, logs = await client.history()
            assert [e.id for e in events] == old_events
            assert sorted(b.id for b in logs) == [b.id for b in logs]  # merged by server time
            assert {b.id for b in logs} == set(old_logs)
            few, _ = await client.history(max_events=2, max_log_entries_per_stream=1)
            assert [e.id for e in few] == old_events[-2:]  # the newest, oldest first
            await client.history()  # the cursor is at the newest entries again
            col = Collector(client.follow())
            new_events = [add_event(r, job_id, EventType.NODE_JOINED, host=f"n{i}")
                          for i in range(5)]
            new_logs = [add_logs(r, job_id, "a-1-x", 0, 10 + i, f"new {i}") for i in range(4)]
            new_many = [add_logs(r, job_id, node, 30, 10, "new last group") for node in many[-1:]]
            await wait_until_async(lambda: len(col.of(Event)) >= 5 and len(col.of(LogBatch)) >= 5,
                                   10, "the new entries")
            await asyncio.sleep(0)  # let anything extra already read arrive too
            assert [e.id for e in col.of(Event)] == new_events
            assert sorted(b.id for b in col.of(LogBatch)) == sorted(new_logs + new_many)
            assert [b.lines for b in col.of(LogBatch) if b.node == "a-1-x"] == [
                [f"new {i}"] for i in range(4)]
            assert not col.of(ConnectionChange)
            await col.stop()
        finally:
            await client.close()

    run(main())


def test_follow_reads_at_most_every_read_interval_and_loses_nothing(redis_url, r, job_id):
    """A writer adding an entry every ~2 ms: one XREAD per entry would be ~500 a second;
    follow waits READ_INTERVAL_S between reads, so entries arrive in a few dozen replies,
    all of them, in order."""
    add_event(r, job_id, EventType.NODE_JOINED, host="a")
    add_logs(r, job_id, "a-1-x", 0, 1, "before")  # the stream is known to history()

    async def main() -> None:
        client = JobClient(redis_url, job_id)
        reads = 0
        xread = client._reader.xread

        async def counting(*args: object, **kwargs: object) -> object:
            nonlocal reads
            reads += 1
            return await xread(*args, **kwargs)

        client._reader.xread = counting  # type: ignore[method-assign]
        try:
            await client.history()
            col = Collector(client.follow())
            await wait_until_async(lambda: reads >= 1, 10, "the first XREAD")
            reads = 0
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            written = []
            # A count, not a duration: on a busy machine the writer is slower, the bound
            # below grows with the time it took, and nothing fails for being slow.
            for i in range(300):
                written.append(await asyncio.to_thread(
                    add_logs, r, job_id, "a-1-x", 0, i + 2, f"line {i}"))
                await asyncio.sleep(0.002)  # the writer's pace between entries, not a wait
            elapsed = loop.time() - t0
            await wait_until_async(lambda: len(col.of(LogBatch)) >= len(written), 10, "every entry")
            assert [b.id for b in col.of(LogBatch)] == written
            assert reads <= elapsed / follow_module.READ_INTERVAL_S + 5, (reads, elapsed)
            await col.stop()
        finally:
            await client.close()

    run(main())


def count_xreads(client: JobClient) -> list[int]:
    """Count the client's XREAD calls (in the one-element list returned)."""
    calls = [0]
    xread = client._reader.xread

    async def counting(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return await xread(*args, **kwargs)

    client._reader.xread = counting  # type: ignore[method-assign]
    return calls


def test_a_log_stream_that_appears_later_is_read_from_its_start(redis_url, r, job_id):
    add_event(r, job_id, EventType.NODE_JOINED, host="a")

    async def main() -> None:
        client = JobClient(redis_url, job_id)
        reads = count_xreads(client)
        try:
            await client.history()
            col = Collector(client.follow())
            # The first XREAD is sent, its streams chosen without the new one.
            await wait_until_async(lambda: reads[0] >= 1, 10, "the first XREAD")
            # Entries written before the stream is registered must not be skipped.
            first = add_logs(r, job_id, "c-3-z", 2, 1, "early", register=False)
            second = add_logs(r, job_id, "c-3-z", 2, 2, "registered")
            add_event(r, job_id, EventType.WORKERS_STARTED, "c-3-z", ranks=[2], pids=[1])
            await wait_until_async(lambda: len(col.of(LogBatch)) >= 2, 5, "the announced stream")
            assert [b.id for b in col.of(LogBatch)] == [first, second]
            # A stream announced by no event is found by the periodic re-read.
            late = add_logs(r, job_id, "d-4-w", 3, 1, "quiet node")
            await wait_until_async(lambda: len(col.of(LogBatch)) >= 3, 8, "the unannounced stream")
            assert col.of(LogBatch)[-1].id == late and col.of(LogBatch)[-1].lines == ["quiet node"]
            await col.stop()
        finally:
            await client.close()

    run(main())


def test_follow_rides_out_a_redis_restart_without_gap_or_duplicate(private_redis, job_id):
    srv = private_redis
    srv.stop()
    srv.extra_args = ["--appendonly", "yes", "--appendfsync", "always"]
    srv.start()
    r = make_client(srv.url)
    add_event(r, job_id, EventType.NODE_JOINED, host="a")

    async def main() -> None:
        client = JobClient(srv.url, job_id)
        try:
            await client.history()
            col = Collector(client.follow())
            # (kind, id): ids of different streams can be equal.
            before = [("e", add_event(r, job_id, EventType.LOGS_DROPPED, count=i)) for i in range(3)]
            before.append(("l", add_logs(r, job_id, "a-1-x", 0, 1, "before")))
            await wait_until_async(lambda: len(col.records) >= 4, 10, "entries before the outage")
            srv.kill()
            await wait_until_async(lambda: col.of(ConnectionChange), 10, "the outage to be reported")
            down = col.of(ConnectionChange)[0]
            assert not down.connected and srv.url in down.error
            assert down.error.startswith("cannot reach Redis at ")
            srv.start()
            # Written before the reader is back: a reader that re-sent '$' would skip these.
            r2 = make_client(srv.url)
            after = [("e", add_event(r2, job_id, EventType.LOGS_DROPPED, count=10 + i))
                     for i in range(3)]
            after.append(("l", add_logs(r2, job_id, "a-1-x", 0, 2, "after")))
            await wait_until_async(lambda: len(col.records) >= 10, 15, "entries after the restart")
            # A last entry on each stream: once both are read, any duplicate of an earlier
            # entry, which comes before them, has been read too.
            after.append(("e", add_event(r2, job_id, EventType.LOGS_DROPPED, count=99)))
            after.append(("l", add_logs(r2, job_id, "a-1-x", 0, 3, "last")))
            await wait_until_async(
                lambda: {rec.id for rec in col.records if isinstance(rec, (Event, LogBatch))}
                >= {after[-2][1], after[-1][1]}, 15, "the last entries")
            r2.close()
            changes = col.of(ConnectionChange)
            assert [c.connected for c in changes] == [False, True]
            got = [("e" if isinstance(rec, Event) else "l", rec.id) for rec in col.records
                   if isinstance(rec, (Event, LogBatch))]
            assert sorted(got) == sorted(before + after)  # all of them, none twice
            await col.stop()
        finally:
            await client.close()

    try:
        run(main())
    finally:
        r.close()


def test_commands_acks_list_jobs_and_follow_with_a_real_agent(redis_url, r, job_id, tmp_path):
    args = ["--redis", redis_url, "--job-id", job_id, "--local-addr", "127.0.0.1",
            "--nproc-per-node", "1", "--max-restarts", "2", "--shutdown-timeout", "5",
            str(SCRIPTS / "sleeper.py")]

    async def main() -> Agent:
        client = JobClient(redis_url, job_id)
        try:
            assert not await client.job_exists()
            await client.history()  # nothing yet: follow starts at the beginning of it all
            col = Collector(client.follow())
            agent = Agent(args, tmp_path, "a")
            await wait_until_async(
                lambda: any(isinstance(b, LogBatch) and b.lines[0].startswith("worker rank=0")
                            for b in col.records), 30, "the worker's first line")
            types = [e.type for e in col.of(Event)]
            assert types[:3] == [EventType.NODE_JOINED, EventType.RENDEZVOUS_COMPLETE,
                                 EventType.WORKERS_STARTED]
            assert await client.job_exists()

            jobs = {j.job_id: j for j in await client.list_jobs()}
            mine = jobs[job_id]
            assert (mine.state, mine.nodes, mine.world_size, mine.restarts_used,
                    mine.max_restarts) == ("running", 1, 1, 0, 2)
            assert 0 <= mine.age_s < 60 and mine.created_ms > 0

            assert await client.can_write() == (True, "")
            active = await client.active_nodes()
            assert len(active) == 1
            with pytest.raises(ValueError, match="unknown command type"):
                await client.send_command("explode")

            cid = await client.send_command("restart")
            assert re.fullmatch(r"c-[0-9a-f]{8}", cid)
            seen = []
            acks = await client.wait_acks(cid, timeout=15, on_ack=seen.append)
            assert [(a.node, a.status) for a in acks] == [(next(iter(active)), "accepted")]
            assert acks == seen and "restart from " in acks[0].reason and "@" in acks[0].reason
            await wait_until_async(
                lambda: any(e.type == EventType.RESTARTING and e.data.get("command_id") == cid
                            for e in col.of(Event)), 15, "the restart")
            meta = await client.meta()
            assert meta["min_nodes"] == "1" and meta["max_restarts"] == "2"

            cid = await client.send_command("stop")
            acks = await client.wait_acks(cid, expected_nodes=1, timeout=15)
            assert [a.status for a in acks] == ["accepted"]
            await wait_until_async(lambda: any(e.type == EventType.JOB_STOPPED for e in col.of(Event)),
                                   15, "the job to stop")
            # Asking again after the fact finds the ack in the stream at once.
            again = await client.wait_acks(cid, expected_nodes=1, timeout=1)
            assert [a.status for a in again] == ["accepted"]
            await col.stop()
            return agent
        finally:
            await client.close()

    agent = run(main())
    assert agent.wait(30) == 143, agent.output[-2000:]
    wait_until(lambda: r.hget(JobKeys(job_id).meta, "final_state") == b"stopped", 5, "final state")


def test_can_write_is_false_for_a_read_only_acl_user(redis_url, r, job_id):
    user, password = f"ro-{uuid.uuid4().hex[:6]}", f"pw-{uuid.uuid4().hex}"
    r.execute_command("ACL", "SETUSER", user, "on", f">{password}", "%R~*", "+@read", "+ping",
                      "+acl|whoami", "+acl|dryrun")
    noacl = f"{user}-noacl"
    r.execute_command("ACL", "SETUSER", noacl, "on", f">{password}", "%R~*", "+@read", "+ping")
    host_port = redis_url.split("://", 1)[1]

    async def main() -> None:
        ro = JobClient(f"redis://{user}:{password}@{host_port}", job_id)
        default = JobClient(redis_url, job_id)
        blind = JobClient(f"redis://{noacl}:{password}@{host_port}", job_id)
        try:
            ok, why = await ro.can_write()
            assert not ok
            assert why.startswith(f"the Redis user '{user}' may not write the command stream")
            assert password not in why and "***" in why
            with pytest.raises(RedisUnavailableError, match="may not write the command stream") as e:
                await ro.send_command("stop")
            assert password not in str(e.value)
            assert await default.can_write() == (True, "")
            # ACL not permitted to this user: no answer, so no refusal (send will tell).
            assert await blind.can_write() == (True, "")
            assert await ro.job_exists() is False  # reading works
        finally:
            for c in (ro, default, blind):
                await c.close()

    try:
        run(main())
    finally:
        r.execute_command("ACL", "DELUSER", user, noacl)


def test_list_jobs_summarises_from_meta_events_and_counters(redis_url, r, job_id):
    keys = JobKeys(job_id)
    r.zadd(JOBS_INDEX, {job_id: 1_000, "bad{job": 2_000})
    r.hset(keys.meta, mapping={"created_ms": 1_000, "min_nodes": 1, "max_nodes": 2,
                               "max_restarts": 5})
    r.set(keys.restarts, 2)
    add_event(r, job_id, EventType.NODE_JOINED, "a-1-x", host="a")
    add_event(r, job_id, EventType.NODE_JOINED, "b-2-y", host="b")
    add_event(r, job_id, EventType.RENDEZVOUS_COMPLETE, round=3, world_size=8,
              nodes=[{"node": "a-1-x", "host": "a", "group_rank": 0},
                     {"node": "b-2-y", "host": "b", "group_rank": 1}])
    add_event(r, job_id, EventType.WORKERS_STARTED, ranks=[0, 1, 2, 3], pids=[1, 2, 3, 4])
    add_event(r, job_id, EventType.JOB_FAILED, root_cause={"rank": 1}, restarts_used=2)
    r.hset(keys.resources, mapping={"0": '{"cpu": 5, "rss": 7}', "1": "not json"})

    async def main() -> None:
        client = JobClient(redis_url)
        try:
            jobs = {j.job_id: j for j in await client.list_jobs()}
            assert "bad{job" not in jobs
            j = jobs[job_id]
            assert (j.state, j.nodes, j.world_size, j.restarts_used, j.max_restarts,
                    j.created_ms) == ("failed", 2, 8, 2, 5, 1_000)
            assert j.age_s > 1_000  # server time minus 1970 + 1 s
            with pytest.raises(ValueError):
                await client.meta()  # no job id
        finally:
            await client.close()
        jc = JobClient(redis_url, job_id)
        try:
            assert await jc.resources() == {0: {"cpu": 5, "rss": 7}}
        finally:
            await jc.close()

    try:
        run(main())
    finally:
        r.zrem(JOBS_INDEX, "bad{job")


def test_unreachable_redis_is_one_clear_error_without_the_password():
    async def main() -> None:
        client = JobClient("redis://me:hunter2@127.0.0.1:1", "some-job")
        try:
            with pytest.raises(RedisUnavailableError) as e:
                await client.job_exists()
        finally:
            await client.close()
        msg = str(e.value)
        assert msg.startswith("cannot reach Redis at redis://me:***@127.0.0.1:1")
        assert "hunter2" not in msg and "\n" not in msg

    run(main())


def test_list_jobs_counts_nodes_from_the_round_when_the_events_folded_miss_it(
        redis_url, r, job_id):
    """list_jobs folds only the newest LIST_EVENTS_PER_JOB events of a running job: when its
    last rendezvous_complete is older than those (a big job's workers_started, restarts), the
    node count comes from the round record, not from the few joins in the window."""
    from elastic_console.job.client import LIST_EVENTS_PER_JOB

    keys = JobKeys(job_id)
    r.zadd(JOBS_INDEX, {job_id: 1_000})
    r.hset(keys.meta, mapping={"created_ms": 1_000, "min_nodes": 3, "max_nodes": 3})
    nodes = [{"node": f"n{i}-1-x", "host": f"h{i}", "addr": "10.0.0.1", "port": 29500,
              "nproc": 1, "group_rank": i} for i in range(3)]
    add_event(r, job_id, EventType.RENDEZVOUS_COMPLETE, round=0, world_size=3,
              nodes=[{k: n[k] for k in ("node", "host", "group_rank")} for n in nodes])
    r.set(keys.rdzv_round_info, json.dumps({"round": 0, "world_size": 3, "nodes": nodes}))
    for _ in range(LIST_EVENTS_PER_JOB):  # a late joiner's join, then starts, past the window
        add_event(r, job_id, EventType.NODE_JOINED, "late-9-z", host="late")
        add_event(r, job_id, EventType.WORKERS_STARTED, ranks=[0], pids=[1])

    async def main() -> None:
        client = JobClient(redis_url)
        try:
            j = {j.job_id: j for j in await client.list_jobs()}[job_id]
            assert j.nodes == 3, j
        finally:
            await client.close()

    asyncio.run(main())


class ManyCollector(Collector):
    """Consumes ``client.follow_many()``, keeping every record and every list."""

    async def _run(self) -> None:
        self.lists: list[list[object]] = []
        async for recs in self._agen:
            self.lists.append(recs)
            self.records.extend(recs)


def test_follow_many_yields_what_follow_yields(redis_url, r, job_id):
    """The console's reader (a list per read, log entries through LogEntryDecoder) sees the
    same records as follow: events, batches of several nodes, a repeat,
    an entry in another field order, a malformed one (counted in Skipped), a new node's
    stream announced by an event."""
    add_event(r, job_id, EventType.NODE_JOINED, host="a")
    add_logs(r, job_id, "a-1-x", 0, 1, "before")
    keys = JobKeys(job_id)

    async def main() -> None:
        one, many = JobClient(redis_url, job_id), JobClient(redis_url, job_id)
        try:
            await one.history()
            await many.history()
            col, mcol = Collector(one.follow()), ManyCollector(many.follow_many())
            for i in range(40):
                add_logs(r, job_id, "a-1-x", i % 3, 2 + i, f"line {i}", "second")
                if i % 10 == 0:
                    add_event(r, job_id, EventType.NODE_JOINED, host=f"h{i}")
            add_logs(r, job_id, "a-1-x", 0, 2, "line 0", "second")  # a repeat: both yield it
            fields = encode_log_batch(LogBatch("a-1-x", 1, 0, 0, "err", 99, ["reordered"]))
            r.xadd(keys.logs("a-1-x"), dict(reversed(list(fields.items()))))
            r.xadd(keys.logs("a-1-x"), {"v": "1", "node": "a-1-x", "rank": "x", "s": "out"})
            add_event(r, job_id, EventType.NODE_JOINED, "b-2-y", host="b")
            add_logs(r, job_id, "b-2-y", 7, 1, "from b")
            # A last record in each stream: once both readers have all three, everything
            # written before them has arrived (order holds within a stream), and counts are
            # exact without waiting out a moment for stragglers.
            add_logs(r, job_id, "a-1-x", 0, 100, "end of a")
            add_logs(r, job_id, "b-2-y", 7, 2, "end of b")
            add_event(r, job_id, EventType.NODE_JOINED, host="end")

            def ended(records: list[object]) -> bool:
                return {"end of a", "end of b", "end"} <= {
                    x.lines[0] if isinstance(x, LogBatch) else x.data.get("host")
                    for x in records if isinstance(x, LogBatch | Event)}

            await wait_until_async(lambda: ended(col.records) and ended(mcol.records), 10,
                                   "every stream's last record")
            assert len(col.of(LogBatch)) == 43 + 2
            # Within a stream, the same order; across streams it depends on what each read
            # happened to find.
            assert col.of(Event) == mcol.of(Event) and col.of(LogBatch) == mcol.of(LogBatch)
            assert not col.of(ConnectionChange) and not mcol.of(ConnectionChange)
            assert mcol.of(Skipped)[-1].total == 1 == many.skipped
            assert all(mcol.lists) and len(mcol.lists) < len(mcol.records)
            assert many.last_ids == one.last_ids
            await col.stop()
            await mcol.stop()
        finally:
            await one.close()
            await many.close()

    run(main())


def test_reading_thousands_of_resource_samples_lets_the_event_loop_run(redis_url, r, job_id,
                                                                       monkeypatch):
    """4,096 ranks' samples decoded in one go were a 90 ms stall a second: the client yields
    to the event loop every RESOURCES_PER_SLICE samples, so keys and frames go between."""
    n = 4 * client_module.RESOURCES_PER_SLICE + 1
    r.hset(JobKeys(job_id).resources, mapping={
        str(rank): json.dumps({"rank": rank, "cpu": 99.5, "rss": 1 << 30, "ts": 1.0})
        for rank in range(n)})

    async def main() -> None:
        client = JobClient(redis_url, job_id)
        turns = 0
        done = False
        seen: list[int] = []  # the loop turns so far, at each sample decoded
        decode = client_module.decode_json

        def counting_decode(*args: object) -> object:
            seen.append(turns)
            return decode(*args)

        async def ticker() -> None:
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)  # one event-loop turn per count: what is measured

        monkeypatch.setattr(client_module, "decode_json", counting_decode)
        try:
            task = asyncio.ensure_future(ticker())
            samples = await client.resources()
            done = True
            await task
        finally:
            await client.close()
        assert len(samples) == n and samples[7]["cpu"] == 99.5
        # Turns between the first sample decoded and the last: the reply's wait not counted.
        assert seen[-1] - seen[0] >= 4, (seen[0], seen[-1])

    run(main())


def test_follow_many_hands_a_big_read_over_in_small_lists(redis_url, r, job_id, monkeypatch):
    """A read holds up to READ_COUNT entries of every stream: follow_many decodes and yields
    DECODE_SLICE entries' records at a time, so the console gets control back in between."""
    monkeypatch.setattr(follow_module, "DECODE_SLICE", 8)
    add_event(r, job_id, EventType.NODE_JOINED, host="a")
    add_logs(r, job_id, "a-1-x", 0, 1, "before")

    async def main() -> None:
        client = JobClient(redis_url, job_id)
        try:
            await client.history()
            for i in range(50):  # all there before the first read
                add_logs(r, job_id, "a-1-x", 0, 2 + i, f"line {i}")
            col = ManyCollector(client.follow_many())
            await wait_until_async(lambda: len(col.of(LogBatch)) == 50, 10, "the 50 lines")
            await col.stop()
        finally:
            await client.close()
        assert [b.lines for b in col.of(LogBatch)] == [[f"line {i}"] for i in range(50)]
        assert max(len(lst) for lst in col.lists) <= 8 and len(col.lists) >= 7

    run(main())


def test_history_without_logs_reads_no_log_stream(redis_url, r, job_id):
    # `status` of 4,096 nodes: one read per node stream for nothing but a cursor was most of
    # its time (bench/cli_scale_bench.py). logs=False touches no log stream at all.
    events = [add_event(r, job_id, EventType.NODE_JOINED, host=f"h{i}") for i in range(3)]
    for i in range(2 * HISTORY_STREAMS_PER_READ + 1):
        add_logs(r, job_id, f"n{i}-{i}-z", i, 1, "a line")
    before = r.info("commandstats").get("cmdstat_xrevrange", {}).get("calls", 0)

    async def main() -> None:
        client = JobClient(redis_url, job_id)
        try:
            got, logs = await client.history(max_events=10, max_log_entries_per_stream=0,
                                             logs=False)
            assert [e.id for e in got] == events and logs == []
            assert set(client.last_ids) == {JobKeys(job_id).events}
            col = Collector(client.follow(logs=False))  # events still follow on from there
            new = add_event(r, job_id, EventType.NODE_LEFT, host="h0")
            await wait_until_async(lambda: col.of(Event), 10, "the new event")
            assert [e.id for e in col.of(Event)] == [new]
            await col.stop()
        finally:
            await client.close()

    run(main())
    assert r.info("commandstats")["cmdstat_xrevrange"]["calls"] - before == 1
