"""Log directories and files, made so that the log tree cannot be turned against its owner.

A log directory is often shared (``/tmp``, a team's scratch space), and an agent that opened
``attempt_0/0/stdout.log`` as someone else planted it (a symlink to the user's ``~/.bashrc``)
would overwrite the target with worker output. So every directory the agent makes is private
(:data:`LOG_DIR_MODE`) and entered without following symlinks (:func:`open_private_dir`), and
every file is created anew, never through a symlink, readable by its owner only
(:data:`LOG_FILE_MODE`). A file a --logs-specs plugin names is in the plugin's directory, but
it too is never opened through a symlink (:func:`open_plugin_file`). Anything out of place
raises :class:`LogPathError`, whose message is one line for the terminal.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

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


def open_plugin_file(path: Path) -> int:
    """A file a --logs-specs plugin named: its directory is the plugin's (made by its
    ``reify``, with its modes), but the file itself is never opened through a symlink."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, LOG_FILE_MODE)
    except OSError as exc:
        raise LogPathError(f"cannot create the log file {path} that --logs-specs named: "
                           f"{_reason(exc)}") from exc
