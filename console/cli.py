"""`elastic-console`: watch and steer elastic jobs from any machine that reaches their Redis.

    elastic-console ls
    elastic-console status JOB [--json]
    elastic-console logs JOB [--rank R] [--follow] [--tail N] [--grep RE] [--stderr] [--dedupe]
    elastic-console events JOB [--follow] [--json]
    elastic-console restart JOB [--yes] [--timeout S]
    elastic-console stop JOB [--yes] [--timeout S]
    elastic-console stacks JOB [--rank R] [--json] [--timeout S]
    elastic-console collectives JOB [--rank R] [--json] [--timeout S]
    elastic-console attach [JOB] [--read-only] [--scrollback N]   (no JOB: the list of jobs)
    elastic-console serve [JOB] [--host H] [--port N] [--allow-commands] [--max-sessions N]
    elastic-console rm JOB [--force] [--timeout S]

``--redis URL`` (before or after the subcommand) names the server; default
``$ELASTIC_REDIS_URL``, else ``redis://127.0.0.1:6379``. Its password is best given in
``$REDISCLI_AUTH`` (or ``--redis-password-file``): a password in argv shows in ``ps`` until
``main`` has re-executed the process without it.

Exit status: 0 success; 1 a runtime failure (Redis unreachable, unknown job, an agent that
did not accept a command, a cancelled confirmation); 2 bad usage (bad arguments, job id or
regex; a confirmation that cannot be asked). A failure is one line on stderr starting
``elastic-console: error: ``, never a traceback. Ctrl-C ends ``--follow`` with status 0.

Everything printed that came from the job (log lines, host names, messages) goes through
:func:`elastic_agent.coordination.text.sanitize`; SGR colours are kept only on a terminal.
The Textual app is imported only by ``attach``, so the other subcommands start fast and work
without a terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import time
import unicodedata
from collections.abc import Callable, Coroutine, Iterable
from typing import IO, Any, NoReturn

from elastic_agent.coordination.connection import (
    DEFAULT_URL,
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    Endpoint,
    EndpointError,
    RedisUnavailableError,
    argv_without_passwords,
    parse_endpoint,
    redact,
    with_outside_password,
)
from elastic_agent.coordination.protocol import (
    STDERR,
    CommandType,
    Event,
    InvalidJobIdError,
    LogBatch,
    validate_job_id,
)
from elastic_agent.coordination.text import sanitize, strip_sgr, terminal_line

from .job.client import Ack, JobClient
from .job.dedupe import Collapser, Group
from .job.formatting import fmt_age, fmt_bytes
from .job.state import (
    DEFAULT_ALL_SCROLLBACK,
    DEFAULT_SCROLLBACK,
    RANK_LINES_TOTAL,
    BatchDeduper,
    ConnectionChange,
    JobView,
    RankState,
)
from .tui.serve import DEFAULT_MAX_SESSIONS  # the module imports aiohttp only when it serves

PROG = "elastic-console"
EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2
ENV_URL = "ELASTIC_REDIS_URL"


class CliError(Exception):
    """A failure to report as one line, with the exit status to use."""

    def __init__(self, message: str, code: int = EXIT_RUNTIME) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, status 2, no usage dump
        raise CliError(f"{message} (see {PROG} --help)", EXIT_USAGE)


def _nonneg_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is negative")
    return n


def _positive_int(value: str) -> int:
    n = _nonneg_int(value)
    if n == 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not positive")
    return n


def _positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not positive")
    return x


def build_parser() -> argparse.ArgumentParser:
    """The command line. ``--redis`` is accepted before and after the subcommand."""
    redis_help = (f"Redis server: host, host:port, redis://[user:password@]host:port/db, "
                  f"rediss://, unix://, redis+sentinel://h1:26379,h2:26379/SERVICE "
                  f"or any node of a Redis Cluster (found out, or redis+cluster://) "
                  f"(default ${ENV_URL}, else {DEFAULT_URL}); a password is best given in "
                  f"${PASSWORD_ENV}")
    password_help = (f"file holding the Redis password, used when the URL has none (default "
                     f"${PASSWORD_FILE_ENV}, else ${PASSWORD_ENV}: both keep it out of ps)")
    common = _Parser(add_help=False)
    # SUPPRESS: a subcommand without --redis must not overwrite the global one with None.
    common.add_argument("--redis", metavar="URL", default=argparse.SUPPRESS, help=redis_help)
    common.add_argument("--redis-password-file", metavar="PATH", default=argparse.SUPPRESS,
                        help=password_help)
    p = _Parser(prog=PROG, description="Watch and steer elastic PyTorch jobs through Redis.")
    p.add_argument("--redis", metavar="URL", default=None, help=redis_help)
    p.add_argument("--redis-password-file", metavar="PATH", default=None, help=password_help)
    # No subcommand: the home screen, the list of jobs (as `attach` without a job).
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=False)

    ls = sub.add_parser("ls", parents=[common], help="list the jobs on the server")
    ls.add_argument("--json", action="store_true", help="one JSON array")

    st = sub.add_parser("status", parents=[common], help="a job's state, nodes and ranks")
    st.add_argument("job", metavar="JOB")
    st.add_argument("--json", action="store_true", help="one JSON object")

    lg = sub.add_parser("logs", parents=[common], help="the workers' output")
    lg.add_argument("job", metavar="JOB")
    lg.add_argument("--rank", type=_nonneg_int, default=None, help="only this global rank")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    lg.add_argument("--tail", type=_nonneg_int, default=100, metavar="N",
                    help="print the last N lines first (default 100)")
    lg.add_argument("--grep", metavar="RE", default=None,
                    help="only lines matching this regular expression (colours ignored)")
    lg.add_argument("--stderr", action="store_true", help="only the workers' stderr")
    lg.add_argument("--attempt", type=_nonneg_int, default=None, metavar="N",
                    help="the lines of attempt N only (the rendezvous round N: an earlier "
                    "run of the workers, before a restart; as k9s's previous logs)")
    lg.add_argument("--dedupe", action="store_true",
                    help="a line many ranks printed (within 10 s), once: '×N ranks [0-511] "
                    f"text'; with --follow printed {DEDUPE_HOLD_S:g} s after its first copy")

    ev = sub.add_parser("events", parents=[common], help="the job's event stream")
    ev.add_argument("job", metavar="JOB")
    ev.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    ev.add_argument("--json", action="store_true", help="one JSON object per line")

    for name, what in (("restart", "restart the worker group of every node"),
                       ("stop", "stop the job on every node")):
        c = sub.add_parser(name, parents=[common], help=what)
        c.add_argument("job", metavar="JOB")
        c.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
        c.add_argument("--timeout", type=_positive_float, default=15.0, metavar="S",
                       help="seconds to wait for the agents' acks (default 15)")

    sk = sub.add_parser("stacks", parents=[common],
                        help="every rank's Python stacks, identical ones grouped, odd ones first")
    sk.add_argument("job", metavar="JOB")
    sk.add_argument("--rank", type=_nonneg_int, default=None, help="only this global rank")
    sk.add_argument("--json", action="store_true", help="one JSON object")
    sk.add_argument("--timeout", type=_positive_float, default=10.0, metavar="S",
                    help="seconds to wait for every rank's answer (default 10)")

    co = sub.add_parser("collectives", parents=[common],
                        help="every rank's newest collectives (torch's flight recorder): the "
                        "ranks the others wait for, mismatched collectives")
    co.add_argument("job", metavar="JOB")
    co.add_argument("--rank", type=_nonneg_int, default=None, help="only this global rank")
    co.add_argument("--json", action="store_true",
                    help="one JSON object; `suspects`: the waited-for ranks, ascending")
    co.add_argument("--timeout", type=_positive_float, default=10.0, metavar="S",
                    help="seconds to wait for every rank's answer (default 10)")

    rm = sub.add_parser("rm", parents=[common],
                        help="remove a finished or lost job's records from Redis now")
    rm.add_argument("job", metavar="JOB")
    rm.add_argument("--force", action="store_true",
                    help="a running job too: stop it first (every worker on every node)")
    rm.add_argument("--timeout", type=_positive_float, default=30.0, metavar="S",
                    help="with --force: seconds to wait for the agents to stop (default 30)")

    at = sub.add_parser("attach", parents=[common], help="the live terminal console")
    at.add_argument("job", metavar="JOB", nargs="?", default=None,
                    help="the job; without it the console opens on the list of jobs")
    at.add_argument("--read-only", action="store_true", help="never send commands")
    at.add_argument("--scrollback", type=_positive_int, default=DEFAULT_SCROLLBACK, metavar="N",
                    help=f"log lines kept per rank (default {DEFAULT_SCROLLBACK}), "
                         f"{RANK_LINES_TOTAL:,} over all ranks at most (32,768 ranks keep "
                         f"{RANK_LINES_TOTAL // 32768} each); all ranks interleaved keep "
                         f"max(N, {DEFAULT_ALL_SCROLLBACK})")

    sv = sub.add_parser("serve", parents=[common],
                        help="the console in a web browser (read-only unless --allow-commands)")
    sv.add_argument("job", metavar="JOB", nargs="?", default=None,
                    help="the job; without it the browser opens on the list of jobs")
    sv.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=_nonneg_int, default=8765,
                    help="TCP port (default 8765; 0 picks a free one)")
    sv.add_argument("--allow-commands", action="store_true",
                    help="let the browser restart, stop and signal (default: read-only)")
    sv.add_argument("--scrollback", type=_positive_int, default=DEFAULT_SCROLLBACK, metavar="N",
                    help=f"log lines kept per rank (default {DEFAULT_SCROLLBACK})")
    sv.add_argument("--max-sessions", type=_positive_int, default=DEFAULT_MAX_SESSIONS,
                    metavar="N", help="browser sessions (each a console process) at once "
                    f"(default {DEFAULT_MAX_SESSIONS})")
    return p


# -- entry point --------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; return its exit status (see the module docstring)."""
    if argv is None:  # first, before anything else runs: may re-exec without the password
        argv = argv_without_passwords(("--redis",))
    args: argparse.Namespace | None = None
    try:
        args = build_parser().parse_args(argv)
        return _dispatch(args)
    except CliError as exc:
        return _fail(str(exc), exc.code)
    except KeyboardInterrupt:
        # Ctrl-C is how --follow ends; elsewhere it is an interruption (128 + SIGINT).
        return EXIT_OK if args is not None and getattr(args, "follow", False) else 130
    except BrokenPipeError:
        # `elastic-console logs JOB | head`: the reader left; that is not an error. Point
        # stdout at /dev/null so the interpreter's final flush does not complain either.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


