"""`ls`, `status` and `events`: one read of the server's jobs, of a job's folded view or of
its event stream, printed as a table, as text or as JSON (``events --follow`` then prints new
events as they come). Nothing here writes to Redis.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from elastic_agent.coordination.transport.endpoints import Endpoint
from elastic_agent.coordination.wire.event_records import Event
from elastic_agent.coordination.wire.text import sanitize, terminal_line

from ..job.formatting import fmt_age, fmt_bytes
from ..job.metrics import JobMetrics
from ..job.model import RankState
from ..job.state import JobView
from .common import EXIT_OK, PROG, _clock, _follow, _job, _load_view, _open, _out, _q, _table, _write
from .metrics import value_out

__all__ = ["events", "ls", "status", "status_object"]


# -- ls -----------------------------------------------------------------------------------

async def ls(ep: Endpoint, args: argparse.Namespace) -> int:
    client = await _open(ep, None)
    try:
        jobs = await client.list_jobs()
    finally:
        await client.close()
    if client.index_note:
        print(terminal_line(f"{PROG}: note: {client.index_note}", False), file=sys.stderr)
    if args.json:
        _out(json.dumps([j.to_json() for j in jobs]))
        return EXIT_OK
    if not jobs:
        print(f"no jobs on {ep.display}", file=sys.stderr)
        return EXIT_OK
    _table(["JOB", "STATE", "NODES", "WORLD", "RESTARTS", "AGE", "EXPIRES"],
           ([j.job_id, j.state if j.lost_for_s is None else f"lost {fmt_age(j.lost_for_s)} ago",
             str(j.nodes), _q(j.world_size),
             f"{j.restarts_used}/{_q(j.max_restarts)}", fmt_age(j.age_s),
             "-" if j.expires_in_s is None else f"in {fmt_age(j.expires_in_s)}"]
            for j in jobs))
    return EXIT_OK


# -- status -------------------------------------------------------------------------------

def _rank_json(r: RankState, m: JobMetrics) -> dict[str, Any]:
    latest = m.latest.get(r.rank)
    return {"rank": r.rank, "host": r.host, "node": r.node, "local_rank": r.local_rank,
            "pid": r.pid, "state": r.state, "restarts": r.restarts, "last_exit": r.last_exit,
            "cpu": r.cpu, "rss": r.rss, "threads": r.threads,
            # Training (console/job/metrics.py): None until its output showed any.
            "step": latest.step if latest else None,
            "rate": latest.rate if latest else None,
            "total": latest.total if latest else None,
            "metrics": {k: value_out(v) for k, v in m.values_of(r.rank).items()}}


def status_object(view: JobView, job: str, redis_display: str) -> dict[str, Any]:
    """What ``status --json`` prints of a job's view (the TTL aside): also what bench/chaos.py
    compares an attached console's view with, so both always show the same fields."""
    return {
        "job": job, "redis": redis_display, "state": view.state, "round": view.round,
        "world_size": view.world_size, "min_nodes": view.min_nodes,
        "max_nodes": view.max_nodes, "restarts_used": view.restarts_used,
        "max_restarts": view.max_restarts, "created_ms": view.created_ms,
        "last_heartbeat_ms": view.lost_since_ms,
        "nodes": {n: {"host": i.host, "status": i.status, "group_rank": i.group_rank}
                  for n, i in view.nodes.items()},
        "ranks": [_rank_json(view.ranks[r], view.metrics) for r in sorted(view.ranks)],
        "root_cause": view.root_cause,
        "stragglers": view.stragglers,
        "patterns": list(view.patterns.values()),  # the restart patterns (issue 22)
        "nan": view.first_nan,  # the first rank whose metric became NaN or infinite
    }


