"""Short human forms of sizes, durations and server times, shared by the app and the CLI
(no Textual: the CLI must stay importable without it)."""

from __future__ import annotations

import time


def fmt_bytes(n: int | None) -> str:
    """``812.3 MiB``; ``-`` for unknown."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"  # pragma: no cover - the loop always returns


def fmt_age(seconds: float | None) -> str:
    """A short duration: ``4s``, ``2m05s``, ``3h07m``, ``2d04h``; ``-`` for unknown."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_clock(ms: int, utc: bool = False) -> str:
    """Server ms as ``HH:MM:SS`` (local time, or UTC for reproducible screenshots)."""
    try:
        secs = int(ms) / 1000
        return time.strftime("%H:%M:%S", time.gmtime(secs) if utc else time.localtime(secs))
    except (TypeError, ValueError, OverflowError, OSError):
        return "??:??:??"
