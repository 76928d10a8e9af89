"""Which ranks a job's collectives wait for, from every rank's flight recorder (issue 22).

Pure: no I/O, no torch. The input is one :class:`RankTrace` per rank (decoded by
``trace_records.decode_collective_reply``); :func:`analyse` names, per process group:

* where each rank is: the newest collective it entered in that group (sequence id, op, tensor
  sizes, finished or not), grouped by position so that 32,768 ranks at one place are one line;
* the ranks the others wait for: members whose newest collective in the group is older than
  the newest one some member is blocked in (the group's *frontier*);
* mismatches: ranks that entered the same sequence id of a group with a different op or
  different sizes (a collective that can never complete).

The job's ``suspects`` are the waited-for ranks that are not themselves blocked in any
collective (a rank hung in Python, one collective behind); when every waited-for rank is
blocked too (a rank inside another group's collective: the ranks wait for each other), the
ones the most ranks wait for. Members are known from each rank's own process-group registry
(``torch.distributed``'s), so a member that never entered a group's collective is seen too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .stack_dumps import format_ranks
from .trace_records import CollectiveEntry, CollectiveTrace

#: Positions (distinct places ranks are at) and mismatches a summary carries per group.
MAX_POSITIONS = 16
MAX_MISMATCHES = 16
#: Ranks a summary lists in full in one field (the rest are counted).
MAX_LISTED_RANKS = 4096


@dataclass(frozen=True)
class RankTrace:
    """One rank's decoded trace, with where it runs."""

    rank: int
    node: str
    host: str
    trace: CollectiveTrace


def _op(entry: CollectiveEntry) -> str:
    """``gloo:all_reduce`` -> ``all_reduce`` (the backend is the same on every rank)."""
    return entry.op.split(":", 1)[-1]


def _position(entry: CollectiveEntry | None) -> dict[str, Any]:
    if entry is None:
        return {"seq": 0, "op": "", "in": [], "out": [], "done": True}
    return {"seq": entry.seq, "op": _op(entry), "in": [list(s) for s in entry.in_sizes],
            "out": [list(s) for s in entry.out_sizes], "done": entry.done}


def _listed(ranks: Iterable[int]) -> list[int]:
    return sorted(ranks)[:MAX_LISTED_RANKS]


