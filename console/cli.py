"""`elastic-console`: watch and steer elastic jobs from any machine that reaches their Redis.

    elastic-console ls
    elastic-console status JOB [--json]
    elastic-console logs JOB [--rank R] [--follow] [--tail N] [--grep RE] [--stderr] [--dedupe]
    elastic-console events JOB [--follow] [--json]
    elastic-console metrics JOB [--metric M] [--rank R | --aggregate] [--json | --csv]
    elastic-console restart JOB [--yes] [--timeout S]
    elastic-console stop JOB [--yes] [--timeout S]
    elastic-console stacks JOB [--rank R] [--json] [--timeout S]
    elastic-console collectives JOB [--rank R] [--json] [--timeout S]
    elastic-console attach [JOB] [--read-only] [--scrollback N]   (no JOB: the list of jobs)
    elastic-console serve [JOB] [--host H] [--port N] [--allow-commands] [--max-sessions N]
                          [--token-file PATH]
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
:func:`elastic_agent.coordination.wire.text.sanitize`; SGR colours are kept only on a terminal.
The Textual app is imported only by ``attach``, so the other subcommands start fast and work
without a terminal.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn

from elastic_agent.coordination.transport.endpoints import (
    DEFAULT_URL,
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    Endpoint,
    EndpointError,
    argv_without_passwords,
    parse_endpoint,
    with_outside_password,
)
from elastic_agent.coordination.transport.job_secret import with_job_secret
from elastic_agent.coordination.wire.protocol import MAX_RANK

from .commands import control, diagnose, interactive, logs, metrics, read
from .commands.common import EXIT_OK, EXIT_USAGE, PROG, CliError, _fail, _run
from .commands.logs import DEDUPE_HOLD_S
from .job.state import DEFAULT_ALL_SCROLLBACK, DEFAULT_SCROLLBACK, RANK_LINES_TOTAL
from .tui.serve import DEFAULT_MAX_SESSIONS  # the module imports aiohttp only when it serves

ENV_URL = "ELASTIC_REDIS_URL"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, status 2, no usage dump
        raise CliError(f"{message} (see {PROG} --help)", EXIT_USAGE)


class _Number:
    """The one argparse type of every numeric option: a whole number (``int``) or a number
    (``float``) from ``low`` to ``high`` (``low`` itself excluded when ``above``). NaN, the
    infinities and anything past the bound are refused while parsing, so a bad value is one
    line and status 2 before anything is read or sent (an infinite ``--timeout`` overflows
    only while waiting for the acks, after its restart command was sent)."""

    def __init__(self, kind: type[int] | type[float], low: float, high: float, *,
                 above: bool = False, unit: str = "") -> None:
        self.kind, self.low, self.high, self.above = kind, low, high, above
        what = "a whole number" if kind is int else "a number"
        self.what = (f"{what}{f' of {unit}' if unit else ''} "
                     f"{'above' if above else 'from'} {low:g} "
                     f"{'and at most' if above else 'to'} {high:,g}")

    def __call__(self, value: str) -> int | float:
        shown = repr(value if len(value) <= 40 else value[:40] + "...")
        try:
            x = self.kind(value)
        except ValueError:  # int("1e3"), a 5,000-digit int: also ValueError
            raise argparse.ArgumentTypeError(f"{shown} is not {self.what}") from None
        if not (math.isfinite(x) and (x > self.low if self.above else x >= self.low)
                and x <= self.high):
            raise argparse.ArgumentTypeError(f"{shown} is not {self.what}")
        return x


#: Seconds any --timeout may wait: a day is past any wait for agents' answers, and keeps the
#: deadline arithmetic (milliseconds as ints for XREAD BLOCK) finite.
TIMEOUT_MAX_S = 86_400.0
#: Lines --tail may ask for: a stream keeps 200,000 entries by default (--log-retention), and
#: every line asked for is held in memory before printing.
TAIL_MAX = 1_000_000
ATTEMPT_MAX = 1_000_000_000  # a rendezvous round number
SESSIONS_MAX = 1_000  # serve: each session is a console process
_seconds = _Number(float, 0, TIMEOUT_MAX_S, above=True, unit="seconds")
_rank = _Number(int, 0, MAX_RANK - 1)
_tail = _Number(int, 0, TAIL_MAX)
_attempt = _Number(int, 0, ATTEMPT_MAX)
_scrollback = _Number(int, 1, RANK_LINES_TOTAL)
_port = _Number(int, 0, 65_535)
_sessions = _Number(int, 1, SESSIONS_MAX)


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
    lg.add_argument("--rank", type=_rank, default=None, help="only this global rank")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    lg.add_argument("--tail", type=_tail, default=100, metavar="N",
                    help="print the last N lines first (default 100)")
    lg.add_argument("--grep", metavar="RE", default=None,
                    help="only lines matching this regular expression (colours ignored)")
    lg.add_argument("--stderr", action="store_true", help="only the workers' stderr")
    lg.add_argument("--attempt", type=_attempt, default=None, metavar="N",
                    help="the lines of attempt N only (the rendezvous round N: an earlier "
                    "run of the workers, before a restart; as k9s's previous logs)")
    lg.add_argument("--dedupe", action="store_true",
                    help="a line many ranks printed (within 10 s), once: '×N ranks [0-511] "
                    f"text'; with --follow printed {DEDUPE_HOLD_S:g} s after its first copy")

    ev = sub.add_parser("events", parents=[common], help="the job's event stream")
    ev.add_argument("job", metavar="JOB")
    ev.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    ev.add_argument("--json", action="store_true", help="one JSON object per line")

    me = sub.add_parser("metrics", parents=[common],
                        help="a training metric's curve (rank 0's, a rank's or the median "
                        "across ranks), as the console's metrics view draws it")
    me.add_argument("job", metavar="JOB")
    me.add_argument("--metric", metavar="M", default=None,
                    help="the metric (default: the first loss-like one)")
    who = me.add_mutually_exclusive_group()
    who.add_argument("--rank", type=_rank, default=None,
                     help="this global rank's points (default rank 0)")
    who.add_argument("--aggregate", action="store_true",
                     help="the median across ranks at each step, with its min and max")
    fmt = me.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true",
                     help='one JSON object: {"metric", "rank", "points": [{"step", "ms", '
                     '"value", "attempt", "redone"}]}')
    fmt.add_argument("--csv", action="store_true", help="CSV with a header line")

    for name, what in (("restart", "restart the worker group of every node"),
                       ("stop", "stop the job on every node")):
        c = sub.add_parser(name, parents=[common], help=what)
        c.add_argument("job", metavar="JOB")
        c.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
        c.add_argument("--timeout", type=_seconds, default=15.0, metavar="S",
                       help="seconds to wait for the agents' acks (default 15)")

    sk = sub.add_parser("stacks", parents=[common],
                        help="every rank's Python stacks, identical ones grouped, odd ones first")
    sk.add_argument("job", metavar="JOB")
    sk.add_argument("--rank", type=_rank, default=None, help="only this global rank")
    sk.add_argument("--json", action="store_true", help="one JSON object")
    sk.add_argument("--timeout", type=_seconds, default=10.0, metavar="S",
                    help="seconds to wait for every rank's answer (default 10)")

    co = sub.add_parser("collectives", parents=[common],
                        help="every rank's newest collectives (torch's flight recorder): the "
                        "ranks the others wait for, mismatched collectives")
    co.add_argument("job", metavar="JOB")
    co.add_argument("--rank", type=_rank, default=None, help="only this global rank")
    co.add_argument("--json", action="store_true",
                    help="one JSON object; `suspects`: the waited-for ranks, ascending")
    co.add_argument("--timeout", type=_seconds, default=10.0, metavar="S",
                    help="seconds to wait for every rank's answer (default 10)")

    rm = sub.add_parser("rm", parents=[common],
                        help="remove a finished or lost job's records from Redis now")
    rm.add_argument("job", metavar="JOB")
    rm.add_argument("--force", action="store_true",
                    help="a running job too: stop it first (every worker on every node)")
    rm.add_argument("--timeout", type=_seconds, default=30.0, metavar="S",
                    help="with --force: seconds to wait for the agents to stop (default 30)")

    at = sub.add_parser("attach", parents=[common], help="the live terminal console")
    at.add_argument("job", metavar="JOB", nargs="?", default=None,
                    help="the job; without it the console opens on the list of jobs")
    at.add_argument("--read-only", action="store_true", help="never send commands")
    at.add_argument("--scrollback", type=_scrollback, default=DEFAULT_SCROLLBACK, metavar="N",
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
    sv.add_argument("--port", type=_port, default=8765,
                    help="TCP port (default 8765; 0 picks a free one)")
    sv.add_argument("--allow-commands", action="store_true",
                    help="let the browser restart, stop and signal (default: read-only)")
    sv.add_argument("--token-file", default=None, metavar="PATH",
                    help="write the URL's access token to PATH (mode 0600, replaced whole, "
                         "removed at exit) and print the URL without it: for a server whose "
                         "output is kept in a log (a pod, a service)")
    sv.add_argument("--scrollback", type=_scrollback, default=DEFAULT_SCROLLBACK, metavar="N",
                    help=f"log lines kept per rank (default {DEFAULT_SCROLLBACK})")
    sv.add_argument("--max-sessions", type=_sessions, default=DEFAULT_MAX_SESSIONS,
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


def _endpoint(args: argparse.Namespace) -> Endpoint:
    value = getattr(args, "redis", None) or os.environ.get(ENV_URL) or DEFAULT_URL
    try:
        # redis://agent@HOST:PORT of a SLURM-hosted Redis: its password derives from
        # $ELASTIC_JOB_SECRET and the job (JOB_SECRET_ENV, the agent's announce line).
        ep = with_job_secret(parse_endpoint(value), getattr(args, "job", None))
        return with_outside_password(ep, getattr(args, "redis_password_file", None))
    except EndpointError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def _dispatch(args: argparse.Namespace) -> int:
    ep = _endpoint(args)
    if args.command in (None, "attach"):
        return interactive.attach(ep, args)
    if args.command == "serve":
        return interactive.serve(ep, args)
    commands: dict[str, Callable[[Endpoint, argparse.Namespace], Coroutine[Any, Any, int]]] = {
        "ls": read.ls, "status": read.status, "logs": logs.logs, "events": read.events,
        "restart": control.command, "stop": control.command, "stacks": diagnose.stacks,
        "collectives": diagnose.collectives, "rm": control.rm, "metrics": metrics.metrics,
    }
    return _run(commands[args.command](ep, args))


if __name__ == "__main__":
    sys.exit(main())
