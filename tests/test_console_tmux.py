"""End to end in a real terminal: the installed `elastic-console attach` inside tmux, real
keys, the screen read back -- against a real agent and a real Redis."""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from elastic_agent.coordination.wire.event_records import EventType, decode_event
from elastic_agent.coordination.wire.keyspace import JobKeys
from tests.agents import EXAMPLES, SCRIPTS, Agent, wait_until
from tests.conftest import require

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


# -- a live Rich bar, on the agent's terminal and in the console; the metrics view ---------

AGENT_CMD = Path(sys.executable).with_name("elastic-agent")
#: Lightning's Rich bar as a terminal shows it: ``Epoch 0/0  ━━━╺━━━ 35/400 0:00:07 • ...``.
RICH_BAR = re.compile(r"Epoch \d+/\d+\s+\S+\s+(\d+)/\d+\s")


def bar_rows(screen: str) -> list[tuple[int, int]]:
    """(row, step) of every row of the screen that shows Lightning's bar."""
    return [(i, int(m[1])) for i, line in enumerate(screen.splitlines())
            if (m := RICH_BAR.search(line))]


def advances_in_place(tmux: Tmux, what: str) -> None:
    """The bar is one row of ``tmux``'s screen whose step count changes in place: a later
    screen shows another step on the same row, and never a second row of frames."""
    first = wait_until(lambda: bar_rows(tmux.screen()), 60, f"Lightning's bar {what}")
    assert len(first) == 1, f"frames pile up {what}: {first}"
    (row, step), = first

    def moved() -> list[tuple[int, int]] | None:
        now = bar_rows(tmux.screen())
        return now if now and now != first else None

    now = wait_until(moved, 20, f"the bar to advance {what}")
    assert len(now) == 1 and now[0][0] == row and now[0][1] > step, (
        f"the bar {what} moved from row {row} step {step} to {now}")


def test_a_live_rich_bar_and_the_metrics_view_in_tmux(redis_url, job_id, tmp_path):
    """Lightning's default (Rich) bar, its worker on a terminal because the agent runs in one
    (``--worker-tty auto`` in tmux), is drawn in place on the agent's terminal and in the
    attached console's log view; then the console's metrics view: ``m`` shows the loss's
    chart, ``t`` puts it by time, ``esc`` returns."""
    require_tmux()
    require("lightning")
    agent_tmux = Tmux([str(AGENT_CMD), "--redis", redis_url, "--job-id", job_id,
                       "--local-addr", "127.0.0.1", "--nproc-per-node", "1",
                       "--worker-tty", "auto", "--log-dir", str(tmp_path / "logs"),
                       str(EXAMPLES / "lightning_train.py"), "--epochs", "1",
                       "--batches", "600", "--step-sleep", "0.1"], width=120, height=30)
    console = None
    pid = int(subprocess.run([*agent_tmux._tmux, "list-panes", "-t", agent_tmux.name, "-F",
                              "#{pane_pid}"], capture_output=True, text=True).stdout)
    try:
        advances_in_place(agent_tmux, "on the agent's terminal")
        console = Tmux([str(CONSOLE), "attach", job_id, "--redis", redis_url])
        advances_in_place(console, "in the console's log view")
        console.keys("m")
        # "drawing…" until the chart's first frame: then its y axis (┤) is there
        chart = wait_until(lambda: s if "by step" in (s := console.screen()) and "┤" in s
                           else None, 20, "the metrics view's chart")
        assert "train_loss" in chart, chart
        assert any("\u2800" < c <= "\u28ff" for c in chart), "no point drawn:\n" + chart
        console.keys("t")
        wait_until(lambda: "by time" in console.screen(), 10, "the chart by time")
        console.keys("Escape")
        wait_until(lambda: "Ranks" in (s := console.screen()) and "by time" not in s, 20,
                   "the job's screen again")
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}\n--- the agent's terminal ---\n{agent_tmux.screen()}\n--- the console ---\n"
            f"{console.screen() if console else ''}") from None
    finally:
        if console is not None:
            console.kill()
        # The agent stops its workers on SIGTERM, as torchrun does; whatever is left is killed.
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            tree = [proc, *proc.children(recursive=True)]
            proc.send_signal(signal.SIGTERM)
            _, left = psutil.wait_procs(tree, timeout=20)
            for p in left:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        agent_tmux.kill()