def analyse(traces: Sequence[RankTrace]) -> dict[str, Any]:
    """The analysis as one JSON-ready object: ``suspects`` (ascending), ``groups``,
    ``mismatches``, ``errors`` (ranks without a trace) and ``ranks`` (how many answered)."""
    ok = [t for t in traces if not t.trace.error]
    members: dict[str, set[int]] = {}
    newest: dict[str, dict[int, CollectiveEntry]] = {}
    at_seq: dict[tuple[str, int], dict[tuple[Any, ...], list[int]]] = {}
    blocked: set[int] = set()
    for t in ok:
        for name, ranks in t.trace.groups.items():
            members.setdefault(name, set()).update(ranks)
        for e in t.trace.entries:
            members.setdefault(e.pg, set()).add(t.rank)
            mine = newest.setdefault(e.pg, {})
            if t.rank not in mine or e.seq >= mine[t.rank].seq:
                mine[t.rank] = e
            key = (_op(e), e.in_sizes, e.out_sizes)
            at_seq.setdefault((e.pg, e.seq), {}).setdefault(key, []).append(t.rank)
        blocked.update(t.rank for e in t.trace.entries if not e.done)
    answered = {t.rank for t in ok}
    waiters: dict[int, set[int]] = {}
    groups = []
    for name in sorted(members, key=lambda n: (len(n), n)):
        ranks = members[name] & answered
        places = newest.get(name, {})
        frontier = max((places[r].seq for r in ranks if r in places), default=0)
        waiting = {r for r in ranks if r in places and places[r].seq == frontier
                   and not places[r].done}
        waited = {r for r in ranks if (places[r].seq if r in places else 0) < frontier} \
            if waiting else set()
        for r in waited:
            waiters.setdefault(r, set()).update(waiting)
        by_place: dict[tuple[Any, ...], list[int]] = {}
        for r in sorted(ranks):
            e = places.get(r)
            key = (-1, "", (), (), True) if e is None else (e.seq, _op(e), e.in_sizes,
                                                             e.out_sizes, e.done)
            by_place.setdefault(key, []).append(r)
        positions = sorted(by_place.items(), key=lambda kv: (-len(kv[1]), kv[0][0]))
        groups.append({
            "pg": name, "members": format_ranks(members[name]), "size": len(members[name]),
            "frontier": frontier, "waiting": _listed(waiting), "waited_for": _listed(waited),
            "positions": [{**_position(places.get(rs[0])), "ranks": format_ranks(rs),
                           "count": len(rs)} for _, rs in positions[:MAX_POSITIONS]],
        })
    mismatches = []
    for (name, seq), variants in sorted(at_seq.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if len(variants) > 1 and len(mismatches) < MAX_MISMATCHES:
            mismatches.append({"pg": name, "seq": seq, "variants": [
                {"op": op, "in": [list(s) for s in ins], "out": [list(s) for s in outs],
                 "ranks": format_ranks(rs)}
                for (op, ins, outs), rs in sorted(variants.items(), key=lambda kv: -len(kv[1]))]})
    roots = {r for r in waiters if r not in blocked}
    if roots:
        suspects = roots
    else:
        most = max((len(w) for w in waiters.values()), default=0)
        suspects = {r for r, w in waiters.items() if len(w) == most}
    return {
        "ranks": len(traces), "answered": len(ok), "suspects": _listed(suspects),
        "groups": groups, "mismatches": mismatches,
        "errors": [{"rank": t.rank, "host": t.host, "error": t.trace.error}
                   for t in sorted(traces, key=lambda t: t.rank) if t.trace.error][:64],
    }


#: What an event carries of an analysis (events are cut whole above 1 MiB).
EVENT_GROUPS = 16
EVENT_RANKS = 256


def event_record(analysis: dict[str, Any], request: str) -> dict[str, Any]:
    """An analysis bounded for an event's data (``stalled``, ``workers_stopped``): the
    suspects, then at most :data:`EVENT_GROUPS` groups, those with waited-for ranks first,
    each with at most :data:`EVENT_RANKS` ranks per list."""
    groups = sorted(analysis.get("groups") or [], key=lambda g: not g.get("waited_for"))
    return {
        "request": request, "suspects": analysis.get("suspects", [])[:EVENT_RANKS],
        "answered": analysis.get("answered", 0),
        "groups": [{**g, "waiting": g["waiting"][:EVENT_RANKS],
                    "waited_for": g["waited_for"][:EVENT_RANKS]}
                   for g in groups[:EVENT_GROUPS]],
        "mismatches": (analysis.get("mismatches") or [])[:EVENT_GROUPS],
    }


def _ranks(value: Any) -> str:
    """``rank 3`` / ``ranks 0-2,5`` of a rank list or of a position (``ranks``, ``count``)."""
    if isinstance(value, dict):
        return f"rank{'' if value['count'] == 1 else 's'} {value['ranks']}"
    return f"rank{'' if len(value) == 1 else 's'} {format_ranks(value)}"


def summary_lines(analysis: dict[str, Any], hosts: dict[int, str] | None = None) -> list[str]:
    """The analysis as plain lines for a terminal (the caller escapes them)."""
    hosts = hosts or {}
    lines = []
    suspects = analysis.get("suspects") or []
    if suspects:
        named = ", ".join(f"{r}" + (f" ({hosts[r]})" if hosts.get(r) else "")
                          for r in suspects[:32])
        lines.append(f"suspects (the ranks the others wait for): {named}")
    else:
        lines.append("no rank is waited for: no collective is blocked on a missing rank")
    for g in analysis.get("groups") or []:
        head = f"process group {g['pg']} ({g['size']} ranks {g['members']})"
        if g.get("waited_for"):
            verb = "waits" if len(g["waiting"]) == 1 else "wait"
            head += (f": {_ranks(g['waiting'])} {verb} in collective #{g['frontier']}"
                     f" for {_ranks(g['waited_for'])}")
        lines.append(head)
        for p in g.get("positions") or []:
            if p["seq"] <= 0:
                lines.append(f"  {_ranks(p)}: no collective in this group yet")
                continue
            state = "finished" if p["done"] else "inside, not finished"
            lines.append(f"  {_ranks(p)}: #{p['seq']} {p['op']} in={p['in']} "
                         f"out={p['out']} ({state})")
    for m in analysis.get("mismatches") or []:
        parts = "; ".join(f"{v['op']} in={v['in']} on ranks {v['ranks']}" for v in m["variants"])
        lines.append(f"mismatch in process group {m['pg']} at #{m['seq']}: {parts}")
    for e in analysis.get("errors") or []:
        lines.append(f"rank {e['rank']}: {e['error']}")
    return lines