async def status(ep: Endpoint, args: argparse.Namespace) -> int:
    job = _job(args)
    client = await _open(ep, job)
    try:
        view = await _load_view(client, resources=True)
    finally:
        await client.close()
    ranks = [view.ranks[r] for r in sorted(view.ranks)]
    # A running job's keys carry a lease that its agents renew: only an ended (or lost) job
    # really expires.
    expires = (view.expires_in_ms / 1000 if view.expires_in_ms is not None and (
        view.is_final or view.state == "lost") else None)
    if args.json:
        _out(json.dumps({**status_object(view, job, ep.display), "expires_in_s": expires},
                        default=str))
        return EXIT_OK
    rnd = f" (round {view.round})" if view.round is not None else ""
    if view.lost_since_ms is not None and not view.is_final:
        quiet = (view.liveness_ms - view.lost_since_ms) / 1000
        rnd += (f": no agent has sent a heartbeat for {fmt_age(max(0.0, quiet))}"
                if view.lost_since_ms else ": no agent heartbeats")
    _out(f"job       {job}: {view.state}{rnd}")
    _out(f"redis     {ep.display}")
    active = view.active_nodes()
    bounds = f"{_q(view.min_nodes)}..{_q(view.max_nodes)}"
    _out(f"nodes     {len(active)} active (wanted {bounds})")
    for node_id, info in sorted(view.nodes.items(), key=lambda kv: (kv[1].group_rank is None,
                                                                    kv[1].group_rank or 0)):
        gr = f", group rank {info.group_rank}" if info.group_rank is not None else ""
        _out(f"          {info.host} ({node_id}): {info.status}{gr}")
    _out(f"world     {_q(view.world_size)} ranks")
    _out(f"restarts  {view.restarts_used}/{_q(view.max_restarts)} used")
    if expires is not None:
        _out(f"expires   in {fmt_age(expires)}: then Redis drops the job's records "
             f"({PROG} rm removes them now)")
    if view.root_cause:
        c = view.root_cause
        _out(f"root cause: rank {_q(c.get('rank'))} on {c.get('host', '?')}: "
             f"{c.get('message') or c.get('exit_code')}")
        _write("    " + line for line in str(c.get("traceback") or "").split("\n") if line)
    for pattern in view.patterns.values():
        _out(f"pattern   {pattern}")
    if view.first_nan:
        n = view.first_nan
        _out(f"nan       rank {n['rank']} on {n['host']}: {n['metric']} became {n['value']} "
             f"at step {_q(n['step'])} (the first)")
    if view.stragglers:
        _out("stragglers " + ", ".join(f"rank {x['rank']} on {x['host']} ({x['ratio']:g}x "
                                       "slower)" for x in view.stragglers[:16]))
    if view.skipped:
        _out(f"skipped   {view.skipped} record{'' if view.skipped == 1 else 's'} that could not "
             "be read (malformed, foreign or of an unknown version)")
    _out()
    if not ranks:
        _out("no workers have started yet")
        return EXIT_OK
    steps = view.metrics.any_step  # the training columns once any rank printed a step
    latest = view.metrics.latest
    _table(["RANK", "HOST", "LOCAL", "PID", "STATE", "RESTARTS", "LAST EXIT", "CPU%", "RSS",
            *(["STEP", "STEPS/S"] if steps else [])],
           ([str(r.rank), r.host, _q(r.local_rank), _q(r.pid), r.state, str(r.restarts),
             _q(r.last_exit), "-" if r.cpu is None else f"{r.cpu:.1f}", fmt_bytes(r.rss),
             *(_step_cells(latest.get(r.rank)) if steps else [])]
            for r in ranks))
    return EXIT_OK


def _step_cells(latest: Any) -> list[str]:
    if latest is None:
        return ["-", "-"]
    return [_q(latest.step), "-" if latest.rate is None else f"{latest.rate:.2f}"]


# -- events -------------------------------------------------------------------------------

def _value(v: Any, limit: int = 300) -> str:
    if isinstance(v, str) and v and not any(c in v for c in ' ="\\') and len(v) <= limit:
        return sanitize(v)
    text = json.dumps(v, ensure_ascii=False, separators=(",", ":"), default=str)
    if len(text) > limit:
        text = text[:limit] + f"…(+{len(text) - limit} chars)"
    return sanitize(text)


def _event_line(ev: Event) -> str:
    pairs = " ".join(f"{sanitize(str(k))}={_value(v)}" for k, v in ev.data.items())
    return f"{_clock(ev.server_ms)} {sanitize(ev.node)} {ev.type} {pairs}".rstrip()


def _event_json(ev: Event) -> str:
    # ensure_ascii (the default) escapes every control character: safe on any terminal.
    return json.dumps({"id": ev.id, "time_ms": ev.server_ms, "type": ev.type, "node": ev.node,
                       "data": ev.data}, default=str)


async def events(ep: Endpoint, args: argparse.Namespace) -> int:
    job = _job(args)
    fmt = _event_json if args.json else _event_line
    client = await _open(ep, job)
    try:
        events, _ = await client.history(max_events=10_000, max_log_entries_per_stream=0)
        _write(fmt(e) for e in events)
        sys.stdout.flush()
        if args.follow:
            await _follow(client, ep, logs=False, render=lambda rec: [fmt(rec)]
                          if isinstance(rec, Event) else [])
    finally:
        await client.close()
    return EXIT_OK
