"""Worker output that moves the cursor, rendered as a terminal shows it (pyte).

A worker on a terminal (``--worker-tty``) draws live displays: Rich's progress bars redraw
their lines by moving the cursor up and erasing (``\\r\\x1b[2K\\x1b[1A\\x1b[2K...``), tqdm's
stacked bars move down and back up. Kept as bytes, or cut into lines at ``\\n``, that is a
log of frames. :class:`StreamScreen` feeds such a stream to a VT100 emulator (pyte's
``Screen``) the size of the worker's terminal and reads back what it would show:

* **finished lines**: rows the display can no longer redraw, in screen order, each stamped
  with the time of its first byte (a row's first write; redrawing it keeps that time);
* the **live block**: the rows from the first unfinished one down to the last that holds
  anything, what the display still redraws. The log pipeline ships it as the stream's live
  block (``LogBatch.live``); the next batch replaces it.

Which rows are finished is learned from the stream itself. A display redraws at most
``extent`` rows above the lowest row it reached, where ``extent`` is the most it ever moved
the cursor up from there (Rich: its height minus one; tqdm: the position of its lowest bar).
A row further up that was not touched for :data:`HOLD` seconds is finished (the hold covers a
display's first frame, drawn before it ever moved up); so is a row that scrolls off the top of
the screen, and every row above the cursor once the display shows its cursor again (Rich hides
it while live). A row the display does reach again after all is live again, and is finished
once more later: one line shows twice, nothing is lost.

Rows are text with SGR colours (bold, italic, underline, reverse, strikethrough, blink and the
16, 256 and 24-bit colours pyte keeps; it has no "dim"); every other control sequence is
consumed by the emulator or removed before it: OSC, DCS, APC, PM and SOS strings (titles,
hyperlinks), unknown or overlong CSI sequences. C0 and C1 controls, Unicode separators,
format and bidirectional controls become visible escapes (``\\x01``, ``\\u202e``), as
:func:`~elastic_agent.coordination.wire.text.sanitize` shows them. A soft-wrapped row (the text
reached the last column) is joined to the row it continues: a long line stays one line.

Bounded whatever a worker prints: the emulator holds ``columns x lines`` cells; an escape
sequence is held across reads up to :data:`MAX_PENDING_ESCAPE` characters (then dropped); a
string sequence is skipped without being kept; saved cursors are capped. Cost: pyte's Python
parser, a few microseconds a character, paid only by a stream that moves the cursor (the log
pipeline's fast path never reaches this module for plain text).
"""

from __future__ import annotations

import codecs
import contextlib
import re
import unicodedata
from itertools import groupby
from operator import itemgetter

import pyte
from pyte import graphics
from pyte import modes as mo
from wcwidth import wcwidth

__all__ = ["HOLD", "MAX_PENDING_ESCAPE", "StreamScreen", "moves_cursor"]

#: A row above the redrawn extent is finished once untouched this long (seconds).
HOLD = 1.0
#: The longest escape sequence waited for across reads (characters); longer ones are dropped.
MAX_PENDING_ESCAPE = 64
#: A row erased and rewritten is another line (a new first byte) if the letters in its first
#: this many cells changed; else it is the same line redrawn (a bar's label stays, its
#: numbers and blocks move).
HEAD_CELLS = 12
#: The longest soft-wrapped line kept whole (characters): a worker printing megabytes without
#: a newline costs this much, its head (the log pipeline caps lines further).
MAX_CARRY = 64 * 1024
#: Saved cursor positions kept (``ESC 7``); a stream that only saves cannot grow memory.
MAX_SAVEPOINTS = 16

# Bytes that mean "render me": cursor movement, erase, scroll, insert/delete (not SGR's 'm'),
# and the cursor shown or hidden (a live display starting or ending).
_MOVES = re.compile(rb"\x1b\[(?:[0-9;]*[A-HJKSTdfLMP@X`]|\?[0-9;]*[hl])")


def moves_cursor(data: bytes) -> bool:
    """Whether ``data`` holds a sequence that only a terminal emulator renders right. One
    C-level ``in`` for plain text (the common case)."""
    return b"\x1b[" in data and _MOVES.search(data) is not None


# -- the filter in front of the emulator -----------------------------------------------------------

