"""The records ranks answer a read-only request with: Python stacks and collective traces.

A ``stacks`` or ``collectives`` command (or a capture an agent makes on its own, such as a
stall's) asks every rank; its agent publishes one entry per rank on ``JobKeys.stacks`` or
``JobKeys.collectives`` under the request's id. coordination/wire/stack_replies.py and
collective_replies.py do the round trip; stack_dumps.py and collectives.py read the contents.
A worker's sampler reply (how much of its time it spends in collectives) is here too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .protocol import (
    _REQUEST_RE,
    MAX_NAME_CHARS,
    PROTOCOL_VERSION,
    ProtocolError,
    _small_int,
    _str,
    _strs,
    decode_json,
    is_rank,
    rank_list,
    record_list,
    record_version,
)

# -- stack replies ----------------------------------------------------------------------

#: faulthandler text of one rank, as published (an agent cuts it there and says so).
MAX_STACK_TEXT_BYTES = 256 * 1024
MAX_STACK_ERROR_CHARS = 512


@dataclass(frozen=True)
class StackReply:
    """One rank's answer to a stack request: faulthandler ``text``, or the ``error`` that
    says why there is none. ``coordination.stack_dumps`` parses the text."""

    request: str
    node: str
    host: str
    rank: int
    pid: int
    text: str
    error: str = ""
    truncated: bool = False
    id: str = ""


def encode_stack_reply(reply: StackReply) -> dict[str, str]:
    """Stream fields of a reply; ``text`` is cut to ``MAX_STACK_TEXT_BYTES`` (``truncated``
    says so) and ``error`` to ``MAX_STACK_ERROR_CHARS``."""
    raw = reply.text.encode("utf-8", "replace")
    cut = len(raw) > MAX_STACK_TEXT_BYTES
    return {
        "v": str(PROTOCOL_VERSION),
        "request": reply.request,
        "node": reply.node[:MAX_NAME_CHARS],
        "host": reply.host[:MAX_NAME_CHARS],
        "rank": str(reply.rank),
        "pid": str(reply.pid),
        "text": raw[:MAX_STACK_TEXT_BYTES].decode("utf-8", "ignore") if cut else reply.text,
        "truncated": "1" if cut or reply.truncated else "0",
        "error": reply.error[:MAX_STACK_ERROR_CHARS],
    }


def decode_stack_reply(entry_id: str | bytes, fields: Mapping[Any, Any]) -> StackReply | None:
    """Decode a stack reply; ``None`` for a malformed one or an unknown version (sizes are
    checked before anything is decoded)."""
    try:
        raw_text = fields.get(b"text", fields.get("text", ""))
        if len(raw_text) > MAX_STACK_TEXT_BYTES + 4:
            return None
        f = _strs(fields)
        request, node, host = f.get("request", ""), f.get("node", ""), f.get("host", "")
        if (record_version(f) is None or not _REQUEST_RE.fullmatch(request)
                or len(node) > MAX_NAME_CHARS or len(host) > MAX_NAME_CHARS
                or len(f.get("error", "")) > MAX_STACK_ERROR_CHARS * 4):
            return None
        rank, pid = _small_int(f["rank"]), _small_int(f.get("pid", "0"))
    except (KeyError, ValueError, TypeError, AttributeError):
        return None
    if not is_rank(rank) or not 0 <= pid < (1 << 31):
        return None
    return StackReply(request=request, node=node, host=host, rank=rank, pid=pid,
                      text=f.get("text", ""), error=f.get("error", "")[:MAX_STACK_ERROR_CHARS],
                      truncated=f.get("truncated") == "1", id=_str(entry_id))


# -- collective traces (issue 22) ---------------------------------------------------------

#: One rank's reduced flight recorder, as a worker sends it and an agent publishes it (the
#: worker cuts its oldest entries to fit: supervision/launch/recorder_probe.py).
MAX_TRACE_BYTES = 64 * 1024
#: Entries and process groups a reader takes from one trace; members listed per group.
MAX_TRACE_ENTRIES = 1024
MAX_TRACE_GROUPS = 64
MAX_TRACE_DIMS = 8


class CollectiveEntry(NamedTuple):
    """One collective a rank entered, as its flight recorder saw it."""

    pg: str
    seq: int
    op: str
    in_sizes: tuple[tuple[int, ...], ...]
    out_sizes: tuple[tuple[int, ...], ...]
    done: bool
    t_ns: int = 0


@dataclass(frozen=True)
class CollectiveTrace:
    """A rank's trace: the members of each process group it knows (group name -> global
    ranks) and its newest collective entries, oldest first; ``error`` when it has none."""

    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    entries: tuple[CollectiveEntry, ...] = ()
    error: str = ""
    cut: bool = False


def _sizes(value: Any) -> tuple[tuple[int, ...], ...]:
    out = []
    for shape in record_list(value, MAX_TRACE_DIMS):
        dims = record_list(shape, MAX_TRACE_DIMS)
        if not all(type(d) is int and 0 <= d < (1 << 62) for d in dims):
            raise ProtocolError("a tensor size is not a list of non-negative integers")
        out.append(tuple(dims))
    return tuple(out)


def decode_collective_trace(raw: str | bytes) -> CollectiveTrace:
    """A trace from a worker or a reply (bounded, checked field by field); :class:`ProtocolError`
    for anything that is not one."""
    value = decode_json(raw, "collective trace", MAX_TRACE_BYTES)
    if not isinstance(value, dict):
        raise ProtocolError("collective trace is not an object")
    error = value.get("error", "")
    if not isinstance(error, str):
        raise ProtocolError("collective trace error is not a string")
    groups: dict[str, tuple[int, ...]] = {}
    raw_groups = value.get("groups", {})
    if not isinstance(raw_groups, dict):
        raise ProtocolError("collective trace groups are not an object")
    for name, members in list(raw_groups.items())[:MAX_TRACE_GROUPS]:
        if len(name) > MAX_NAME_CHARS:
            raise ProtocolError("a process group name is too long")
        groups[name] = tuple(sorted(set(rank_list(members))))
    entries = []
    for e in record_list(value.get("entries", []), MAX_TRACE_ENTRIES):
        if not isinstance(e, dict):
            raise ProtocolError("a collective entry is not an object")
        pg, op = e.get("pg", ""), e.get("op", "")
        seq, t_ns = e.get("seq", 0), e.get("t_ns", 0)
        if not (isinstance(pg, str) and isinstance(op, str) and len(pg) <= MAX_NAME_CHARS
                and len(op) <= MAX_NAME_CHARS and type(seq) is int and 0 <= seq < (1 << 62)
                and type(t_ns) is int and 0 <= t_ns < (1 << 63)):
            raise ProtocolError("a collective entry has a bad pg, op, seq or time")
        entries.append(CollectiveEntry(pg, seq, op, _sizes(e.get("in")), _sizes(e.get("out")),
                                       e.get("done") is True, t_ns))
    return CollectiveTrace(groups, tuple(entries), error[:MAX_STACK_ERROR_CHARS],
                           value.get("cut") is True)


def encode_collective_trace(trace: CollectiveTrace) -> str:
    """The JSON of a trace, as :func:`decode_collective_trace` reads it."""
    return json.dumps({
        "groups": {k: list(v) for k, v in trace.groups.items()},
        "entries": [{"pg": e.pg, "seq": e.seq, "op": e.op, "in": [list(s) for s in e.in_sizes],
                     "out": [list(s) for s in e.out_sizes], "done": e.done, "t_ns": e.t_ns}
                    for e in trace.entries],
        "error": trace.error, "cut": trace.cut}, separators=(",", ":"))


@dataclass(frozen=True)
class CollectiveReply:
    """One rank's answer to a ``collectives`` request (``trace.error`` says why it is empty)."""

    request: str
    node: str
    host: str
    rank: int
    pid: int
    trace: CollectiveTrace
    id: str = ""


