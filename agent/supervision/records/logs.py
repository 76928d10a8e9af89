"""Worker output: per-rank files, the agent's terminal (torchrun's redirects/tee) and Redis.

Every chunk a worker writes to stdout or stderr goes three ways:

1. raw, unchanged, to ``<attempt dir>/<local_rank>/stdout.log`` / ``stderr.log`` (torchrun's
   per-rank layout); the file always holds the whole output, however long its lines;
2. to the agent's terminal, by torchrun's rules: ``redirects`` send a stream to the file only,
   ``tee`` to the file and the terminal with a ``[role0]:``-style prefix on every line, a
   stream neither redirected nor teed goes to the terminal unprefixed, and
   ``local_ranks_filter`` limits which local ranks reach the terminal at all;
3. as lines to the node's log stream in Redis, through a
   :class:`~elastic_agent.supervision.records.publisher.StreamPublisher`: one
   :class:`~elastic_agent.coordination.protocol.LogBatch` per worker stream and flush, the
   batches of all the node's workers in one entry (:class:`NodeBatcher`), which waits up to
   :data:`LOG_LINGER` for more lines (fewer, fuller XADDs; an event sends it at once).

Redis gets what a terminal shows, not the bytes: a line redrawn with ``\\r`` (a progress bar)
is shipped as its last frame (``\\r\\n`` is an ordinary line end). While such a line is
redrawn without a newline, its latest frame is shipped at most every
:data:`LIVE_INTERVAL` seconds (the first :data:`LIVE_DELAY` after the redrawing starts) as
the ``live`` last line of an entry; the line's next state (newer frame or final) is the first
line of the stream's next entry, which replaces it. A bar redrawn 1,000 times a second costs
at most ``1 / LIVE_INTERVAL`` entries a second; one finished within ``LIVE_DELAY`` costs
nothing but its final line. Frames are whole writes: the text after the last ``\\r`` of what
was read is taken as the frame, so a frame split across reads (a writer that does not flush
per frame) can show half-drawn for one update.

Throughput is the point (a worker may print millions of lines): the work is per chunk, not per
line, with C-level bytes operations (``rfind``, ``replace``, ``split``, ``decode``), and the
terminal gets one big write per chunk. A line is only looked at on its own when it is longer
than ``max_line_bytes``.

Output is untrusted: it is kept byte for byte in the file, decoded with replacement characters
for Redis (escape sequences stay as data; the console escapes them when it renders).

The log tree must not be turned against its owner: a log directory is often shared (``/tmp``,
a team's scratch space), and an agent that opened ``attempt_0/0/stdout.log`` as someone else
planted it (a symlink to the user's ``~/.bashrc``) would overwrite the target with worker
output. So every directory the agent makes is private (:data:`LOG_DIR_MODE`) and entered
without following symlinks (:func:`open_private_dir`), and every file is created anew, never
through a symlink, readable by its owner only (:data:`LOG_FILE_MODE`). Anything out of place
raises :class:`LogPathError`, whose message is one line for the terminal.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import stat
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntFlag
from pathlib import Path
from string import Template
from typing import IO, Any, Protocol

from elastic_agent.coordination import protocol
from elastic_agent.coordination.protocol import JobKeys, LogBatch
from elastic_agent.supervision.records.publisher import DropMarkerFactory, Record, StreamPublisher

#: Longest line shipped to Redis; the rest of a longer line is replaced by a marker.
DEFAULT_MAX_LINE_BYTES = 16 * 1024
#: A log entry stops growing past this many bytes (keeps entries and replays reasonable).
DEFAULT_MAX_ENTRY_BYTES = 256 * 1024
#: An unterminated line waits this long for its newline before the terminal shows it anyway
#: (a progress bar redrawn with ``\r`` must stay visible, as it is with torchrun's ``--tee``).
TERMINAL_PARTIAL_DELAY = 0.1
#: ... or until it is this long.
TERMINAL_PARTIAL_MAX = 64 * 1024
#: A line redrawn with ``\r`` is shipped to Redis (``live``) this long after it started to be
#: redrawn (a bar finished sooner costs only its final line) ...
LIVE_DELAY = 0.1
#: ... and then at most this often while it changes.
LIVE_INTERVAL = 0.25
#: A node's log entry waits this long for more lines before it is sent (an event, e.g. a
#: worker's exit, sends it at once): one XADD per node and 50 ms, not per worker and line.
LOG_LINGER = 0.05
#: Worker output may hold secrets (tokens, paths, data): only the agent's user may read it.
LOG_FILE_MODE = 0o600
LOG_DIR_MODE = 0o700

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_ADVICE = "remove it, or pass a --log-dir that only you can write to"


class LogPathError(OSError):
    """A log directory or file the agent cannot use safely. The message is one line: what is
    wrong and what to do."""


def open_private_dir(path: Path, base: Path | None = None) -> int:
    """Open the log directory ``path`` and return its descriptor (the caller closes it).

    ``base`` (default: ``path``'s parent) is the user's choice: it is created if missing and
    may be reached through symlinks. Every component of ``path`` below it is the agent's:
    created with :data:`LOG_DIR_MODE` if missing, entered without following a symlink, and
    refused unless it is a directory of this user that nobody else may write to (someone who
    can write in it could plant a symlink after any check). Each step is relative to the
    descriptor of the one before, so a directory swapped behind our back is never entered.
    Raises :class:`LogPathError`.
    """
    base = path.parent if base is None else base
    parts = path.relative_to(base).parts
    try:
        base.mkdir(mode=LOG_DIR_MODE, parents=True, exist_ok=True)
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise LogPathError(f"cannot use the log directory {base}: {_reason(exc)}") from exc
    current = base
    try:
        for name in parts:
            current = current / name
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, LOG_DIR_MODE, dir_fd=fd)
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise _not_a_directory(fd, name, current, exc) from exc
            os.close(fd)
            fd = child
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise LogPathError(
                    f"refusing to write worker logs in {current}: that directory belongs to "
                    f"another user (uid {st.st_uid}); {_ADVICE}")
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise LogPathError(
                    f"refusing to write worker logs in {current}: other users may write to "
                    f"that directory (mode {stat.S_IMODE(st.st_mode):o}); {_ADVICE}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_log_file(dir_fd: int, name: str, path: Path) -> int:
    """Create the file ``name`` in the directory open as ``dir_fd``; return a write descriptor.

    Always a new file (mode :data:`LOG_FILE_MODE`), never opened through a symlink or a hard
    link. A regular file already there is a log of an earlier run with the same job id and
    log directory: it is replaced, as torchrun's files are. A symlink or anything else is
    refused with a :class:`LogPathError`; ``path`` names the file in messages.
    """
    try:
        return os.open(name, _FILE_FLAGS, LOG_FILE_MODE, dir_fd=dir_fd)
    except FileExistsError:
        pass
    except OSError as exc:
        raise LogPathError(f"cannot create the log file {path}: {_reason(exc)}") from exc
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise _unexpected(dir_fd, name, path, st)
        # unlink removes the name only: a hard link's other names keep their content.
        os.unlink(name, dir_fd=dir_fd)
        return os.open(name, _FILE_FLAGS, LOG_FILE_MODE, dir_fd=dir_fd)
    except FileExistsError:
        raise LogPathError(f"refusing to write {path}: something else keeps creating that "
                           f"file; {_ADVICE}") from None
    except LogPathError:
        raise
    except OSError as exc:
        raise LogPathError(f"cannot create the log file {path}: {_reason(exc)}") from exc


def _not_a_directory(dir_fd: int, name: str, path: Path, exc: OSError) -> LogPathError:
    if exc.errno in (errno.ENOTDIR, errno.ELOOP):
        with contextlib.suppress(OSError):
            return _unexpected(dir_fd, name, path,
                               os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
    return LogPathError(f"cannot create the log directory {path}: {_reason(exc)}")


def _unexpected(dir_fd: int, name: str, path: Path, st: os.stat_result) -> LogPathError:
    """A refusal naming what was found where the agent wanted its own file or directory."""
    if stat.S_ISLNK(st.st_mode):
        target = ""
        with contextlib.suppress(OSError):
            target = f" to {os.readlink(name, dir_fd=dir_fd)!r}"
        what = f"is a symbolic link{target}, which the agent never follows"
    elif stat.S_ISDIR(st.st_mode):
        what = "is a directory"
    elif stat.S_ISREG(st.st_mode):
        what = "is a file, not a directory"
    else:
        what = "is a special file (a FIFO, socket or device)"
    return LogPathError(f"refusing to write worker logs: {path} {what}; {_ADVICE}")


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


class Std(IntFlag):
    """Which of a worker's streams a setting applies to (torchrun's ``Std``)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR


