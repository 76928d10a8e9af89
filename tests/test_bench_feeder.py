"""The console bench's feeder writes log entries as RESP of its own (redis-py's packing cost a
core of this machine): they must be byte for byte what an agent writes."""

from __future__ import annotations

import sys
from pathlib import Path

from elastic_agent.coordination.protocol import JobKeys, decode_log_batch, encode_log_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import console_bench


def test_the_feeders_log_entries_are_what_encode_log_batch_writes(r, job_id):
    feeder = console_bench.Feeder(r, job_id, 40, 20_000, seed=3)
    feeder.setup()
    lines = feeder.prefill(0.3)
    keys = JobKeys(job_id)
    got = entries = 0
    seqs: dict[tuple[int, str], list[int]] = {}
    for stream in r.smembers(keys.log_streams):
        for entry_id, fields in r.xrange(stream):
            batch = decode_log_batch(entry_id, fields)
            assert batch is not None, fields
            assert list(fields.items()) == [(k.encode(), v.encode())
                                            for k, v in encode_log_batch(batch).items()]
            got += len(batch.lines)
            entries += 1
            seqs.setdefault((batch.rank, batch.stream), []).append(batch.seq)
    assert lines == got == feeder.lines_written > 0
    assert entries == feeder.entries_written
    assert all(s == list(range(1, len(s) + 1)) for s in seqs.values())
