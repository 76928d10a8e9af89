"""End to end in a real terminal: the installed `elastic-console attach` inside tmux, real
keys, the screen read back -- against a real agent and a real Redis."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_agent.coordination.wire.event_records import EventType, decode_event
from elastic_agent.coordination.wire.keyspace import JobKeys
from tests.agents import SCRIPTS, Agent, wait_until

CONSOLE = Path(sys.executable).with_name("elastic-console")


def require_tmux() -> None:
    # A failure, never a skip: a suite that skips its only real-terminal test still passes.
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed: `make test` installs it (scripts/ensure-tools.sh, "
                    "as root); elsewhere install it with your package manager", pytrace=False)


class Tmux:
    """A tmux server of its own (``-L``): sessions of other tests or of a user's tmux, and
    their options, cannot change this one's size."""

    def __init__(self, command: list[str], width: int = 180, height: int = 48) -> None:
        self.name = f"ec-{uuid.uuid4().hex[:8]}"
        self._tmux = ["tmux", "-L", self.name]
        # pytest exports COLUMNS/LINES (80x24): the console would believe them over the pane.
        subprocess.run([*self._tmux, "new-session", "-d", "-s", self.name, "-x", str(width),
                        "-y", str(height), "env", "-u", "COLUMNS", "-u", "LINES", *command],
                       check=True)

    def screen(self) -> str:
        p = subprocess.run([*self._tmux, "capture-pane", "-p", "-t", self.name],
                           capture_output=True, text=True)
        return p.stdout

    def keys(self, *keys: str) -> None:
        subprocess.run([*self._tmux, "send-keys", "-t", self.name, *keys], check=True)

    def alive(self) -> bool:
        return subprocess.run([*self._tmux, "has-session", "-t", self.name],
                              capture_output=True).returncode == 0

    def kill(self) -> None:
        subprocess.run([*self._tmux, "kill-server"], capture_output=True)

    @contextlib.contextmanager
    def ending_with(self, agent: Agent) -> Iterator[None]:
        """Ends this tmux and ``agent`` afterwards; a failed assertion shows both screens."""
        try:
            yield
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- the tmux screen ---\n{self.screen()}\n"
                                 f"--- the agent ---\n{agent.output[-2000:]}") from None
        finally:
            self.kill()
            agent.kill()
            agent.wait(10)


def restarts_by_command(r, job: str) -> int:
    return sum(1 for i, f in r.xrange(JobKeys(job).events)
               if (e := decode_event(i, f)) and e.type == EventType.RESTARTING
               and e.data.get("reason") == "command")


def test_attach_restart_and_detach_in_tmux(redis_url, r, job_id, tmp_path):
    require_tmux()
    agent = Agent(["--redis", redis_url, "--job-id", job_id, "--nproc-per-node", "2",
                   "--local-addr", "127.0.0.1", str(SCRIPTS / "sleeper.py")], tmp_path, "a")
    tmux = Tmux([str(CONSOLE), "attach", job_id, "--redis", redis_url])
    with tmux.ending_with(agent):
        wait_until(lambda: job_id in tmux.screen() and "running" in tmux.screen(), 30,
                   "the console showing the running job")
        wait_until(lambda: "tick" in tmux.screen(), 20, "live log lines on screen")
        tmux.keys("r")
        wait_until(lambda: "Restart the worker group?" in tmux.screen(), 10, "the confirm dialog")
        assert restarts_by_command(r, job_id) == 0, "nothing may be sent before confirming"
        tmux.keys("y")
        wait_until(lambda: "accepted by 1/1 agent" in tmux.screen(), 20, "the ack on screen")
        wait_until(lambda: restarts_by_command(r, job_id) == 1, 20, "the restart in Redis")
        tmux.keys("Escape")
        # The timeline shows beside the dialog: wait for the dialog itself to close, or the
        # q below lands in it (a lone Escape reaches Textual only after its escape delay).
        wait_until(lambda: "Restart the worker group?" not in tmux.screen(), 20,
                   "the dialog to close")
        wait_until(lambda: "restarting (command)" in tmux.screen(), 20,
                   "the restart read back from the timeline")
        tmux.keys("q")
        wait_until(lambda: not tmux.alive(), 15, "the console to detach")
        assert agent.proc.poll() is None, "detaching must never stop the job"
