"""One log line as the LogView shows it: its text made safe, its width in cells, its styles,
and the cache of its rendering. No Textual (Rich only).

Untrusted text: every line goes through :func:`~elastic_agent.coordination.wire.text.sanitize` and is
turned into Rich ``Text`` with ``Text.from_ansi`` (SGR colours kept) or plain ``Text``:
never markup. ``[bold]x[/bold]`` shows as those characters; ``ESC ] 0 ; title BEL`` shows as
``\\x1b]0;title\\x07``. Tabs are expanded (a raw tab would move the terminal's cursor). A
line longer than ``MAX_LINE_CHARS`` characters or ``MAX_LINE_CELLS`` cells is cut, with a "…".

:func:`text_cells` and :func:`cells_of` give the width :func:`build_text` would draw, without
building it: the wrapped view keeps every line's width (:mod:`.log_index`), and the filter
matches what :func:`visible_text` shows. :class:`RenderCache` keeps drawn lines as
:class:`Rendered` segments, without the widget's base style (see :class:`Rendered` for why).
"""

from __future__ import annotations

import time
from itertools import compress
from operator import and_, not_

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from rich.text import Text

from elastic_agent.coordination.wire.text import sanitize, strip_sgr

__all__ = ["ERR_TEXT_STYLE", "MAX_LINE_CELLS", "MAX_LINE_CHARS", "RANK_PALETTE", "TAB_SIZE",
           "TS_ERR_STYLE", "TS_STYLE", "RenderCache", "Rendered", "TimestampFormatter",
           "build_text", "cells_of", "rank_style", "styled", "text_cells", "visible_text"]

#: Raw characters of one line that are looked at; the rest is cut (and a "…" shown).
MAX_LINE_CHARS = 4_000
#: Cells of one line that are shown (after sanitizing, which can lengthen a line).
MAX_LINE_CELLS = 4_000
TAB_SIZE = 8
_ELLIPSIS = "…"

#: Rank tag colours, chosen to be told apart on dark and light themes; red is left to stderr.
RANK_PALETTE: tuple[str, ...] = (
    "#5fafff", "#ffaf5f", "#87d787", "#d787d7", "#5fd7d7", "#ffd75f",
    "#af87ff", "#87afaf", "#d7af87", "#87d7ff", "#afd75f", "#ff87d7",
)
_RANK_STYLES = tuple(Style(color=c, bold=True) for c in RANK_PALETTE)
TS_STYLE = Style(dim=True)
TS_ERR_STYLE = Style(color="#d75f5f", dim=True)
ERR_TEXT_STYLE = Style(color="#ff8787")
_CUT_STYLE = Style(dim=True, reverse=True)


def visible_text(raw: str) -> str:
    """What the user reads of a line, without colours: what ``pattern`` is matched against.

    That is ``strip_sgr(sanitize(raw))``. Shortcut: when nothing unprintable is left once the
    SGR sequences are gone, every ESC started one of them and sanitize would change nothing.
    (The other order is not the same: in ``ESC [3 ESC [1m m`` removing the inner SGR first
    makes a new, real SGR sequence out of what the user sees as ``\x1b[3m``.)
    """
    plain = strip_sgr(raw)
    if plain.isprintable():
        return plain
    return strip_sgr(sanitize(raw))


def rank_style(rank: object) -> Style:
    """The stable tag style of a rank (palette colour by ``rank % len(palette)``)."""
    return _RANK_STYLES[rank % len(_RANK_STYLES)] if type(rank) is int else _RANK_STYLES[0]


def build_text(raw: str) -> Text:
    """A line as Rich ``Text``: sanitized, SGR colours kept, tabs expanded, never markup.

    The Text has no base style (``Text.render`` ignores it when there are no spans): the
    caller applies one under the segments' own styles (``Strip.apply_style``).
    """
    cut = len(raw) > MAX_LINE_CHARS
    s = sanitize(raw[:MAX_LINE_CHARS] if cut else raw)
    # After sanitize, an ESC can only start an SGR sequence: plain text skips the decoder.
    text = Text.from_ansi(s, no_wrap=True, end="") if "\x1b" in s else Text(s, no_wrap=True, end="")
    if "\t" in s:
        text.expand_tabs(TAB_SIZE)
    if text.cell_len > MAX_LINE_CELLS:
        text.truncate(MAX_LINE_CELLS)
        cut = True
    if cut:
        text.append(_ELLIPSIS, _CUT_STYLE)
    return text


