"""JSON from Redis (a node log entry's parts, decode_json's records) is parsed by the JSON
scanner directly (a console reads ~50k node entries a second at 32,768 ranks, `status` 32,768
resource samples), accepting and refusing exactly what json.loads does."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_agent.coordination.wire import protocol
from elastic_agent.coordination.wire.log_records import (
    LogBatch,
    LogEntryDecoder,
    decode_log_entries,
    encode_node_log_entry,
)


def outcome(parse, raw):
    try:
        return "ok", parse(raw)
    except Exception as exc:  # the kind of failure is what must match
        return "error", type(exc).__name__


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner,
                                                                max_size=3),
    max_leaves=12)


def _same(raw) -> None:
    a, b = outcome(protocol._loads, raw), outcome(json.loads, raw)
    if a[0] == "ok" and b[0] == "ok":
        assert json.dumps(a[1]) == json.dumps(b[1])
    else:
        assert a == b


@settings(max_examples=300, deadline=None)
@given(json_values, st.sampled_from(["", " ", "\n", "\t "]), st.sampled_from(["", " ", "x", "]"]),
       st.booleans())
def test_parts_parse_as_json_loads_does(value, before, after, as_bytes):
    text = before + json.dumps(value) + after
    _same(text.encode() if as_bytes else text)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40))
def test_any_bytes_parse_or_fail_as_json_loads_does(raw):
    _same(raw)


def test_agents_entries_skip_json_loads(monkeypatch):
    batches = [LogBatch("gpu0-1-ab", rank, rank % 8, 1, "out", 3 + rank, [f"step {rank}"])
               for rank in range(8)]
    entries = [(f"1700000000000-{i}".encode(),
                [x for kv in encode_node_log_entry("gpu0-1-ab", batches[i:i + 2]).items()
                 for x in (kv[0].encode(), kv[1].encode())]) for i in range(0, 8, 2)]
    loads = []
    real = json.loads
    monkeypatch.setattr(protocol.json, "loads", lambda raw, *a, **k: loads.append(raw)
                        or real(raw, *a, **k))
    got, refused = LogEntryDecoder().decode(entries)
    assert refused == 0 and [(b.rank, b.lines) for b in got] == [
        (b.rank, b.lines) for b in batches]
    assert loads == []  # every entry through the scanner
    # Whitespace around the parts (no agent writes it): json.loads takes it, as it did.
    eid, flat = entries[0]
    spaced = list(flat)
    spaced[5] = b" " + spaced[5] + b"\n"
    assert [b.rank for b in decode_log_entries(eid, dict(zip(spaced[::2], spaced[1::2])))] == [0, 1]
    assert len(loads) == 1


def test_decode_json_skips_json_loads(monkeypatch):
    loads = []
    real = json.loads
    monkeypatch.setattr(protocol.json, "loads", lambda raw, *a, **k: loads.append(raw)
                        or real(raw, *a, **k))
    sample = b'{"cpu":97.5,"rss":123456789,"threads":12,"pid":4242,"ts":1700000000.25}'
    assert protocol.decode_json(sample, "a sample", 1024)["rss"] == 123456789
    assert loads == []
    with pytest.raises(protocol.ProtocolError, match="not valid JSON"):
        protocol.decode_json(b"{'cpu': 1}", "a sample", 1024)
    with pytest.raises(protocol.ProtocolError, match="not valid JSON"):
        protocol.decode_json(b"[" * 100_000 + b"]" * 100_000, "a sample", 10**6)
