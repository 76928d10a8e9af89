"""Collectives of a job's ranks for the console (issue 22): fetch every rank's flight
recorder trace (a ``collectives`` command, or an existing capture by its id), analyse
(``coordination.collectives``), and put the result into lines or JSON. Shared by
``elastic-console collectives`` and the app's stacks screen; no Textual here.

Every string in the result came from workers and agents: lines are plain text, escaped by the
CLI and the app on output, never markup.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic_agent.coordination.transport.endpoints import Endpoint
from elastic_agent.coordination.wire.collective_replies import read_collective_replies, request_collectives
from elastic_agent.coordination.wire.collectives import RankTrace, analyse, summary_lines
from elastic_agent.coordination.wire.stack_replies import current_round

from .client import issuer
from .stack_view import DEFAULT_TIMEOUT, _client, asked_lately, note_asked


@dataclass(frozen=True)
class CollectivesResult:
    request: str
    traces: list[RankTrace]
    analysis: dict[str, Any]
    seconds: float

    @property
    def hosts(self) -> dict[int, str]:
        return {t.rank: t.host for t in self.traces if t.host}


async def fetch_collectives(endpoint: Endpoint, job_id: str, *, rank: int | None = None,
                            request_id: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                            on_reply: Callable[[int, int], None] | None = None,
                            ) -> CollectivesResult:
    """Ask the job's agents for their ranks' traces (``rank``: one rank), or with
    ``request_id`` read an existing request or capture (a stall's, a stop's). Raises redis
    errors and OSError for the caller to word. Asked again within ``stack_view``'s
    ASK_INTERVAL_S, it reads the last request's answer instead of asking."""
    client = _client(endpoint)
    start = time.monotonic()
    if request_id is None:
        request_id = asked_lately(job_id, rank, "collectives", start)
    try:
        if request_id is None:
            request_id, traces = await request_collectives(
                client, job_id, issuer(), rank=rank, timeout=timeout, on_reply=on_reply)
            note_asked(job_id, rank, "collectives", start, request_id)
        else:
            info = await current_round(client, job_id)
            traces = await read_collective_replies(client, job_id, request_id, None,
                                                   min(timeout, 3.0), info=info,
                                                   on_reply=on_reply)
    finally:
        await client.aclose()
    return CollectivesResult(request_id, traces, analyse(traces), time.monotonic() - start)


def result_lines(result: CollectivesResult, job_id: str) -> list[str]:
    """The answer as plain lines: a heading, the suspects, then each process group."""
    n = len(result.traces)
    head = (f"collectives of job {job_id}: {n} rank{'' if n == 1 else 's'}, "
            f"{result.analysis['answered']} with a trace (request {result.request}, "
            f"{result.seconds:.1f} s)")
    return [head, *summary_lines(result.analysis, result.hosts)]


def result_json(result: CollectivesResult, job_id: str) -> dict[str, Any]:
    """One object; ``suspects`` lists the ranks the others wait for, ascending."""
    return {"job": job_id, "request": result.request, "seconds": round(result.seconds, 3),
            **result.analysis,
            "hosts": {str(r): h for r, h in sorted(result.hosts.items())}}
