"""`elastic-console serve [JOB]`: the console in a web browser (textual-serve).

For those who cannot open a terminal to the cluster. Each browser tab gets its own console
process (textual-serve's model: the app runs as a subprocess behind a websocket), so a tab
shows exactly what ``attach`` would: the job, or the list of jobs without one.

Safety, by default:

* **loopback**: ``--host 127.0.0.1``; another address is a choice the user makes (and is told
  about on stderr);
* **read-only**: the restart, stop, signal and stacks keys say "read-only: started without
  --allow-commands" and send nothing; only ``--allow-commands`` gives the browser the
  terminal console's commands (each still behind its confirm dialog);
* **a random access token** (``secrets.token_urlsafe(24)``) in the printed URL. Every request
  is checked by an aiohttp middleware in front of textual-serve's routes (its index page, its
  websocket, its static files and downloads): the token in the query (compared in constant
  time) or the cookie the index page sets with it (HttpOnly, SameSite=Strict, so the page's
  scripts, styles and websocket need no token in their URLs and a page of another site cannot
  use it). Anything else gets 403. The websocket also refuses a foreign ``Origin`` (a page
  elsewhere driving the console through the user's cookie).

The Redis URL (with its password, if any) reaches the per-tab console through an environment
variable of the server process, never its command line (``ps`` shows command lines to every
user). The per-tab command is ``python -m elastic_console.serve --tab ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import os
import secrets
import shlex
import signal
import sys
from typing import Any

from elastic_agent.coordination.connection import Endpoint, parse_endpoint, redact
from elastic_agent.coordination.protocol import validate_job_id
from elastic_agent.coordination.text import terminal_line

from .state import DEFAULT_SCROLLBACK

__all__ = ["READ_ONLY_WHY", "TOKEN_COOKIE", "make_web_app", "serve"]

#: What a command key says in the browser when ``--allow-commands`` was not given.
READ_ONLY_WHY = "read-only: started without --allow-commands"
TOKEN_COOKIE = "elastic_console_token"
_URL_ENV = "_ELASTIC_CONSOLE_SERVE_URL"
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _tab_command(job: str | None, allow_commands: bool, scrollback: int) -> str:
    argv = [sys.executable, "-m", "elastic_console.serve", "--tab", "--scrollback",
            str(scrollback)]
    if allow_commands:
        argv.append("--allow-commands")
    if job is not None:
        argv.append(validate_job_id(job))
    return shlex.join(argv)


def _token_ok(supplied: str | None, token: str) -> bool:
    return bool(supplied) and hmac.compare_digest(str(supplied).encode(), token.encode())


def make_web_app(server: Any, token: str) -> Any:
    """textual-serve's aiohttp application for ``server`` with the token checked on every
    request (see the module doc). A coroutine: ``await make_web_app(...)``."""
    from aiohttp import web

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        by_query = _token_ok(request.query.get("token"), token)
        if not (by_query or _token_ok(request.cookies.get(TOKEN_COOKIE), token)):
            raise web.HTTPForbidden(text="elastic-console serve: this URL needs the access "
                                    "token printed when the server started\n")
        origin = request.headers.get("Origin")
        if request.path == "/ws" and origin and origin not in (
                f"http://{request.host}", f"https://{request.host}"):
            raise web.HTTPForbidden(text="elastic-console serve: foreign origin\n")
        if request.path == "/":
            # textual-serve writes absolute URLs (static files, websocket) from public_url:
            # make them the host the browser used, or the cookie would not go with them
            # ("localhost" vs "127.0.0.1", an SSH tunnel's port). Set before the handler,
            # which renders without awaiting anything first.
            server.public_url = f"{request.scheme}://{request.host}"
        response = await handler(request)
        if by_query and request.path == "/" and not response.prepared:
            response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="Strict", path="/")
            response.headers["Referrer-Policy"] = "no-referrer"  # the URL holds the token
            response.headers["Cache-Control"] = "no-store"
        return response

    async def quiet(app: web.Application) -> None:
        pass  # textual-serve prints a banner with the command and a URL without the token

    async def build() -> web.Application:
        server.on_startup = quiet
        app = await server._make_app()
        app.middlewares.append(guard)
        return app

    return build()


def serve(endpoint: Endpoint, job: str | None, *, host: str = "127.0.0.1", port: int = 8765,
          allow_commands: bool = False, scrollback: int = DEFAULT_SCROLLBACK) -> int:
    """Serve the console until interrupted (Ctrl-C, SIGTERM); print the URL with its token."""
    try:
        from aiohttp import web
        from textual_serve.server import Server
    except ModuleNotFoundError as exc:
        print(f"elastic-console: error: the browser view needs textual-serve ({exc}); "
              "pip install textual-serve", file=sys.stderr)
        return 1
    token = secrets.token_urlsafe(24)
    os.environ[_URL_ENV] = endpoint.url  # for the tabs' processes: not in their argv
    title = f"elastic-console {job}" if job else "elastic-console"
    server = Server(_tab_command(job, allow_commands, scrollback), host=host, port=port,
                    title=title)

    async def main() -> None:
        runner = web.AppRunner(await make_web_app(server, token), handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise SystemExit(_say_error(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}")) from None
        bound = runner.addresses[0][1] if runner.addresses else port
        shown = f"[{host}]" if ":" in host else host
        server.public_url = f"http://{shown}:{bound}"  # textual-serve builds its URLs on it
        what = f"job {job}" if job else f"the jobs on {endpoint.display}"
        mode = "commands allowed" if allow_commands else "read-only"
        print(terminal_line(f"elastic-console: serving {what} ({mode}) at "
                            f"{server.public_url}/?token={token}", False), flush=True)
        if host not in _LOOPBACK:
            print(f"elastic-console: warning: listening on {host}: anyone who can reach it "
                  "and has the URL (its token) sees the job", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except SystemExit as exc:
        return int(exc.code or 0)
    except KeyboardInterrupt:
        pass
    return 0


def _say_error(message: str) -> int:
    print(terminal_line(f"elastic-console: error: {redact(message)}", False), file=sys.stderr,
          flush=True)
    return 1


# -- one browser tab -----------------------------------------------------------------------------

def _tab(argv: list[str]) -> int:
    """The console of one browser tab (run by textual-serve with its web driver)."""
    p = argparse.ArgumentParser(prog="elastic_console.serve")
    p.add_argument("--tab", action="store_true", required=True)
    p.add_argument("--allow-commands", action="store_true")
    p.add_argument("--scrollback", type=int, default=DEFAULT_SCROLLBACK)
    p.add_argument("job", nargs="?", default=None)
    args = p.parse_args(argv)
    endpoint = parse_endpoint(os.environ.pop(_URL_ENV, None))
    from .app import ConsoleApp
    from .save import deliver_log_view

    class BrowserConsoleApp(ConsoleApp):
        def _read_only_reason(self) -> str:
            if self.read_only_flag:
                return READ_ONLY_WHY
            return super()._read_only_reason()

        def action_save_log(self) -> None:
            # The user is at a browser, maybe on another machine: the file goes to them.
            self.run_worker(deliver_log_view(self), group="save", exit_on_error=False)

    app = BrowserConsoleApp(None if args.job is None else validate_job_id(args.job),
                            endpoint=endpoint, read_only=not args.allow_commands,
                            scrollback=max(1, args.scrollback), freeze_gc=True)
    code = app.run()
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(_tab(sys.argv[1:]))