def _fail(message: str, code: int) -> int:
    # Messages quote job state and server replies: escaped like standard output.
    # redact: the last guard, should a message ever quote a URL or a password in any form.
    print(terminal_line(f"{PROG}: error: {redact(message)}", False), file=sys.stderr, flush=True)
    return code


def _endpoint(args: argparse.Namespace) -> Endpoint:
    value = getattr(args, "redis", None) or os.environ.get(ENV_URL) or DEFAULT_URL
    try:
        return with_outside_password(parse_endpoint(value),
                                     getattr(args, "redis_password_file", None))
    except EndpointError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def _job(args: argparse.Namespace) -> str:
    try:
        return validate_job_id(args.job)
    except InvalidJobIdError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def _dispatch(args: argparse.Namespace) -> int:
    ep = _endpoint(args)
    if args.command in (None, "attach"):
        return _attach(ep, args)
    if args.command == "serve":
        from .tui.serve import serve  # aiohttp and textual-serve only for this subcommand

        return serve(ep, None if args.job is None else _job(args), host=args.host,
                     port=args.port, allow_commands=args.allow_commands,
                     scrollback=args.scrollback, max_sessions=args.max_sessions)
    commands: dict[str, Callable[[Endpoint, argparse.Namespace], Coroutine[Any, Any, int]]] = {
        "ls": _ls, "status": _status, "logs": _logs, "events": _events,
        "restart": _command, "stop": _command, "stacks": _stacks,
        "collectives": _collectives, "rm": _rm,
    }
    return _run(commands[args.command](ep, args))


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


