"""A worker's failure as the job records it: the root-cause record, and why a node leaves.

Pure data shaping, no I/O: the agent fills these from a ``WorkerExit`` (its own workers) or
from another node's ``job_failed`` record, which arrives decoded (``event_records.py``) but may
carry any JSON; only what is shown is looked at, and sizes are bounded before publishing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .launch.exits import WorkerExit


def failure_dict(e: WorkerExit, node: str, host: str) -> dict[str, Any]:
    """The record of one worker's failure, as ``workers_failed`` and the root cause carry it."""
    return {"rank": e.global_rank, "local_rank": e.local_rank, "pid": e.pid,
            "exit_code": e.exit_code, "signal": e.signal, "message": e.message, "node": node,
            "host": host, "timestamp": e.timestamp, "traceback": traceback_of(e.error_file),
            "error_file_path": e.error_file_path if e.error_file else ""}


def traceback_of(error_file: Any) -> str | None:
    """The Python call stack in torch's error-file layout (``message.extraInfo.py_callstack``),
    if the file has one."""
    if not isinstance(error_file, dict):
        return None
    msg = error_file.get("message")
    if isinstance(msg, dict):
        extra = msg.get("extraInfo") or {}
        return extra.get("py_callstack") if isinstance(extra, dict) else None
    return None


def truncate_json(data: Any, limit: int) -> Any:
    """``data`` if its JSON fits in ``limit`` characters, else its head, marked truncated."""
    text = json.dumps(data, default=str)
    if len(text) <= limit:
        return data
    return {"truncated": True, "head": text[:limit]}


@dataclass(frozen=True)
class FailedElsewhere:
    """Why a node left the exit barrier: another node's workers failed (see
    ``ElasticAgent._succeed``)."""

    node: str
    cause: Any

    def __str__(self) -> str:
        c = self.cause if isinstance(self.cause, dict) else {}
        where = f"rank {c.get('rank', '?')} on {c.get('host') or self.node}"
        return f"the worker group failed ({where}: {c.get('message') or 'cause unknown'})"