StdSpec = Std | Mapping[int, Std]

_VALUE_RE = re.compile(r"[0-3]")
_MAPPING_RE = re.compile(r"\d+:[0-3](,\d+:[0-3])*")


def parse_std_spec(spec: str) -> Std | dict[int, Std]:
    """Parse torchrun's ``-r``/``-t`` value: ``"3"`` -> ``Std.ALL``, ``"0:3,1:1"`` -> a map.

    Values: 0 none, 1 stdout, 2 stderr, 3 both; a map gives a value per local rank (ranks
    not named get 0). Raises ValueError naming the accepted forms on anything else.
    """
    s = str(spec).strip().replace(" ", "")
    if _VALUE_RE.fullmatch(s):
        return Std(int(s))
    if _MAPPING_RE.fullmatch(s):
        out: dict[int, Std] = {}
        for item in s.split(","):
            rank, value = item.split(":")
            if int(rank) in out:
                raise ValueError(f"invalid stream spec {spec!r}: local rank {rank} is given twice")
            out[int(rank)] = Std(int(value))
        return out
    raise ValueError(
        f"invalid stream spec {spec!r}: expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both), "
        "or a per-local-rank map such as 0:3,1:1"
    )


def std_for(spec: StdSpec, local_rank: int) -> Std:
    """The setting of one local rank (a map gives ``NONE`` to ranks it does not name)."""
    if isinstance(spec, Mapping):
        return Std(spec.get(local_rank, Std.NONE))
    return Std(spec)