# Characters pyte would act on or stop drawing at, shown instead as sanitize shows them: C0
# controls but BS, HT, LF, VT, FF, CR and ESC (handled below), DEL and C1 (pyte reads U+009B
# and U+009D as CSI and OSC), line/paragraph separators, format and bidi controls.
_VISIBLE = re.compile("[\x00-\x07\x0e-\x1a\x1c-\x1f\x7f-\x9f\u00ad\u200b-\u200f\u2028-\u202e"
                      "\u2060-\u206f\ufeff\ufff9-\ufffb]")


def _visible(m: re.Match[str]) -> str:
    code = ord(m.group(0))
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


_CSI_FINALS = "".join(sorted(set(pyte.Stream.csi) - {"c", "n"}))  # not the device reports
# What pyte gets: CSI with plain parameters and a final it knows ('?' only for modes).
_GOOD_CSI = re.compile(r"\x1b\[(?:[0-9;]{0,32}[" + re.escape(_CSI_FINALS) + r"]|\?[0-9;]{0,32}[hl])")
# Any other complete CSI (removed), ESC + one character (kept: save/restore cursor, index,
# reverse index, reset), and the strings that run to ST or BEL (removed: titles, hyperlinks).
_ANY_CSI = re.compile(r"\x1b\[[\x30-\x3f]{0,64}[\x20-\x2f]{0,4}[\x40-\x7e]")
_SHORT = re.compile(r"\x1b[\x20-\x2f]{0,4}[\x30-\x4f\x51-\x57\x59\x5a\x5c\x60-\x7e]")
_STRING_START = re.compile(r"\x1b[\]P^_X]")
_STRING_END = re.compile(r"\x07|\x1b\\")
_KEPT_ESCAPES = frozenset("78DEMc")  # DECSC, DECRC, IND, NEL, RI, RIS


class _Filter:
    """Bytes -> text pyte can take safely: decoded (UTF-8, replacement characters), escape
    sequences complete and bounded, strings and unknown sequences removed."""

    __slots__ = ("_decoder", "_in_string", "_pending")

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = ""  # an escape sequence cut by the end of a read
        self._in_string = False  # inside an OSC/DCS/... string: skipped up to its end

    def __call__(self, data: bytes) -> str:
        text = self._pending + self._decoder.decode(data)
        self._pending = ""
        out: list[str] = []
        at, n = 0, len(text)
        while at < n:
            if self._in_string:
                end = _STRING_END.search(text, at)
                if end is None:
                    if text.endswith("\x1b"):
                        self._pending = "\x1b"  # maybe the start of ST
                    return "".join(out)
                self._in_string = False
                at = end.end()
                continue
            esc = text.find("\x1b", at)
            if esc < 0:
                out.append(_VISIBLE.sub(_visible, text[at:]))
                break
            if esc > at:
                out.append(_VISIBLE.sub(_visible, text[at:esc]))
            at = esc
            m = _GOOD_CSI.match(text, at)
            if m is not None:
                out.append(m.group(0))
                at = m.end()
                continue
            m = _ANY_CSI.match(text, at) or _SHORT.match(text, at)
            if m is not None:
                seq = m.group(0)
                if len(seq) == 2 and seq[1] in _KEPT_ESCAPES:
                    out.append(seq)
                at = m.end()
                continue
            if _STRING_START.match(text, at):
                self._in_string = True
                at += 2
                continue
            if n - at < MAX_PENDING_ESCAPE and _could_continue(text[at:]):
                self._pending = text[at:]  # wait for the rest of the sequence
                break
            at += 1  # a broken sequence: drop its ESC, show the rest as text
        return "".join(out)


def _could_continue(tail: str) -> bool:
    """Whether ``tail`` (ESC ...) may still become a sequence with more characters."""
    if len(tail) == 1:
        return True
    if tail[1] == "[":
        return re.fullmatch(r"\x1b\[[\x30-\x3f]*[\x20-\x2f]*", tail) is not None
    return re.fullmatch(r"\x1b[\x20-\x2f]+", tail) is not None


# -- SGR back from pyte's cells -------------------------------------------------------------------

_FG = {name: code for code, name in {**graphics.FG_ANSI, **graphics.FG_AIXTERM}.items()}
_BG = {name: code for code, name in {**graphics.BG_ANSI, **graphics.BG_AIXTERM}.items()}
_HEX = re.compile(r"[0-9a-fA-F]{6}")


def _colour(value: str, table: dict[str, int], truecolour: int) -> str:
    code = table.get(value)
    if code is not None:
        return str(code)
    if _HEX.fullmatch(value):
        r, g, b = int(value[0:2], 16), int(value[2:4], 16), int(value[4:6], 16)
        return f"{truecolour};2;{r};{g};{b}"
    return ""


