"""`attach` and `serve`: the console itself, in this terminal (the Textual app) or in web
browsers. Both import the app's side only when they run, so the other subcommands start fast
and work without a terminal.
"""

from __future__ import annotations

import argparse
import sys

from elastic_agent.coordination.transport.endpoints import Endpoint

from ..job.client import JobClient
from ..job.state import DEFAULT_SCROLLBACK
from .common import EXIT_OK, EXIT_USAGE, PROG, CliError, _job, _run

__all__ = ["attach", "serve"]


def attach(ep: Endpoint, args: argparse.Namespace) -> int:
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


def serve(ep: Endpoint, args: argparse.Namespace) -> int:
    """Serve the console to web browsers (``serve`` in ``elastic_console.tui.serve``, imported
    here only). Its return value is the exit status."""
    from ..tui.serve import serve as serve_app  # aiohttp and textual-serve only for this subcommand

    return serve_app(ep, None if args.job is None else _job(args), host=args.host,
                     port=args.port, allow_commands=args.allow_commands,
                     scrollback=args.scrollback, max_sessions=args.max_sessions,
                     token_file=getattr(args, "token_file", None))