def parse_local_ranks_filter(value: str | None) -> frozenset[int] | None:
    """``"0,2"`` -> ``{0, 2}``; empty or None -> None (all ranks). Raises ValueError."""
    if value is None or not str(value).strip():
        return None
    try:
        return frozenset(int(v) for v in str(value).split(","))
    except ValueError:
        raise ValueError(
            f"invalid local ranks filter {value!r}: expected a comma-separated list of "
            "integers, e.g. 0,1,2"
        ) from None


def line_prefix(template: str | None, role: str, rank: int, local_rank: int) -> str:
    """The prefix of teed lines, as torchrun builds it.

    With a template (torchrun's ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``) ``${role_name}``,
    ``${rank}`` (global) and ``${local_rank}`` are substituted; without, torchrun's TailLog
    default ``[{role}{local_rank}]:`` (the local rank, not the global one).
    """
    if template:
        return Template(template).safe_substitute(role_name=role, rank=rank,
                                                  local_rank=local_rank)
    return f"[{role}{local_rank}]:"


def make_logs_drop_marker(job_id: str, node_id: str) -> DropMarkerFactory:
    """The publisher's drop marker for log lines: a ``logs_dropped`` event with the count."""
    events_key = JobKeys(job_id).events

    def marker(count: int) -> tuple[str, dict[str, str]]:
        return events_key, protocol.encode_event(protocol.EventType.LOGS_DROPPED, node_id,
                                                 {"count": count})

    return marker


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


@dataclass(frozen=True)
class LogConfig:
    """How a node's worker output is shown and shipped (torchrun's -r, -t, filter, prefix)."""

    redirects: StdSpec = Std.NONE
    tee: StdSpec = Std.NONE
    local_ranks_filter: frozenset[int] | None = None
    log_line_prefix_template: str | None = None
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    maxlen: int = protocol.LOGS_MAXLEN
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES
    #: torchrun's --duplicate-std{out,err}-filters: ``protocol.STDOUT``/``STDERR`` -> strings;
    #: a teed line holding any of them also goes to the attempt's ``filtered_std*.log``.
    duplicate_filters: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_line_bytes < 16:
            raise ValueError("max_line_bytes must be at least 16")


