"""The end of a launch (issue 23): `elastic-agent` exits without the interpreter's teardown of
every object, yet runs what the teardown would (atexit handlers, flushed output); the
embedded Redis stops by its SHUTDOWN command, not at its next cron tick after a SIGTERM.
The time saved is measured by bench/launch_bench.py (figure a)."""

from __future__ import annotations

import os
import subprocess

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.supervision.hosting.standalone import RedisServer
from tests.agents import AGENT, EXAMPLES

#: Imported by every interpreter on PYTHONPATH; notes only the agent's own ends: its atexit
#: handlers, and its teardown (module globals cleared: the sentinel's __del__).
SITECUSTOMIZE = """\
import atexit, os, sys
_notes = os.environ.get("FAST_EXIT_NOTES")
if _notes and "elastic_agent.supervision.cli" in sys.orig_argv:
    _fd = os.open(_notes, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    atexit.register(os.write, _fd, b"atexit\\n")

    class _Teardown:
        def __init__(self):
            self.write, self.fd = os.write, _fd

        def __del__(self):
            self.write(self.fd, b"teardown\\n")

    _sentinel = _Teardown()
"""


def test_the_agent_skips_the_interpreters_teardown_but_not_atexit_nor_its_output(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    tmpdir = tmp_path / "tmp"  # the agent's temporary directories (stacks, embedded Redis)
    tmpdir.mkdir()
    notes = tmp_path / "notes"
    env = {**os.environ, "FAST_EXIT_NOTES": str(notes), "TMPDIR": str(tmpdir),
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([*AGENT, "--standalone", "--nproc-per-node", "2", "--log-dir",
                        str(tmp_path / "logs"), str(EXAMPLES / "hello.py")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert notes.read_text() == "atexit\n"  # the handlers ran; the teardown did not
    assert p.stdout.count("hello from rank") == 2
    assert "succeeded" in p.stderr.splitlines()[-2], p.stderr[-2000:]  # the summary's last
    assert list(tmpdir.iterdir()) == []  # the stacks directory's atexit removal ran


def test_a_server_stops_by_its_shutdown_command_or_by_sigterm_when_refused(monkeypatch):
    said: list[bool] = []
    shutdown = RedisServer._shutdown
    monkeypatch.setattr(RedisServer, "_shutdown",
                        lambda self: said.append(shutdown(self)) or said[-1])
    plain = RedisServer().start()
    guarded = RedisServer().start()
    make_client(guarded.url).config_set("requirepass", "not-the-default")
    procs = [plain.proc, guarded.proc]
    try:
        plain.cleanup()
        guarded.cleanup()  # the command refused (NOAUTH): SIGTERM, as before
    finally:
        for proc in procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert said == [True, False]
    assert [proc.returncode for proc in procs if proc is not None] == [0, 0]

