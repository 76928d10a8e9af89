"""`elastic-console serve --token-file`: the access token in a file, out of the server's output.

Printed, the URL's token lands wherever the output is kept (a pod's log, a service's journal),
readable by whoever reads that. With ``--token-file`` it goes to that file alone (0600, renamed
into place so a symlink planted at the path is replaced, never followed; removed at exit) and
the printed URL names the file instead. tests/test_kubernetes.py runs console.yaml's server.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from elastic_console.tui.serve import write_token
from tests.agents import Agent, wait_until

CONSOLE = [sys.executable, "-m", "elastic_console.cli"]


def test_a_token_file_is_replaced_whole_never_through_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("someone else's file\n")
    path = tmp_path / "token"
    path.symlink_to(victim)
    write_token(str(path), "t" * 32)
    assert not path.is_symlink() and path.read_text() == "t" * 32 + "\n"
    assert path.stat().st_mode & 0o777 == 0o600
    assert victim.read_text() == "someone else's file\n"
    write_token(str(path), "u" * 32)  # a restarted server's: the old one replaced
    assert path.read_text() == "u" * 32 + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["token", "victim"]  # no leftovers


def test_serve_with_a_token_file_prints_the_url_without_its_token(
        redis_url: str, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    server = Agent(["serve", "--port=0", f"--token-file={token_file}"], tmp_path, "serve",
                   env={"ELASTIC_REDIS_URL": redis_url}, command=CONSOLE)
    try:
        m = wait_until(lambda: re.search(r"at (http://127\.0\.0\.1:\d+)/TOKEN/ \(TOKEN: the "
                                         r"contents of (.+)\)", server.output), 60,
                       "serve to say where it serves")
        assert m.group(2) == str(token_file)
        token = token_file.read_text().strip()
        assert re.fullmatch(r"[\w-]{32}", token) and token not in server.output
        server.proc.terminate()
        assert server.wait(30) == 0, server.output
    finally:
        server.kill()
    assert not token_file.exists()


def test_a_token_file_that_cannot_be_written_is_one_line(redis_url: str,
                                                         tmp_path: Path) -> None:
    p = subprocess.run([*CONSOLE, "serve", "--port=0",
                        f"--token-file={tmp_path}/missing/token"],
                       env={**os.environ, "ELASTIC_REDIS_URL": redis_url},
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert p.returncode == 1, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--token-file" in lines[0] and "No such file" in lines[0], lines
    assert "serving" not in p.stdout  # nothing served, no URL