def encode_collective_reply(reply: CollectiveReply) -> dict[str, str]:
    """Stream fields of a reply. A trace that does not fit ``MAX_TRACE_BYTES`` loses its
    oldest entries (``cut``)."""
    trace = reply.trace
    text = encode_collective_trace(trace)
    while len(text.encode()) > MAX_TRACE_BYTES and trace.entries:
        trace = CollectiveTrace(trace.groups, trace.entries[len(trace.entries) // 4 + 1:],
                                trace.error, True)
        text = encode_collective_trace(trace)
    if len(text.encode()) > MAX_TRACE_BYTES:
        text = encode_collective_trace(CollectiveTrace(error="the trace is too large"))
    return {"v": str(PROTOCOL_VERSION), "request": reply.request,
            "node": reply.node[:MAX_NAME_CHARS], "host": reply.host[:MAX_NAME_CHARS],
            "rank": str(reply.rank), "pid": str(reply.pid), "trace": text}


def decode_collective_reply(entry_id: str | bytes,
                            fields: Mapping[Any, Any]) -> CollectiveReply | None:
    """Decode a collectives reply; ``None`` for a malformed one or an unknown version (the
    trace's size is checked before it is decoded)."""
    try:
        raw = fields.get(b"trace", fields.get("trace", ""))
        if len(raw) > MAX_TRACE_BYTES:
            return None
        f = _strs(fields)
        request, node, host = f.get("request", ""), f.get("node", ""), f.get("host", "")
        if (record_version(f) is None or not _REQUEST_RE.fullmatch(request)
                or len(node) > MAX_NAME_CHARS or len(host) > MAX_NAME_CHARS):
            return None
        rank, pid = _small_int(f["rank"]), _small_int(f.get("pid", "0"))
        trace = decode_collective_trace(f.get("trace", ""))
    except (KeyError, ValueError, TypeError, AttributeError):  # ProtocolError is a ValueError
        return None
    if not is_rank(rank) or not 0 <= pid < (1 << 31):
        return None
    return CollectiveReply(request, node, host, rank, pid, trace, _str(entry_id))


def decode_busy_sample(raw: str | bytes) -> tuple[int, int, float]:
    """A worker's sampler reply: ``(samples, samples inside a collective, window seconds)``;
    :class:`ProtocolError` for anything else."""
    value = decode_json(raw, "recorder sample", 4096)
    if not isinstance(value, dict):
        raise ProtocolError("recorder sample is not an object")
    n, busy, window = value.get("samples"), value.get("busy"), value.get("window_s")
    if not (type(n) is int and type(busy) is int and 0 <= busy <= n < (1 << 40)
            and isinstance(window, (int, float)) and type(window) is not bool
            and 0 <= window < 1e9):
        raise ProtocolError("recorder sample has bad counts")
    return n, busy, float(window)
