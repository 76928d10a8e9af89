"""Whole-tree stops: the processes of a worker's tree besides the worker, found and ended.

A worker's descendants may leave its process group (a session of their own, a double fork, an
orphan reparented to init), and a stop (:meth:`.workers.WorkerGroup.stop`) ends them too. They
are found by parentage (the keeper is the tree's subreaper: its descendants are the tree), by
the worker's ``TORCHELASTIC_ERROR_FILE`` in their environment (which they inherited), and, for
a pipe still held once everything else is gone, by a descriptor on the worker's output pipes;
each is signalled through its own process group when it leads one, and its end is seen on a
pidfd, not polled. The searches read /proc (Linux): the group runs them in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import psutil

from elastic_agent.supervision.launch import keeper

from .keeper_client import KeeperHandle, WorkerHandle

#: How long stop() waits for SIGKILLed processes before giving up on them (a process in
#: uninterruptible sleep, e.g. wedged in a driver, cannot die sooner).
KILL_WAIT = 10.0


def find_strays(workers: Sequence[WorkerHandle], handle: KeeperHandle | None,
                tree: bool = True) -> dict[int, psutil.Process]:
    """Processes of the workers' trees other than the workers themselves.

    Children are found by parentage while their worker lives; orphans (reparented to
    init) and daemons (new session) by the worker's error file path in their
    environment, which they inherited. ``tree`` False: only the latter. Runs in a
    thread: it reads /proc.
    """
    me = os.getpid()
    worker_pids = {w.pid for w in workers if w.pid}
    roots = [w.pid for w in workers if w.pid and not w.exited.done()]
    if handle is not None and handle.pid and not handle.exited.done():
        roots.append(handle.pid)  # the tree's subreaper: its descendants are the tree
    if not tree:
        roots = []
    found: dict[int, psutil.Process] = {}
    parents = keeper.parents() if roots else {}  # one walk of /proc for every root
    for root in roots:
        for pid in keeper.descendants(root, parents) - worker_pids:
            with contextlib.suppress(psutil.Error):
                found[pid] = psutil.Process(pid)
    keeper_pid = handle.pid if handle is not None else 0
    markers = [b"\0TORCHELASTIC_ERROR_FILE=" + os.fsencode(w.error_file) + b"\0"
               for w in workers]
    for pid in _with_marker(markers, {*found, *worker_pids, me, keeper_pid}):
        with contextlib.suppress(psutil.Error):
            found[pid] = psutil.Process(pid)
    return found


def signal_all(sig: signal.Signals, strays: Mapping[int, psutil.Process],
               workers: Iterable[WorkerHandle] = ()) -> None:
    """``sig`` to each of ``workers``' process groups and to every stray (to its group if
    it leads one)."""
    own_group = os.getpgrp()
    for w in workers:
        # The group outlives its leader while any member lives: signal it even if the
        # worker itself has exited.
        if w.pid and w.pid != own_group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.pid, sig)
    for proc in strays.values():
        try:
            if not proc.is_running():  # psutil also guards against a reused pid
                continue
            pgid = os.getpgid(proc.pid)
            if pgid == proc.pid and pgid != own_group:
                os.killpg(pgid, sig)  # a daemon leading its own group: take its children
            else:
                proc.send_signal(sig)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue


async def wait_gone(workers: Iterable[WorkerHandle],
                    strays: Mapping[int, psutil.Process], timeout: float) -> bool:
    """Wait until every worker has exited and every stray is gone; False on timeout."""
    waits: list[asyncio.Future[Any]] = [w.exited for w in workers if not w.exited.done()]
    closers: list[Callable[[], None]] = []
    for proc in strays.values():
        fut, close = _process_gone(proc)
        if fut is not None:
            waits.append(fut)
            closers.append(close)
    try:
        if not waits:
            return True
        _, pending = await asyncio.wait(waits, timeout=timeout)
        return not pending
    finally:
        for close in closers:
            close()


def running(proc: psutil.Process) -> bool:
    """Whether ``proc`` is still there (a zombie is not)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _with_marker(markers: Sequence[bytes], skip: set[int]) -> list[int]:
    """Processes of this user (other than ``skip``) whose environment holds one of
    ``markers`` (``\\0NAME=VALUE\\0``), read raw from /proc: a dict of every process's
    environment was most of a stop's time on a busy host."""
    uid = os.getuid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = b"\0" + f.read() + b"\0"
        except OSError:
            continue  # gone, or not ours to read
        if any(m in env for m in markers):
            found.append(int(name))
    return found


def pipe_holders(inodes: set[int], ttys: Iterable[str] = ()) -> dict[int, psutil.Process]:
    """Processes of ours with a descriptor on one of these pipes (Linux /proc), or on one
    of these terminals (``--worker-tty``: the workers' pty slaves, by path)."""
    wanted = {f"pipe:[{i}]" for i in inodes} | set(ttys)
    me = os.getpid()
    uid = os.getuid()
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["uids"]):
        if proc.pid == me:
            continue
        uids = proc.info["uids"]
        if uids is None or uids.real != uid:
            continue
        fd_dir = f"/proc/{proc.pid}/fd"
        try:
            for fd in os.listdir(fd_dir):
                with contextlib.suppress(OSError):
                    if os.readlink(f"{fd_dir}/{fd}") in wanted:
                        found[proc.pid] = proc
                        break
        except OSError:
            continue
    return found


def _process_gone(proc: psutil.Process) -> tuple[asyncio.Future[Any] | None, Callable[[], None]]:
    """A future done when ``proc`` (not our child) is gone, and a clean-up function.

    A pidfd becomes readable when the process terminates, so the loop is told, not asked.
    Where pidfds are missing (not Linux >= 5.3) psutil waits in a thread instead.
    """
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return None, lambda: None
    except (AttributeError, OSError):
        fut = asyncio.ensure_future(asyncio.to_thread(psutil.wait_procs, [proc], KILL_WAIT * 3))
        return fut, fut.cancel
    if not proc.is_running():  # the pid was reused before we opened it: ours is gone
        os.close(fd)
        return None, lambda: None
    fut = loop.create_future()

    def gone() -> None:
        if not fut.done():
            fut.set_result(None)
        loop.remove_reader(fd)

    loop.add_reader(fd, gone)

    def close() -> None:
        loop.remove_reader(fd)
        os.close(fd)

    return fut, close
