"""The block an agent prints when its job ends: torchrun's "Root Cause" layout.

No I/O here: the agent prints the lines through its terminal policy (``text.terminal_line``),
which escapes whatever a record from another node or a worker's error file put in them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import IO, Any

_BAR = "=" * 64


def script_name(entrypoint: Sequence[str]) -> str:
    """What the summary calls the job: its ``.py`` argument, else the entrypoint's last word."""
    name = entrypoint[-1] if entrypoint else "job"
    return next((a for a in entrypoint if a.endswith(".py")), name)


def summary_lines(script: str, job_id: str, cause: dict[str, Any] | None, failed: bool,
                  restarts_used: int, max_restarts: int) -> list[str]:
    """The end-of-job block: success with what it recovered from, or the root cause."""
    if not failed:
        lines = [_BAR, f"{script} succeeded: job {job_id}, "
                 f"{restarts_used}/{max_restarts} restarts used"]
        if cause:
            lines.append(f"  recovered from: rank {cause.get('rank')} on {cause.get('host')}:"
                         f" {cause.get('message')}")
        return [*lines, _BAR]
    lines = [_BAR, f"{script} FAILED", "-" * 64,
             "Root Cause (first observed failure across all nodes):"]
    if cause:
        lines += [
            f"  time      : {cause_time(cause)}",
            f"  host      : {cause.get('host')}",
            f"  rank      : {cause.get('rank')} (local_rank: {cause.get('local_rank')})",
            f"  exitcode  : {cause.get('exit_code')} (pid: {cause.get('pid')})",
            f"  message   : {cause.get('message')}",
        ]
        lines.append(f"  error_file: {cause.get('error_file_path') or '<N/A>'}")
        if cause.get("traceback"):
            lines.append("  traceback :")
            lines += ["    " + t for t in str(cause["traceback"]).split("\n")]
    else:
        lines.append("  <unknown>")
    return [*lines, f"  restarts  : {restarts_used}/{max_restarts} used", _BAR]


def cause_time(cause: dict[str, Any]) -> str:
    """When the root cause happened, local time; '?' for a value no clock can show (the cause
    may come from another node's record)."""
    try:
        ms = cause.get("server_ms") or int(float(cause.get("timestamp") or 0) * 1000)
        return time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(int(ms) / 1000))
    except (TypeError, ValueError, OverflowError, OSError):
        return "?"


def isatty(stream: IO[str]) -> bool:
    """Whether ``stream`` is a terminal (False for anything that cannot say)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
