"""Shared by the console's widgets: untrusted text to Rich ``Text``, formatting, colours.

Everything shown that came from Redis or the job goes through :func:`safe_text`: it sanitizes
(again: idempotent and cheap) and decodes the only escapes sanitize lets through, SGR colours,
into styles. A Rich ``Text`` is never parsed as markup, so ``[bold]`` stays four brackets and
letters; a raw ``ESC`` never reaches the terminal (``Text("\\x1b[31m")`` would send it as is).
"""

from __future__ import annotations

from rich.style import Style
from rich.text import Text

from ..formatting import fmt_age, fmt_bytes, fmt_clock
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


