"""`elastic-console serve` in a real browser: Debian's chromium driven by playwright.

The installed command serves a running job (real agent, real Redis); chromium loads the
printed URL. The terminal is drawn on a canvas (xterm.js, WebGL), so what the page shows is
read where the browser receives it: the websocket frames carrying the console's output,
escape sequences removed. No browser is downloaded (``executable_path``): a machine without
chromium fails this test, never skips it (``make test`` installs it: scripts/ensure-tools.sh).
"""

from __future__ import annotations

import contextlib
import http.server
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_agent.coordination.transport.connection import make_client
from tests.test_console_app import commands_sent, sleeper_job, stop_agent
from tests.waiting import wait_until_async

CONSOLE = Path(sys.executable).with_name("elastic-console")
_CSI = re.compile(rb"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[@-Z\\-_])")


def chromium() -> str:
    # A failure, never a skip: a suite that skips its only browser test still passes.
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("chromium is not installed: `make test` installs Debian's package "
                    "(scripts/ensure-tools.sh, as root)", pytrace=False)
    return path


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture
def serve_args() -> tuple[str, ...]:
    """More arguments of `serve` (a test parametrizes this name to give some)."""
    return ()


@pytest.fixture
def served(redis_url: str, tmp_path: Path, serve_args: tuple[str, ...]
           ) -> Iterator[tuple[str, str]]:
    """A running job and `elastic-console serve JOB --port 0 *serve_args`: (job id, printed
    URL)."""
    job = f"web-{uuid.uuid4().hex[:8]}"
    agent = sleeper_job(redis_url, job, tmp_path)
    proc = subprocess.Popen([str(CONSOLE), "--redis", redis_url, "serve", job, "--port", "0",
                             *serve_args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(30)
        m = re.search(r"at (http://127\.0\.0\.1:\d+/\S+)", "".join(lines))
        assert m, f"no URL printed: {lines} {proc.poll()}"
        yield job, m.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        stop_agent(agent)


def test_browser_view_token_read_only_ranks_and_live_lines(served, redis_url):
    from playwright.sync_api import sync_playwright

    job, url = served
    root, token = re.fullmatch(r"(http://[^/]+/)([\w-]{32})/", url).groups()
    # Without the token, or with a wrong one, nothing is served: page, websocket, files.
    for path in ("", f"?token={token}", "ws", "static/js/textual.js", f"{token[:-1]}/",
                 f"{token}x/", f"x{token}/", f"{token[::-1]}/ws", "download/x",
                 f"download/{token}", f"static/{token}/"):
        assert status(root + path) == 403, path
    assert status(f"{root}{token}/static/js/textual.js") == 200
    # textual-serve's page opens downloads at the root: only a live one-time key answers.
    assert status(f"{root}download/{'0' * 32}") == 404
    received: list[bytes] = []
    text: list[str] = []

    def screen() -> str:
        # Only the frames that came since the last look; an escape sequence cut between two
        # frames is rare and costs nothing but a stray character.
        if received:
            chunk, received[:] = b"".join(received), []
            text.append(_CSI.sub(b"", chunk).decode("utf-8", "replace"))
            if len(text) > 1:
                text[:] = ["".join(text)[-200_000:]]
        return text[0] if text else ""

    def wait_for(pattern: str, timeout: float = 15) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, screen())
            if m:
                return m
            page.wait_for_timeout(50)  # playwright delivers frames while it waits
        raise AssertionError(f"{pattern!r} never shown in the browser; got {screen()[-2000:]!r}")

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium(),
                                     args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            refused = page.goto(root)
            assert refused is not None and refused.status == 403
            assert "access token" in page.content()
            page.on("websocket", lambda ws: ws.on(
                "framereceived", lambda payload: received.append(
                    payload if isinstance(payload, bytes) else payload.encode())))
            loaded = page.goto(url)
            assert loaded is not None and loaded.status == 200
            headers = loaded.headers
            assert headers.get("referrer-policy") == "no-referrer" and "set-cookie" not in headers
            wait_for(re.escape(job))  # the header names the job
            wait_for(r"RANK")  # the rank table...
            first = int(wait_for(r"tick (\d+) rank [01]").group(1))  # ...and the log view
            # Live: newer lines keep coming through the page's websocket.
            text.clear()
            wait_for("|".join(f"tick {n} rank" for n in range(first + 1, first + 2000)))
            page.locator(".textual-terminal").click()
            page.keyboard.press("r")
            wait_for(r"read-only:\s*started\s*without\s*--allow-commands")
            # ctrl+s: the log view as shown comes to the browser as a download (its own
            # page: textual-serve opens the one-time URL in a new tab).
            downloads: list[Any] = []
            # Chromium may report the download on the new tab or on the page that opened it.
            page.context.on("page", lambda tab: tab.on("download", lambda d: downloads.append(d)))
            page.on("download", lambda d: downloads.append(d))
            page.keyboard.press("Control+s")
            deadline = time.monotonic() + 15
            while not downloads and time.monotonic() < deadline:
                page.wait_for_timeout(50)
            assert downloads, "ctrl+s started no download"
            saved = Path(downloads[0].path()).read_bytes()
            assert downloads[0].suggested_filename.startswith(f"{job}-")
            assert b"\x1b" not in saved and re.search(rb"tick \d+ rank [01]", saved)
        finally:
            browser.close()
    r = make_client(redis_url)
    try:
        assert commands_sent(r, job) == 0  # r sent nothing
    finally:
        r.close()


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Another web server on the same host (another user's TensorBoard, say): it keeps the
    headers of every request it gets."""

    seen: list[str] = []

    def do_GET(self) -> None:
        self.seen.append(f"{self.path}\n{self.headers}")
        body = b"<html><body>another server</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_the_token_reaches_no_other_server_on_the_host(served):
    """Browsers do not keep cookies apart by port: whatever the page leaves in the browser
    must not go to another port of the same host."""
    from playwright.sync_api import sync_playwright

    _, url = served
    token = re.search(r"[\w-]{32}", url)
    assert token, url
    token = token.group(0)
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    _Recorder.seen = []
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium(),
                                         args=["--no-sandbox", "--disable-gpu"])
            try:
                page = browser.new_page()
                opened: list[Any] = []
                page.on("websocket", lambda ws: opened.append(ws))
                loaded = page.goto(url)
                assert loaded is not None and loaded.status == 200
                deadline = time.monotonic() + 15
                while not opened and time.monotonic() < deadline:
                    page.wait_for_timeout(50)
                assert opened, "the console's websocket never opened"
                assert f"/{token}/ws" in opened[0].url
                # No cookie holds the token (a cookie of this host goes to all its ports).
                cookies = page.context.cookies()
                assert not [c for c in cookies if token in c["value"]], cookies
                port = other.server_address[1]
                for there in (f"http://127.0.0.1:{port}/", f"http://127.0.0.1:{port}/ws",
                              f"http://localhost:{port}/static/x"):
                    assert page.goto(there).status == 200
            finally:
                browser.close()
    finally:
        other.shutdown()
        other.server_close()
    assert len(_Recorder.seen) >= 3, _Recorder.seen
    leaked = [seen for seen in _Recorder.seen if token in seen]
    assert not leaked, leaked


async def _session(client: Any, url: str, origin: str | None = None) -> Any:
    """Open one console session (the page's websocket): the websocket, or the refusal's
    HTTP status."""
    import aiohttp

    try:
        return await client.ws_connect(url.replace("http://", "ws://") + "ws",
                                       headers={"Origin": origin} if origin else None)
    except aiohttp.WSServerHandshakeError as exc:
        return exc.status


def tab_processes(server_pid: int) -> int:
    """The console processes (one per session) the server runs."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        return sum("--tab" in p.cmdline()
                   for p in psutil.Process(server_pid).children(recursive=True))
    return 0


@pytest.mark.parametrize("serve_args", [("--max-sessions", "2")])
def test_sessions_beyond_max_sessions_are_refused(served, serve_args):
    import asyncio

    import aiohttp
    import psutil

    _, url = served
    server = next(p.pid for p in psutil.Process().children() if "serve" in p.cmdline())

    async def scenario() -> None:
        async with aiohttp.ClientSession() as client:
            # A page of another site cannot drive a console, even with the URL.
            assert await _session(client, url, origin="http://elsewhere.example") == 403
            answers = [await _session(client, url) for _ in range(5)]
            opened = [a for a in answers if not isinstance(a, int)]
            try:
                assert len(opened) == 2 and answers[2:] == [503, 503, 503], answers
                await wait_until_async(lambda: tab_processes(server) == 2, 30, "2 consoles")
                # A session that ends frees its place.
                await opened.pop().close()
                await wait_until_async(lambda: tab_processes(server) == 1, 30, "1 console")
                again = await _session(client, url)
                assert not isinstance(again, int), again
                opened.append(again)
                assert await _session(client, url) == 503
            finally:
                for ws in opened:
                    await ws.close()

    asyncio.run(scenario())
