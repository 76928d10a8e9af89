"""How a group's workers start and end, as the agent reports them.

:class:`WorkerExit` is one worker's end: its exit code or signal, and the message of the error
file torch's ``@record`` wrote, which is the worker's and so read as untrusted
(:func:`read_error_file`). :class:`GroupResult` is the group's outcome (a
:class:`WorkerState`) with the exits known at that moment; :class:`WorkerInfo` a started
worker, :class:`WorkerStartError` one that could not be. Plain values: the agent's loop, its
failure policy and its events take them without the process group (:mod:`.workers`) that
made them.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: A larger error file is not read (a worker could otherwise make the agent load gigabytes).
ERROR_FILE_MAX_BYTES = 4 << 20


class WorkerStartError(RuntimeError):
    """A worker could not be started (e.g. the entrypoint does not exist, or its log files
    cannot be created safely). The message is one line for the terminal."""


class WorkerState(str, Enum):
    """The state of a worker group (the subset of torch's ``WorkerState`` that applies)."""

    INIT = "INIT"
    HEALTHY = "HEALTHY"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


@dataclass(frozen=True)
class WorkerInfo:
    """A started worker."""

    local_rank: int
    global_rank: int
    pid: int


@dataclass(frozen=True)
class WorkerExit:
    """How a worker ended.

    ``exit_code`` is the return code (negative for a signal, as in torch); ``signal`` its
    name (``"SIGKILL"``) or None; ``message`` the error file's message when the worker wrote
    one (torch's ``@record``), else ``"Signal 9 (SIGKILL)"`` or ``"exit code 3"``;
    ``error_file`` the file's parsed content or None. ``timestamp`` is this host's
    ``time.time()`` when the exit was seen. ``stopping`` is True for an exit caused by
    :meth:`WorkerGroup.stop`.
    """

    local_rank: int
    global_rank: int
    pid: int
    exit_code: int | None
    signal: str | None
    message: str
    error_file: dict[str, Any] | None
    timestamp: float
    error_file_path: str = ""
    stopping: bool = False

    @property
    def failed(self) -> bool:
        return self.exit_code != 0

    def event_data(self) -> dict[str, Any]:
        """The fields of a ``worker_exited`` event (see ``event_records.EventType``)."""
        return {
            "rank": self.global_rank, "local_rank": self.local_rank, "pid": self.pid,
            "exit_code": self.exit_code, "signal": self.signal, "message": self.message,
            "error_file": self.error_file, "timestamp": self.timestamp,
            "stopping": self.stopping,
        }


@dataclass(frozen=True)
class GroupResult:
    """What :meth:`WorkerGroup.wait` saw: the state and the exits known at that moment."""

    state: WorkerState
    failures: tuple[WorkerExit, ...] = ()
    exits: tuple[WorkerExit, ...] = ()

    @property
    def root_cause(self) -> WorkerExit | None:
        """The earliest failure (the one that brought the group down)."""
        return min(self.failures, key=lambda e: e.timestamp) if self.failures else None


def read_error_file(path: Path) -> dict[str, Any] | None:
    """The worker's error file (torch's ``@record`` format), or None if absent or invalid.

    The file is the worker's, so it is read as untrusted: never through a symlink (which
    could make the agent publish a file the worker chose), only if it is a regular file (a
    FIFO would block the event loop; O_NONBLOCK keeps the open itself from blocking), only
    up to ERROR_FILE_MAX_BYTES, and nesting too deep for ``json`` is only a bad file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc
        log.warning("cannot read the error file %s: %s", path, why)
        return None
    with open(fd, "rb") as fp:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            log.warning("cannot read the error file %s: it is not a regular file", path)
            return None
        raw = fp.read(ERROR_FILE_MAX_BYTES + 1)
    if len(raw) > ERROR_FILE_MAX_BYTES:
        log.warning("cannot read the error file %s: larger than %d bytes", path,
                    ERROR_FILE_MAX_BYTES)
        return None
    try:
        data = json.loads(raw.decode("utf-8", "replace"))
    except (ValueError, RecursionError) as exc:
        log.warning("cannot read the error file %s: %s", path, exc)
        return None
    return data if isinstance(data, dict) else None


def error_message(data: Mapping[str, Any]) -> str:
    """``{"message": {"message": ...}}`` (``@record``) or ``{"message": "..."}``."""
    msg = data.get("message")
    if isinstance(msg, Mapping):
        msg = msg.get("message")
    return msg if isinstance(msg, str) else ""