# -- ls -----------------------------------------------------------------------------------

async def _ls(ep: Endpoint, args: argparse.Namespace) -> int:
    client = await _open(ep, None)
    try:
        jobs = await client.list_jobs()
    finally:
        await client.close()
    if client.index_note:
        print(terminal_line(f"{PROG}: note: {client.index_note}", False), file=sys.stderr)
    if args.json:
        _out(json.dumps([j.to_json() for j in jobs]))
        return EXIT_OK
    if not jobs:
        print(f"no jobs on {ep.display}", file=sys.stderr)
        return EXIT_OK
    _table(["JOB", "STATE", "NODES", "WORLD", "RESTARTS", "AGE", "EXPIRES"],
           ([j.job_id, j.state if j.lost_for_s is None else f"lost {fmt_age(j.lost_for_s)} ago",
             str(j.nodes), _q(j.world_size),
             f"{j.restarts_used}/{_q(j.max_restarts)}", fmt_age(j.age_s),
             "-" if j.expires_in_s is None else f"in {fmt_age(j.expires_in_s)}"]
            for j in jobs))
    return EXIT_OK


# -- status -------------------------------------------------------------------------------

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


def _rank_json(r: RankState) -> dict[str, Any]:
    return {"rank": r.rank, "host": r.host, "node": r.node, "local_rank": r.local_rank,
            "pid": r.pid, "state": r.state, "restarts": r.restarts, "last_exit": r.last_exit,
            "cpu": r.cpu, "rss": r.rss, "threads": r.threads}


