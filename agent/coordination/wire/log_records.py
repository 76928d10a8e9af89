"""The records of a job's log streams (``JobKeys.logs``): the workers' output, in batches.

An agent writes one entry per node and flush holding the batches of several worker streams
(:func:`encode_node_log_entry`); an entry of one worker stream (:func:`encode_log_batch`) is
still read. Both shapes decode to :class:`LogBatch`. The console reads tens of thousands of
entries a second, so the decoders here are written for speed (:class:`LogEntryDecoder`) and
held to the same answers as the plain ones by property tests.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from .protocol import (
    MAX_NAME_CHARS,
    MAX_RANK,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    _loads,
    _small_int,
    _str,
    _strs,
    is_rank,
    record_version,
    stream_id_ms,
)

#: The longest log entry a reader decodes: an agent's is at most ~272 KiB
#: (supervision/records/logs.py).
MAX_LOG_ENTRY_BYTES = 4 * 1024 * 1024

STDOUT = "out"
STDERR = "err"

#: The longest live block a reader takes (a worker's terminal is at most this many rows).
MAX_LIVE_LINES = 1000
#: The oldest first byte an age may name (ms): a line may wait a year for its newline.
MAX_AGE_MS = 366 * 86_400_000


class LogBatch(NamedTuple):
    """Consecutive lines of one worker's stdout or stderr.

    A NamedTuple, not a frozen dataclass: a console reads tens of thousands a second, and a
    frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field) cost ~3 us of the
    ~10 us a batch may take there (``bench/console_bench.py``, 4,096 ranks).

    ``seq`` numbers a worker's batches within an attempt, so a reader can drop the
    duplicate a retried XADD may write (Redis 7 has no idempotent XADD).

    ``live``: how many of the last lines are not finished: the stream's *live block*, what
    the worker still redraws in place (a bar redrawn with ``\r``: one line; a display that
    moves the cursor up, such as Rich's, several). The first ``live`` lines of the stream's
    next batch (``seq + 1``) take those rows, newer or final: they replace the block (rows it
    has no line for are left blank). An entry written as ``live=1`` by an older agent reads
    as one live line, as it always did.

    ``age`` and ``live_age``: how many milliseconds before the entry was written (its id)
    the first byte of the batch's first line, and of its live block, was printed. A line
    redrawn for a minute keeps the time it started: a reader stamps it ``server_ms - age``
    (durations only: no host clock is compared with Redis's).
    """

    node: str
    rank: int
    local_rank: int
    attempt: int
    stream: str  # STDOUT or STDERR
    seq: int
    lines: list[str]
    id: str = ""
    live: int = 0
    age: int = 0
    live_age: int = 0

    @property
    def server_ms(self) -> int:
        return stream_id_ms(self.id)

    def line_times(self) -> list[int]:
        """The server ms of each line: its first byte's time, as well as it is known. The
        first line and the live block have their own; a line between them was printed after
        the first and before the block (or the entry): it gets the latest time that keeps
        that order."""
        ms = self.server_ms
        first = max(0, ms - self.age)
        later = max(first, ms - self.live_age) if self.live else ms
        return [first] + [later] * (len(self.lines) - 1)


def encode_log_batch(batch: LogBatch) -> dict[str, str]:
    """Encode a batch as stream fields; lines are joined with newlines (a line has none).
    ``live`` adds ``live=N`` (a reader that does not know the field shows the frames as
    lines), ``age`` and ``live_age`` the fields ``age`` and ``lage`` when not 0."""
    fields = {
        "v": str(PROTOCOL_VERSION),
        "node": batch.node,
        "rank": str(batch.rank),
        "lrank": str(batch.local_rank),
        "attempt": str(batch.attempt),
        "s": batch.stream,
        "seq": str(batch.seq),
        "lines": "\n".join(batch.lines),
    }
    if batch.live:
        fields["live"] = str(int(batch.live))
    if batch.age:
        fields["age"] = str(batch.age)
    if batch.live_age:
        fields["lage"] = str(batch.live_age)
    return fields


def decode_log_batch(entry_id: str | bytes, fields: Mapping[Any, Any]) -> LogBatch | None:
    """Decode a log entry; ``None`` for a malformed one or an unknown version."""
    try:
        if b"lines" in fields:
            # A reply as redis-py gives it without decode_responses (the console, 50k
            # lines/s): look fields up as bytes and decode only the two text ones.
            get = fields.get
            stream = _LOG_STREAMS.get(get(b"s"))  # type: ignore[arg-type]
            raw_lines = fields[b"lines"]
            node_b = fields[b"node"]
            if (stream is None or get(b"v") not in _SUPPORTED_V_BYTES
                    or len(raw_lines) > MAX_LOG_ENTRY_BYTES or len(node_b) > MAX_NAME_CHARS):
                return None
            batch = LogBatch(
                node=node_b.decode("utf-8", "replace"),
                rank=_small_int(fields[b"rank"]),
                local_rank=_small_int(get(b"lrank", b"-1")),
                attempt=_small_int(get(b"attempt", b"0")),
                stream=stream,
                seq=_small_int(get(b"seq", b"0")),
                lines=raw_lines.decode("utf-8", "replace").split("\n"),
                id=_str(entry_id),
                live=_count(get(b"live", b"0")),
                age=_count(get(b"age", b"0"), MAX_AGE_MS),
                live_age=_count(get(b"lage", b"0"), MAX_AGE_MS),
            )
        else:
            f = _strs(fields)
            stream = f.get("s", "")
            if (stream not in (STDOUT, STDERR) or record_version(f) is None
                    or len(f["lines"]) > MAX_LOG_ENTRY_BYTES or len(f["node"]) > MAX_NAME_CHARS):
                return None
            batch = LogBatch(
                node=f["node"],
                rank=_small_int(f["rank"]),
                local_rank=_small_int(f.get("lrank", "-1")),
                attempt=_small_int(f.get("attempt", "0")),
                stream=stream,
                seq=_small_int(f.get("seq", "0")),
                lines=f["lines"].split("\n"),
                id=_str(entry_id),
                live=_count(f.get("live", "0").encode()),
                age=_count(f.get("age", "0").encode(), MAX_AGE_MS),
                live_age=_count(f.get("lage", "0").encode(), MAX_AGE_MS),
            )
    except (KeyError, ValueError, TypeError, AttributeError):
        return None
    if (not is_rank(batch.rank) or batch.attempt < 0 or batch.seq < 0 or batch.local_rank < -1
            or batch.live > len(batch.lines)):
        return None
    return batch


# -- a node's log entry: the batches of several of its workers ---------------------------


def encode_node_log_entry(node: str, batches: Sequence[LogBatch]) -> dict[str, str]:
    """One log entry for the batches of several worker streams of ``node``: what agents write,
    one XADD per node and flush (``log_shipping.LOG_LINGER``), not one per worker stream, which made
    ~50k one-line entries a second for 4,096 ranks printing ~12 lines/s each; now ~5k.

    Fields: ``v``, ``node``, ``parts`` (JSON: one ``[rank, local_rank, attempt, stream, seq,
    lines, live]`` per batch, in order; ``lines`` counts its lines, at least one; ``live`` 1
    if the batch ends with a live block, else 0), ``lines`` (every batch's lines, in the same
    order, joined with newlines) and, when a batch has a live block of more than one line or
    an age, ``ext`` (JSON: one ``[live, age, live_age]`` per batch: the size of its live
    block and its ages, :class:`LogBatch`). A reader that does not know ``ext`` reads a live
    block as its last line only. Each batch keeps its own ``seq`` and ``live``: readers
    dedupe and redraw per worker stream exactly as with one entry per batch.
    """
    parts: list[list[Any]] = []
    texts: list[str] = []
    ext: list[list[int]] = []
    extended = False
    for b in batches:
        text = "\n".join(b.lines)
        texts.append(text)
        live = int(b.live)
        parts.append([b.rank, b.local_rank, b.attempt, b.stream, b.seq, text.count("\n") + 1,
                      1 if live else 0])
        ext.append([live, b.age, b.live_age])
        extended = extended or live > 1 or b.age > 0 or b.live_age > 0
    fields = {"v": str(PROTOCOL_VERSION), "node": node,
              "parts": json.dumps(parts, separators=(",", ":")), "lines": "\n".join(texts)}
    if extended:
        fields["ext"] = json.dumps(ext, separators=(",", ":"))
    return fields


def decode_log_entries(entry_id: str | bytes, fields: Mapping[Any, Any]) -> list[LogBatch] | None:
    """The batches of any log entry: one worker stream's (:func:`decode_log_batch`) or a
    node's (:func:`encode_node_log_entry`). ``None`` for a malformed entry (one bad part
    refuses the whole entry: its lines could not be told apart)."""
    def field(name: str) -> Any:  # fields as redis-py gives them: bytes or str names
        return fields.get(name.encode(), fields.get(name))

    try:
        parts = field("parts")
        if parts is None:
            batch = decode_log_batch(entry_id, fields)
            return None if batch is None else [batch]
        return _node_batches(entry_id, field("v"), field("node"), parts, field("lines"),
                             field("ext"))
    except TypeError:  # an unhashable name
        return None


def _node_batches(entry_id: Any, v: Any, node_raw: Any, parts_raw: Any,
                  lines_raw: Any, ext_raw: Any = None) -> list[LogBatch] | None:
    """A node entry's batches from its raw fields (bytes or str); None if malformed. A
    malformed ``ext`` is ignored (the batches read as an older agent's)."""
    try:
        if (_str(v) not in _SUPPORTED_V_STR or len(node_raw) > MAX_NAME_CHARS
                or len(lines_raw) > MAX_LOG_ENTRY_BYTES or len(parts_raw) > MAX_LOG_ENTRY_BYTES):
            return None
        # Not decode_json: its depth walk would cost more than the rest here (a node's
        # parts hold ~30 lists); the checks below refuse anything but a list of flat lists.
        parts = _loads(parts_raw)
        if type(parts) is not list or not parts:
            return None
        node = _str(node_raw)
        lines = _str(lines_raw).split("\n")
        eid = _str(entry_id)
        out: list[LogBatch] = []
        at = 0
        make = tuple.__new__
        for part in parts:
            if type(part) is not list or len(part) != 7:
                return None
            rank, lrank, attempt, stream, seq, n, live = part
            if not (type(rank) is int and 0 <= rank < MAX_RANK and type(lrank) is int
                    and -1 <= lrank < MAX_RANK and type(attempt) is int and 0 <= attempt < 1 << 53
                    and type(stream) is str and stream in (STDOUT, STDERR) and type(seq) is int
                    and 0 <= seq < 1 << 63 and type(n) is int and 1 <= n <= len(lines) - at
                    and (live == 0 or live == 1) and type(live) is int):
                return None
            out.append(make(LogBatch, (node, rank, lrank, attempt, STDOUT if stream == STDOUT
                                       else STDERR, seq, lines[at:at + n], eid, live, 0, 0)))
            at += n
    except (TypeError, ValueError, AttributeError, RecursionError):
        return None
    if at != len(lines):
        return None
    if ext_raw is not None:
        _extend(out, ext_raw)
    return out


def _extend(batches: list[LogBatch], ext_raw: Any) -> None:
    """Apply a node entry's ``ext`` (live block sizes, ages) to its batches, in place; a
    malformed one is ignored as a whole."""
    try:
        if len(ext_raw) > MAX_LOG_ENTRY_BYTES:
            return
        ext = _loads(ext_raw)
    except (TypeError, ValueError, RecursionError):
        return
    if type(ext) is not list or len(ext) != len(batches):
        return
    for e, b in zip(ext, batches):
        if not (type(e) is list and len(e) == 3 and all(type(x) is int for x in e)
                and (e[0] >= 1) == (b.live >= 1) and 0 <= e[0] <= len(b.lines)
                and 0 <= e[1] <= MAX_AGE_MS and 0 <= e[2] <= MAX_AGE_MS):
            return
    for i, (e, b) in enumerate(zip(ext, batches)):
        batches[i] = tuple.__new__(LogBatch, (*b[:8], e[0], e[1], e[2]))

#: A log entry's field names as encode_log_batch writes them, in its order (``live`` after).
_LOG_FIELDS = [b"v", b"node", b"rank", b"lrank", b"attempt", b"s", b"seq", b"lines"]
#: ... and as encode_node_log_entry writes them (with ``ext`` when it has one).
_NODE_LOG_FIELDS = [b"v", b"node", b"parts", b"lines"]
_NODE_LOG_EXT_FIELDS = [*_NODE_LOG_FIELDS, b"ext"]


def decode_log_entry(entry_id: str | bytes, flat: list[Any]) -> LogBatch | None:
    """Decode a log entry given as Redis replies it without decode_responses: the flat list
    ``[field, value, field, value, ...]``. ``None`` for a malformed one or an unknown version.

    An entry in the order :func:`encode_log_batch` writes (every agent's) is read by position
    without building a dict; any other is decoded by :func:`decode_log_batch`.
    """
    try:
        n = len(flat)
        if flat[0:16:2] != _LOG_FIELDS or not (n == 16 or (n == 18 and flat[16] == b"live")):
            it = iter(flat)
            return decode_log_batch(entry_id, dict(zip(it, it)))
        v, node_b, rank_b, lrank_b, attempt_b, s_b, seq_b, lines_b = flat[1:16:2]
        stream = _LOG_STREAMS.get(s_b)
        if (stream is None or v not in _SUPPORTED_V_BYTES or len(lines_b) > MAX_LOG_ENTRY_BYTES
                or len(node_b) > MAX_NAME_CHARS
                or max(len(rank_b), len(lrank_b), len(attempt_b), len(seq_b)) > 19):
            return None
        batch = LogBatch(node_b.decode("utf-8", "replace"), int(rank_b), int(lrank_b),
                         int(attempt_b), stream, int(seq_b),
                         lines_b.decode("utf-8", "replace").split("\n"), _str(entry_id),
                         _count(flat[17]) if n == 18 else 0)
    except (KeyError, ValueError, TypeError, AttributeError, IndexError):
        return None
    if (not is_rank(batch.rank) or batch.attempt < 0 or batch.seq < 0 or batch.local_rank < -1
            or batch.live > len(batch.lines)):
        return None
    return batch


class LogEntryDecoder:
    """:func:`decode_log_entries` for many entries at once, for a reader of tens of thousands
    a second (the console at 4,096 ranks): the same batches, or the same refusals (a property
    test holds it to that), at about a third of the cost for one worker stream's entries.

    Why it is cheaper: the fields that name a worker stream (``v``, ``node``, ``rank``,
    ``lrank``, ``attempt``, ``s``, names and values) are the same in every entry of that
    stream. They are validated and decoded once and remembered by their raw bytes (one dict
    lookup instead of four ``int()`` and a name check); at most ``limit`` are kept (a writer
    that varies them only costs the full decode). A node's entries (what agents write)
    are read by position; entries in any other order through :func:`decode_log_entries`.
    """

    __slots__ = ("_sources", "limit")

    def __init__(self, limit: int = 16_384) -> None:
        # raw header (12 items) -> (node, rank, local_rank, attempt, stream)
        self._sources: dict[tuple[Any, ...], tuple[str, int, int, int, str]] = {}
        self.limit = limit

    def decode(self, entries: Any) -> tuple[list[LogBatch], int]:
        """Decode one stream's entries as a raw XREAD reply holds them (``[[id, [field,
        value, ...]], ...]``). Returns the batches in order and how many entries were refused."""
        out: list[LogBatch] = []
        refused = 0
        sources = self._sources
        make = tuple.__new__
        for entry in entries:
            try:
                entry_id, flat = entry
                n = len(flat)
                src = sources.get(tuple(flat[:12])) if n == 16 or n == 18 else None
                if (src is None or flat[12] != b"seq" or flat[14] != b"lines"
                        or (n == 18 and flat[16] != b"live")):
                    if n == 8 and flat[0:8:2] == _NODE_LOG_FIELDS:  # an agent's node entry
                        many = _node_batches(entry_id, flat[1], flat[3], flat[5], flat[7])
                    elif n == 10 and flat[0:10:2] == _NODE_LOG_EXT_FIELDS:  # ... with ext
                        many = _node_batches(entry_id, flat[1], flat[3], flat[5], flat[7],
                                             flat[9])
                    elif (n == 16 or n == 18) and flat[0:16:2] == _LOG_FIELDS:
                        batch = decode_log_entry(entry_id, flat)  # a worker stream's, new
                        many = None if batch is None else [batch]
                        if batch is not None:
                            self._remember(flat, batch)
                    else:  # any other order or shape
                        it = iter(flat)
                        many = decode_log_entries(entry_id, dict(zip(it, it)))
                    if many is None:
                        refused += 1
                    else:
                        out += many
                    continue
                seq_b, lines_b = flat[13], flat[15]
                if len(seq_b) > 19 or len(lines_b) > MAX_LOG_ENTRY_BYTES:
                    refused += 1
                    continue
                seq = int(seq_b)
                live = _count(flat[17]) if n == 18 else 0
                lines = lines_b.decode("utf-8", "replace").split("\n")
                if seq < 0 or live > len(lines):
                    refused += 1
                    continue
                out.append(make(LogBatch, (
                    src[0], src[1], src[2], src[3], src[4], seq, lines,
                    entry_id.decode() if type(entry_id) is bytes else str(entry_id),
                    live, 0, 0)))
            except (KeyError, ValueError, TypeError, AttributeError, IndexError):
                refused += 1
        return out, refused

    def _remember(self, flat: list[Any], batch: LogBatch) -> None:
        """Keep the header of a worker stream's entry in the agent's field order that
        :func:`decode_log_entry` accepted."""
        if len(self._sources) >= self.limit:
            self._sources.clear()  # a writer varying its headers: start again, bounded
        with contextlib.suppress(TypeError):  # an unhashable value: never looked up either
            self._sources[tuple(flat[:12])] = (batch.node, batch.rank, batch.local_rank,
                                               batch.attempt, batch.stream)


_LOG_STREAMS = {STDOUT.encode(): STDOUT, STDERR.encode(): STDERR}
# ``live`` as usually written, looked up before any parsing.
_LIVE = {b"0": 0, b"1": 1}


def _count(raw: Any, limit: int = MAX_LIVE_LINES) -> int:
    """A field holding a count from 0 to ``limit`` (``live``, an age), as bytes; anything
    else raises (ValueError, or TypeError for a value that is not bytes): the entry is
    skipped."""
    found = _LIVE.get(raw) if type(raw) is bytes else None
    if found is not None:
        return found
    if type(raw) is not bytes or not 0 < len(raw) <= 13 or not raw.isdigit():
        raise ValueError("not a count")
    n = int(raw)
    if n > limit:
        raise ValueError("out of range")
    return n
_SUPPORTED_V_BYTES = frozenset(str(v).encode() for v in SUPPORTED_VERSIONS)
_SUPPORTED_V_STR = frozenset(str(v) for v in SUPPORTED_VERSIONS)
