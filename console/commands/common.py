"""What every subcommand shares: the exit statuses and the one-line error (:class:`CliError`),
the job id checked and the job's client opened (one line when there is no such job), the job's
view folded once from its records (:func:`_load_view`), and standard output, through which
every line passes under one terminal policy (escaped; colours kept only on a terminal).

The helpers keep their underscore: they are the subcommands' own, not an API.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import IO, Any

from elastic_agent.coordination.transport.connection import RedisUnavailableError
from elastic_agent.coordination.transport.endpoints import Endpoint, redact
from elastic_agent.coordination.wire.keyspace import InvalidJobIdError, validate_job_id
from elastic_agent.coordination.wire.text import terminal_line

from ..job.client import JobClient
from ..job.state import ConnectionChange, JobView

__all__ = ["EXIT_OK", "EXIT_RUNTIME", "EXIT_USAGE", "PROG", "CliError"]


PROG = "elastic-console"
EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    """A failure to report as one line, with the exit status to use."""

    def __init__(self, message: str, code: int = EXIT_RUNTIME) -> None:
        super().__init__(message)
        self.code = code


def _fail(message: str, code: int) -> int:
    # Messages quote job state and server replies: escaped like standard output.
    # redact: the last guard, should a message ever quote a URL or a password in any form.
    print(terminal_line(f"{PROG}: error: {redact(message)}", False), file=sys.stderr, flush=True)
    return code


def _job(args: argparse.Namespace) -> str:
    try:
        return validate_job_id(args.job)
    except InvalidJobIdError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def _run(coro: Coroutine[Any, Any, int]) -> int:
    try:
        return asyncio.run(coro)
    except RedisUnavailableError as exc:
        raise CliError(str(exc), EXIT_RUNTIME) from None


async def _open(ep: Endpoint, job: str | None) -> JobClient:
    """A client for ``job``, failing with one line when the job does not exist."""
    client = JobClient(ep, job)
    if job is not None:
        try:
            exists = await client.job_exists()
        except BaseException:
            await client.close()
            raise
        if not exists:
            await client.close()
            raise CliError(f"no job '{job}' on {ep.display}: {PROG} ls lists the jobs")
    return client


def _write(lines: Iterable[str]) -> None:
    """Every line of standard output goes through here: its text came from Redis, so it gets
    the one terminal policy (escaped; colours kept and reset on a terminal, gone in a pipe)."""
    colour = sys.stdout.isatty()
    sys.stdout.write("".join(terminal_line(line, colour) + "\n" for line in lines))


def _out(text: str = "") -> None:
    _write([text])


def _table(headers: list[str], rows: Iterable[list[str]], out: IO[str] | None = None) -> None:
    # Cells are made plain first: column widths are counted on what the reader sees. A
    # printable cell (no control character, so no ESC either) is already what terminal_line
    # makes of it: `status` of 32,768 ranks has ~300k cells, and the call was a third of it.
    cells = [[c if c.isprintable() else terminal_line(c, False) for c in r]
             for r in [headers, *rows]]
    widths = [max(map(len, column)) for column in zip(*cells)]
    (out or sys.stdout).write("".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n" for r in cells))


def _q(value: Any) -> str:
    return "-" if value is None else str(value)


def _clock(ms: int) -> str:
    """Server ms as local HH:MM:SS.mmm."""
    return time.strftime("%H:%M:%S", time.localtime(ms / 1000)) + f".{ms % 1000:03d}"


def _say_connection(change: ConnectionChange, ep: Endpoint) -> None:
    if change.connected:
        print(f"{PROG}: reconnected to {ep.display}", file=sys.stderr, flush=True)
    else:
        print(terminal_line(f"{PROG}: connection lost: {change.error}; reconnecting", False),
              file=sys.stderr, flush=True)


async def _follow(client: JobClient, ep: Endpoint, *, logs: bool,
                  render: Callable[[Any], list[str]]) -> None:
    """Print what ``render`` makes of each followed record until interrupted; say on stderr
    when the connection is lost and back."""
    async for rec in client.follow(logs=logs):
        if isinstance(rec, ConnectionChange):
            _say_connection(rec, ep)
            continue
        lines = render(rec)
        if lines:
            _write(lines)
            sys.stdout.flush()


async def _load_view(client: JobClient, *, resources: bool) -> JobView:
    events, _ = await client.history(max_events=10_000, max_log_entries_per_stream=0,
                                     logs=False)
    view = JobView(client.keys.job_id, scrollback=1)
    view.apply_meta(await client.meta())
    view.apply_events(events)
    if resources:
        view.apply_resources(await client.resources())
    view.apply_liveness(*await client.liveness())
    view.note_skipped(client.skipped)
    return view
