"""`logs`: the workers' output as ``[rank R] text`` lines. The last ``--tail`` lines of the job
(or of one earlier ``--attempt``), then with ``--follow`` the new ones; filtered (``--rank``,
``--stderr``, ``--grep``), the second copy of a retried write dropped, a line many ranks
printed shown once (``--dedupe``), and a line redrawn in place (a progress bar) shown as a
terminal shows it (see :class:`_LogPrinter`).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import sys
import time
import unicodedata
from collections.abc import Iterable

from elastic_agent.coordination.transport.endpoints import Endpoint
from elastic_agent.coordination.wire.log_records import STDERR, LogBatch
from elastic_agent.coordination.wire.text import sanitize, strip_sgr, terminal_line

from ..job.client import JobClient
from ..job.dedupe import Collapser, Group
from ..job.inplace import latest_rows, live_count
from ..job.log_fold import BatchDeduper
from .common import EXIT_OK, EXIT_USAGE, PROG, CliError, _follow, _job, _open, _write

__all__ = ["DEDUPE_HOLD_S", "DEDUPE_PENDING_LIMIT", "logs"]


#: logs -f --dedupe: how long the first copy of a line waits for the other ranks' copies.
#: A stream cannot redraw a printed line, so its count is final when printed.
DEDUPE_HOLD_S = 1.0
DEDUPE_PENDING_LIMIT = 10_000  # rows waiting to be printed; past it the oldest go at once


class _LogPrinter:
    """Filters, dedupes and prints log batches as ``[rank R] text`` lines.

    What a worker redraws in place (a progress bar, a live display: a ``live`` batch's last
    lines, its stream's *live block*, replaced by the first lines of its stream's next batch)
    is printed as a terminal shows it, never frame by frame. ``logs`` prints every line in
    its latest state, where it first appeared (a line's place is its first byte's). ``logs
    -f`` on a terminal keeps the newest live block on the last rows, rewritten in place as it
    changes, and prints its lines for good once they are finished; into a pipe or a file it
    prints finished lines only, since that output is kept or read by programs, for which a
    frame is noise and a rewrite is garbage.
    """

    def __init__(self, args: argparse.Namespace, tty: bool = False) -> None:
        self.rank: int | None = args.rank
        self.stderr_only: bool = args.stderr
        self.dedupe = BatchDeduper()
        self.tty = tty
        try:
            self.grep = re.compile(args.grep) if args.grep is not None else None
        except re.error as exc:
            raise CliError(f"bad --grep pattern {args.grep!r}: {exc}", EXIT_USAGE) from None
        # the live block shown on the last rows: its stream and lines
        self._status: tuple[tuple[str, int, str, int], list[str]] | None = None
        self._shown = 0  # rows of it on the terminal now
        self.collapse: Collapser | None = Collapser() if getattr(args, "dedupe", False) else None
        self._pending: dict[int, Group] = {}  # --dedupe --follow: rows not printed yet
        self._handles = 0

    def _wanted(self, batch: LogBatch) -> bool:
        return not ((self.rank is not None and batch.rank != self.rank) or (
            self.stderr_only and batch.stream != STDERR) or self.dedupe.seen(batch))

    def _match(self, raw: str) -> bool:
        # The pattern is matched against what the reader sees: escaped, without colours.
        return self.grep is None or self.grep.search(strip_sgr(sanitize(raw))) is not None

    def history(self, batches: list[LogBatch], n: int, follow: bool) -> list[str]:
        """The last ``n`` lines of ``batches``, oldest first, each in its latest state and in
        the place it first appeared (a live block's rows take its stream's next lines); a
        stream's still live block is left out when following (the newest one becomes the
        status block on a terminal)."""
        kept = [b for b in batches if self._wanted(b)]  # forward: the deduper needs the order
        if self.collapse is not None:
            return self._collapsed_history(kept, n, follow)
        rows, live = latest_rows(kept)
        if follow:
            newest = None
            for b in reversed(kept):
                key = (b.node, b.rank, b.stream, b.attempt)
                if key in live:
                    newest = key
                    break
            for key, at in live.items():
                if self.tty and key == newest:
                    block = [rows[i] for i in at if rows[i] is not None]
                    shown = [t for t in block if self._match(t[1])]
                    if shown:
                        self._status = (key, [f"[rank {key[1]}] {t[1]}" for t in shown])
                for i in at:
                    rows[i] = None
        out: list[str] = []
        for row in reversed(rows):
            if len(out) >= n:
                break
            if row is not None and self._match(row[1]):
                out.append(f"[rank {row[0]}] {row[1]}")
        out.reverse()
        return out

    def follow(self, rec: object) -> list[str]:
        """The finished lines of a followed record to print; on a terminal they are written
        here, around the status block (so nothing is returned)."""
        if not isinstance(rec, LogBatch) or not self._wanted(rec):
            return []
        lines, live = rec.lines, None
        k = live_count(rec)
        if k:
            lines, live = lines[:-k], lines[-k:]
        prefix = f"[rank {rec.rank}] "
        if self.collapse is not None:
            self._collect(rec, [raw for raw in lines if self._match(raw)])
            done = self.due()
        else:
            done = [prefix + raw for raw in lines if self._match(raw)]
        if not self.tty:
            return done
        key = (rec.node, rec.rank, rec.stream, rec.attempt)
        if self._status is not None and self._status[0] == key:
            self._status = None  # that block finished, or has a newer state below
        if live is not None:
            shown = [prefix + raw for raw in live if self._match(raw)]
            if shown:
                self._status = (key, shown)
        self.redraw(done)
        return []

    # -- --dedupe ---------------------------------------------------------------------------
    def _collapsed_history(self, kept: list[LogBatch], n: int, follow: bool) -> list[str]:
        """The last ``n`` rows of ``kept`` with identical lines of many ranks collapsed
        (:mod:`elastic_console.job.dedupe`), each line in its latest state as above."""
        assert self.collapse is not None
        last = {(b.node, b.rank, b.stream, b.attempt): i for i, b in enumerate(kept)}
        rows: list[Group] = []
        for i, b in enumerate(kept):
            lines = b.lines
            k = live_count(b)
            if k and (follow or last[(b.node, b.rank, b.stream, b.attempt)] != i):
                lines = lines[:-k]  # frames a later batch replaced, or the status block
            for raw in lines:
                if not self._match(raw):
                    continue
                row, g = self.collapse.add(b.server_ms, b.rank, b.stream, raw, len(rows))
                if g is None:
                    rows.append(Group(b.server_ms, b.rank, b.stream, raw, row))
                else:
                    rows[row] = g
        self.collapse = Collapser()  # what follows is printed as it comes: a fresh start
        return [_collapsed_row(g) for g in rows[max(0, len(rows) - n):]]

    def _collect(self, rec: LogBatch, lines: list[str]) -> None:
        assert self.collapse is not None
        now = time.monotonic()
        for raw in lines:
            row, g = self.collapse.add(rec.server_ms, rec.rank, rec.stream, raw, self._handles)
            if g is None:
                g = Group(rec.server_ms, rec.rank, rec.stream, raw, row)
                g.stamp = now
                self._handles += 1
            elif row in self._pending:
                g.stamp = self._pending[row].stamp
            self._pending[row] = g  # (a row keeps its place: order of first appearance)
        if len(self._pending) > DEDUPE_PENDING_LIMIT:
            for g in list(self._pending.values())[:len(self._pending) - DEDUPE_PENDING_LIMIT]:
                g.stamp = 0.0  # due now

    def due(self, everything: bool = False) -> list[str]:
        """--dedupe --follow: the rows whose first copy came ``DEDUPE_HOLD_S`` ago (or all),
        oldest first; they are final (a printed row takes no more ranks)."""
        if self.collapse is None or not self._pending:
            return []
        cutoff = time.monotonic() - DEDUPE_HOLD_S
        out = []
        for row, g in list(self._pending.items()):
            if not everything and g.stamp > cutoff:
                break
            del self._pending[row]
            self.collapse.close(g.stream, g.text, row)
            out.append(_collapsed_row(g))
        return out

    def print_due(self, everything: bool = False) -> None:
        done = self.due(everything)
        if not done:
            return
        if self.tty:
            self.redraw(done)
        else:
            _write(done)
            sys.stdout.flush()

    def redraw(self, done: Iterable[str] = ()) -> None:
        """On a terminal: erase the status block, print ``done``, draw the status block again
        (each row cut to the terminal's width: a wrapped row could not be rewritten; at most
        the terminal's height less one row)."""
        parts = ["\r\x1b[K" + "\x1b[1A\x1b[K" * (self._shown - 1)] if self._shown else []
        parts.extend(terminal_line(line, True) + "\n" for line in done)
        self._shown = 0
        if self._status is not None:
            size = shutil.get_terminal_size()
            width = max(10, size.columns - 1)
            block = self._status[1][-max(1, size.lines - 1):]
            parts.append("\n".join(_fit(terminal_line(row, False), width) for row in block))
            self._shown = len(block)
        if parts:
            sys.stdout.write("".join(parts))
            sys.stdout.flush()

    def close(self) -> None:
        """Leave the terminal on a new line after a status block."""
        if self._shown:
            self._shown = 0
            sys.stdout.write("\n")
            sys.stdout.flush()


def _collapsed_row(g: Group) -> str:
    """``[rank 3] text``, or ``×512 ranks [0-511] text`` for a line many ranks printed."""
    return f"[rank {g.rank}] {g.text}" if len(g.ranks) == 1 else f"{g.label()} {g.text}"


def _fit(text: str, width: int) -> str:
    """``text`` (no control characters) cut to ``width`` terminal cells."""
    if text.isascii():
        return text[:width]
    out, used = [], 0
    for ch in text:
        cells = 0 if unicodedata.combining(ch) else (
            2 if unicodedata.east_asian_width(ch) in "WF" else 1)
        if used + cells > width:
            break
        out.append(ch)
        used += cells
    return "".join(out)


async def logs(ep: Endpoint, args: argparse.Namespace) -> int:
    job = _job(args)
    if args.attempt is not None:
        return await _attempt_logs(ep, job, args)
    printer = _LogPrinter(args, tty=sys.stdout.isatty())
    client = await _open(ep, job)
    try:
        _, batches = await client.history(max_events=0,
                                          max_log_entries_per_stream=max(2_000, args.tail))
        _note_streams(client)
        _write(printer.history(batches, args.tail, args.follow))
        sys.stdout.flush()
        if args.follow:
            printer.redraw()  # an unfinished line of the history, if any
            ticker = asyncio.create_task(_print_due(printer)) if args.dedupe else None
            try:
                await _follow(client, ep, logs=True, render=printer.follow)
            finally:
                if ticker is not None:
                    ticker.cancel()
                printer.print_due(everything=True)
    finally:
        printer.close()
        await client.close()
    return EXIT_OK


async def _attempt_logs(ep: Endpoint, job: str, args: argparse.Namespace) -> int:
    """``logs --attempt N``: that attempt's last ``--tail`` lines (console/job/attempts.py)."""
    if args.follow:
        raise CliError("--attempt shows an attempt that is over; it cannot be followed "
                       "(drop -f, or drop --attempt to follow the current one)", EXIT_USAGE)
    printer = _LogPrinter(args)
    client = await _open(ep, job)
    try:
        found = await client.attempt_logs(args.attempt, args.rank,
                                          max_lines=max(10_000, args.tail))
    finally:
        await client.close()
    _note_streams(client)
    if not found.batches:
        sys.stderr.write(f"no lines of attempt {args.attempt} of job {job} are kept"
                         f"{'' if args.rank is None else f' for rank {args.rank}'}\n")
        return EXIT_OK
    _write(printer.history(found.batches, args.tail, follow=False))
    printer.close()
    return EXIT_OK


def _note_streams(client: JobClient) -> None:
    """One line on stderr when the job's set of log streams held more names than are read."""
    if client.streams_note:
        print(terminal_line(f"{PROG}: note: {client.streams_note}", False), file=sys.stderr,
              flush=True)


async def _print_due(printer: _LogPrinter) -> None:
    # A timer, not an event: a held row is due when time passes, whether lines come or not.
    while True:
        await asyncio.sleep(DEDUPE_HOLD_S / 4)
        printer.print_due()