def text_cells(raw: str) -> int:
    """Cell width of :func:`build_text` ``(raw)``, cheaply (exactly the same number)."""
    cut = len(raw) > MAX_LINE_CHARS
    s = raw[:MAX_LINE_CHARS] if cut else raw
    if s.isascii() and s.isprintable():  # the common case: one cell per character
        cells = len(s)
    else:
        # Without its SGR sequences, a line with nothing else unprintable is shown as is.
        plain = strip_sgr(s) if "\x1b" in s else s
        if plain.isascii() and plain.isprintable():
            cells = len(plain)
        elif "\t" in plain:  # tab stops depend on the columns before them: measure the real thing
            return build_text(raw).cell_len
        else:
            cells = cell_len(visible_text(s))
    if cells > MAX_LINE_CELLS:
        return MAX_LINE_CELLS + 1
    return cells + cut


def cells_of(texts: list[str]) -> list[int]:
    """:func:`text_cells` of many lines; plain ASCII lines are measured at C speed."""
    cells = list(map(len, texts))
    simple = map(and_, map(str.isascii, texts), map(str.isprintable, texts))
    for i in compress(range(len(texts)), map(not_, simple)):
        cells[i] = text_cells(texts[i])
    if cells and max(cells) > MAX_LINE_CHARS:
        for i, n in enumerate(cells):
            if n > MAX_LINE_CHARS:
                cells[i] = text_cells(texts[i])
    return cells


class TimestampFormatter:
    """``server_ms -> 'HH:MM:SS.mmm'`` with the per-second part cached."""

    def __init__(self, utc: bool) -> None:
        self.utc = utc
        self._cache: dict[int, str] = {}

    def __call__(self, ms: object) -> str:
        try:
            sec, milli = divmod(int(ms), 1000)  # type: ignore[call-overload]
            hms = self._cache.get(sec)
            if hms is None:
                if len(self._cache) > 8192:
                    self._cache.clear()
                t = time.gmtime(sec) if self.utc else time.localtime(sec)
                hms = self._cache[sec] = time.strftime("%H:%M:%S", t)
        except (TypeError, ValueError, OverflowError, OSError):
            return "??:??:??.???"
        return f"{hms}.{milli:03d}"


class Rendered:
    """Cached rendering of one line: styled segments of its prefix and text.

    Their styles are the line's own (colours, the rank tag's, stderr's), without the widget's
    base style, which each frame adds (``styled``): focus changes the base (a tint), and a
    cache that held it was thrown away and re-rendered on every ``tab``.

    Segments only, never a ``Strip``: a Strip soon refers to itself through its own caches
    (``divide``, ``crop``), so one kept for longer than a frame survives into the oldest
    generation and is then freed only by a full collection, a pause that grows with every
    line shown. Strips are made per frame and die young.
    """

    __slots__ = ("prefix", "prefix_width", "text", "text_width")

    def __init__(self, prefix: list[Segment], prefix_width: int, text: list[Segment],
                 text_width: int) -> None:
        self.prefix = prefix
        self.prefix_width = prefix_width
        self.text = text
        self.text_width = text_width


class RenderCache:
    """``seq -> Rendered``, least recently used out. A plain dict (insertion ordered):
    unlike a linked-list LRU, dropping it or an entry leaves no reference cycle behind."""

    __slots__ = ("_d", "_max")

    def __init__(self, maxsize: int) -> None:
        self._d: dict[int, Rendered] = {}
        self._max = maxsize

    def get(self, seq: int) -> Rendered | None:
        d = self._d
        value = d.pop(seq, None)
        if value is not None:
            d[seq] = value  # most recent last
        return value

    def put(self, seq: int, value: Rendered) -> None:
        d = self._d
        d[seq] = value
        if len(d) > self._max:
            del d[next(iter(d))]

    def discard(self, seq: int) -> None:
        self._d.pop(seq, None)

    def clear(self) -> None:
        self._d = {}

    def __len__(self) -> int:
        return len(self._d)


def styled(segments: list[Segment], base: Style) -> list[Segment]:
    """``segments`` (a line's own styles) over the widget's ``base`` style: a new list."""
    return [Segment(text, base + style) for text, style, _ in segments]