def status_object(view: JobView, job: str, redis_display: str) -> dict[str, Any]:
    """What ``status --json`` prints of a job's view (the TTL aside): also what bench/chaos.py
    compares an attached console's view with, so both always show the same fields."""
    return {
        "job": job, "redis": redis_display, "state": view.state, "round": view.round,
        "world_size": view.world_size, "min_nodes": view.min_nodes,
        "max_nodes": view.max_nodes, "restarts_used": view.restarts_used,
        "max_restarts": view.max_restarts, "created_ms": view.created_ms,
        "last_heartbeat_ms": view.lost_since_ms,
        "nodes": {n: {"host": i.host, "status": i.status, "group_rank": i.group_rank}
                  for n, i in view.nodes.items()},
        "ranks": [_rank_json(view.ranks[r]) for r in sorted(view.ranks)],
        "root_cause": view.root_cause,
        "stragglers": view.stragglers,
        "patterns": list(view.patterns.values()),  # the restart patterns (issue 22)
    }


async def _status(ep: Endpoint, args: argparse.Namespace) -> int:
    job = _job(args)
    client = await _open(ep, job)
    try:
        view = await _load_view(client, resources=True)
    finally:
        await client.close()
    ranks = [view.ranks[r] for r in sorted(view.ranks)]
    # A running job's keys carry a lease that its agents renew: only an ended (or lost) job
    # really expires.
    expires = (view.expires_in_ms / 1000 if view.expires_in_ms is not None and (
        view.is_final or view.state == "lost") else None)
    if args.json:
        _out(json.dumps({**status_object(view, job, ep.display), "expires_in_s": expires},
                        default=str))
        return EXIT_OK
    rnd = f" (round {view.round})" if view.round is not None else ""
    if view.lost_since_ms is not None and not view.is_final:
        quiet = (view.liveness_ms - view.lost_since_ms) / 1000
        rnd += (f": no agent has sent a heartbeat for {fmt_age(max(0.0, quiet))}"
                if view.lost_since_ms else ": no agent heartbeats")
    _out(f"job       {job}: {view.state}{rnd}")
    _out(f"redis     {ep.display}")
    active = view.active_nodes()
    bounds = f"{_q(view.min_nodes)}..{_q(view.max_nodes)}"
    _out(f"nodes     {len(active)} active (wanted {bounds})")
    for node_id, info in sorted(view.nodes.items(), key=lambda kv: (kv[1].group_rank is None,
                                                                    kv[1].group_rank or 0)):
        gr = f", group rank {info.group_rank}" if info.group_rank is not None else ""
        _out(f"          {info.host} ({node_id}): {info.status}{gr}")
    _out(f"world     {_q(view.world_size)} ranks")
    _out(f"restarts  {view.restarts_used}/{_q(view.max_restarts)} used")
    if expires is not None:
        _out(f"expires   in {fmt_age(expires)}: then Redis drops the job's records "
             f"({PROG} rm removes them now)")
    if view.root_cause:
        c = view.root_cause
        _out(f"root cause: rank {_q(c.get('rank'))} on {c.get('host', '?')}: "
             f"{c.get('message') or c.get('exit_code')}")
        _write("    " + line for line in str(c.get("traceback") or "").split("\n") if line)
    for pattern in view.patterns.values():
        _out(f"pattern   {pattern}")
    if view.stragglers:
        _out("stragglers " + ", ".join(f"rank {x['rank']} on {x['host']} ({x['ratio']:g}x "
                                       "slower)" for x in view.stragglers[:16]))
    if view.skipped:
        _out(f"skipped   {view.skipped} record{'' if view.skipped == 1 else 's'} that could not "
             "be read (malformed, foreign or of an unknown version)")
    _out()
    if not ranks:
        _out("no workers have started yet")
        return EXIT_OK
    _table(["RANK", "HOST", "LOCAL", "PID", "STATE", "RESTARTS", "LAST EXIT", "CPU%", "RSS"],
           ([str(r.rank), r.host, _q(r.local_rank), _q(r.pid), r.state, str(r.restarts),
             _q(r.last_exit), "-" if r.cpu is None else f"{r.cpu:.1f}", fmt_bytes(r.rss)]
            for r in ranks))
    return EXIT_OK


