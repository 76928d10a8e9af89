"""`elastic-console serve` in a real browser: Debian's chromium driven by playwright.

The installed command serves a running job (real agent, real Redis); chromium loads the
printed URL. The terminal is drawn on a canvas (xterm.js, WebGL), so what the page shows is
read where the browser receives it: the websocket frames carrying the console's output,
escape sequences removed. No browser is downloaded (``executable_path``): a machine without
chromium fails this test, never skips it (``make test`` installs it: scripts/ensure-tools.sh).
"""

from __future__ import annotations

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

from elastic_agent.coordination.connection import make_client
from tests.test_console_app import commands_sent, sleeper_job, stop_agent

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
def served(redis_url: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A running job and `elastic-console serve JOB --port 0`: (job id, printed URL)."""
    job = f"web-{uuid.uuid4().hex[:8]}"
    agent = sleeper_job(redis_url, job, tmp_path)
    proc = subprocess.Popen([str(CONSOLE), "--redis", redis_url, "serve", job, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(30)
        m = re.search(r"at (http://127\.0\.0\.1:\d+/\?token=[\w-]+)", "".join(lines))
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
    base = url.split("?", 1)[0]
    # Without the token (or with a wrong one) nothing is served: page, websocket, files.
    for path in ("", "?token=wrong", "ws", "static/js/textual.js", "download/x"):
        assert status(base + path) == 403, path
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
            refused = page.goto(base)
            assert refused is not None and refused.status == 403
            assert "access token" in page.content()
            page.on("websocket", lambda ws: ws.on(
                "framereceived", lambda payload: received.append(
                    payload if isinstance(payload, bytes) else payload.encode())))
            loaded = page.goto(url)
            assert loaded is not None and loaded.status == 200
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
