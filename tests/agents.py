"""Launching real `elastic-agent` processes for tests, and waiting on what they do."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import psutil

from tests.waiting import wait_until  # noqa: F401 - re-exported for the agent tests

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
AGENT = [sys.executable, "-m", "elastic_agent.supervision.cli"]


class Agent:
    """One elastic-agent process; output goes to a file so a chatty job never blocks it."""

    def __init__(self, args: list[str], tmp: Path, name: str, env: dict[str, str] | None = None,
                 prefix: list[str] | None = None, command: list[str] | None = None,
                 cwd: str | Path | None = None):
        """``prefix`` goes before the command (``ip netns exec NS``: another host);
        ``command`` replaces ``python -m`` the agent's module (an installed script)."""
        self.out_path = tmp / f"{name}.out"
        self._out = open(self.out_path, "wb")  # noqa: SIM115 - closed in wait()
        full_env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        self.proc = subprocess.Popen([*(prefix or []), *(command or AGENT), *args],
                                     stdout=self._out, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True, cwd=cwd)
        self.pid = self.proc.pid

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait(self, timeout: float = 120) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"agent did not exit within {timeout} s:\n{self.output[-4000:]}") from None
        finally:
            self._out.close()
        return code

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        """The host dies: the agent first, then everything it started. Its workers killed
        first, the agent could see them die and report it (under load it did: a job killed
        this way read as "failed", not as lost)."""
        started = self.descendants()  # before the agent dies: its orphans are init's then
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, 9)
        for p in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out
