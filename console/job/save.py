"""Save what you see (``ctrl+s``): the log view as shown, written to a plain text file.

"As shown" is the log view's own list of visible lines: its source (all ranks, one rank, the
collapsed rows of ``u``), its stderr-only switch and its regex filter; each line with the
timestamp and the rank tag when the view shows them. Colours are dropped and worker text goes
through the one escaping policy (``strip_sgr(sanitize(raw))``, as the filter matches it), so
the file holds no ESC, BEL or other control byte whatever a worker printed: ``cat`` of it is
safe on any terminal.

The file is new, in the given directory (the current one by default), named after the job and
the local time, ``JOB-YYYYmmdd-HHMMSS.log``; an existing name gets ``-1``, ``-2``... and is
never overwritten. ``O_CREAT | O_EXCL`` also refuses a symlink planted at the name (even one
pointing nowhere), and ``O_NOFOLLOW`` says so twice. No Textual here: the app gathers the
lines on its loop (a snapshot of tuples) and this module formats and writes them in a thread.
"""

from __future__ import annotations

import asyncio
import errno
import io
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_agent.coordination.wire.text import sanitize, strip_sgr

__all__ = ["SaveResult", "deliver_log_view", "format_lines", "new_log_file", "save_lines",
           "save_log_view", "shown_lines"]

MAX_NAME_TRIES = 1_000  # JOB-time-N.log: a thousand saves in one second is not a user


@dataclass(frozen=True)
class SaveResult:
    path: Path
    lines: int


def _plain(raw: object) -> str:
    text = raw if type(raw) is str else str(raw)
    return strip_sgr(sanitize(text))


def format_lines(lines: Iterable[tuple[Any, Any, Any, Any]], *, rank_tags: bool,
                 timestamp: Callable[[Any], str] | None, rank_digits: int = 1) -> Iterator[str]:
    """Each ``(server_ms, rank, stream, text)`` as the log view shows it, without colours."""
    for line in lines:
        try:
            ms, rank, _stream, raw = line
        except (TypeError, ValueError):
            ms, rank, raw = 0, "?", repr(line)
        parts = []
        if timestamp is not None:
            parts.append(timestamp(ms) + " ")
        if rank_tags:
            parts.append(_plain(f"[{rank!s:>{rank_digits}}] "))
        parts.append(_plain(raw))
        yield "".join(parts)


def new_log_file(job_id: str, directory: Path, now: float | None = None) -> tuple[Path, int]:
    """Create (exclusively) and open a new file for ``job_id``'s lines: ``(path, fd)``."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    # The job id is validated (letters, digits, - _ .) but a dot-leading name would hide.
    base = f"{_plain(job_id).replace(os.sep, '_').lstrip('.') or 'job'}-{stamp}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(
        os, "O_CLOEXEC", 0)
    for n in range(MAX_NAME_TRIES):
        path = directory / (f"{base}.log" if n == 0 else f"{base}-{n}.log")
        try:
            return path, os.open(path, flags, 0o644)
        except FileExistsError:
            continue  # never overwrite; a symlink at the name counts as existing
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                continue
            raise
    raise FileExistsError(f"{directory}: {MAX_NAME_TRIES} files named {base}*.log exist")


def save_lines(job_id: str, directory: Path, lines: Iterable[str]) -> SaveResult:
    """Write ``lines`` to a new file in ``directory`` (see the module doc)."""
    path, fd = new_log_file(job_id, directory)
    n = 0
    with os.fdopen(fd, "w", encoding="utf-8", errors="replace", newline="\n") as out:
        for line in lines:
            out.write(line)
            out.write("\n")
            n += 1
    return SaveResult(path, n)


async def shown_lines(app: Any) -> Iterator[str]:
    """The log view's lines as shown (see the module doc), snapshotted now: a generator of
    formatted lines that is safe to run in a thread (the ring may move on meanwhile)."""
    log = app.log_view
    deadline = time.monotonic() + 5.0
    while log.scanning and time.monotonic() < deadline:
        # A filter's rescan fills older matches in slices (log_view.py) and says nothing
        # when done: wait for it, or the file would lack the older part of what is shown.
        await asyncio.sleep(0.02)
    snapshot = list(log.visible_lines())
    timestamp = log._format_ts if log.show_timestamps else None
    digits = max(1, int(getattr(log, "_digits", 1) or 1))
    return format_lines(snapshot, rank_tags=log.show_rank_tags, timestamp=timestamp,
                        rank_digits=digits)


async def save_log_view(app: Any, directory: Path | None = None) -> SaveResult | None:
    """``ctrl+s`` in the console: save ``app.log_view`` as shown and notify where.

    Formatted and written in a thread: 200k lines take a few hundred ms.
    """
    lines = await shown_lines(app)
    target = Path.cwd() if directory is None else directory
    try:
        result = await asyncio.to_thread(save_lines, app.job_id, target, lines)
    except OSError as exc:
        why = exc.strerror or str(exc)
        app.notify(f"cannot save the log view in {_plain(str(target))}: {_plain(why)}",
                   title="Save", severity="error", markup=False)
        return None
    app.notify(f"saved {result.lines} line{'' if result.lines == 1 else 's'} to "
               f"{_plain(str(result.path))}", title="Save", markup=False)
    return result


async def deliver_log_view(app: Any) -> str:
    """``ctrl+s`` in the browser view: the same lines, downloaded by the browser (Textual's
    ``deliver_text``) rather than written on the server. Returns the file name offered."""
    lines = await shown_lines(app)
    text = await asyncio.to_thread(lambda: "".join(line + "\n" for line in lines))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{_plain(app.job_id).lstrip('.') or 'job'}-{stamp}.log"
    app.deliver_text(io.StringIO(text), save_filename=name, mime_type="text/plain")
    n = text.count("\n")
    app.notify(f"sent {n} line{'' if n == 1 else 's'} to the browser as {name}", title="Save",
               markup=False)
    return name