def _sgr(ch: pyte.screens.Char) -> str:
    """The SGR sequence that draws ``ch``'s attributes from a reset state ("" for none)."""
    codes = []
    if ch.bold:
        codes.append("1")
    if ch.italics:
        codes.append("3")
    if ch.underscore:
        codes.append("4")
    if ch.blink:
        codes.append("5")
    if ch.reverse:
        codes.append("7")
    if ch.strikethrough:
        codes.append("9")
    if ch.fg != "default":
        c = _colour(ch.fg, _FG, 38)
        if c:
            codes.append(c)
    if ch.bg != "default":
        c = _colour(ch.bg, _BG, 48)
        if c:
            codes.append(c)
    return f"\x1b[{';'.join(codes)}m" if codes else ""


_SGR_CACHE: dict[tuple[object, ...], str] = {}
_ATTRS = itemgetter(slice(1, None))  # a cell's attributes, without its character
#: The attributes of a cell with none (after the character): default colours, no style.
_PLAIN = pyte.screens.Char(" ")[1:]


def _blank(ch: pyte.screens.Char) -> bool:
    return (ch.data == " " and ch.bg == "default" and not ch.reverse and not ch.underscore
            and not ch.strikethrough)


# -- the emulator --------------------------------------------------------------------------------


class _Cells(dict):  # type: ignore[type-arg]
    """character -> its cell with one set of attributes, made once."""

    def __init__(self, attrs: pyte.screens.Char) -> None:
        super().__init__()
        self.attrs = attrs

    def __missing__(self, char: str) -> pyte.screens.Char:
        cell = self[char] = self.attrs._replace(data=char)
        return cell


