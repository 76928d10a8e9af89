"""The fold of a job's events into a :class:`~elastic_console.job.state.JobView`: one
handler per event type, by the rules below. :class:`EventFold` is a part of JobView (its
base class): its methods run on the view and change the fields ``JobView.__init__`` made.
Nothing an event holds can make it raise: an unknown type, a missing or mistyped field is
ignored (counted in ``ignored``).

Derivation rules (a final job state is sticky: later events never reopen the job)

==========================  ================================================================
event                       effect
==========================  ================================================================
``node_joined``             node -> ``joined`` (host recorded)
``node_left``               node -> ``left``
``node_lost``               ``lost_node`` -> ``lost``
``rendezvous_complete``     ``round``, ``world_size``; every node of the round -> ``joined``
                            with its ``group_rank``; other nodes lose their group rank; ranks
                            at or beyond the new world size are dropped (they no longer exist)
``workers_started``         each listed rank -> ``running`` with node, host, local rank and
                            pid; its start count goes up (``restarts`` = starts - 1); job ->
                            ``running``; ``restarts_used`` = ``restart_count``
``worker_exited``           exit code 0 -> rank ``exited``; nonzero or a signal while the
                            agent was not ``stopping`` it -> ``failed`` (timeline entry with
                            the traceback); while ``stopping`` -> ``stopped``. ``last_exit`` =
                            the signal name, else the exit code. An exit whose pid is not the
                            rank's current pid is stale and changes no state
``workers_stopped``         each listed rank -> ``stopped`` unless it ``failed`` or ``exited``
                            (the more precise outcome stays visible)
``group_failed``            ``root_cause`` = its root cause (timeline detail: traceback)
``restarting``              job -> ``restarting``; every rank -> ``restarting``;
                            ``restarts_used``/``max_restarts`` from the event
``job_succeeded``           job -> ``succeeded``
``job_failed``              job -> ``failed``; ``root_cause`` from the event if it has one
``job_stopped``             job -> ``stopped``
``command_ack``             recorded for :meth:`JobView.acks_for` (one per node per command)
``logs_dropped``            ``lines_dropped`` += count
``worker_timer_expired``    timeline entry (rank, scope, what the watchdog did; detail: deadline)
``stalled``                 timeline entry (``ref``: the stacks capture); the odd ranks ->
                            ``stalled``, the other ranks captured -> ``waiting`` (for them),
                            each until its next log line
``straggler``               timeline entry; the named ranks -> ``slow`` (running, slower than
                            the others), the ranks it no longer names -> ``running``;
                            ``stragglers`` = its ranks (rank, host, ratio), until a restart
``nan``                     timeline entry (rank, step, metric, value, host); ``first_nan`` =
                            the earliest one (server time): the first rank whose metric became
                            NaN or infinite
==========================  ================================================================

Duplicates: a retried XADD can write an entry twice (Redis 7 has no idempotent XADD). An
event is a duplicate when its ``(node, seq)`` was seen among the last 16k events (any order);
an event without ``seq`` (an older agent, a hand-written entry) when the same node wrote the
same type with the same data among the last few hundred events (events carry pids,
timestamps or counters, so a genuine repeat is never identical; ``logs_dropped`` is exempt).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from typing import Any

from elastic_agent.coordination.wire.event_records import Event, EventType
from elastic_agent.coordination.wire.protocol import MAX_NAME_CHARS, MAX_RANK, rank_list, record_list
from elastic_agent.coordination.wire.text import sanitize

from .dedupe import format_ranks
from .fields import _clip, _detail, _float, _host, _int, _q
from .model import (
    EXITED,
    FAILED,
    FINAL_STATES,
    JOINED,
    LEFT,
    LOST,
    MAX_NOTE_CHARS,
    MAX_VIEW_NODES,
    MAX_VIEW_RANKS,
    RESTARTING,
    RUNNING,
    SLOW,
    STALLED,
    STOPPED,
    SUCCEEDED,
    WAITS,
    NodeInfo,
    TimelineEntry,
)
from .restarts import _cause_detail, _cause_text, _traceback, restart_took

__all__ = ["EventFold"]

log = logging.getLogger(__name__)

_EVENT_DEDUPE_WINDOW = 512  # events without seq: content fingerprints remembered
_EVENT_SEQ_WINDOW = 16_384  # events with seq: (node, seq) pairs remembered
_ACK_COMMANDS_LIMIT = 1000


class EventFold:
    """How events change a :class:`~elastic_console.job.state.JobView` (see the module doc).

    A base class of JobView, never used alone: it keeps no fields of its own, its handlers read
    and write the view's (made by ``JobView.__init__``) and use its ``_new_rank`` and
    ``_host_of``, as the log fold does.
    """

    def apply_events(self, events: Iterable[Event]) -> None:
        """:meth:`apply_event` for each event, in order."""
        for ev in events:
            self.apply_event(ev)

    def apply_event(self, ev: Event) -> None:
        """Fold one event (see the rules in the module docstring). Never raises."""
        self._events_applied += 1
        try:
            if not isinstance(ev, Event) or not isinstance(ev.data, dict):
                self.ignored += 1
                return
            handler = self._HANDLERS.get(ev.type)
            if handler is None:
                self.ignored += 1
                return
            if self._is_repeat(ev):
                return
            self.last_event_ms = max(self.last_event_ms, ev.server_ms)
            handler(self, ev, sanitize(ev.node), ev.data)
        except Exception as exc:  # bad data must never take the console down
            log.debug("ignored malformed %s event %s: %r", getattr(ev, "type", "?"),
                      getattr(ev, "id", "?"), exc)
            self.ignored += 1
        self.version += 1

    # -- event handlers --------------------------------------------------------------------
    def _is_repeat(self, ev: Event) -> bool:
        """True for the second copy of an event a retried XADD wrote twice (see module doc)."""
        seq = getattr(ev, "seq", 0)
        if isinstance(seq, int) and seq > 0:
            key: tuple[str, ...] = (ev.node, str(seq))
            seen, order, window = self._seen_seqs, self._seen_seq_order, _EVENT_SEQ_WINDOW
        elif ev.type == EventType.LOGS_DROPPED:
            return False  # two overflow episodes of the same size are both real
        else:
            # A digest, not the text: 512 events of 1 MiB each would otherwise be kept whole.
            data = json.dumps(ev.data, sort_keys=True, default=str).encode("utf-8", "replace")
            key = (ev.type, ev.node, hashlib.blake2b(data, digest_size=16).hexdigest())
            seen, order, window = self._recent_set, self._recent_events, _EVENT_DEDUPE_WINDOW
        if key in seen:
            return True
        seen.add(key)
        order.append(key)
        if len(order) > window:
            seen.discard(order.popleft())
        return False

    def _note(self, ev: Event, kind: str, text: str, detail: Any = "", ref: str = "") -> None:
        self.timeline.append(TimelineEntry(ev.server_ms, kind,
                                           sanitize(_clip(text, MAX_NOTE_CHARS)),
                                           _detail(detail), sanitize(ref[:MAX_NAME_CHARS])))
        self.timeline_total += 1

    def _pattern(self, ev: Event, kind: str, text: str) -> None:
        self.patterns[kind] = sanitize(_clip(text, MAX_NOTE_CHARS))
        self._note(ev, "pattern", text)

    def _on_restart_storm(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        text = (f"restart storm: {_q(_int(d.get('restarts'), None))} restarts within "
                f"{_q(_float(d.get('minutes'), None))} min")
        if d.get("policy") == "stop":
            text += " (--on-restart-storm stop: the job fails)"
        self._pattern(ev, EventType.RESTART_STORM, text)

    def _on_suspect_node(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        suspect = d.get("suspect_node")
        if not isinstance(suspect, str) or not suspect:
            self.ignored += 1
            return
        suspect = sanitize(suspect[:MAX_NAME_CHARS])
        rounds = [r for r in record_list(d.get("rounds"), 64) if type(r) is int]
        text = (f"suspect node {_host(d.get('host'), suspect)} ({suspect}): in every failure "
                f"of the last {len(rounds)} rounds")
        if d.get("excluded") is True:
            text += "; left out of the job"
        self._pattern(ev, EventType.SUSPECT_NODE, text)

    def _on_no_progress(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        rounds = [r for r in record_list(d.get("rounds"), 64) if type(r) is int]
        self._pattern(ev, EventType.NO_PROGRESS,
                      f"no progress: the last {len(rounds)} rounds ended before any")

    def _on_node_excluded(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        info = self._node(node, d.get("host"))
        info.status = LEFT
        self._note(ev, "pattern", f"node {info.host} left the job as a suspect ({node})",
                   str(d.get("reason", "")))

    def _node(self, node_id: str, host: Any = None) -> NodeInfo:
        info = self.nodes.get(node_id)
        if info is None:
            info = NodeInfo(host=_host(host, node_id))
            if len(self.nodes) < MAX_VIEW_NODES:
                self.nodes[node_id] = info
            else:
                self.ignored += 1  # past the bound: a record nobody keeps
        elif host:
            info.host = _host(host, node_id)
        return info

    def _on_node_joined(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        info = self._node(node, d.get("host"))
        info.status = JOINED
        info.nproc = _int(d.get("nproc"), info.nproc) or 0
        self._note(ev, "node", f"node {info.host} joined ({node})")

    def _on_node_left(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        info = self._node(node, d.get("host"))
        info.status = LEFT
        reason = d.get("reason")
        self._note(ev, "node", f"node {info.host} left" + (f": {reason}" if reason else ""))

    def _on_node_lost(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        lost = d.get("lost_node")
        if not isinstance(lost, str) or not lost:
            self.ignored += 1
            return
        lost = sanitize(lost[:MAX_NAME_CHARS])
        self.patterns.clear()  # a round end: its claimer says which patterns still hold
        info = self._node(lost, d.get("host"))
        info.status = LOST
        self._note(ev, "node", f"node {info.host} lost: its heartbeats stopped ({lost})")

    def _on_rendezvous_complete(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        self.round = _int(d.get("round"), self.round)
        world = _int(d.get("world_size"), None)
        members: list[str] = []
        lines = []
        for n in record_list(d.get("nodes"), MAX_VIEW_NODES):
            if not isinstance(n, dict) or not isinstance(n.get("node"), str):
                continue
            member = sanitize(n["node"][:MAX_NAME_CHARS])
            info = self._node(member, n.get("host"))
            info.status = JOINED
            info.group_rank = _int(n.get("group_rank"), None)
            info.nproc = _int(n.get("nproc"), info.nproc) or 0
            members.append(member)
            lines.append(f"group rank {info.group_rank}: {info.host} ({member})")
        for node_id, info in self.nodes.items():
            if node_id not in members:
                info.group_rank = None
        self._round_nodes = members
        if world is not None and 0 <= world <= MAX_RANK:
            self.world_size = world
            for rank in [r for r in self.ranks if r >= world]:
                del self.ranks[rank]
        again = " (announced again: Redis had lost the job)" if d.get("restored") is True else ""
        self._note(ev, "rendezvous", f"round {self.round} complete: {len(members)} node"
                   f"{'' if len(members) == 1 else 's'}, world size {self.world_size}{again}",
                   "\n".join(lines))

    def _on_workers_started(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        ranks = record_list(d.get("ranks"))  # one node's workers: past the bound, ignored
        local = record_list(d.get("local_ranks"))
        pids = record_list(d.get("pids"))
        host = _host(d["host"], node) if d.get("host") else self._host_of(node)
        self._node(node, d.get("host"))
        refused = False
        for i, r in enumerate(ranks):
            rank = _int(r, None)
            if rank is None:
                continue
            rs = self.ranks.get(rank)
            if rs is None:
                rs = self._new_rank(rank)
                if rs is None:  # outside the world, or past the bound
                    refused = True
                    continue
            pid = _int(pids[i], None) if i < len(pids) else None
            # The same workers announced again after Redis lost the job: not a new start.
            again = d.get("restored") is True and rs.state == RUNNING and rs.pid == pid
            rs.node, rs.host, rs.state = node, host, RUNNING
            rs.local_rank = _int(local[i], None) if i < len(local) else None
            rs.pid = pid
            if not again:
                rs.starts += 1
                rs.restarts = rs.starts - 1
                rs.ended_ms = 0
        raw = d.get("ranks")
        if refused or (type(raw) is list and len(raw) > len(ranks)):
            self.ignored += 1  # one count for the event, however many ranks it named
        used = _int(d.get("restart_count"), None)
        if used is not None:
            self.restarts_used = used
        if not self.is_final:
            self.state = RUNNING
        took = restart_took(d.get("restart"))
        if took is not None:
            self._note(ev, "restarted", f"workers on {host} running again {took[0]}", took[1])

    def _on_worker_exited(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        rank = _int(d.get("rank"), None)
        if rank is None:
            self.ignored += 1
            return
        code = d.get("exit_code")
        sig = d.get("signal")
        failed = bool(sig) or (code not in (0, None))
        rs = self.ranks.get(rank)
        pid = _int(d.get("pid"), None)
        stale = rs is not None and rs.pid is not None and pid is not None and pid != rs.pid
        if rs is None:
            rs = self._new_rank(rank)
            if rs is not None:
                rs.node, rs.pid, rs.host = node, pid, self._host_of(node)
        if rs is not None and not stale:
            rs.last_exit = sanitize(str(sig)) if sig else _int(code, None)
            rs.ended_ms = ev.server_ms  # its QUIET stops here
            if d.get("stopping"):
                rs.state = STOPPED
            else:
                rs.state = FAILED if failed else EXITED
        if failed and not d.get("stopping"):
            host = sanitize(str(d.get("host") or self._host_of(node)))
            what = d.get("message") or (f"signal {sig}" if sig else f"exit code {code}")
            self._note(ev, "failure", f"rank {rank} failed on {host}: {what}",
                       _traceback(d.get("error_file")) or what)

    def _on_worker_timer_expired(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        rank = _int(d.get("rank"), None)
        scope = d.get("scope")
        if rank is None or not isinstance(scope, str):
            self.ignored += 1
            return
        host = d.get("host") or self._host_of(node)
        did = f"killed with {d.get('signal')}" if d.get("killed") is True else "not killed"
        deadline = _float(d.get("deadline"), None)
        self._note(ev, "watchdog", f"rank {rank} on {host}: timer {scope[:200]!r} expired; {did}",
                   f"scope: {scope}\ndeadline: {_q(deadline)} (the worker's time.time())\n"
                   f"pid: {_q(_int(d.get('pid'), None))}")

    def _on_stalled(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        groups = [g for g in record_list(d.get("groups"), 50) if isinstance(g, dict)]
        odd = set(rank_list(d.get("odd_ranks")))
        captured = {r for g in groups for r in rank_list(g.get("ranks"))}
        self._stalled_ms = max(self._stalled_ms, ev.server_ms)
        self.patterns.clear()
        for rank in captured | odd:
            rs = self.ranks.get(rank)
            if rs is not None and rs.state in (RUNNING, STALLED, WAITS):
                rs.state = STALLED if rank in odd or not odd else WAITS
        idle = _float(d.get("idle_s"), None)
        text = f"job stalled: no rank made progress for {_q(idle)} s; "
        if odd:
            hosts = [_host(h, "?") for h in record_list(d.get("odd_hosts"), 4)]
            text += f"odd rank{'s' if len(odd) > 1 else ''} {format_ranks(odd)}"
            text += f" on {', '.join(hosts)}" if hosts else ""
            first = next((g for g in groups if set(rank_list(g.get("ranks"))) <= odd), None)
            if first and first.get("summary"):
                text += f" ({str(first['summary'])[:200]})"
        else:
            text += f"no rank stands out ({len(groups)} group{'' if len(groups) == 1 else 's'}"
            text += " of stacks)"
        traced = d.get("collectives")  # issue 22: every rank's flight recorder, analysed
        suspects = rank_list(traced.get("suspects")) if isinstance(traced, dict) else []
        if suspects:
            text += (f"; collectives wait for rank{'s' if len(suspects) > 1 else ''} "
                     f"{format_ranks(suspects)}")
        policy = d.get("policy")
        if policy in ("restart", "stop"):
            text += f"; --on-stall {policy}"
        lines = []
        for g in groups[:20]:
            ranks = rank_list(g.get("ranks"))
            hosts = ", ".join(_host(h, "?") for h in record_list(g.get("hosts"), 4))
            lines.append(f"{len(ranks)} rank{'' if len(ranks) == 1 else 's'} "
                         f"[{format_ranks(ranks)}] on {hosts}: {g.get('summary', '?')}")
            for f in record_list(g.get("frames"), 12):
                if isinstance(f, list) and len(f) == 3:
                    lines.append(f'    File "{f[0]}", line {f[1]}, in {f[2]}')
        request = d.get("request")
        self._note(ev, "stalled", text, "\n".join(lines),
                   request if isinstance(request, str) else "")

    def _on_straggler(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        named = []
        for item in record_list(d.get("ranks"), 64):
            if not isinstance(item, dict):
                continue
            rank = _int(item.get("rank"), None)
            ratio = _float(item.get("ratio"), None)
            if rank is None or not 0 <= rank < MAX_VIEW_RANKS or ratio is None:
                continue
            host = _host(item.get("host"), str(item.get("node") or "?"))
            named.append({"rank": rank, "host": host, "ratio": round(ratio, 2)})
        named.sort(key=lambda x: x["rank"])
        ranks = {x["rank"] for x in named}
        for rank, rs in self.ranks.items():
            if rs.state == SLOW and rank not in ranks:
                rs.state = RUNNING
            elif rank in ranks and rs.state == RUNNING:
                rs.state = SLOW
        self.stragglers = named
        if not named:
            self._note(ev, "straggler", "no straggler any more")
            return
        window = _float(d.get("window_s"), None)
        text = "straggler" + ("s" if len(named) > 1 else "") + ": " + ", ".join(
            f"rank {x['rank']} on {x['host']} ({x['ratio']:g}x the median compute time)"
            for x in named[:8])
        self._note(ev, "straggler", text,
                   f"each rank's share of time outside collectives, against the job's median, "
                   f"over windows of {_q(window)} s (torch's flight recorder, sampled)")

    def _on_nan(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        rank, step = _int(d.get("rank"), None), _int(d.get("step"), None)
        metric, value = d.get("metric"), d.get("value")
        if rank is None or not isinstance(metric, str) or not metric:
            self.ignored += 1
            return
        metric = sanitize(metric[:MAX_NAME_CHARS])
        value = value if value in ("nan", "inf", "-inf") else "nan"
        host = _host(d.get("host"), node)
        attempt = _int(d.get("attempt"), None)
        first = self.first_nan
        if first is None or ev.server_ms < first["server_ms"]:
            self.first_nan = {"rank": rank, "step": step, "metric": metric, "value": value,
                              "host": host, "node": node, "attempt": attempt,
                              "server_ms": ev.server_ms}
        text = f"rank {rank} on {host}: {metric} became {value} at step {_q(step)}"
        if d.get("policy") == "stop":
            text += " (--on-nan stop: the job stops)"
        self._note(ev, "nan", text)

    def _on_workers_stopped(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        for r in rank_list(d.get("ranks")):
            rs = self.ranks.get(r)
            if rs is not None and rs.state not in (FAILED, EXITED):
                rs.state = STOPPED
                rs.ended_ms = rs.ended_ms or ev.server_ms

    def _on_group_failed(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        cause = d.get("root_cause")
        if isinstance(cause, dict):
            self.root_cause = cause
        self.patterns.clear()
        self._note(ev, "group_failed", "worker group failed: " + _cause_text(cause),
                   _cause_detail(cause))

    def _on_restarting(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        self.restarts_used = _int(d.get("restarts_used"), self.restarts_used) or 0
        self.max_restarts = _int(d.get("max_restarts"), self.max_restarts)
        if not self.is_final:
            self.state = RESTARTING
        for rs in self.ranks.values():
            rs.state = RESTARTING
        self.stragglers = []
        reason = d.get("reason") or "?"
        text = f"restarting ({reason}): {self.restarts_used}/{_q(self.max_restarts)} restarts used"
        if d.get("command_id"):
            text += f", command {d['command_id']}"
        if d.get("detail"):
            text += f": {d['detail']}"
        # The round that ended: enter on the entry shows that attempt's logs (issue 22).
        self._note(ev, "restart", text, ref="" if self.round is None else str(self.round))

    def _on_job_end(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        final = {EventType.JOB_SUCCEEDED: SUCCEEDED, EventType.JOB_FAILED: FAILED,
                 EventType.JOB_STOPPED: STOPPED}[ev.type]
        self.restarts_used = _int(d.get("restarts_used"), self.restarts_used) or 0
        self.max_restarts = _int(d.get("max_restarts"), self.max_restarts)
        if not self.is_final:
            self.state = final
        if final == FAILED:
            cause = d.get("root_cause")
            if isinstance(cause, dict):
                self.root_cause = cause
            self._note(ev, "job", f"job failed after {self.restarts_used} restarts: "
                       + _cause_text(self.root_cause), _cause_detail(self.root_cause))
        elif final == STOPPED and d.get("scheduler"):
            self._note(ev, "job", f"job stopped by the scheduler ({d.get('scheduler')}, "
                       f"{d.get('signal', '?')}: {d.get('meaning', '')})")
        elif final == STOPPED:
            self._note(ev, "job", f"job stopped by {d.get('issuer', '?')} "
                       f"(command {d.get('command_id', '?')})")
        else:
            self.patterns.clear()
            self._note(ev, "job", f"job succeeded ({self.restarts_used} restarts used)")

    def _on_job_requeued(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        """The scheduler requeued the job: its stop was not its end, it runs again."""
        self.state = RUNNING
        self._note(ev, "job", f"job requeued by the scheduler ({d.get('scheduler', '?')}, "
                   f"restart {_int(d.get('slurm_restart_count'), 0)}): it runs again under "
                   "the same id")

    def _on_command_ack(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        cid = d.get("command_id")
        if not isinstance(cid, str):
            self.ignored += 1
            return
        cid = cid[:MAX_NAME_CHARS]
        status = sanitize(str(d.get("status", "?"))[:32])
        reason = sanitize(_clip(str(d.get("reason", "")), MAX_NOTE_CHARS))
        acks = self._acks.setdefault(cid, {})
        if node in acks or len(acks) >= MAX_VIEW_NODES:
            return  # exactly one ack per agent per command: a second one is a repeat
        acks[node] = (node, status, reason)
        if len(self._acks) > _ACK_COMMANDS_LIMIT:
            del self._acks[next(iter(self._acks))]
        host = d.get("host") or self._host_of(node)
        self._note(ev, "ack", f"command {cid} {status} by {host}" + (f": {reason}" if reason else ""))

    def _on_redis_stopping(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        final = d.get("final_state")
        if isinstance(final, str) and final in FINAL_STATES and not self.is_final:
            self.state = final  # the job's own end event may have been trimmed away
        linger = _float(d.get("linger_s"), None)
        if linger is None or not 0 <= linger <= 86_400:  # NaN and absurd values included
            linger = 0.0
        self.redis_stops_ms = ev.server_ms + int(linger * 1000)
        self._note(ev, "job", f"the job's embedded Redis (--standalone) stops once no console "
                   f"is attached, in {linger:g} s at the latest")

    def _on_logs_dropped(self, ev: Event, node: str, d: dict[str, Any]) -> None:
        count = _int(d.get("count"), 0) or 0
        self.lines_dropped += count
        self._note(ev, "logs", f"{count} log lines dropped on {self._host_of(node)} "
                   "(its buffer overflowed while Redis was unreachable)")

    _HANDLERS = {
        EventType.NODE_JOINED: _on_node_joined,
        EventType.NODE_LEFT: _on_node_left,
        EventType.NODE_LOST: _on_node_lost,
        EventType.RENDEZVOUS_COMPLETE: _on_rendezvous_complete,
        EventType.WORKERS_STARTED: _on_workers_started,
        EventType.WORKER_EXITED: _on_worker_exited,
        EventType.WORKER_TIMER_EXPIRED: _on_worker_timer_expired,
        EventType.STALLED: _on_stalled,
        EventType.STRAGGLER: _on_straggler,
        EventType.WORKERS_STOPPED: _on_workers_stopped,
        EventType.GROUP_FAILED: _on_group_failed,
        EventType.RESTARTING: _on_restarting,
        EventType.JOB_SUCCEEDED: _on_job_end,
        EventType.JOB_FAILED: _on_job_end,
        EventType.JOB_STOPPED: _on_job_end,
        EventType.JOB_REQUEUED: _on_job_requeued,
        EventType.COMMAND_ACK: _on_command_ack,
        EventType.LOGS_DROPPED: _on_logs_dropped,
        EventType.REDIS_STOPPING: _on_redis_stopping,
        EventType.RESTART_STORM: _on_restart_storm,
        EventType.SUSPECT_NODE: _on_suspect_node,
        EventType.NO_PROGRESS: _on_no_progress,
        EventType.NODE_EXCLUDED: _on_node_excluded,
        EventType.NAN: _on_nan,
    }
