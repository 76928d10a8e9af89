"""The logs of one earlier attempt: ``elastic-console logs JOB --attempt N`` and the console's
``p`` (as k9s's ``p`` shows a container's previous run).

An attempt is a rendezvous round (the agent's ``attempt_N`` log directory): every log batch
carries it (``LogBatch.attempt``). A node writes its batches in order and its attempts only
grow, so each node's stream is read backwards, a page at a time, from its newest entry: the
batches of attempt N are kept, newer ones skipped, and the first batch of an older attempt
ends that stream's read. Bounded: at most ``MAX_SCANNED`` entries a stream (a stream holds
``--log-retention`` entries at most anyway); each stream keeps its newest lines, its share of
``max_lines`` (at least ``MIN_SHARE``), and the merge keeps the newest ``max_lines``. Nothing
of this runs while following: it is one read on demand, O(the attempt's lines and those
after it) per stream, over the streams the job's set names (at most ``LOG_STREAM_NAMES_MAX``
of them, see ``JobClient._stream_members``), their first pages ``FIRST_PAGES_PER_READ`` at a
time.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic_agent.coordination.wire.log_records import LogBatch
from elastic_agent.coordination.wire.protocol import stream_id_ms

#: Entries read per round trip.
PAGE = 500
#: Streams whose first page one round trip reads (at most this many pages held at once): at
#: 4,096 nodes a round trip per stream was most of the read's time.
FIRST_PAGES_PER_READ = 8
#: At most this many entries are read from one stream for one attempt.
MAX_SCANNED = 1_000_000
#: Lines a stream may keep however many streams share ``max_lines``.
MIN_SHARE = 200


@dataclass(frozen=True)
class AttemptLogs:
    """Attempt ``attempt``'s batches of every node, oldest first (by server time)."""

    attempt: int
    batches: list[LogBatch]
    #: Some stream's read ended before it reached the attempt's first entry (its bound, or
    #: the stream was trimmed past it): older lines of the attempt may be gone.
    partial: bool
    #: One line when the job's set of log streams held more names than are read (some
    #: nodes' streams were not looked at: ``JobClient.streams_note``), else "".
    note: str = ""

    @property
    def lines(self) -> int:
        return sum(len(b.lines) for b in self.batches)


async def read_attempt(client: Any, streams: list[str], attempt: int, rank: int | None,
                       max_lines: int, decode: Callable[[Any], list[LogBatch]],
                       refused: Callable[[str, Exception], Any] | None = None) -> AttemptLogs:
    """Read ``attempt``'s batches (of ``rank`` only, if given) from ``streams`` (see the module
    docstring); ``decode`` turns a page of ``(id, fields)`` entries into batches. A stream
    Redis refuses to read (not a stream) goes to ``refused``, which skips it or raises."""
    per_stream: list[list[LogBatch]] = []
    partial = False
    share = max(min(max_lines, MIN_SHARE), max_lines // max(1, len(streams)))
    for g in range(0, len(streams), FIRST_PAGES_PER_READ):
        group = streams[g:g + FIRST_PAGES_PER_READ]
        pipe = client.pipeline(transaction=False)
        for stream in group:
            pipe.xrevrange(stream, count=PAGE)
        firsts = await pipe.execute(raise_on_error=False)
        for stream, first in zip(group, firsts):
            if isinstance(first, Exception):
                if refused is None:
                    raise first
                refused(stream, first)
                continue
            kept, reached = await _read_stream(client, stream, attempt, rank, share, decode,
                                               first)
            partial = partial or not reached
            if kept:
                per_stream.append(kept)
        del firsts
    merged = list(heapq.merge(*per_stream, key=lambda b: _order(b.id)))
    lines, first = 0, len(merged)
    while first > 0 and lines < max_lines:  # the newest max_lines of them all
        first -= 1
        lines += len(merged[first].lines)
    return AttemptLogs(attempt, merged[first:], partial or first > 0)


async def _read_stream(client: Any, stream: str, attempt: int, rank: int | None,
                       max_lines: int, decode: Callable[[Any], list[LogBatch]],
                       first: list[Any] | None = None) -> tuple[list[LogBatch], bool]:
    """The stream's batches of ``attempt``, oldest first, and whether the read got to the
    attempt's start (an older attempt's batch came, or the stream's first entry was the
    attempt's first). ``first``: its newest page, already read."""
    newest_first: list[LogBatch] = []
    lines = 0
    high, scanned = "+", 0
    while scanned < MAX_SCANNED:
        if first is not None:
            entries, first = first, None
        else:
            entries = await client.xrevrange(stream, max=high, count=PAGE)
        if not entries:
            return newest_first[::-1], True  # the stream's first entry: nothing is older
        scanned += len(entries)
        last = entries[-1][0]
        high = "(" + (last.decode() if isinstance(last, bytes) else str(last))
        for batch in reversed(decode(list(reversed(entries)))):
            if batch.attempt > attempt:
                continue
            if batch.attempt < attempt:
                return newest_first[::-1], True
            if rank is not None and batch.rank != rank:
                continue
            newest_first.append(batch)
            lines += len(batch.lines)
            if lines >= max_lines:
                return newest_first[::-1], False  # the newest lines: where it ended
        if len(entries) < PAGE:
            return newest_first[::-1], True
    return newest_first[::-1], False


def _order(entry_id: str) -> tuple[int, int]:
    ms = stream_id_ms(entry_id)
    _, _, seq = entry_id.partition("-")
    return ms, int(seq) if seq.isdigit() else 0
