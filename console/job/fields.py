"""Reading a record's fields without trusting them: a number only when it is one (a bool is
not, to the protocol), the default when a field is missing or mistyped; names and timeline
text cut to their bounds and sanitized (:func:`elastic_agent.coordination.wire.text.sanitize`).
Shared by the parts of the fold (state, event_fold, log_fold, restarts), and theirs only:
the names keep their underscore, they are no API for the screens or the CLI.
"""

from __future__ import annotations

from typing import Any

from elastic_agent.coordination.wire.protocol import MAX_NAME_CHARS
from elastic_agent.coordination.wire.text import sanitize

from .model import MAX_DETAIL_CHARS


def _s(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _int(value: Any, default: int | None) -> int | None:
    if isinstance(value, bool):  # True is an int to Python, not to the protocol
        return default
    if isinstance(value, int):
        return value
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default


def _float(value: Any, default: float | None) -> float | None:
    if isinstance(value, bool):
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def _q(value: Any) -> str:
    return "?" if value is None else str(value)


def _host(host: Any, node_id: str) -> str:
    if host:
        return sanitize(str(host)[:MAX_NAME_CHARS])
    # Node ids are "<host>-<pid>-<random>": the host is the best guess we have.
    return sanitize(node_id.rsplit("-", 2)[0] if node_id.count("-") >= 2 else node_id)


def _detail(value: Any) -> str:
    if not value:
        return ""
    text = _clip(str(value), MAX_DETAIL_CHARS)
    return "\n".join(sanitize(line) for line in text.splitlines())


def _clip(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its head and its tail (a
    traceback's last lines name the error) around a note of how much was cut."""
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head
    return f"{text[:head]}\n… {len(text) - limit} characters cut …\n{text[-tail:]}"
