"""A worker's stdout and stderr as terminals (``--worker-tty``), as under torchrun in a terminal.

torchrun's workers write to the launcher's own stdout and stderr: run from a terminal, they see
a terminal (``isatty()`` True), so Rich and tqdm draw live progress bars. The agent reads its
workers' output (files, tee, Redis), so it gives each stream a pseudo-terminal of its own
instead of a pipe: two per worker, so that stdout.log and stderr.log stay apart as in torch's
layout. The agent reads the master ends as it reads pipes; the slave ends are the worker's
fds 1 and 2, passed to the keeper (or to a parked worker) exactly like pipe ends.

Each slave is in raw mode: no ``\\n`` -> ``\\r\\n`` (the files keep the worker's bytes as a pipe
would), no echo, no signals from the line discipline. Its window size is the agent's terminal's
(or :data:`DEFAULT_SIZE`), so a bar is as wide as it would be under torchrun. The pty is never
a worker's controlling terminal (a worker starts its own session and never opens it), so no
job-control signal reaches a worker through it. Reading a master once every slave is closed
fails with EIO: asyncio's read transport reports it as the connection's end (EOF).
"""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import sys
import termios
import tty
from typing import IO

__all__ = ["DEFAULT_SIZE", "MODES", "open_pty", "window_for"]

#: ``--worker-tty`` values: auto (a terminal when the agent's stdout is one), on, off.
MODES = ("auto", "on", "off")
#: (columns, lines) of a worker's terminal when the agent's own is not one.
DEFAULT_SIZE = (120, 40)


def window_for(mode: str, stream: IO[str] | None = None) -> tuple[int, int] | None:
    """The (columns, lines) of the workers' terminals for ``--worker-tty mode``, or None for
    pipes. ``stream`` (default ``sys.stdout``) is the agent's terminal, if it is one."""
    stream = sys.stdout if stream is None else stream
    try:
        fd = stream.fileno()
        is_tty = os.isatty(fd)
    except (AttributeError, OSError, ValueError):  # replaced by a test, or closed
        fd, is_tty = -1, False
    if mode == "off" or (mode == "auto" and not is_tty):
        return None
    if is_tty:
        try:
            size = os.get_terminal_size(fd)
        except OSError:
            return DEFAULT_SIZE
        if size.columns >= 20 and size.lines >= 2:  # a terminal that reports nothing says 0
            return (min(size.columns, 1000), min(size.lines, 500))
    return DEFAULT_SIZE


def open_pty(size: tuple[int, int]) -> tuple[int, int, str]:
    """A new pseudo-terminal for one worker stream: ``(master, slave, slave's path)``, the
    slave raw and ``size`` (columns, lines) big; both ends close-on-exec (the keeper dup2s
    the slave onto the worker's fd 1 or 2, which is inherited)."""
    master, slave = pty.openpty()
    try:
        tty.setraw(slave)
        columns, lines = size
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
        name = os.ttyname(slave)
        os.set_inheritable(master, False)
        os.set_inheritable(slave, False)
    except BaseException:
        os.close(master)
        os.close(slave)
        raise
    return master, slave, name
