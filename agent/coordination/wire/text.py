"""Untrusted text made safe to show: worker output, host names, error messages are data.

One policy for every place the project writes text that came from Redis or from workers: the
console's screens, its CLI, and the agent's own messages and summary (not ``--tee``, which is
raw as torchrun's). It lives beside the wire contract because both sides show what the wire
carries; it imports nothing.

Contract
    :func:`sanitize` keeps tab and ANSI SGR sequences (``ESC [ params m``: colours and
    attributes) and turns every other control character into visible text, so nothing a
    worker prints can move the cursor, clear the screen, set the terminal title, ring the
    bell or open a hyperlink in the console's terminal:

    * ESC, BEL and other C0 characters, DEL and C1 characters become ``\\xNN``
      (``ESC ] 0;title BEL`` shows as the text ``\\x1b]0;title\\x07``), CR becomes ``\\r``;
    * Unicode line and paragraph separators (U+2028, U+2029) become ``\\u2028``/``\\u2029``:
      ``str.splitlines`` (used by Rich's ANSI decoder) would otherwise break a line there;
    * bidirectional overrides and isolates (U+202A-U+202E, U+2066-U+2069) become
      ``\\u202e`` etc., so text cannot visually reorder itself ("Trojan Source").

    Nothing here interprets Rich or Textual markup. The UI builds ``rich.text.Text`` from the
    result with ``Text.from_ansi`` (never markup), which keeps the SGR colours.

    :func:`strip_sgr` removes SGR sequences, for plain output and for matching a regex against
    what the user reads. Apply it to sanitized text (``strip_sgr(sanitize(s))``), never the other
    way round: stripping first can join the pieces of a broken sequence into a live one
    (``"\\x1b[3\\x1b[1mm"`` becomes ``ESC[3m``), which sanitize would then keep.

Speed: a printable line (the common case) costs one ``str.isprintable`` (no control, format or
separator character: none of the above can be in it) and is returned as is; a coloured one a
single precompiled ``search``. This runs at the workers' full output rate.
"""

from __future__ import annotations

import re

# SGR only: ESC [ then parameters (digits, ';' and ':' for 38:2::r:g:b colours) then 'm'.
# Anything else that starts with ESC (cursor moves, OSC titles, hyperlinks) is escaped.
_SGR = r"\x1b\[[0-9;:]*m"
# Every character that must not reach the terminal as itself. Tab (0x09) is kept.
_UNSAFE = r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]"

_SGR_RE = re.compile(_SGR)
# A line with nothing to escape: runs of safe characters and SGR sequences, nothing else. No
# ESC sits inside either, so at each ESC only an SGR can continue the match, and possessive
# quantifiers never backtrack (linear in the line, whatever it holds). Twice as fast as
# searching for an unsafe character that does not start an SGR (a lookahead at each position).
_ONLY_SAFE_RE = re.compile(f"(?:[^{_UNSAFE[1:-1]}]++|{_SGR})*+")
# Alternation order matters: an SGR sequence is matched (and kept) before its ESC could be
# matched on its own (and escaped).
_TOKEN_RE = re.compile(f"({_SGR})|{_UNSAFE}")


def _escape(ch: str) -> str:
    code = ord(ch)
    if ch == "\r":
        return "\\r"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}"


# Precomputed replacements: the callback below is a dict lookup, not string formatting.
_ESCAPES: dict[str, str] = {
    ch: _escape(ch)
    for ch in (
        *map(chr, range(0x00, 0x09)), *map(chr, range(0x0A, 0x20)), *map(chr, range(0x7F, 0xA0)),
        "\u2028", "\u2029", *map(chr, range(0x202A, 0x202F)), *map(chr, range(0x2066, 0x206A)),
    )
}


def _replace(m: re.Match[str]) -> str:
    sgr = m.group(1)
    return sgr if sgr is not None else _ESCAPES[m.group(0)]


def sanitize(line: str) -> str:
    """``line`` with every control character except tab and SGR shown as visible text.

    Pure and total: any ``str`` in, a ``str`` out that contains no control character other
    than tab and the ESC of an SGR sequence.
    """
    if line.isprintable():  # most lines: no control, format or separator character (C speed)
        return line
    if _ONLY_SAFE_RE.fullmatch(line) is not None:  # only coloured (or tabs): nothing to do
        return line
    return _TOKEN_RE.sub(_replace, line)


def strip_sgr(line: str) -> str:
    """``line`` without its SGR (colour) sequences; other characters are left as they are."""
    if "\x1b" not in line:
        return line
    return _SGR_RE.sub("", line)


#: Ends every coloured line on a terminal, so a colour a worker opened never bleeds further.
SGR_RESET = "\x1b[0m"


def terminal_line(text: str, colour: bool) -> str:
    """One line of untrusted text as it may be written to a terminal or a pipe.

    Every control character is escaped (a newline in ``text`` included: one call, one line).
    With ``colour`` (the output is a terminal) SGR colours are kept and reset at the end of the
    line; without (a pipe, a file) they are removed.
    """
    safe = sanitize(text)
    if not colour:
        return strip_sgr(safe)
    return safe + SGR_RESET if "\x1b" in safe else safe


def terminal_lines(text: str, colour: bool) -> list[str]:
    """Multi-line untrusted text (a traceback) as lines for :func:`terminal_line`. Splits on
    ``\n`` only: every other separator stays inside its line, escaped."""
    return [terminal_line(line, colour) for line in text.split("\n")]
