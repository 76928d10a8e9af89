"""The console bench's feeder writes log entries as RESP of its own (redis-py's packing cost a
core of this machine): they must be byte for byte what an agent writes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.log_records import decode_log_entries, encode_node_log_entry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import console_bench


@pytest.mark.parametrize(("ranks", "rate"), [(40, 20_000), (64, 2_000)],
                         ids=["many-lines-a-batch", "one-or-two-lines-a-batch"])
def test_the_feeders_log_entries_are_what_an_agent_writes(r, job_id, ranks, rate):
    feeder = console_bench.Feeder(r, job_id, ranks, rate, seed=3)
    feeder.setup()
    lines = feeder.prefill(0.3)
    keys = JobKeys(job_id)
    got = entries = 0
    seqs: dict[tuple[int, str], list[int]] = {}
    for stream in r.smembers(keys.log_streams):
        for entry_id, fields in r.xrange(stream):
            batches = decode_log_entries(entry_id, fields)
            assert batches, fields
            node = batches[0].node
            assert list(fields.items()) == [(k.encode(), v.encode())
                                            for k, v in encode_node_log_entry(node, batches).items()]
            got += sum(len(b.lines) for b in batches)
            entries += 1
            for b in batches:
                seqs.setdefault((b.rank, b.stream), []).append(b.seq)
    assert lines == got == feeder.lines_written > 0
    assert entries == feeder.entries_written
    assert all(s == list(range(1, len(s) + 1)) for s in seqs.values())
