"""JobClient's follow half at scale (console/job/follow.py): reads sized and spaced by the number of
streams, lists that span streams, bursts of events read apart. Counts, not times; real Redis."""

from __future__ import annotations

import asyncio
from typing import Any

from elastic_agent.coordination.wire.event_records import Event, EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.log_records import LogBatch
from elastic_console.job import follow as follow_module
from elastic_console.job.client import JobClient
from elastic_console.job.follow import (
    READ_COUNT,
    READ_COUNT_MIN,
    READ_INTERVAL_MAX_S,
    READ_INTERVAL_S,
    read_count,
    read_interval,
)
from tests.test_console_client import ManyCollector, add_event, add_logs, run
from tests.waiting import wait_until_async


def record_xreads(client: JobClient) -> list[dict[str, Any]]:
    """Every XREAD of the client's reader: its COUNT, its BLOCK, its streams and how many
    entries of each stream came back."""
    calls: list[dict[str, Any]] = []
    xread = client._reader.xread

    async def recording(streams: dict[str, str], count: int | None = None,
                        block: int | None = None) -> Any:
        # "entries" stays empty for a read cancelled in flight (the follow stopped during it).
        call: dict[str, Any] = {"count": count, "block": block, "streams": len(streams),
                                "entries": []}
        calls.append(call)
        reply = await xread(streams, count=count, block=block)
        call["entries"] = [len(entries) for _, entries in reply or ()]
        return reply

    client._reader.xread = recording  # type: ignore[method-assign]
    return calls


def test_read_count_and_interval_follow_the_number_of_streams():
    # A job of 64 nodes reads as before; one of 4,096 asks for a share of the budget of each
    # stream, and reads every 0.1 s, not every 20 ms.
    assert read_count(65) == READ_COUNT and read_interval(65) == READ_INTERVAL_S
    assert read_count(4097) == READ_COUNT_MIN and read_count(4097) * 4097 <= 2 * 32_768
    assert read_interval(4097) == READ_INTERVAL_MAX_S
    assert read_count(1) == READ_COUNT and read_count(0) == READ_COUNT
    assert READ_INTERVAL_S < read_interval(1_000) < READ_INTERVAL_MAX_S


def test_one_read_brings_its_budget_not_count_per_stream(redis_url, r, job_id, monkeypatch):
    """A console behind many streams: each XREAD asks for READ_BUDGET / streams of each (the
    reply is bounded by the budget, not by streams x READ_COUNT), and nothing is lost."""
    monkeypatch.setattr(follow_module, "READ_BUDGET", 24)
    monkeypatch.setattr(follow_module, "READ_COUNT_MIN", 2)
    nodes = [f"n{i}-{i}-z" for i in range(8)]
    add_event(r, job_id, EventType.NODE_JOINED, host="a")
    for i, node in enumerate(nodes):
        add_logs(r, job_id, node, i, 1, "before")

    async def main() -> None:
        client = JobClient(redis_url, job_id)
        calls = record_xreads(client)
        try:
            await client.history()
            for seq in range(2, 12):  # 10 entries a stream, there before the first read
                for i, node in enumerate(nodes):
                    add_logs(r, job_id, node, i, seq, f"line {seq}")
            col = ManyCollector(client.follow_many())
            await wait_until_async(lambda: len(col.of(LogBatch)) == 80, 10, "the 80 entries")
            await col.stop()
        finally:
            await client.close()
        reads = [c for c in calls if c["entries"]]
        # 9 streams (the events and 8 log streams): 24 // 9 = 2 entries of each per read.
        assert reads and all(c["count"] == 2 for c in reads), reads
        assert all(n <= 2 for c in reads for n in c["entries"]), reads
        got = col.of(LogBatch)
        for node in nodes:
            assert [b.seq for b in got if b.node == node] == list(range(2, 12))

    run(main())


def test_a_burst_of_events_is_read_apart_at_full_count(redis_url, r, job_id, monkeypatch):
    """The events stream gets the same small share as every log stream in the joint read; when
    that share came back full (a restart of thousands of ranks), the next reads take the
    events alone, READ_COUNT at a time, without waiting: a few reads, not one per share."""
    monkeypatch.setattr(follow_module, "READ_BUDGET", 4)
    monkeypatch.setattr(follow_module, "READ_COUNT_MIN", 1)
    add_event(r, job_id, EventType.NODE_JOINED, host="a")
    for i in range(3):
        add_logs(r, job_id, f"n{i}-{i}-z", i, 1, "before")

    async def main() -> None:
        client = JobClient(redis_url, job_id)
        calls = record_xreads(client)
        try:
            await client.history()
            burst = [add_event(r, job_id, EventType.WORKER_EXITED, host="a", rank=k,
                               exit_code=1) for k in range(300)]
            col = ManyCollector(client.follow_many())
            await wait_until_async(lambda: len(col.of(Event)) == 300, 20, "the 300 events")
            await col.stop()
        finally:
            await client.close()
        assert [e.id for e in col.of(Event)] == burst
        joint = [c for c in calls if c["streams"] == 4 and c["entries"]]
        alone = [c for c in calls if c["streams"] == 1]
        # One joint read (1 event: its share), then the events alone: 299 in two reads.
        assert joint and joint[0]["count"] == 1
        assert alone and all(c["count"] == READ_COUNT and c["block"] is None for c in alone)
        assert len([c for c in calls if c["entries"]]) <= 5, calls

    run(main())


def test_follow_many_lists_span_streams(redis_url, r, job_id):
    """At 4,096 nodes a read holds one or two entries of each of hundreds of streams: they are
    decoded and yielded DECODE_SLICE entries at a time across streams, not a list per stream;
    each stream's cursor is past its entries, so the follow goes on without gap or repeat."""
    nodes = [f"n{i}-{i}-z" for i in range(40)]
    add_event(r, job_id, EventType.NODE_JOINED, host="a")
    for i, node in enumerate(nodes):
        add_logs(r, job_id, node, i, 1, "before")
    keys = JobKeys(job_id)

    async def main() -> None:
        client = JobClient(redis_url, job_id)
        try:
            await client.history()
            written = {node: add_logs(r, job_id, node, i, 2, "one") for i, node in
                       enumerate(nodes)}  # one entry a stream, before the first read
            col = ManyCollector(client.follow_many())
            await wait_until_async(lambda: len(col.of(LogBatch)) == 40, 10, "the 40 entries")
            lists = len(col.lists)
            assert lists <= 3, lists  # 40 entries: two lists of DECODE_SLICE at most, not 40
            assert all(client.last_ids[keys.logs(node)] == written[node] for node in nodes)
            later = add_logs(r, job_id, nodes[7], 7, 3, "later")
            await wait_until_async(lambda: len(col.of(LogBatch)) == 41, 10, "the next entry")
            await asyncio.sleep(0.1)  # a repeat would arrive with the next read
            await col.stop()
        finally:
            await client.close()
        got = col.of(LogBatch)
        assert len(got) == 41 and got[-1].id == later
        assert sorted(b.node for b in got[:40]) == sorted(nodes)

    run(main())
