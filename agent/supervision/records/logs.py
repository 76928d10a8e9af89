"""Worker output: per-rank files, the agent's terminal (torchrun's redirects/tee) and Redis.

Every chunk a worker writes to stdout or stderr goes three ways:

1. raw, unchanged, to ``<attempt dir>/<local_rank>/stdout.log`` / ``stderr.log`` (torchrun's
   per-rank layout); the file always holds the whole output, however long its lines;
2. to the agent's terminal, by torchrun's rules: ``redirects`` send a stream to the file only,
   ``tee`` to the file and the terminal with a ``[role0]:``-style prefix on every line, a
   stream neither redirected nor teed goes to the terminal unprefixed, and
   ``local_ranks_filter`` limits which local ranks reach the terminal at all;
3. as lines to the node's log stream in Redis (log_shipping.py).

This module is the pipeline's front: the node's sinks (:class:`NodeLogs`), one worker's
(:class:`WorkerLogs`), and the fan-out of each of its streams to file, terminal, Redis and
torchrun's duplicate filters. Where each stream goes is settled by log_config.py (torchrun's
flags, or a --logs-specs plugin's plan); every log directory and file is made by
log_files.py, never through a symlink.

Throughput is the point (a worker may print millions of lines): the work is per chunk, not per
line, with C-level bytes operations (``rfind``, ``replace``, ``split``, ``decode``), and the
terminal gets one big write per chunk. A line is only looked at on its own when it is longer
than ``max_line_bytes``.

Output is untrusted: it is kept byte for byte in the file, decoded with replacement characters
for Redis (escape sequences of plain output stay as data; the console escapes them when it
renders). Output that moves the cursor (a Rich live display) is drawn on an emulated terminal
instead (screen.py): finished lines and a live block, which the agent's terminal shows
redrawn in place (live_area.py). Plain output never reaches the emulator: one ``in`` per chunk
tells them apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Hashable
from pathlib import Path
from typing import IO, Protocol

from elastic_agent.coordination.wire import log_records
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.supervision.records.live_area import LiveArea, is_terminal, terminal_id
from elastic_agent.supervision.records.log_config import (
    LogConfig,
    RankDestinations,
    Std,
    line_prefix,
    std_for,
)
from elastic_agent.supervision.records.log_files import create_log_file, open_plugin_file, open_private_dir
from elastic_agent.supervision.records.log_shipping import NodeBatcher, Shipper
from elastic_agent.supervision.records.publisher import StreamPublisher
from elastic_agent.supervision.records.screen import StreamScreen, moves_cursor

log = logging.getLogger(__name__)

#: An unterminated line waits this long for its newline before the terminal shows it anyway
#: (a progress bar redrawn with ``\r`` must stay visible, as it is with torchrun's ``--tee``).
TERMINAL_PARTIAL_DELAY = 0.1
#: ... or until it is this long.
TERMINAL_PARTIAL_MAX = 64 * 1024
#: (columns, lines) of the terminal that renders cursor-moving output of workers on pipes.
DEFAULT_SCREEN = (120, 40)


class OutputObserver(Protocol):
    """Sees every chunk a worker writes, raw, before the pipeline cuts it into lines (the
    training metrics read from output: diagnosis/metrics.py's tracker, wired in by the
    agent). Called on the event loop, once per chunk: it must be cheap and must not raise."""

    def feed(self, rank: int, stream: str, data: bytes, /) -> object: ...


class BinaryWriter(Protocol):
    """Where terminal output goes (``sys.stdout.buffer`` or a test's ``BytesIO``)."""

    def write(self, data: bytes, /) -> object: ...

    def flush(self) -> object: ...


class _TextWriter:
    """Bytes onto a text stream that has no binary buffer (e.g. one replaced by a test)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, data: bytes) -> int:
        self._stream.write(data.decode("utf-8", "replace"))
        return len(data)

    def flush(self) -> None:
        self._stream.flush()


def terminal_writer(stream: IO[str]) -> BinaryWriter:
    """A binary writer for a text stream such as ``sys.stdout``."""
    buffer = getattr(stream, "buffer", None)
    if buffer is not None:
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.flush()  # what was printed as text must come before our bytes
        return buffer  # type: ignore[no-any-return]
    return _TextWriter(stream)


class NodeLogs:
    """The log pipeline of one node: shared settings, terminal, publisher and stream name.

    ``publisher`` None ships nothing to Redis (files and terminal only). ``stdout``/``stderr``
    default to the agent's own ``sys.stdout``/``sys.stderr``. ``observer`` sees every raw
    chunk before the rest of the pipeline does.
    """

    def __init__(
        self,
        config: LogConfig | None = None,
        *,
        publisher: StreamPublisher | None = None,
        job_id: str | None = None,
        node_id: str | None = None,
        stdout: BinaryWriter | None = None,
        stderr: BinaryWriter | None = None,
        observer: OutputObserver | None = None,
    ) -> None:
        self.config = config or LogConfig()
        #: Sees every chunk of every worker (see :class:`OutputObserver`); None: nothing does.
        self.observer = observer
        if publisher is not None and (job_id is None or node_id is None):
            raise ValueError("shipping logs to Redis needs job_id and node_id")
        self.publisher = publisher
        self.node_id = node_id or ""
        self._stream_key = JobKeys(job_id).logs(self.node_id) if job_id else ""
        self.batcher = (NodeBatcher(publisher, self._stream_key, self.config, self.node_id)
                        if publisher is not None else None)
        self._streams_key = JobKeys(job_id).log_streams if job_id else ""
        self._registered = False
        self._stdout = stdout
        self._stderr = stderr
        self._filtered: dict[tuple[str, Path], _FilteredFile] = {}
        #: global rank -> time.monotonic() of its newest output (stall detection, stall.py)
        self.last_output: dict[int, float] = {}
        #: (columns, lines) of the workers' terminals (``--worker-tty``): output that moves
        #: the cursor is rendered on an emulated terminal this big (screen.py).
        self.screen_size: tuple[int, int] = DEFAULT_SCREEN
        self._areas: dict[Hashable, LiveArea] = {}

    def live_area(self, writer: BinaryWriter) -> LiveArea | None:
        """The live area (live_area.py) of the terminal ``writer`` writes to; None if it is
        not a terminal. The agent's stdout and stderr share one when they are one terminal."""
        if not is_terminal(writer):
            return None
        key = terminal_id(writer)
        area = self._areas.get(key)
        if area is None:
            area = self._areas[key] = LiveArea(writer)
        return area

    @property
    def stream_key(self) -> str:
        """The node's log stream (``JobKeys(job).logs(node_id)``), or "" without Redis."""
        return self._stream_key

    def _writer(self, which: str) -> BinaryWriter:
        if which == log_records.STDOUT:
            if self._stdout is None:
                self._stdout = terminal_writer(sys.stdout)
            return self._stdout
        if self._stderr is None:
            self._stderr = terminal_writer(sys.stderr)
        return self._stderr

    def open_worker(self, *, directory: Path, role: str, rank: int, local_rank: int,
                    attempt: int, destinations: RankDestinations | None = None) -> WorkerLogs:
        """Create the files of one worker in ``directory`` and return its sink.

        ``directory`` is made private if missing (its parent is taken as given); see
        :func:`open_private_dir` and :func:`create_log_file`. Raises :class:`LogPathError`.
        """
        if self.publisher is not None and not self._registered:
            # Consoles find the node's stream through this set; SADD is idempotent, so a
            # replay after an outage is harmless.
            self.publisher.publish_command("SADD", self._streams_key, self._stream_key)
            self._registered = True
        return WorkerLogs(self, directory=directory, role=role, rank=rank,
                          local_rank=local_rank, attempt=attempt, destinations=destinations)

    def filtered_file(self, stream: str, attempt_dir: Path,
                      plugin_path: Path | None = None) -> _FilteredFile | None:
        """The attempt's ``filtered_stdout.log``/``filtered_stderr.log`` (torchrun's
        duplicate filters), shared by the node's workers; None without filters. The previous
        attempt's file is closed when the next one opens."""
        needles = self.config.duplicate_filters.get(stream)
        if needles is None:
            return None
        key = (stream, plugin_path or attempt_dir)
        found = self._filtered.get(key)
        if found is None:
            for old in [k for k in self._filtered if k[0] == stream]:
                self._filtered.pop(old).close()
            name = f"filtered_std{stream}.log"
            if plugin_path is not None:
                fd = open_plugin_file(plugin_path)
            else:
                dir_fd = open_private_dir(attempt_dir)
                try:
                    fd = create_log_file(dir_fd, name, attempt_dir / name)
                finally:
                    os.close(dir_fd)
            found = self._filtered[key] = _FilteredFile(fd, needles)
        return found


class _FilteredFile:
    """Complete lines of several workers, those holding a needle, each with its worker's
    prefix (torchrun's ``TailLog`` with a ``log_line_filter``)."""

    def __init__(self, fd: int, needles: tuple[str, ...]) -> None:
        self._file: IO[bytes] | None = open(fd, "wb", buffering=0)  # noqa: SIM115
        self.needles = tuple(n.encode() for n in needles)

    def write_matching(self, prefix: bytes, lines: list[bytes]) -> None:
        out = [prefix + line + b"\n" for line in lines
               if any(n in line for n in self.needles)]
        if out and self._file is not None:
            with contextlib.suppress(OSError):  # a full disk loses only the duplicate
                self._file.write(b"".join(out))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class WorkerLogs:
    """The output sink of one worker: ``feed`` chunks as they come, ``eof`` at the end.

    Fed synchronously from the event loop (the worker's pipe callbacks). ``drained`` is set
    once both streams reached EOF (or ``close`` was called); by then every complete and
    partial line has been written to the file and terminal and handed to the publisher.
    """

    def __init__(self, node: NodeLogs, *, directory: Path, role: str, rank: int,
                 local_rank: int, attempt: int,
                 destinations: RankDestinations | None = None) -> None:
        cfg = node.config
        self.directory = directory
        self.rank = rank
        self.local_rank = local_rank
        self.attempt = attempt
        visible = cfg.local_ranks_filter is None or local_rank in cfg.local_ranks_filter
        prefix = line_prefix(cfg.log_line_prefix_template, role, rank, local_rank).encode()
        self._streams: dict[str, _StreamLog] = {}
        if destinations is not None:
            self._open_planned(node, destinations, prefix)
        else:
            self._open_default(node, directory, prefix, visible)
        self.drained = asyncio.Event()
        self._last_output = node.last_output
        self._observer = node.observer

    def _open_default(self, node: NodeLogs, directory: Path, prefix: bytes,
                      visible: bool) -> None:
        cfg, rank, local_rank, attempt = node.config, self.rank, self.local_rank, self.attempt
        dir_fd = open_private_dir(directory)
        try:
            for name, bit, fname in ((log_records.STDOUT, Std.OUT, "stdout.log"),
                                     (log_records.STDERR, Std.ERR, "stderr.log")):
                teed = bool(std_for(cfg.tee, local_rank) & bit)
                redirected = bool(std_for(cfg.redirects, local_rank) & bit)
                writer = node._writer(name) if visible and (teed or not redirected) else None
                shipper = None
                if node.batcher is not None:
                    shipper = Shipper(node.batcher, cfg, rank, local_rank, attempt, name)
                fd = create_log_file(dir_fd, fname, directory / fname)
                # torchrun duplicates only what it tees (its TailLog reads the teed files).
                filtered = node.filtered_file(name, directory.parent) if teed else None
                self._streams[name] = _StreamLog(directory / fname, fd, writer,
                                                 prefix if teed else b"", shipper,
                                                 cfg.max_line_bytes, filtered, prefix,
                                                 node=node, key=(rank, name))
        except BaseException:
            for opened in self._streams.values():
                opened.close()
            raise
        finally:
            os.close(dir_fd)

    def _open_planned(self, node: NodeLogs, destinations: RankDestinations,
                      prefix: bytes) -> None:
        cfg = node.config
        try:
            for name, dest in ((log_records.STDOUT, destinations.stdout),
                               (log_records.STDERR, destinations.stderr)):
                shipper = None
                if node.batcher is not None:
                    shipper = Shipper(node.batcher, cfg, self.rank, self.local_rank,
                                       self.attempt, name)
                fd = open_plugin_file(dest.file) if dest.file is not None else None
                filtered = (node.filtered_file(name, dest.filtered.parent, dest.filtered)
                            if dest.filtered is not None else None)
                self._streams[name] = _StreamLog(
                    dest.file or Path(os.devnull), fd,
                    node._writer(name) if dest.terminal else None,
                    prefix if dest.prefixed else b"", shipper, cfg.max_line_bytes, filtered,
                    prefix, node=node, key=(self.rank, name))
        except BaseException:
            for opened in self._streams.values():
                opened.close()
            raise

    @property
    def stdout_path(self) -> Path:
        return self._streams[log_records.STDOUT].path

    @property
    def stderr_path(self) -> Path:
        return self._streams[log_records.STDERR].path

    def feed(self, stream: str, data: bytes) -> None:
        """Process one chunk of ``stream`` (``log_records.STDOUT`` or ``log_records.STDERR``)."""
        self._last_output[self.rank] = time.monotonic()
        if self._observer is not None:
            try:
                self._observer.feed(self.rank, stream, data)
            except Exception:  # the output must reach its file whatever the observer does
                log.exception("the output observer failed on rank %d: it sees no more of "
                              "this worker's output", self.rank)
                self._observer = None
        self._streams[stream].feed(data)

    def eof(self, stream: str) -> None:
        """``stream`` ended: flush its partial last line and close its file."""
        self._streams[stream].close()
        if all(s.closed for s in self._streams.values()):
            self.drained.set()

    def close(self) -> None:
        """End both streams now (e.g. a pipe a stray process keeps open). Idempotent."""
        for name in self._streams:
            self.eof(name)


class _StreamLog:
    """One stream of one worker: raw file, terminal (optionally prefixed), Redis shipper.

    Plain output takes the fast path: bytes to the terminal, lines cut by the shipper. Output
    that moves the cursor (:func:`~.screen.moves_cursor`) is drawn on an emulated terminal
    (:class:`~.screen.StreamScreen`) until it is plain again: its finished lines and live
    block go to the shipper and the terminal (a terminal's :class:`~.live_area.LiveArea`
    redraws the block in place; a pipe or file gets finished lines only).
    """

    def __init__(self, path: Path, fd: int | None, writer: BinaryWriter | None, prefix: bytes,
                 shipper: Shipper | None, max_line_bytes: int,
                 filtered: _FilteredFile | None = None, filtered_prefix: bytes = b"", *,
                 node: NodeLogs | None = None, key: Hashable = None) -> None:
        self.path = path
        self._filtered = filtered
        self._filtered_prefix = filtered_prefix
        self._filter_tail = b""  # the unfinished line, for the filtered file
        self._filter_max = max(max_line_bytes, 1 << 20)
        # Unbuffered: each chunk is one write(2), so `tail -f` sees output as it comes.
        self._file: IO[bytes] | None = (  # no file: a --logs-specs console-only stream
            open(fd, "wb", buffering=0) if fd is not None else None)  # noqa: SIM115
        self._writer = writer
        self._prefix = prefix
        self._nl_prefix = b"\n" + prefix
        self._shipper = shipper
        self._pending: list[bytes] = []  # an unterminated line not yet on the terminal
        self._pending_len = 0
        self._midline = False  # the terminal shows the start of a line we are in
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False
        self._node = node
        self._key = key if key is not None else id(self)
        self._screen: StreamScreen | None = None  # while the output moves the cursor
        self._live: tuple[list[str], float] | None = None  # its live block, read once a feed
        self._area: LiveArea | None = None  # the terminal's live area, if it is a terminal
        self._area_known = False

    def feed(self, data: bytes) -> None:
        if self.closed or not data:
            return
        if self._file is not None:
            self._file.write(data)
        if self._screen is not None or moves_cursor(data):
            self._render(data)
        else:
            if self._writer is not None:
                self._to_terminal(data)
            if self._shipper is not None:
                self._shipper.feed(data)
        if self._filtered is not None:
            self._filter(data)

    def _filter(self, data: bytes, final: bool = False) -> None:
        assert self._filtered is not None
        buf = self._filter_tail + data
        nl = buf.rfind(b"\n")
        if final or len(buf) - nl > self._filter_max:  # the end, or a line past any bound
            lines, self._filter_tail = buf.split(b"\n"), b""
            if not lines[-1]:
                lines.pop()
        elif nl < 0:
            self._filter_tail = buf
            return
        else:
            lines, self._filter_tail = buf[:nl].split(b"\n"), buf[nl + 1:]
        self._filtered.write_matching(self._filtered_prefix, lines)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._screen is not None:
            finished = self._screen.close()
            self._screen = None
            if self._shipper is not None:
                self._shipper.rendered(finished, None, True)
            self._show_rendered(finished, True)
        if self._writer is not None and (self._pending or self._midline):
            self._write((b"" if self._midline else self._prefix)
                        + b"".join(self._pending) + b"\n")
            self._pending.clear()
            self._midline = False
        if self._shipper is not None:
            self._shipper.eof()
        if self._filtered is not None:
            self._filter(b"", final=True)
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- output that moves the cursor ------------------------------------------------------

    def _render(self, data: bytes) -> None:
        now = time.monotonic()
        screen = self._screen
        if screen is None:
            screen = self._screen = self._enter_screen(now)
        screen.feed(data, now)
        self._live = None
        finished = screen.take_finished()
        idle = screen.idle
        changed = screen.changed
        if self._shipper is not None:
            self._shipper.rendered(finished, None if idle else self._screen_live, changed)
        self._show_rendered(finished, changed or idle)
        if idle:  # plain again: back to the fast path
            self._screen = None
            self._live = None

    def _enter_screen(self, now: float) -> StreamScreen:
        """Start drawing on an emulated terminal, from the unterminated line (what the
        shipper holds of it, or what the terminal has not shown yet)."""
        size = self._node.screen_size if self._node is not None else DEFAULT_SCREEN
        screen = StreamScreen(*size)
        head = self._shipper.take_over() if self._shipper is not None else None
        if head is None and self._pending:
            head = (b"".join(self._pending), now)
        if head is not None and head[0]:
            screen.feed(head[0], head[1])
        if self._writer is not None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._midline:  # the start of that line is on the terminal: it is redrawn
                area = self._live_area()
                self._write(b"\r\x1b[2K" if area is not None else b"\n")
            self._pending.clear()
            self._pending_len = 0
            self._midline = False
        return screen

    def _screen_live(self) -> tuple[list[str], float]:
        if self._live is None:
            assert self._screen is not None
            self._live = self._screen.live()
        return self._live

    def _show_rendered(self, finished: list[tuple[str, float]], changed: bool) -> None:
        """Finished lines, and the live block if it ``changed``, on the agent's terminal (a
        pipe or a file gets finished lines only)."""
        if self._writer is None:
            return
        area = self._live_area()
        if area is not None and (changed or self._screen is None):
            # (drawn by the print below when there are finished lines)
            area.set(self._key, self._prefix,
                     [] if self._screen is None else self._screen_live()[0], draw=not finished)
        if finished:
            data = b"".join(self._prefix + text.encode("utf-8", "replace") + b"\n"
                            for text, _ in finished)
            if area is not None:
                area.print(data, self._writer)
            else:
                self._write(data)

    def _live_area(self) -> LiveArea | None:
        if not self._area_known:
            self._area_known = True
            if self._writer is not None and self._node is not None:
                self._area = self._node.live_area(self._writer)
        return self._area

    # -- terminal ------------------------------------------------------------------------

    def _to_terminal(self, data: bytes) -> None:
        nl = data.rfind(b"\n")
        if nl < 0:
            self._pending.append(data)
            self._pending_len += len(data)
            if self._pending_len >= TERMINAL_PARTIAL_MAX:
                self._flush_partial()
            elif self._timer is None:
                self._arm_timer()
            return
        head = data if nl == len(data) - 1 else data[: nl + 1]
        if self._prefix:
            # One C-level pass inserts the prefix after every newline; the one after the
            # last newline belongs to a line that has not started yet.
            head = head.replace(b"\n", self._nl_prefix)[: -len(self._prefix)]
        parts = [] if self._midline else [self._prefix]
        if self._pending:
            parts.extend(self._pending)
            self._pending.clear()
            self._pending_len = 0
        parts.append(head)
        self._midline = False
        self._write(b"".join(parts))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if nl != len(data) - 1:
            tail = data[nl + 1:]
            self._pending.append(tail)
            self._pending_len = len(tail)
            self._arm_timer()

    def _arm_timer(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # fed outside a loop (a unit test): shown at the next newline
            return
        self._timer = loop.call_later(TERMINAL_PARTIAL_DELAY, self._flush_partial)

    def _flush_partial(self) -> None:
        """Show an unterminated line now; its continuation will follow without a prefix."""
        self._timer = None
        if not self._pending or self.closed:
            return
        area = self._live_area()
        if area is not None and area.active and self._pending_len < TERMINAL_PARTIAL_MAX:
            return  # under a live area a line is shown once whole (the area holds the rows)
        self._write((b"" if self._midline else self._prefix) + b"".join(self._pending))
        self._pending.clear()
        self._pending_len = 0
        self._midline = True

    def _write(self, data: bytes) -> None:
        assert self._writer is not None
        area = self._live_area()
        if area is not None and area.active:
            area.print(data, self._writer)  # above the workers' live blocks
            return
        try:
            self._writer.write(data)
            self._writer.flush()
        except (OSError, ValueError):
            # The agent's terminal went away (closed pipe, detached tty): the output is
            # still in the files and in Redis, so stop showing it rather than fail.
            self._writer = None
