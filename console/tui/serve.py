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
* **a secret path**: a random token (``secrets.token_urlsafe(24)``) is the first segment of
  every URL the console serves (``http://127.0.0.1:8765/TOKEN/``): textual-serve's app (its
  index page, websocket and static files) is mounted under it, and an aiohttp middleware in
  front of everything compares the segment in constant time; anything else gets 403. No
  cookie: a browser sends a host's cookies to every port of that host (another user's
  TensorBoard on a shared node, anything at the laptop's end of an SSH tunnel), so a cookie
  holding the token would give it away. The one exception is textual-serve's
  ``/download/KEY``, which its page script opens at the root: the key (a uuid4 the console
  makes for one download, gone once it is fetched) is its own secret. The websocket also
  refuses a foreign ``Origin``, and the page and its files say ``Referrer-Policy:
  no-referrer`` (the URL holds the token);
* **a bounded number of sessions**: each websocket runs a console process, so at most
  ``--max-sessions`` (default :data:`DEFAULT_MAX_SESSIONS`) run at once; one more gets 503 and
  a line on the server's stderr;
* **the token out of logs, when asked**: the URL with its token is printed for whoever started
  the server in a terminal; with ``--token-file PATH`` the token goes to that file alone (0600,
  replaced whole, never through a symlink, removed at exit) and the printed URL says where it
  is, for a server whose output others read (a pod's log, a service's journal).

The Redis URL (with its password, if any) reaches the per-tab console through an environment
variable of the server process, never its command line (``ps`` shows command lines to every
user). The per-tab command is ``python -m elastic_console.tui.serve --tab ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import os
import re
import secrets
import shlex
import signal
import sys
import time
from typing import Any

from elastic_agent.coordination.transport.endpoints import Endpoint, parse_endpoint, redact
from elastic_agent.coordination.wire.keyspace import validate_job_id
from elastic_agent.coordination.wire.text import terminal_line

from ..job.state import DEFAULT_SCROLLBACK

__all__ = ["DEFAULT_MAX_SESSIONS", "READ_ONLY_WHY", "make_web_app", "serve"]

#: What a command key says in the browser when ``--allow-commands`` was not given.
READ_ONLY_WHY = "read-only: started without --allow-commands"
#: Browser sessions (each a console process, 25 MiB and up) that may run at once.
DEFAULT_MAX_SESSIONS = 8
#: textual-serve's page opens a download at ``/download/<the uuid4 hex textual makes>``.
_DOWNLOAD = re.compile(r"/download/[0-9a-f]{32}")
_URL_ENV = "_ELASTIC_CONSOLE_SERVE_URL"
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _tab_command(job: str | None, allow_commands: bool, scrollback: int) -> str:
    argv = [sys.executable, "-m", "elastic_console.tui.serve", "--tab", "--scrollback",
            str(scrollback)]
    if allow_commands:
        argv.append("--allow-commands")
    if job is not None:
        argv.append(validate_job_id(job))
    return shlex.join(argv)


def _token_ok(supplied: str | None, token: str) -> bool:
    return bool(supplied) and hmac.compare_digest(str(supplied).encode(), token.encode())