class _Screen(pyte.Screen):
    """pyte's screen, telling its owner which rows are touched, reached, scrolled off and
    continued by a soft wrap."""

    def __init__(self, columns: int, lines: int, owner: StreamScreen) -> None:
        self.owner: StreamScreen | None = None  # (pyte's __init__ calls reset)
        super().__init__(columns, lines)
        self.owner = owner
        self.set_mode(mo.LNM)  # the pty is raw: a worker's "\n" is a terminal's "\r\n"
        self._wrapping = False
        self._cells: dict[pyte.screens.Char, _Cells] = {}  # attributes -> their characters

    # rows moving
    def index(self) -> None:
        top, bottom = self.margins or pyte.screens.Margins(0, self.lines - 1)
        if self.cursor.y == bottom and self.owner is not None:
            self.owner._scroll(top, bottom, wrapped=self._wrapping)
        elif self.owner is not None and self.cursor.y + 1 < self.lines:
            self.owner._cont[self.cursor.y + 1] = self._wrapping
        super().index()
        if self.owner is not None:
            self.owner._reach(self.cursor.y)

    def reverse_index(self) -> None:
        top, bottom = self.margins or pyte.screens.Margins(0, self.lines - 1)
        if self.cursor.y == top and self.owner is not None:
            self.owner._shift_down(top, bottom, 1)
        super().reverse_index()
        if self.owner is not None:
            self.owner._reach(self.cursor.y)

    def insert_lines(self, count: int | None = None) -> None:
        top, bottom = self.margins or pyte.screens.Margins(0, self.lines - 1)
        if self.owner is not None and top <= self.cursor.y <= bottom:
            self.owner._shift_down(self.cursor.y, bottom, count or 1)
        super().insert_lines(count)

    def delete_lines(self, count: int | None = None) -> None:
        top, bottom = self.margins or pyte.screens.Margins(0, self.lines - 1)
        if self.owner is not None and top <= self.cursor.y <= bottom:
            self.owner._shift_up(self.cursor.y, bottom, count or 1)
        super().delete_lines(count)

    # the cursor moving up (what teaches the owner how far a display redraws)
    def cursor_up(self, count: int | None = None) -> None:
        super().cursor_up(count)
        if self.owner is not None:
            self.owner._reach(self.cursor.y)

    def cursor_down(self, count: int | None = None) -> None:
        super().cursor_down(count)
        if self.owner is not None:
            self.owner._reach(self.cursor.y)

    def cursor_position(self, line: int | None = None, column: int | None = None) -> None:
        super().cursor_position(line, column)
        if self.owner is not None:
            self.owner._reach(self.cursor.y)

    def cursor_to_line(self, line: int | None = None) -> None:
        super().cursor_to_line(line)
        if self.owner is not None:
            self.owner._reach(self.cursor.y)

    def restore_cursor(self) -> None:
        super().restore_cursor()
        if self.owner is not None:
            self.owner._reach(self.cursor.y)

    def save_cursor(self) -> None:
        super().save_cursor()
        del self.savepoints[:-MAX_SAVEPOINTS]

    # rows written
    def draw(self, data: str) -> None:
        """pyte's draw, except that a character of no width that combines with nothing is
        skipped (pyte stops drawing the rest of the text there) and a wrap is remembered."""
        owner = self.owner
        if owner is not None:
            owner._touch(self.cursor.y)
        data = data.translate(self.g1_charset if self.charset else self.g0_charset)
        columns = self.columns
        cursor = self.cursor
        if data.isascii() and data.isprintable() and mo.IRM not in self.mode:
            self._draw_ascii(data)
            return
        for char in data:
            width = wcwidth(char)
            if cursor.x == columns:
                if mo.DECAWM in self.mode:
                    self._wrapping = True
                    try:
                        self.carriage_return()
                        self.linefeed()
                    finally:
                        self._wrapping = False
                    if owner is not None:
                        owner._touch(cursor.y)
                elif width > 0:
                    cursor.x -= width
            if mo.IRM in self.mode and width > 0:
                self.insert_characters(width)
            if owner is not None and cursor.attrs[1:] != _PLAIN:
                owner._styled[cursor.y] = True
            line = self.buffer[cursor.y]
            if width == 1:
                line[cursor.x] = cursor.attrs._replace(data=char)
            elif width == 2:
                line[cursor.x] = cursor.attrs._replace(data=char)
                if cursor.x + 1 < columns:
                    line[cursor.x + 1] = cursor.attrs._replace(data="")
            elif width == 0 and unicodedata.combining(char):
                if cursor.x:
                    last = line[cursor.x - 1]
                    line[cursor.x - 1] = last._replace(
                        data=unicodedata.normalize("NFC", last.data + char)[:8])
                continue
            else:
                continue
            cursor.x = min(cursor.x + width, columns)
        self.dirty.add(cursor.y)

    def _draw_ascii(self, data: str) -> None:
        """:meth:`draw` for text of one cell a character: a row's worth at a time."""
        cursor, columns, owner = self.cursor, self.columns, self.owner
        cells = self._cells.get(cursor.attrs)
        if cells is None:
            if len(self._cells) > 64:
                self._cells.clear()
            cells = self._cells[cursor.attrs] = _Cells(cursor.attrs)
        styled = cursor.attrs[1:] != _PLAIN
        i, n = 0, len(data)
        while i < n:
            if styled and owner is not None:
                owner._styled[cursor.y] = True
            if cursor.x >= columns:
                if mo.DECAWM not in self.mode:  # every further character lands on the last cell
                    self.buffer[cursor.y][columns - 1] = cells[data[-1]]
                    break
                self._wrapping = True
                try:
                    self.carriage_return()
                    self.linefeed()
                finally:
                    self._wrapping = False
                if owner is not None:
                    owner._touch(cursor.y)
            take = data[i:i + columns - cursor.x]
            x = cursor.x
            self.buffer[cursor.y].update(zip(range(x, x + len(take)), map(cells.__getitem__, take)))
            cursor.x = x + len(take)
            i += len(take)
        self.dirty.add(cursor.y)

    def erase_in_line(self, how: int = 0, private: bool = False) -> None:
        if how in (0, 1, 2):
            if self.owner is not None and (how == 2 or self.cursor.x == 0):
                self.owner._erased(self.cursor.y)
            super().erase_in_line(how, private)
            if self.owner is not None:
                self.owner._touch(self.cursor.y)
                if self.cursor.attrs[1:] != _PLAIN:
                    self.owner._styled[self.cursor.y] = True

    def erase_in_display(self, how: int = 0, *args: object, **kwargs: object) -> None:
        if how not in (0, 1, 2, 3):
            return
        if how != 0 and self.owner is not None:
            self.owner._before_clear()
        super().erase_in_display(how)
        if self.owner is not None:
            rows = (range(self.cursor.y, self.lines) if how == 0 else
                    range(self.cursor.y + 1) if how == 1 else range(self.lines))
            styled = self.cursor.attrs[1:] != _PLAIN
            for y in rows:
                self.owner._touch(y, write=False)
                if styled:
                    self.owner._styled[y] = True

    def insert_characters(self, count: int | None = None) -> None:
        super().insert_characters(count)
        if self.owner is not None:
            self.owner._touch(self.cursor.y)

    def delete_characters(self, count: int | None = None) -> None:
        super().delete_characters(count)
        if self.owner is not None:
            self.owner._touch(self.cursor.y)

    def erase_characters(self, count: int | None = None) -> None:
        super().erase_characters(count)
        if self.owner is not None:
            self.owner._touch(self.cursor.y)

    # modes: no resizing or screen-wide reverse; the cursor shown again ends a display
    _REFUSED = frozenset({mo.DECCOLM, mo.DECSCNM})

    def set_mode(self, *modes: int, **kwargs: object) -> None:
        shift = 5 if kwargs.get("private") else 0
        kept = [m for m in modes if (m << shift) not in self._REFUSED]
        hidden = self.cursor.hidden
        super().set_mode(*kept, **kwargs)
        if hidden and not self.cursor.hidden and self.owner is not None:
            self.owner._display_ended()

    def reset_mode(self, *modes: int, **kwargs: object) -> None:
        shift = 5 if kwargs.get("private") else 0
        super().reset_mode(*[m for m in modes if (m << shift) not in self._REFUSED], **kwargs)

    def reset(self) -> None:
        if self.owner is not None:
            self.owner._before_reset()
        super().reset()
        if self.owner is not None:
            self.set_mode(mo.LNM)