# -- logs ---------------------------------------------------------------------------------

#: logs -f --dedupe: how long the first copy of a line waits for the other ranks' copies.
#: A stream cannot redraw a printed line, so its count is final when printed.
DEDUPE_HOLD_S = 1.0
DEDUPE_PENDING_LIMIT = 10_000  # rows waiting to be printed; past it the oldest go at once

class _LogPrinter:
    """Filters, dedupes and prints log batches as ``[rank R] text`` lines.

    A line a worker redraws in place (a progress bar: a ``live`` batch's last line, replaced
    by the first line of its stream's next batch) is printed as a terminal shows it, never
    frame by frame. ``logs`` prints every line in its latest state (an unfinished one where
    its latest frame came). ``logs -f`` on a terminal keeps the newest unfinished line on the
    last row, rewritten with ``\\r`` as it changes, and prints it for good once it is
    finished; into a pipe or a file it prints finished lines only, since that output is kept
    or read by programs, for which a frame is noise and a rewrite is garbage.
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
        self._status: tuple[tuple[str, int, str, int], str] | None = None  # stream, line
        self._shown = False  # the status line is on the terminal's last row
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
        """The last ``n`` lines of ``batches``, oldest first, each in its latest state: a frame
        that a later batch of its stream replaced is left out, and so is a still unfinished
        line when following (the newest one becomes the status line on a terminal)."""
        kept = [b for b in batches if self._wanted(b)]  # forward: the deduper needs the order
        if self.collapse is not None:
            return self._collapsed_history(kept, n, follow)
        out: list[str] = []
        later: set[tuple[str, int, str, int]] = set()  # streams with a newer batch
        for b in reversed(kept):
            if len(out) >= n:
                break
            key = (b.node, b.rank, b.stream, b.attempt)
            lines = b.lines
            prefix = f"[rank {b.rank}] "
            if b.live:
                if (follow and self.tty and self._status is None and key not in later
                        and self._match(lines[-1])):
                    self._status = (key, prefix + lines[-1])
                if follow or key in later:
                    lines = lines[:-1]
            later.add(key)
            for raw in reversed(lines):
                if self._match(raw):
                    out.append(prefix + raw)
                    if len(out) >= n:
                        break
        out.reverse()
        return out

    def follow(self, rec: object) -> list[str]:
        """The finished lines of a followed record to print; on a terminal they are written
        here, around the status line (so nothing is returned)."""
        if not isinstance(rec, LogBatch) or not self._wanted(rec):
            return []
        lines, live = rec.lines, None
        if rec.live:
            lines, live = lines[:-1], lines[-1]
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
            self._status = None  # that line finished, or has a newer frame below
        if live is not None and self._match(live):
            self._status = (key, prefix + live)
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
            if b.live and (follow or last[(b.node, b.rank, b.stream, b.attempt)] != i):
                lines = lines[:-1]  # a frame a later batch replaced, or the status line
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
        """On a terminal: erase the status line, print ``done``, draw the status line again
        (cut to the terminal's width: a wrapped line could not be rewritten with ``\\r``)."""
        parts = ["\r\x1b[K"] if self._shown else []
        parts.extend(terminal_line(line, True) + "\n" for line in done)
        self._shown = self._status is not None
        if self._status is not None:
            width = max(10, shutil.get_terminal_size().columns - 1)
            parts.append(_fit(terminal_line(self._status[1], False), width))
        if parts:
            sys.stdout.write("".join(parts))
            sys.stdout.flush()

    def close(self) -> None:
        """Leave the terminal on a new line after a status line."""
        if self._shown:
            self._shown = False
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


async def _logs(ep: Endpoint, args: argparse.Namespace) -> int:
    job = _job(args)
    if args.attempt is not None:
        return await _attempt_logs(ep, job, args)
    printer = _LogPrinter(args, tty=sys.stdout.isatty())
    client = await _open(ep, job)
    try:
        _, batches = await client.history(max_events=0,
                                          max_log_entries_per_stream=max(2_000, args.tail))
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
    if not found.batches:
        sys.stderr.write(f"no lines of attempt {args.attempt} of job {job} are kept"
                         f"{'' if args.rank is None else f' for rank {args.rank}'}\n")
        return EXIT_OK
    _write(printer.history(found.batches, args.tail, follow=False))
    printer.close()
    return EXIT_OK


async def _print_due(printer: _LogPrinter) -> None:
    # A timer, not an event: a held row is due when time passes, whether lines come or not.
    while True:
        await asyncio.sleep(DEDUPE_HOLD_S / 4)
        printer.print_due()


# -- events -------------------------------------------------------------------------------

def _value(v: Any, limit: int = 300) -> str:
    if isinstance(v, str) and v and not any(c in v for c in ' ="\\') and len(v) <= limit:
        return sanitize(v)
    text = json.dumps(v, ensure_ascii=False, separators=(",", ":"), default=str)
    if len(text) > limit:
        text = text[:limit] + f"…(+{len(text) - limit} chars)"
    return sanitize(text)


def _event_line(ev: Event) -> str:
    pairs = " ".join(f"{sanitize(str(k))}={_value(v)}" for k, v in ev.data.items())
    return f"{_clock(ev.server_ms)} {sanitize(ev.node)} {ev.type} {pairs}".rstrip()


def _event_json(ev: Event) -> str:
    # ensure_ascii (the default) escapes every control character: safe on any terminal.
    return json.dumps({"id": ev.id, "time_ms": ev.server_ms, "type": ev.type, "node": ev.node,
                       "data": ev.data}, default=str)


async def _events(ep: Endpoint, args: argparse.Namespace) -> int:
    job = _job(args)
    fmt = _event_json if args.json else _event_line
    client = await _open(ep, job)
    try:
        events, _ = await client.history(max_events=10_000, max_log_entries_per_stream=0)
        _write(fmt(e) for e in events)
        sys.stdout.flush()
        if args.follow:
            await _follow(client, ep, logs=False, render=lambda rec: [fmt(rec)]
                          if isinstance(rec, Event) else [])
    finally:
        await client.close()
    return EXIT_OK


# -- restart / stop -----------------------------------------------------------------------

def _confirm(question: str, assume_yes: bool) -> None:
    if assume_yes:
        return
    if not sys.stdin.isatty():
        raise CliError("refusing to act without confirmation: stdin is not a terminal "
                       "(pass --yes to confirm)", EXIT_USAGE)
    sys.stderr.write(question + " [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        raise CliError("cancelled; nothing was sent", EXIT_RUNTIME)


async def _command(ep: Endpoint, args: argparse.Namespace) -> int:
    job = _job(args)
    kind = CommandType.RESTART if args.command == "restart" else CommandType.STOP
    client = await _open(ep, job)
    try:
        view = await _load_view(client, resources=False)
        if view.is_final:
            raise CliError(f"job '{job}' has already {view.state}: there is nothing to {kind}")
        expected = view.active_nodes()
        if not expected:
            raise CliError(f"no agent of job '{job}' is running to receive a {kind} command")
        ok, why = await client.can_write()
        if not ok:
            raise CliError(why)
        question = (f"Restart the worker group of job {job}?" if kind == CommandType.RESTART
                    else f"Stop job {job} (every worker on every node)?")
        _confirm(question, args.yes)
        cid = await client.send_command(kind)
        n = len(expected)
        _out(f"{kind} command {cid} sent to job {job}; waiting for {n} agent"
             f"{'' if n == 1 else 's'} to answer")
        sys.stdout.flush()

        def show(ack: Ack) -> None:
            reason = f": {ack.reason}" if ack.reason else ""
            _out(f"  {ack.status} by {ack.host} ({ack.node}){reason}")
            sys.stdout.flush()

        acks = await client.wait_acks(cid, expected_nodes=n, timeout=args.timeout, on_ack=show)
    finally:
        await client.close()
    by_node = {a.node: a for a in acks}
    missing = [f"{host} ({node})" for node, host in expected.items() if node not in by_node]
    refused = [a for a in acks if a.node in expected and a.status != "accepted"]
    if missing:
        return _fail(f"no answer within {args.timeout:g} s from: {', '.join(missing)}",
                     EXIT_RUNTIME)
    if refused:
        return _fail(f"{len(refused)} of {n} agents did not accept the {kind} command",
                     EXIT_RUNTIME)
    _out(f"all {n} agent{'' if n == 1 else 's'} accepted the {kind} command")
    return EXIT_OK


# -- stacks and collectives: per-rank requests -------------------------------------------

async def _ready_for_request(ep: Endpoint, args: argparse.Namespace, job: str) -> None:
    """Refuse, with one line, a per-rank request (``stacks``, ``collectives``) that no worker
    can answer: the job ended, no round completed, or ``--rank`` is not in it."""
    import redis

    from .job.stack_view import job_round

    client = await _open(ep, job)
    try:
        final = (await client.meta()).get("final_state")
        if final:
            raise CliError(f"job '{job}' has already {sanitize(final)}: no worker to ask")
        info = await job_round(ep, job)
    except (redis.RedisError, OSError) as exc:
        raise CliError(f"cannot read job '{job}': {sanitize(str(exc))}") from None
    finally:
        await client.close()
    if info is None or not info.total_workers:
        raise CliError(f"job '{job}' has no running workers (no rendezvous round completed)")
    if args.rank is not None and args.rank >= info.total_workers:
        raise CliError(f"rank {args.rank} is not in job '{job}' (world size "
                       f"{info.total_workers})", EXIT_USAGE)


async def _stacks(ep: Endpoint, args: argparse.Namespace) -> int:
    """Ask every agent of the job for its ranks' Python stacks (read-only: no confirmation)."""
    import redis

    from .job.stack_view import fetch_stacks, result_json, result_lines

    job = _job(args)
    await _ready_for_request(ep, args, job)
    try:
        result = await fetch_stacks(ep, job, rank=args.rank, timeout=args.timeout)
    except (redis.RedisError, OSError) as exc:
        raise CliError(f"cannot ask job '{job}' for stacks on {ep.display}: "
                       f"{sanitize(str(exc))}") from None
    if args.json:
        _out(json.dumps(result_json(result, job)))
    else:
        _write(result_lines(result, job))
    if not any(s.threads for s in result.stacks):
        return _fail(f"no rank of job '{job}' answered with stacks", EXIT_RUNTIME)
    return EXIT_OK


async def _collectives(ep: Endpoint, args: argparse.Namespace) -> int:
    """Ask every agent for its ranks' flight recorder traces (read-only: no confirmation)."""
    import redis

    from .job.collective_view import fetch_collectives, result_json, result_lines

    job = _job(args)
    await _ready_for_request(ep, args, job)
    try:
        result = await fetch_collectives(ep, job, rank=args.rank, timeout=args.timeout)
    except (redis.RedisError, OSError) as exc:
        raise CliError(f"cannot ask job '{job}' for collectives on {ep.display}: "
                       f"{sanitize(str(exc))}") from None
    if args.json:
        _out(json.dumps(result_json(result, job)))
    else:
        _write(result_lines(result, job))
    if not result.analysis["answered"]:
        return _fail(f"no rank of job '{job}' answered with a collective trace (is "
                     "--flight-recorder 0, or torch.distributed not started yet?)", EXIT_RUNTIME)
    return EXIT_OK


# -- rm -----------------------------------------------------------------------------------

async def _rm(ep: Endpoint, args: argparse.Namespace) -> int:
    """Remove a job's records now. A finished or lost job goes at once; a running one only
    with --force, once a stop command has stopped every agent (they would write the job
    back otherwise), within --timeout."""
    job = _job(args)
    client = await _open(ep, job)
    try:
        view = await _load_view(client, resources=False)
        running = not view.is_final and view.state != "lost"
        if running:
            expected = view.active_nodes()
            if not args.force:
                raise CliError(f"job '{job}' is {view.state} ({len(expected)} agent"
                               f"{'' if len(expected) == 1 else 's'}): stop it first, or "
                               f"'{PROG} rm --force {job}' stops and removes it")
            ok, why = await client.can_write()
            if not ok:
                raise CliError(why)
            cid = await client.send_command(CommandType.STOP)
            _out(f"stop command {cid} sent to job {job}; waiting up to {args.timeout:g} s for "
                 "its agents to stop")
            sys.stdout.flush()
            deadline = time.monotonic() + args.timeout
            while await client.live_agents():
                if time.monotonic() >= deadline:
                    raise CliError(f"the agents of job '{job}' did not stop within "
                                   f"{args.timeout:g} s; nothing was removed (see "
                                   f"{PROG} status {job})")
                # An agent's heartbeat is a score in a sorted set: nothing signals it leaving.
                await asyncio.sleep(0.2)
        n = await client.remove()
    finally:
        await client.close()
    _out(f"removed job {job} ({n} key{'' if n == 1 else 's'})")
    return EXIT_OK


# -- attach -------------------------------------------------------------------------------

def _attach(ep: Endpoint, args: argparse.Namespace) -> int:
    """Start the Textual app: ``run_app(endpoint=..., job_id=..., read_only=..., scrollback=...)``
    from ``elastic_console.tui.app``, imported here only (the other subcommands never load
    Textual). Its return value, if an int, is the exit status.

    A job that does not exist yet is not an error: the app waits for it (and lists the jobs it
    knows). An unreachable Redis is, at start: one line now beats a banner on a blank screen.
    Without a terminal there is nothing to show: status 2 (scripts use status/logs/events).
    """
    job = None if getattr(args, "job", None) is None else _job(args)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise CliError("attach needs a terminal (stdin and stdout are not both a tty); "
                       f"scripts can use {PROG} status, logs and events", EXIT_USAGE)
    try:
        from elastic_console.tui.app import run_app
    except ModuleNotFoundError as exc:
        raise CliError(f"the console app cannot start: {exc}") from None

    async def check() -> int:
        client = JobClient(ep, job)
        try:
            # Either raises RedisUnavailableError with one sentence.
            await (client.job_exists() if job is not None else client.list_jobs())
        finally:
            await client.close()
        return EXIT_OK

    _run(check())
    code = run_app(endpoint=ep, job_id=job, read_only=getattr(args, "read_only", False),
                   scrollback=getattr(args, "scrollback", DEFAULT_SCROLLBACK))
    return code if isinstance(code, int) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