def make_web_app(server: Any, token: str, max_sessions: int = DEFAULT_MAX_SESSIONS) -> Any:
    """textual-serve's aiohttp application for ``server``, mounted under ``/token/``, with the
    token checked on every request and the sessions counted (see the module doc). A
    coroutine: ``await make_web_app(...)``."""
    from aiohttp import web

    prefix = f"/{token}/"
    sessions = 0
    said = -60.0  # when the last refusal was reported (one line a minute at most)

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        nonlocal sessions, said
        path = request.path
        if not _token_ok(path[1:].split("/", 1)[0], token) and not _DOWNLOAD.fullmatch(path):
            raise web.HTTPForbidden(text="elastic-console serve: this URL needs the access "
                                    "token printed when the server started (or written to "
                                    "its --token-file)\n")
        if path == prefix[:-1]:
            raise web.HTTPFound(prefix)  # the page's relative URLs need the slash
        if path == prefix:
            # textual-serve writes absolute URLs (static files, websocket) from public_url:
            # make them the host the browser used (an SSH tunnel's port). Set before the
            # handler, which renders without awaiting anything first.
            server.public_url = f"{request.scheme}://{request.host}"
        if path != prefix + "ws":
            response = await handler(request)
            if not response.prepared:
                response.headers["Referrer-Policy"] = "no-referrer"
                response.headers["Cache-Control"] = "no-store"
            return response
        origin = request.headers.get("Origin")
        if origin and origin not in (f"http://{request.host}", f"https://{request.host}"):
            raise web.HTTPForbidden(text="elastic-console serve: foreign origin\n")
        if sessions >= max_sessions:
            if time.monotonic() - said >= 60:
                said = time.monotonic()
                print(f"elastic-console: refusing browser sessions beyond {max_sessions} "
                      "(--max-sessions)", file=sys.stderr, flush=True)
            raise web.HTTPServiceUnavailable(
                text=f"elastic-console serve: {sessions} sessions are running, the most "
                "this server allows (--max-sessions): close a tab\n")
        sessions += 1
        try:  # the handler returns when the session ends
            return await handler(request)
        finally:
            sessions -= 1

    async def quiet(app: web.Application) -> None:
        pass  # textual-serve prints a banner with the command and a URL without the token

    async def build() -> web.Application:
        server.on_startup = quiet
        console = await server._make_app()
        app = web.Application(middlewares=[guard])
        app.add_subapp(prefix[:-1], console)
        app.router.add_get("/download/{key}", server.handle_download)
        return app

    return build()


def write_token(path: str, token: str) -> None:
    """``token`` into ``path``, mode 0600: written to a new file beside it and renamed over it,
    so a reader sees the old file or the whole new one, and a symlink at ``path`` is replaced,
    never followed. OSError if it cannot be."""
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.write(fd, f"{token}\n".encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _remove_token(path: str, token: str) -> None:
    """Remove the token file at exit, if it still holds this server's token (a dead token
    must not be mistaken for a live one; another server's must stay)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            held = os.read(fd, 256)
        finally:
            os.close(fd)
        if held.strip() == token.encode():
            os.unlink(path)


def serve(endpoint: Endpoint, job: str | None, *, host: str = "127.0.0.1", port: int = 8765,
          allow_commands: bool = False, scrollback: int = DEFAULT_SCROLLBACK,
          max_sessions: int = DEFAULT_MAX_SESSIONS, token_file: str | None = None) -> int:
    """Serve the console until interrupted (Ctrl-C, SIGTERM); print the URL with its token,
    or without it once the token is in ``token_file``."""
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
        runner = web.AppRunner(await make_web_app(server, token, max_sessions),
                               handle_signals=False)
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
        # Before anything is announced: a SIGTERM from then on ends the server cleanly
        # (its token file removed).
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        what = f"job {job}" if job else f"the jobs on {endpoint.display}"
        mode = "commands allowed" if allow_commands else "read-only"
        where = f"{server.public_url}/{token}/"
        if token_file is not None:
            try:
                write_token(token_file, token)
            except OSError as exc:
                await runner.cleanup()
                raise SystemExit(_say_error(
                    f"--token-file {token_file}: cannot write the token there: "
                    f"{exc.strerror or exc}")) from None
            where = f"{server.public_url}/TOKEN/ (TOKEN: the contents of {token_file})"
        print(terminal_line(f"elastic-console: serving {what} ({mode}) at {where}", False),
              flush=True)
        if host not in _LOOPBACK:
            print(f"elastic-console: warning: listening on {host}: anyone who can reach it "
                  "and has the URL (its token) sees the job", file=sys.stderr, flush=True)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
            if token_file is not None:
                _remove_token(token_file, token)

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
    p = argparse.ArgumentParser(prog="elastic_console.tui.serve")
    p.add_argument("--tab", action="store_true", required=True)
    p.add_argument("--allow-commands", action="store_true")
    p.add_argument("--scrollback", type=int, default=DEFAULT_SCROLLBACK)
    p.add_argument("job", nargs="?", default=None)
    args = p.parse_args(argv)
    endpoint = parse_endpoint(os.environ.pop(_URL_ENV, None))
    from ..job.save import deliver_log_view
    from .app import ConsoleApp

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