@dataclass(frozen=True)
class StreamDestination:
    """Where one stream of one worker goes when a --logs-specs plugin decides it: ``file``
    (None: no file), the agent's terminal or not, with the tee prefix or not."""

    file: Path | None
    terminal: bool
    prefixed: bool
    filtered: Path | None = None  # the duplicate filters' file (torch's filtered_std*.log)


@dataclass(frozen=True)
class RankDestinations:
    stdout: StreamDestination
    stderr: StreamDestination


def plugin_destinations(plan: Any, local_rank: int) -> RankDestinations:
    """One local rank's destinations from a plugin's plan (``torch_compat.LogPlan``), read
    as torch's ``PContext`` reads a ``LogsDest``: ``""`` is the agent's own stream, shown
    unprefixed and kept in no file; a path is the file; a teed rank is also shown, with the
    prefix. Redis gets every line whatever the plugin says."""

    def one(paths: dict[int, str], tees: dict[int, str], filtered: str) -> StreamDestination:
        path = paths.get(local_rank, "")
        teed = local_rank in tees
        return StreamDestination(file=Path(path) if path else None,
                                 terminal=not path or teed, prefixed=teed,
                                 filtered=Path(filtered) if filtered and teed else None)

    return RankDestinations(one(plan.stdouts, plan.tee_stdouts, plan.filtered_stdout),
                            one(plan.stderrs, plan.tee_stderrs, plan.filtered_stderr))


def open_plugin_file(path: Path) -> int:
    """A file a --logs-specs plugin named: its directory is the plugin's (made by its
    ``reify``, with its modes), but the file itself is never opened through a symlink."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, LOG_FILE_MODE)
    except OSError as exc:
        raise LogPathError(f"cannot create the log file {path} that --logs-specs named: "
                           f"{_reason(exc)}") from exc


class NodeLogs:
    """The log pipeline of one node: shared settings, terminal, publisher and stream name.

    ``publisher`` None ships nothing to Redis (files and terminal only). ``stdout``/``stderr``
    default to the agent's own ``sys.stdout``/``sys.stderr``.
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
    ) -> None:
        self.config = config or LogConfig()
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

    @property
    def stream_key(self) -> str:
        """The node's log stream (``JobKeys(job).logs(node_id)``), or "" without Redis."""
        return self._stream_key

    def _writer(self, which: str) -> BinaryWriter:
        if which == protocol.STDOUT:
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

    def _open_default(self, node: NodeLogs, directory: Path, prefix: bytes,
                      visible: bool) -> None:
        cfg, rank, local_rank, attempt = node.config, self.rank, self.local_rank, self.attempt
        dir_fd = open_private_dir(directory)
        try:
            for name, bit, fname in ((protocol.STDOUT, Std.OUT, "stdout.log"),
                                     (protocol.STDERR, Std.ERR, "stderr.log")):
                teed = bool(std_for(cfg.tee, local_rank) & bit)
                redirected = bool(std_for(cfg.redirects, local_rank) & bit)
                writer = node._writer(name) if visible and (teed or not redirected) else None
                shipper = None
                if node.batcher is not None:
                    shipper = _Shipper(node.batcher, cfg, rank, local_rank, attempt, name)
                fd = create_log_file(dir_fd, fname, directory / fname)
                # torchrun duplicates only what it tees (its TailLog reads the teed files).
                filtered = node.filtered_file(name, directory.parent) if teed else None
                self._streams[name] = _StreamLog(directory / fname, fd, writer,
                                                 prefix if teed else b"", shipper,
                                                 cfg.max_line_bytes, filtered, prefix)
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
            for name, dest in ((protocol.STDOUT, destinations.stdout),
                               (protocol.STDERR, destinations.stderr)):
                shipper = None
                if node.batcher is not None:
                    shipper = _Shipper(node.batcher, cfg, self.rank, self.local_rank,
                                       self.attempt, name)
                fd = open_plugin_file(dest.file) if dest.file is not None else None
                filtered = (node.filtered_file(name, dest.filtered.parent, dest.filtered)
                            if dest.filtered is not None else None)
                self._streams[name] = _StreamLog(
                    dest.file or Path(os.devnull), fd,
                    node._writer(name) if dest.terminal else None,
                    prefix if dest.prefixed else b"", shipper, cfg.max_line_bytes, filtered,
                    prefix)
        except BaseException:
            for opened in self._streams.values():
                opened.close()
            raise

    @property
    def stdout_path(self) -> Path:
        return self._streams[protocol.STDOUT].path

    @property
    def stderr_path(self) -> Path:
        return self._streams[protocol.STDERR].path

    def feed(self, stream: str, data: bytes) -> None:
        """Process one chunk of ``stream`` (``protocol.STDOUT`` or ``protocol.STDERR``)."""
        self._last_output[self.rank] = time.monotonic()
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
    """One stream of one worker: raw file, terminal (optionally prefixed), Redis shipper."""

    def __init__(self, path: Path, fd: int | None, writer: BinaryWriter | None, prefix: bytes,
                 shipper: _Shipper | None, max_line_bytes: int,
                 filtered: _FilteredFile | None = None, filtered_prefix: bytes = b"") -> None:
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

    def feed(self, data: bytes) -> None:
        if self.closed or not data:
            return
        if self._file is not None:
            self._file.write(data)
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

    # -- terminal -------------------------------------------------------------------------

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
        self._write((b"" if self._midline else self._prefix) + b"".join(self._pending))
        self._pending.clear()
        self._pending_len = 0
        self._midline = True

    def _write(self, data: bytes) -> None:
        assert self._writer is not None
        try:
            self._writer.write(data)
            self._writer.flush()
        except (OSError, ValueError):
            # The agent's terminal went away (closed pipe, detached tty): the output is
            # still in the files and in Redis, so stop showing it rather than fail.
            self._writer = None


