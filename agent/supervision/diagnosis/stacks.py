"""Every worker's Python stacks on demand, without root or ptrace.

How: every Python worker registers ``faulthandler.register(SIG, fd, all_threads=True,
chain=False)`` before any user code (:func:`.zygote.arm_stacks`, run by both launch paths:
the exec path starts ``python -u zygote.py --worker SCRIPT|-m MODULE|-c CODE ARGS``, which
reproduces ``python -u`` as a forked ``--preload`` worker does). On a request the agent sends
SIG to the worker's pid; faulthandler's C handler writes every thread's stack to the fd from
the signal handler itself: no GIL, no Python code in the worker, so a worker deadlocked or
stuck in a C call that holds the GIL answers too. Nothing is attached with ptrace (no
CAP_SYS_PTRACE, any ``kernel.yama.ptrace_scope``); the user's program is not changed.

SIG (``--stack-signal``, default ``SIGRTMIN+4``) is a real-time signal: none of torchrun's
(SIGTERM, SIGINT, SIGHUP, SIGQUIT), nor SIGUSR1/SIGUSR2 that programs and SLURM use. A
real-time signal's default action is to terminate, so the agent sends it only to a worker
whose ``/proc/PID/status`` says it catches it (``SigCgt``): a worker still starting, one that
exec'd another program, or a ``--no-python`` one is not signalled.

The fd: a FIFO per rank in the agent process's private runtime directory (:func:`runtime_dir`,
``mkdtemp``: only the agent's user may enter it; not in the log tree, which is torch's layout),
named to the worker by one variable, ``ELASTIC_STACKS=SIG:PATH``.
The agent creates it and holds it open read-write before the worker starts, and reads it with
the event loop (``connect_read_pipe``): no file to poll, nothing left on disk that grows, and
no change to the keeper's descriptor passing (a FIFO is found by path, by an exec'd worker and
a forked one alike). The worker opens it non-blocking (a missing reader cannot hang it), then
blocking, so that no dump is cut short by a full pipe while the agent reads. Bytes that arrive
when no capture is waiting are read and dropped, so a worker can never block on it.

A dump has no end marker. It is written by one run of the signal handler, so it is complete
once that run has returned: faulthandler registers the handler without ``SA_NODEFER``, so the
kernel blocks SIG in the thread running it until it returns. The agent notes which threads
block SIG before it signals (``SigBlk`` in ``/proc/PID/task/*/status``); once a whole line has
come, the dump is complete when SIG is pending nowhere in the process and blocked in no
thread that did not block it before (:func:`handler_done`, checked every
:data:`POLL_S`): a few milliseconds after the worker wrote its last line, instead of a
silence, which is what it falls back to (:data:`QUIET_S` after a whole line, for a process
whose ``/proc`` cannot be read). The whole capture is bounded (:data:`ANSWER_TIMEOUT`, 2 s)
and ranks are asked concurrently. The stop of a restart waits for this capture (the evidence
before the kill): every millisecond of it is on the restart's path.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
from collections.abc import Iterable
from typing import Any

import redis

from elastic_agent.coordination.wire import keyspace, trace_records
from elastic_agent.coordination.wire.stack_dumps import (
    Frame,
    RankStack,
    ThreadStack,
    group_record,
    group_stacks,
    parse_faulthandler,
    render_faulthandler,
)

from ..launch import probes
from ..records.reply_publisher import ReplyPublisher

log = logging.getLogger(__name__)

#: How long ranks have to answer a request (they are asked all at once).
ANSWER_TIMEOUT = probes.ANSWER_TIMEOUT
#: Groups an event carries (the rest are on the stacks stream under its request id).
EVENT_GROUPS = 20
#: Signals a stack signal must never be: torchrun's own, and the user signals others use.
RESERVED = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                      signal.SIGUSR1, signal.SIGUSR2})


_RT_RE = re.compile(r"(?:SIG)?RT(MIN|MAX)(?:([+-])(\d{1,2}))?")


def parse_stack_signal(value: str) -> int | None:
    """``--stack-signal``: ``SIGRTMIN+N``, ``SIGRTMAX-N``, ``RTMIN+N`` or a number, a real-time
    signal; ``off`` (or ``0``) disables stacks. ValueError with a one-line reason otherwise."""
    text = value.strip().upper()
    if text in ("OFF", "NONE", "0"):
        return None
    m = _RT_RE.fullmatch(text)
    if m is not None:
        base = signal.SIGRTMIN if m.group(1) == "MIN" else signal.SIGRTMAX
        n = int(m.group(3) or 0)
        signum = base + n if m.group(2) == "+" else base - n
    elif text.isdigit() and len(text) < 4:
        signum = int(text)
    else:
        raise ValueError(f"{value!r} is not a signal: use SIGRTMIN+N, SIGRTMAX-N, a number "
                         "or off")
    if signum in RESERVED or not signal.SIGRTMIN <= signum <= signal.SIGRTMAX:
        raise ValueError(f"{value!r} is not a real-time signal (SIGRTMIN={int(signal.SIGRTMIN)}"
                         f"..SIGRTMAX={int(signal.SIGRTMAX)}); torchrun's signals and "
                         "SIGUSR1/2 are the job's")
    return int(signum)


# -- the agent's collector -------------------------------------------------------------------

def _ours(frame: Frame) -> bool:
    return frame.file == probes.ZYGOTE_FILE


def to_rank_stack(dump: probes.LocalDump, node: str, host: str) -> RankStack:
    """A dump parsed, the bootstrap's own frames (``zygote.py``) left out, as a traceback
    leaves them out."""
    if dump.error:
        return RankStack(dump.rank, node, host, dump.pid, (), dump.error)
    threads = tuple(ThreadStack(t.thread_id, t.current,
                                tuple(f for f in t.frames if not _ours(f)))
                    for t in parse_faulthandler(dump.text)
                    if not any(f.file == probes.PROBE_FILE for f in t.frames))
    return RankStack(dump.rank, node, host, dump.pid, threads)


class StackCollector(ReplyPublisher):
    """This agent's side of stack requests: capture the local workers, publish per rank."""

    async def capture_local(self, timeout: float = ANSWER_TIMEOUT,
                            ranks: Iterable[int] | None = None,
                            live_only: bool = False) -> list[RankStack]:
        """The stacks of this agent's workers of the current attempt (``ranks``: only those),
        at most ``timeout`` seconds; ``live_only`` leaves out workers that already exited."""
        dumps = await self.group.dump_stacks(ranks=ranks, timeout=timeout, live_only=live_only)
        return [to_rank_stack(d, self.node, self.host) for d in dumps]

    async def publish(self, request_id: str, stacks: Iterable[RankStack]) -> None:
        """One entry per rank on the job's stacks stream. Raises redis errors / OSError."""
        await self._publish(self.keys.stacks, keyspace.STACKS_MAXLEN, (
            trace_records.encode_stack_reply(trace_records.StackReply(
                request=request_id, node=self.node, host=self.host, rank=s.rank, pid=s.pid,
                text=render_faulthandler(s.threads), error=s.error))
            for s in stacks))

    async def evidence(self, request_id: str,
                       timeout: float = ANSWER_TIMEOUT) -> dict[str, Any] | None:
        """Before workers are stopped: the live ones' stacks, published under ``request_id``;
        ``{"request", "groups"}`` for the event, or None when no worker could be asked."""
        try:
            stacks = await self.capture_local(timeout, live_only=True)
        except Exception:
            log.exception("capturing the workers' stacks before stopping them failed")
            return None
        if not any(s.threads for s in stacks):
            return None
        try:  # bounded too: during an outage the stop must not wait for Redis
            await asyncio.wait_for(self.publish(request_id, stacks), ANSWER_TIMEOUT)
        except (redis.RedisError, OSError, asyncio.TimeoutError) as exc:
            log.warning("cannot publish the stacks captured before the stop: %s",
                        exc or "Redis did not answer in time")
        groups = group_stacks(stacks)
        return {"request": request_id,
                "groups": [group_record(g) for g in groups[:EVENT_GROUPS]],
                "ranks": len(stacks)}
