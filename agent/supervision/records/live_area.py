"""The workers' live blocks at the bottom of the agent's terminal, redrawn in place.

When the agent's stdout is a terminal and a worker draws a live display (a Rich progress
bar, rendered by records/screen.py), the agent's tee shows what a terminal would: the
display's rows once, updated where they stand, never a log of frames. :class:`LiveArea`
keeps every such stream's live block (prefixed as the tee prefixes its lines) as the last
rows of the terminal; finished output of any worker is printed above it: the area is erased,
the lines written, the area drawn again. Rows are cut to the terminal's width (a wrapped row
would break the cursor arithmetic) and sanitized like any untrusted text shown on a terminal
(SGR colours kept). Redraws are at most :data:`REDRAW_INTERVAL` apart; finished lines are
never delayed.

One area per terminal: the agent's stdout and stderr, when they are the same terminal,
share it. The area holds at most the terminal's height less one row.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Hashable
from typing import Protocol

from elastic_agent.coordination.wire.text import sanitize

__all__ = ["REDRAW_INTERVAL", "LiveArea", "is_terminal"]

#: The least time between two redraws of the area when only live blocks changed.
REDRAW_INTERVAL = 0.1


class _Writer(Protocol):
    def write(self, data: bytes, /) -> object: ...

    def flush(self) -> object: ...


def is_terminal(writer: object) -> bool:
    """Whether ``writer`` (a binary stream, or anything with ``isatty``) is a terminal."""
    try:
        return bool(writer.isatty())  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False


def terminal_id(writer: object) -> Hashable:
    """What identifies the terminal ``writer`` writes to: its device, else the writer."""
    try:
        st = os.fstat(writer.fileno())  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return id(writer)
    return ("dev", st.st_rdev)


class LiveArea:
    """The live blocks of the node's worker streams, drawn as the terminal's last rows."""

    def __init__(self, writer: _Writer, size: tuple[int, int] | None = None) -> None:
        self._writer: _Writer | None = writer
        self._size = size  # (columns, lines); None: asked of the terminal at each draw
        self._blocks: dict[Hashable, list[bytes]] = {}
        self._shown = 0  # rows of the area on the terminal now
        self._drawn_at = -REDRAW_INTERVAL
        self._timer: asyncio.TimerHandle | None = None

    @property
    def active(self) -> bool:
        """Some live block is shown or waiting to be."""
        return bool(self._blocks) or self._shown > 0

    def set(self, key: Hashable, prefix: bytes, rows: list[str], draw: bool = True) -> None:
        """``key``'s live block is now ``rows`` (text with SGR colours; none: it has none),
        drawn soon (``draw`` False: with the next :meth:`print`)."""
        if rows:
            self._blocks[key] = [prefix + r.encode("utf-8", "replace") for r in
                                 (self._row(r) for r in rows)]
        elif self._blocks.pop(key, None) is None:
            return
        if draw:
            self._redraw_soon()

    def print(self, data: bytes, writer: _Writer | None = None) -> None:
        """Finished output (whole lines) above the area, through ``writer`` (the stream it
        belongs on; default the area's own)."""
        self._erase()
        out = writer or self._writer
        if out is None:
            return
        try:
            out.write(data)
            out.flush()
        except (OSError, ValueError):
            if writer is None:
                self._writer = None
            return
        self._draw()

    def close(self) -> None:
        """Leave the area's last state on the terminal, the cursor below it."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._shown:
            self._draw()
            self._put(b"\n")
            self._shown = 0
        self._blocks.clear()

    # -- drawing --------------------------------------------------------------------------

    def _columns_lines(self) -> tuple[int, int]:
        if self._size is not None:
            return self._size
        size = shutil.get_terminal_size((120, 40))
        return max(size.columns, 20), max(size.lines, 4)

    def _row(self, text: str) -> str:
        return sanitize(text)

    def _redraw_soon(self) -> None:
        if self._timer is not None:
            return
        wait = self._drawn_at + REDRAW_INTERVAL - time.monotonic()
        if wait <= 0:
            self._erase()
            self._draw()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside a loop (a unit test): at once
            self._erase()
            self._draw()
            return
        self._timer = loop.call_later(wait, self._timed)

    def _timed(self) -> None:
        self._timer = None
        self._erase()
        self._draw()

    def _erase(self) -> None:
        """Move to the area's first row and clear to the end of the screen."""
        if self._shown:
            up = f"\x1b[{self._shown - 1}A" if self._shown > 1 else ""
            self._put(f"\r{up}\x1b[J".encode())
            self._shown = 0

    def _draw(self) -> None:
        """Draw every block (after :meth:`_erase`, or where the cursor starts a row)."""
        self._drawn_at = time.monotonic()
        if not self._blocks:
            return
        columns, lines = self._columns_lines()
        rows = [r for block in self._blocks.values() for r in block][-(max(lines - 1, 1)):]
        width = max(columns - 1, 10)
        fitted = [_fit_bytes(r, width) for r in rows]
        self._put(b"\x1b[0m\n".join(fitted) + b"\x1b[0m")
        self._shown = len(fitted)

    def _put(self, data: bytes) -> None:
        if self._writer is None:
            return
        try:
            self._writer.write(data)
            self._writer.flush()
        except (OSError, ValueError):
            self._writer = None  # the terminal went away: the output is in the files


def _fit_bytes(row: bytes, width: int) -> bytes:
    text = row.decode("utf-8", "replace")
    if "\x1b" not in text and text.isascii():
        return row[:width]
    return _fit_sgr(text, width).encode("utf-8", "replace")


def _fit_sgr(text: str, width: int) -> str:
    """``text`` (sanitized: every ESC starts an SGR sequence) cut to ``width`` cells, its
    SGR sequences kept."""
    from rich.cells import cell_len

    out: list[str] = []
    used = 0
    i, n = 0, len(text)
    while i < n:
        if text[i] == "\x1b":
            end = text.find("m", i)
            if end < 0:
                break
            out.append(text[i:end + 1])
            i = end + 1
            continue
        ch = text[i]
        w = cell_len(ch)
        if used + w > width:
            break
        out.append(ch)
        used += w
        i += 1
    return "".join(out)
