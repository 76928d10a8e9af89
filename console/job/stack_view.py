"""Stacks of a job's ranks for the console: fetch (a ``stacks`` command, or an existing capture
by its id), group, and put into lines or JSON. Shared by ``elastic-console stacks`` and the
app's stacks screen; no Textual here.

Every string in the result came from workers and agents: the lines are plain text for
``terminal_line`` / ``Text`` (never markup), and the app and the CLI escape them on output.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic_agent.coordination.transport.connection import make_async_client
from elastic_agent.coordination.transport.endpoints import Endpoint
from elastic_agent.coordination.wire.round_records import RoundInfo
from elastic_agent.coordination.wire.stack_dumps import (
    RankStack,
    StackGroup,
    ThreadStack,
    format_ranks,
    group_line,
    group_stacks,
)
from elastic_agent.coordination.wire.stack_replies import (
    BLOCK_MS,
    current_round,
    read_round,
    read_stack_replies,
    request_stacks,
)

from .client import issuer

#: How long a request waits for every rank by default (the agents answer within 2 s).
DEFAULT_TIMEOUT = 10.0
#: A console process asks a job (or one rank) for stacks at most once every this many
#: seconds: within it, asking again shows that last request's capture without writing
#: (keys held down, a browser tab refreshing). The agents limit requests too (docs/SECURITY.md).
ASK_INTERVAL_S = 5.0
#: (job, rank, kind) -> (monotonic time, request id) of this process's last request.
#: Bounded: a console follows a handful of jobs.
_asked: dict[tuple[str, int | None, str], tuple[float, str]] = {}
_ASKED_LIMIT = 256


def asked_lately(job_id: str, rank: int | None, kind: str, now: float) -> str | None:
    """The id of this process's ``kind`` request (stacks, collectives) for ``job_id`` and
    ``rank`` if it was sent less than :data:`ASK_INTERVAL_S` ago: show its answer again."""
    at, last = _asked.get((job_id, rank, kind), (-ASK_INTERVAL_S, ""))
    return last if last and now - at < ASK_INTERVAL_S else None


def note_asked(job_id: str, rank: int | None, kind: str, now: float, request_id: str) -> None:
    if len(_asked) >= _ASKED_LIMIT:
        _asked.clear()
    _asked[(job_id, rank, kind)] = (now, request_id)


@dataclass(frozen=True)
class StacksResult:
    request: str
    stacks: list[RankStack]
    groups: list[StackGroup]
    seconds: float

    @property
    def hosts(self) -> list[str]:
        return sorted({s.host for s in self.stacks if s.host})


def _client(endpoint: Endpoint) -> Any:
    # A reader: its socket timeout outlasts every XREAD BLOCK it sends.
    return make_async_client(endpoint, blocking_ms=BLOCK_MS, retries=1)


async def job_round(endpoint: Endpoint, job_id: str) -> RoundInfo | None:
    """The job's current round (which ranks exist, on which nodes), or None; raises
    ``ProtocolError`` for a round record that does not decode."""
    client = _client(endpoint)
    try:
        return await read_round(client, job_id)
    finally:
        await client.aclose()


async def fetch_stacks(endpoint: Endpoint, job_id: str, *, rank: int | None = None,
                       request_id: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                       on_reply: Callable[[int, int], None] | None = None) -> StacksResult:
    """Ask the job's agents for stacks (``rank``: one rank), or with ``request_id`` read the
    replies of an existing request or capture (a stall's, a stop's) without asking. Raises
    redis errors and OSError for the caller to word."""
    client = _client(endpoint)
    start = time.monotonic()
    if request_id is None:
        request_id = asked_lately(job_id, rank, "stacks", start)  # show that answer again
    try:
        if request_id is None:
            request_id, stacks = await request_stacks(client, job_id, issuer(), rank=rank,
                                                      timeout=timeout, on_reply=on_reply)
            note_asked(job_id, rank, "stacks", start, request_id)
        else:
            info = await current_round(client, job_id)
            stacks = await _read_capture(client, job_id, request_id, info, min(timeout, 3.0),
                                         on_reply)
    finally:
        await client.aclose()
    return StacksResult(request_id, stacks, group_stacks(stacks), time.monotonic() - start)


async def _read_capture(client: Any, job_id: str, request_id: str, info: Any, timeout: float,
                        on_reply: Callable[[int, int], None] | None) -> list[RankStack]:
    """An existing capture: whatever was published under its id (a capture covers the ranks
    its agents had alive, not necessarily the whole round)."""
    stacks = await read_stack_replies(client, job_id, request_id, None, timeout, info=info,
                                      on_reply=on_reply)
    answered = [s for s in stacks if s.pid or s.threads]
    return answered or stacks


def thread_lines(thread: ThreadStack, indent: str = "    ") -> list[str]:
    """A thread's header and its frames, innermost first: ``function  file:line``."""
    kind = "current thread" if thread.current else "thread"
    head = f"{kind} {thread.thread_id}" if thread.thread_id else kind
    lines = [f"{indent}{head}:"]
    if not thread.frames:
        lines.append(f"{indent}  (no Python frame)")
    lines += [f"{indent}  {f.function}  {f.where()}" for f in thread.frames]
    return lines


def group_header(group: StackGroup) -> str:
    hosts = ", ".join(group.hosts) if group.hosts else "?"
    return f"{group_line(group)}   (on {hosts})"


def result_lines(result: StacksResult, job_id: str) -> list[str]:
    """The whole answer as plain lines: a heading, then each group (smallest first) with its
    threads' frames."""
    n = len(result.stacks)
    lines = [f"stacks of job {job_id}: {n} rank{'' if n == 1 else 's'}, "
             f"{len(result.groups)} group{'' if len(result.groups) == 1 else 's'} "
             f"(request {result.request}, {result.seconds:.1f} s)"]
    for g in result.groups:
        lines += ["", group_header(g)]
        for t in g.threads:
            lines += thread_lines(t)
    return lines


def result_json(result: StacksResult, job_id: str) -> dict[str, Any]:
    return {
        "job": job_id, "request": result.request, "seconds": round(result.seconds, 3),
        "ranks": len(result.stacks),
        "groups": [{
            "ranks": list(g.ranks), "ranks_text": format_ranks(g.ranks), "hosts": list(g.hosts),
            "summary": g.summary, "error": g.error,
            "threads": [{"thread_id": t.thread_id, "current": t.current,
                         "frames": [{"file": f.file, "line": f.line, "function": f.function}
                                    for f in t.frames]} for t in g.threads],
        } for g in result.groups],
        "stacks": [{"rank": s.rank, "node": s.node, "host": s.host, "pid": s.pid,
                    "error": s.error} for s in result.stacks],
    }