class StreamScreen:
    """One worker stream drawn on an emulated terminal (see the module docstring).

    ``feed`` the stream's bytes with the time they were read; :meth:`take_finished` returns
    the rows finished since (text, first byte's time), :meth:`live` the live block; at the
    stream's end :meth:`close` finishes everything.
    """

    def __init__(self, columns: int, lines: int, hold: float = HOLD) -> None:
        self.columns = max(20, int(columns))
        self.lines = max(2, int(lines))
        self.hold = hold
        n = self.lines
        self._born: list[float | None] = [None] * n  # first write's time of each row
        self._touched: list[float] = [0.0] * n  # last write or visit
        self._cont: list[bool] = [False] * n  # the row continues the one above (soft wrap)
        self._styled: list[bool] = [False] * n  # a cell of the row has attributes
        self._emitted = 0  # rows [0, _emitted) are finished (shipped)
        self._low = 0  # the lowest row reached
        self._extent = 0  # how far up from _low the display has redrawn
        self._now = 0.0
        self._ended = False  # the display showed its cursor again: rows above it are done
        self._settled = False  # ... and since, nothing was redrawn: plain lines, no hold
        self._finished: list[tuple[str, float]] = []
        self._carry: tuple[str, float] | None = None  # a scrolled-off row a wrap continues
        # rows erased whole during this feed -> the head of what they held before
        self._erased_heads: dict[int, str] = {}
        self._filter = _Filter()
        self._screen = _Screen(self.columns, self.lines, self)
        self._stream = pyte.Stream(self._screen)
        self.changed = False  # the last feed drew something: the live block may differ

    # -- feeding ------------------------------------------------------------------------------

    def feed(self, data: bytes, now: float) -> None:
        """Draw ``data``, read at ``now`` (a monotonic time)."""
        self._now = now
        text = self._filter(data)
        self.changed = bool(text)
        if text:
            with contextlib.suppress(Exception):  # pyte resets its parser; the screen stays
                self._stream.feed(text)
        if self._erased_heads:
            self._restamp()
        self._finish_rows()

    def take_finished(self) -> list[tuple[str, float]]:
        """The rows finished since the last call, oldest first: (text, first byte's time)."""
        out, self._finished = self._finished, []
        return out

    def live(self) -> tuple[list[str], float]:
        """The live block's rows (may be empty) and its first byte's time."""
        last = self._last_row()
        if last < self._emitted:
            return [], self._now
        rows = self._logical_rows(self._emitted, last + 1)
        born = self._born[self._emitted]
        return [text for text, _ in rows], self._now if born is None else born

    @property
    def idle(self) -> bool:
        """Nothing is live: every row above the cursor is finished, the cursor's row empty and
        nothing below it; the stream can go back to plain lines."""
        y = self._screen.cursor.y
        return (self._emitted >= y and self._screen.cursor.x == 0 and self._carry is None
                and self._last_row() < y)

    def close(self) -> list[tuple[str, float]]:
        """The stream ended: every row still on screen with something on it is finished."""
        last = self._last_row()
        if last >= self._emitted:
            self._emit(last + 1)
        if self._carry is not None:
            self._finished.append(self._carry)
            self._carry = None
        return self.take_finished()

    # -- what the screen tells (see _Screen) ----------------------------------------------------

    def _touch(self, y: int, write: bool = True) -> None:
        """Row ``y`` was written (or erased, ``write`` False)."""
        if 0 <= y < self.lines:
            self._touched[y] = self._now
            if write:
                if self._born[y] is None:
                    self._born[y] = self._now
                if y > self._low:
                    self._low = y
                if y < self._emitted:  # a finished row is redrawn after all: live again
                    self._emitted = y

    def _reach(self, y: int) -> None:
        """The cursor moved to row ``y``."""
        if not 0 <= y < self.lines:
            return
        self._touched[y] = self._now
        if y > self._low:
            self._low = y
        elif y < self._low:
            self._extent = max(self._extent, self._low - y)
            self._settled = False
        if y < self._emitted:  # a finished row is reached again: live again
            self._emitted = y

    def _scroll(self, top: int, bottom: int, wrapped: bool) -> None:
        """Rows ``top+1..bottom`` move up one; ``top`` leaves (finished if it was the
        screen's first row and not yet), the new bottom row is empty."""
        if top == 0:
            if self._emitted == 0:
                self._emit_top_row()
            else:
                self._emitted -= 1
        for arr, blank in self._arrays():
            del arr[top]
            arr.insert(bottom, blank)  # type: ignore[attr-defined]
        self._cont[bottom] = wrapped
        self._low = max(self._low - 1, 0)

    def _shift_down(self, first: int, bottom: int, count: int) -> None:
        """Rows ``first..bottom`` move down ``count`` (those past ``bottom`` are lost)."""
        count = min(count, bottom - first + 1)
        for arr, blank in self._arrays():
            del arr[bottom - count + 1: bottom + 1]  # type: ignore[attr-defined]
            arr[first:first] = [blank] * count  # type: ignore[index]
        if first <= self._emitted - 1:
            self._emitted = first  # rows were inserted into the finished part: live again

    def _shift_up(self, first: int, bottom: int, count: int) -> None:
        count = min(count, bottom - first + 1)
        for arr, blank in self._arrays():
            del arr[first:first + count]  # type: ignore[attr-defined]
            arr[bottom - count + 1:bottom - count + 1] = [blank] * count  # type: ignore[index]
        if first < self._emitted:
            self._emitted = first

    def _erased(self, y: int) -> None:
        self._settled = False
        if 0 <= y < self.lines and y not in self._erased_heads:
            self._erased_heads[y] = self._head(y)

    def _head(self, y: int) -> str:
        line = self._screen.buffer.get(y)
        if not line:
            return ""
        return "".join(ch for x in range(min(HEAD_CELLS, self.columns))
                       for ch in line[x].data if ch.isalpha())

    def _restamp(self) -> None:
        """A row erased and written again keeps its first byte's time (a bar redrawn) unless
        it now starts differently: then it is another line, first written now."""
        for y, before in self._erased_heads.items():
            after = self._head(y)
            if after and before and after != before:
                self._born[y] = self._touched[y]
        self._erased_heads.clear()

    def _arrays(self) -> tuple[tuple[object, object], ...]:
        """The per-row lists, each with what a new empty row holds: they move with the rows."""
        return ((self._born, None), (self._touched, self._now), (self._cont, False),
                (self._styled, False))

    def _display_ended(self) -> None:
        self._ended = self._settled = True
        self._extent = 0

    def _before_clear(self) -> None:
        """The screen (or its top) is about to be erased: the rows above what the display
        redraws were printed for good, finished now (a terminal would have shown them; a
        display that redraws the whole screen reached its top, so none of its rows are)."""
        limit = min(self._low - self._extent, self._screen.cursor.y + 1, self.lines)
        while limit > self._emitted and limit < self.lines and self._cont[limit]:
            limit -= 1
        if limit > self._emitted:
            self._emit(limit)

    def _before_reset(self) -> None:
        """A terminal reset clears the screen: what it showed is finished first."""
        last = self._last_row()
        if last >= self._emitted:
            self._emit(last + 1)
        n = self.lines
        self._born, self._touched, self._cont = [None] * n, [self._now] * n, [False] * n
        self._styled = [False] * n
        self._emitted = self._low = self._extent = 0

    # -- finishing rows -----------------------------------------------------------------------------

    def _finish_rows(self) -> None:
        """Finish the rows above the cursor that the display will not redraw (see the module
        docstring)."""
        y = self._screen.cursor.y
        if self._ended:
            self._ended = False
            upto = y
        else:
            limit = min(y, self._low - self._extent)
            upto = self._emitted
            cutoff = self._now - (0.0 if self._settled else self.hold)
            while upto < limit and self._touched[upto] <= cutoff:
                upto += 1
        # never cut a soft-wrapped line: its rows are finished together
        while upto > self._emitted and upto < self.lines and self._cont[upto]:
            upto -= 1
        if upto > self._emitted:
            self._emit(upto)

    def _emit(self, upto: int) -> None:
        rows = self._logical_rows(self._emitted, upto)
        if self._emitted == 0:
            self._carry = None  # (put in front of row 0's line, if it continued it)
        self._finished.extend(rows)
        self._emitted = upto

    def _emit_top_row(self) -> None:
        """Row 0 scrolls off unfinished: finished now (a soft wrap's start is carried to the
        row that continues it)."""
        text = self._render(0, full=self.lines > 1 and self._cont[1])
        born = self._born[0] if self._born[0] is not None else self._now
        if self._carry is not None and self._cont[0]:
            head = self._carry[0]
            # A line without end is kept to its head (the shipper caps it further).
            text, born = (head + text if len(head) < MAX_CARRY else head), self._carry[1]
            self._carry = None
        elif self._carry is not None:
            self._finished.append(self._carry)
            self._carry = None
        if self.lines > 1 and self._cont[1]:
            self._carry = (text, born)
        else:
            self._finished.append((text, born))

    def _logical_rows(self, start: int, stop: int) -> list[tuple[str, float]]:
        """Rows ``[start, stop)`` as lines: soft-wrapped rows joined; the carried start of a
        line that scrolled off is put in front of its continuation."""
        out: list[tuple[str, float]] = []
        for y in range(start, stop):
            text = self._render(y, full=y + 1 < self.lines and self._cont[y + 1])
            born = self._born[y] if self._born[y] is not None else self._now
            if self._cont[y] and out:
                prev_text, prev_born = out[-1]
                out[-1] = (prev_text + text, prev_born)
            elif y == 0 and self._carry is not None:
                out.append((self._carry[0] + text, self._carry[1]))
            else:
                out.append((text, born))
        return out

    def _last_row(self) -> int:
        """The lowest row that holds something, or the cursor's row if it is past column 0
        (-1: nothing)."""
        buf = self._screen.buffer
        for y in range(self.lines - 1, -1, -1):
            line = buf.get(y)
            if line and any(not _blank(ch) for ch in line.values()):
                return y
            if y == self._screen.cursor.y and self._screen.cursor.x > 0:
                return y
        return -1

    def _render(self, y: int, full: bool = False) -> str:
        """Row ``y`` as text with SGR colours, trailing blanks dropped (unless ``full``: a
        row that a soft wrap continues keeps them, they are inside its line)."""
        line = self._screen.buffer.get(y)
        if not line:
            return " " * self.columns if full else ""
        default = self._screen.default_char
        if not self._styled[y]:  # plain characters: no attribute to compare
            text = "".join([line.get(x, default)[0]
                            for x in range(min(max(line) + 1, self.columns))])
            return text.ljust(self.columns) if full else text.rstrip(" ")
        last = self.columns - 1 if full else -1
        for x, ch in line.items():
            if x > last and x < self.columns and not _blank(ch):
                last = x
        if last < 0:
            return ""
        out: list[str] = []
        style = ""
        cells = [line.get(x, default) for x in range(last + 1)]
        for attrs, run in groupby(cells, _ATTRS):
            want = _SGR_CACHE.get(attrs)
            if want is None:
                if len(_SGR_CACHE) > 1024:
                    _SGR_CACHE.clear()
                want = _SGR_CACHE[attrs] = _sgr(default._make((" ", *attrs)))
            if want != style:
                out.append("\x1b[0m" + want if style else want)
                style = want
            out.append("".join([ch[0] for ch in run]))  # (a wide character's stub is "")
        if style:
            out.append("\x1b[0m")
        return "".join(out)