class _Batch:
    """Lines of one worker stream waiting in the publisher: its part of a node's entry.

    ``segments`` are blocks of lines already joined by newlines: joining them with newlines
    again gives exactly the stream's lines, without a per-line split.
    """

    __slots__ = ("lines", "live", "segments", "shipper")

    def __init__(self, shipper: _Shipper) -> None:
        self.shipper = shipper
        self.segments: list[str] = []
        self.lines = 0
        self.live: str | None = None  # the latest frame of the unfinished line, sent last

    def batch(self) -> LogBatch:
        """The stream's next batch (numbered now: batches are numbered as they are sent)."""
        s = self.shipper
        s.seq += 1
        lines = self.segments if self.live is None else [*self.segments, self.live]
        return LogBatch(node=s.node, rank=s.rank, local_rank=s.local_rank, attempt=s.attempt,
                        stream=s.stream, seq=s.seq, lines=lines, live=self.live is not None)


class _NodeEntry:
    """The node's next log entry (a ``DeferredPayload``): the lines every worker stream of the
    node printed while it waited in the publisher, one :class:`_Batch` per stream, in the
    order they first printed."""

    __slots__ = ("nbytes", "node", "parts")

    def __init__(self, node: str) -> None:
        self.node = node
        self.parts: dict[_Shipper, _Batch] = {}
        self.nbytes = 0

    @property
    def weight(self) -> int:
        return sum(p.lines + (p.live is not None) for p in self.parts.values())

    def build(self) -> dict[str, str]:
        return protocol.encode_node_log_entry(
            self.node, [p.batch() for p in self.parts.values() if p.segments or p.live])


