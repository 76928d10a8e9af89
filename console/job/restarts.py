"""How the timeline tells a restart: how long the agent took to run the workers again and
where the time went, phase by phase (:func:`restart_took`, from ``workers_started``'s
``restart`` record), and the failure that caused it (a root cause's one line and its
traceback, from ``group_failed``, ``job_failed`` and ``worker_exited``). Only
:func:`restart_took` is for others (the tests check it); the rest is the event fold's.
"""

from __future__ import annotations

from typing import Any

from elastic_agent.coordination.wire.event_records import RESTART_PHASES
from elastic_agent.coordination.wire.text import sanitize

from .fields import _float, _q

__all__ = ["restart_took"]

_RESTART_REASONS = {"failed": "failure", "reform": "membership change",
                    "restart": "restart command", "stalled": "stall"}
_PHASE_NAMES = {"evidence": "survivors' stacks captured", "stopped": "workers stopped",
                "reported": "failure reported", "rendezvous": "rendezvous done",
                "keeper": "keeper ready", "started": "every worker started"}


def restart_took(record: Any) -> tuple[str, str] | None:
    """``workers_started``'s ``restart`` field as (a line: how long the restart took and
    where it went, the detail: one phase a line), or None when there is none that makes
    sense. Phases are ms since the agent saw the failure; unknown ones are skipped, and a
    value that is not a finite, non-negative number below a day drops the whole record."""
    if not isinstance(record, dict) or not isinstance(record.get("phases_ms"), dict):
        return None
    marks: list[tuple[str, float]] = []
    for phase in RESTART_PHASES:
        value = record["phases_ms"].get(phase)
        if value is None:
            continue
        ms = _float(value, None)
        if ms is None or not 0 <= ms < 86_400_000:  # NaN fails this too
            return None
        marks.append((phase, ms))
    if not marks:
        return None
    why = record.get("reason")
    reason = (_RESTART_REASONS.get(why) if isinstance(why, str) else None) or sanitize(
        str(why))[:40]
    steps, lines, last = [], [f"restart after: {reason}"], 0.0
    for phase, ms in marks:
        took = max(0.0, ms - last)
        last = max(last, ms)
        steps.append(f"{phase} {took:.0f}")
        lines.append(f"{_PHASE_NAMES[phase]}: +{took:.0f} ms (at {ms:.0f} ms)")
    return (f"{last:.0f} ms after the {reason} was seen ({', '.join(steps)} ms)",
            "\n".join(lines))


def _traceback(error_file: Any) -> str | None:
    """The Python traceback in torch's ``@record`` error file, if there is one."""
    if not isinstance(error_file, dict):
        return None
    msg = error_file.get("message")
    if isinstance(msg, dict):
        extra = msg.get("extraInfo")
        if isinstance(extra, dict) and extra.get("py_callstack"):
            return str(extra["py_callstack"])
    return None


def _cause_text(cause: Any) -> str:
    if not isinstance(cause, dict):
        return "cause unknown"
    where = f"rank {_q(cause.get('rank'))}"
    if cause.get("host"):
        where += f" on {cause['host']}"
    what = cause.get("message") or (
        f"signal {cause['signal']}" if cause.get("signal") else f"exit code {_q(cause.get('exit_code'))}")
    return f"{where}: {what}"


def _cause_detail(cause: Any) -> str:
    if not isinstance(cause, dict):
        return ""
    return str(cause.get("traceback") or cause.get("message") or "")
