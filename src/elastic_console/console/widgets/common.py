"""Shared by the console's widgets: untrusted text to Rich ``Text``, formatting, colours.

Everything shown that came from Redis or the job goes through :func:`safe_text`: it sanitizes
(again: idempotent and cheap) and decodes the only escapes sanitize lets through, SGR colours,
into styles. A Rich ``Text`` is never parsed as markup, so ``[bold]`` stays four brackets and
letters; a raw ``ESC`` never reaches the terminal (``Text("\\x1b[31m")`` would send it as is).
"""

from __future__ import annotations

import time

from rich.style import Style
from rich.text import Text

from ..text import sanitize

__all__ = [
    "JOB_STATE_STYLES",
    "RANK_STATE_STYLES",
    "fmt_age",
    "fmt_bytes",
    "fmt_clock",
    "safe_text",
]

#: Job states (header). Final states are bold: the job will not change any more.
JOB_STATE_STYLES: dict[str, Style] = {
    "waiting": Style(color="bright_black"),
    "running": Style(color="green", bold=True),
    "restarting": Style(color="blue", bold=True),
    "failed": Style(color="red", bold=True, reverse=True),
    "succeeded": Style(color="green", bold=True, reverse=True),
    "stopped": Style(color="yellow", bold=True, reverse=True),
}

#: Rank states (rank table).
RANK_STATE_STYLES: dict[str, Style] = {
    "running": Style(color="green"),
    "restarting": Style(color="blue"),
    "failed": Style(color="red", bold=True),
    "exited": Style(dim=True),
    "stopped": Style(color="yellow"),
}


def safe_text(value: object, style: Style | str = "", *, no_wrap: bool = False,
              multiline: bool = False) -> Text:
    """``value`` as Rich ``Text`` that shows exactly what it says (see the module doc).

    ``multiline``: a newline breaks the line (a traceback); otherwise it shows as ``\\x0a``.
    """
    raw = str(value)
    s = "\n".join(map(sanitize, raw.split("\n"))) if multiline else sanitize(raw)
    if "\x1b" in s:  # only SGR sequences are left: make them styles
        text = Text.from_ansi(s, end="", no_wrap=no_wrap)
        if style:
            text.stylize(style)
        return text
    return Text(s, style=style, end="", no_wrap=no_wrap)


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