class NodeBatcher:
    """Gathers the lines of all the node's worker streams into one entry per flush.

    At 4,096 ranks printing ~12 lines/s each, one entry per worker stream and flush was
    ~50k one-line XADDs a second for Redis and every console to handle; one entry per node
    and flush, waiting up to :data:`LOG_LINGER` for more lines, is a few thousand.
    """

    def __init__(self, publisher: StreamPublisher, key: str, cfg: LogConfig,
                 node: str) -> None:
        self.publisher = publisher
        self.key = key
        self.maxlen = cfg.maxlen
        self.max_entry_bytes = cfg.max_entry_bytes
        self.node = node
        self._entry: _NodeEntry | None = None
        self._handle: Record | None = None

    def part(self, shipper: _Shipper) -> _Batch:
        """``shipper``'s part of the entry still waiting in the publisher, or of a new one
        once it was sent, sealed or full. What is added to it is reported with :meth:`grow`
        before anything else is published."""
        entry, handle = self._entry, self._handle
        if (entry is None or handle is None or not handle.open
                or entry.nbytes >= self.max_entry_bytes):
            entry = _NodeEntry(self.node)
            handle = self.publisher.publish_deferred(self.key, entry, self.maxlen,
                                                     linger=LOG_LINGER)
            self._entry, self._handle = entry, handle
        batch = entry.parts.get(shipper)
        if batch is None:
            batch = entry.parts[shipper] = _Batch(shipper)
        return batch

    def grow(self, nbytes: int) -> None:
        """``nbytes`` more in the entry :meth:`part` just gave a part of."""
        assert self._entry is not None and self._handle is not None
        self._entry.nbytes += nbytes
        self.publisher.grow(self._handle, nbytes)


class _Shipper:
    """Cuts one worker stream into lines and hands them to the publisher in batches."""

    def __init__(self, batcher: NodeBatcher, cfg: LogConfig, rank: int, local_rank: int,
                 attempt: int, stream: str) -> None:
        self.batcher = batcher
        self.cap = cfg.max_line_bytes
        self.node = batcher.node
        self.rank = rank
        self.local_rank = local_rank
        self.attempt = attempt
        self.stream = stream
        self.seq = 0
        # The unterminated line: the head of its current frame (cap + 4 bytes max; the whole
        # line if it was never redrawn), what the frame has beyond that head, whether a \r
        # ended it (the next byte starts a new frame, unless it is the \n of \r\n) and
        # whether it was redrawn at all (only then is it shipped before its newline).
        self._partial = bytearray()
        self._partial_extra = 0
        self._cr = False
        self._redrawn = False
        self._live_timer: asyncio.TimerHandle | None = None
        self._live_dirty = False  # the frame changed since it was last shipped
        self._live_at = -LIVE_INTERVAL  # loop time of the last live frame shipped

    def feed(self, data: bytes) -> None:
        nl = data.rfind(b"\n")
        if nl < 0:
            self._add_partial(data)
            if self._redrawn:
                self._live_changed()
            return
        texts: list[str] = []
        nlines = 0
        if self._partial or self._partial_extra or self._cr:
            first = data.find(b"\n")
            self._add_partial(data[:first])
            texts.append(self._take_partial())
            nlines += 1
            body = data[first + 1: nl] if first < nl else None
        else:
            body = data[:nl]
        if body is not None:
            texts.append(self._decode_block(body))
            nlines += body.count(b"\n") + 1
        if nl != len(data) - 1:
            self._add_partial(data[nl + 1:])
        self._ship(texts, nlines, nl + 1)
        if self._redrawn:
            self._live_changed()

    def eof(self) -> None:
        if self._live_timer is not None:
            self._live_timer.cancel()
            self._live_timer = None
        if self._partial or self._partial_extra or self._cr:
            nbytes = len(self._partial) + self._partial_extra
            self._ship([self._take_partial()], 1, nbytes)

    def _ship(self, texts: list[str], nlines: int, nbytes: int) -> None:
        batch = self.batcher.part(self)
        if batch.live is not None:
            # The first of these lines finishes the line whose frame waits here unsent:
            # the frame would only be replaced by it.
            batch.live = None
        batch.segments.extend(texts)
        batch.lines += nlines
        self.batcher.grow(nbytes)

    # -- lines redrawn in place -----------------------------------------------------------

    def _live_changed(self) -> None:
        """The redrawn line changed: ship its frame when the pace allows (one timer at most,
        armed by a change, so an idle or finished bar costs nothing)."""
        self._live_dirty = True
        if self._live_timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # fed outside a loop (a unit test): the final line only
            return
        delay = max(LIVE_DELAY, self._live_at + LIVE_INTERVAL - loop.time())
        self._live_timer = loop.call_later(delay, self._ship_live)

    def _ship_live(self) -> None:
        self._live_timer = None
        if not (self._redrawn and self._live_dirty):
            return  # finished meanwhile: its final line was shipped instead
        self._live_dirty = False
        self._live_at = asyncio.get_running_loop().time()
        text = self._frame_text(bytes(self._partial), self._partial_extra)
        batch = self.batcher.part(self)
        old = len(batch.live) if batch.live is not None else 0
        batch.live = text  # a frame not sent yet is replaced: frames coalesce in an outage
        self.batcher.grow(max(0, len(text) - old))

    # -- lines ----------------------------------------------------------------------------

    def _decode_block(self, block: bytes) -> str:
        """Complete lines joined by newlines -> text, long lines capped, each line as a
        terminal shows it (see :func:`_last_frames`)."""
        if b"\r" in block:
            block = _last_frames(block)
        if len(block) > self.cap:
            lines = block.split(b"\n")
            if max(map(len, lines)) > self.cap:
                block = b"\n".join([self._cap(line) if len(line) > self.cap else line
                                    for line in lines])
        return block.decode("utf-8", "replace")

    def _cap(self, line: bytes) -> bytes:
        """The head of a too-long line (cut on a UTF-8 boundary) and a visible marker."""
        cut = _utf8_cut(line, self.cap)
        return line[:cut] + _marker(len(line) - cut)

    def _add_partial(self, data: bytes) -> None:
        if self._cr or b"\r" in data:
            data = self._new_frame(data)
            if not data:
                return
        room = self.cap + 4 - len(self._partial)
        if len(data) <= room:
            self._partial += data
        else:
            # Only the head of a giant line is ever kept: memory stays bounded whatever
            # a worker prints without a newline.
            if room > 0:
                self._partial += data[:room]
            self._partial_extra += len(data) - max(room, 0)

    def _new_frame(self, data: bytes) -> bytes:
        """Follow the ``\\r`` in ``data``: return what continues the current frame, after
        forgetting the frames that ``data`` overwrites (a ``\\r`` followed by anything but a
        newline starts a new frame; trailing ones are remembered for the next chunk)."""
        body = data.rstrip(b"\r")
        if not body:
            self._cr = True
            return b""
        cut = body.rfind(b"\r")
        if cut >= 0 or self._cr:
            self._partial.clear()
            self._partial_extra = 0
            self._redrawn = True
            body = body[cut + 1:]
        self._cr = len(body) < len(data) - cut - 1
        return body

    def _take_partial(self) -> str:
        text = self._frame_text(bytes(self._partial), self._partial_extra)
        self._partial.clear()
        self._partial_extra = 0
        self._cr = self._redrawn = self._live_dirty = False
        return text

    def _frame_text(self, raw: bytes, extra: int) -> str:
        if extra or len(raw) > self.cap:
            cut = _utf8_cut(raw, self.cap)
            return (raw[:cut] + _marker(len(raw) - cut + extra)).decode("utf-8", "replace")
        return raw.decode("utf-8", "replace")


def _last_frames(block: bytes) -> bytes:
    """Complete lines joined by ``\\n`` (the last one's ``\\n`` not included), each as a
    terminal shows it: ``\\r\\n`` ends a line like ``\\n``, and a line redrawn with ``\\r`` is
    its last frame (the text after its last ``\\r`` that is followed by something)."""
    block = block.replace(b"\r\n", b"\n").rstrip(b"\r")
    if b"\r" not in block:
        return block
    return b"\n".join([line.rstrip(b"\r").rpartition(b"\r")[2] if b"\r" in line else line
                       for line in block.split(b"\n")])


def _utf8_cut(data: bytes, limit: int) -> int:
    """The largest cut <= ``limit`` that does not split a UTF-8 sequence (``len(data) > limit``)."""
    i = limit
    # A continuation byte (10xxxxxx) at the cut belongs to a character started before it.
    while i > limit - 3 and i > 0 and (data[i] & 0xC0) == 0x80:
        i -= 1
    return i


def _marker(dropped: int) -> bytes:
    return f" …[truncated {dropped} bytes]".encode()
