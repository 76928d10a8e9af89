"""Restart patterns: a restart storm, a suspect node, rounds that end without progress.

Pure logic, no I/O (``pattern_watch.py`` reads and writes Redis). After each round that cost
a restart (a worker failed, the job stalled, a node was lost), the agent that claimed the
restart appends a :class:`RoundEnd` to the job's capped history and :func:`analyse` looks at
that history:

* **restart storm**: at least ``storm_restarts`` round ends within ``storm_minutes``
  (NVIDIA's resiliency extension alerts on 5 in 30 minutes: the defaults);
* **suspect node**: a node present in every one of the last ``suspect_rounds`` round ends
  (its worker was the round's root cause, or it was lost);
* **no progress**: the last ``no_progress_rounds`` round ends all came before any progress.
  Where the job's steps are known (a worker printed them: metrics.py), a round progressed iff
  the job's highest step rose during it, above the highest of every round before it (a resume
  from a checkpoint that only redoes steps is no progress): :func:`step_progress`. Otherwise
  stall.py's progress: output or CPU, later than two stall samples after the round began
  (:func:`progressed`); unknown without stall detection.

A value of 0 switches a pattern off. ``DO_NOT_REQUEUE`` is the agent's exit status when the
job failed with a pattern in its history, and the status of a node left out of the job.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic_agent.coordination.wire import round_records
from elastic_agent.coordination.wire.protocol import (
    MAX_NAME_CHARS,
    ProtocolError,
    decode_json,
    record_list,
)

#: Exit status meaning "do not requeue this job (or this node's task)": a scheduler's wrapper
#: that requeues failed jobs should not requeue this one; the same failure would come back.
#: NVIDIA's resiliency extension uses the same number for the same meaning.
DO_NOT_REQUEUE = 93
#: Round ends kept in Redis (LTRIM): the longest window a pattern may look at.
HISTORY_CAP = 64
#: Rounds whose highest step ``JobKeys.metrics_steps`` keeps in a field of their own; older
#: ones fold into its ``base`` field (metrics_publish.py's script), so the hash stays small
#: and the claimer reads it whole with one bounded HMGET.
STEP_ROUNDS = 80
#: Steps at or above this are not recorded (Lua's numbers are doubles).
MAX_STEP = 1 << 53
STORM_POLICIES = ("observe", "stop")


@dataclass(frozen=True)
class PatternSettings:
    """The flags (see :func:`add_arguments`)."""

    storm_restarts: int = 5
    storm_minutes: float = 30.0
    suspect_rounds: int = 3
    no_progress_rounds: int = 3
    exclude_suspects: bool = False
    on_storm: str = "observe"


@dataclass(frozen=True)
class RoundEnd:
    """One round that ended with a restart (or the job's failure)."""

    round: int
    ms: int  # Redis server time of the end
    reason: str  # failure | stalled | lost
    nodes: tuple[str, ...] = ()  # the nodes in the failure: the root cause's, the lost ones
    progressed: bool | None = None  # None: unknown (no step printed, stall detection off)
    by: str = ""  # the node that claimed the round's restart and wrote this record
    step: int | None = None  # the highest step the round reached, when steps are known

    def to_json(self) -> str:
        return json.dumps({"round": self.round, "ms": self.ms, "reason": self.reason,
                           "nodes": list(self.nodes), "progressed": self.progressed,
                           "by": self.by, "step": self.step}, separators=(",", ":"))

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> RoundEnd:
        """From ``round_records.decode_round_end``'s checked dict."""
        return cls(d["round"], d["ms"], d["reason"], tuple(d["nodes"]), d["progressed"],
                   d["by"], d.get("step"))

    @property
    def claim_field(self) -> str:
        """The job's meta field whose value names the claimer of this round's restart."""
        return claim_field(self.reason, self.round)


def claim_field(reason: str, round_: int) -> str:
    """The meta field claimed (HSETNX, the claimer's node id) by the one agent that restarts
    round ``round_``: a lost node's re-form is claimed apart from a failure's or a stall's."""
    return f"{'reform' if reason == 'lost' else 'restart'}_claim:{round_}"


def verified_history(history: Sequence[RoundEnd], claimers: Sequence[Any], round_: int,
                     now_ms: int) -> tuple[list[RoundEnd], int]:
    """The round ends (newest first) whose claimer is the one the job's meta names for their
    round (``claimers[i]``: the value of ``history[i].claim_field``), in order, none newer
    than ``round_`` or ``now_ms``: ``(kept, dropped)``. Anyone who can write the job's keys
    can push a round end; only the agent that claimed a round's restart wrote its claim."""
    kept: list[RoundEnd] = []
    for end, claimer in zip(history, claimers, strict=True):
        who = claimer.decode("utf-8", "replace") if isinstance(claimer, bytes) else claimer
        if (end.by and who == end.by and end.round <= round_ and end.ms <= now_ms
                and (not kept or end.round < kept[-1].round)):
            kept.append(end)
    return kept, len(history) - len(kept)


@dataclass(frozen=True)
class Decision:
    """A claimer's decision recorded for the other agents (``excluded``, ``do_not_requeue``):
    which round's restart it came from and who claimed it, so an agent can check it against
    the claim before obeying, and say in its events who decided."""

    round: int
    by: str
    nodes: tuple[str, ...] = ()  # the nodes left out (``excluded``)
    why: str = ""  # the patterns found, one line (``do_not_requeue``)

    def to_json(self) -> str:
        return json.dumps({"round": self.round, "by": self.by, "nodes": list(self.nodes),
                           "why": self.why}, separators=(",", ":"))

    @classmethod
    def decode(cls, raw: Any) -> Decision | None:
        """None for anything but a well-formed decision (bounded: at most
        ``round_records.MAX_ROUND_END_NODES`` nodes, 16 KiB in all)."""
        try:
            d = decode_json(raw, "a pattern decision", round_records.MAX_ROUND_END_BYTES)
        except ProtocolError:
            return None
        if not isinstance(d, dict):
            return None
        rnd, by, why, nodes = d.get("round"), d.get("by"), d.get("why", ""), d.get("nodes", [])
        if (type(rnd) is not int or not 0 <= rnd < 1 << 40 or not isinstance(by, str)
                or not 0 < len(by) <= MAX_NAME_CHARS or not isinstance(why, str)
                or type(nodes) is not list
                or len(nodes) > round_records.MAX_ROUND_END_NODES):
            return None
        named = record_list(nodes, round_records.MAX_ROUND_END_NODES)
        if not all(isinstance(n, str) and 0 < len(n) <= MAX_NAME_CHARS for n in named):
            return None
        return cls(rnd, by, tuple(named), why[:1000])


@dataclass(frozen=True)
class Storm:
    restarts: int
    minutes: float
    rounds: tuple[int, ...]


@dataclass(frozen=True)
class Patterns:
    """What :func:`analyse` found; empty when nothing stands out."""

    storm: Storm | None = None
    suspects: tuple[str, ...] = ()
    suspect_rounds: tuple[int, ...] = ()
    no_progress_rounds: tuple[int, ...] = ()
    excluded: tuple[str, ...] = field(default=())

    def __bool__(self) -> bool:
        return bool(self.storm or self.suspects or self.no_progress_rounds)

    def summary(self) -> str:
        """One line for people (the agent's terminal, the reason of ``do_not_requeue``)."""
        parts = []
        if self.storm:
            parts.append(f"restart storm: {self.storm.restarts} restarts within "
                         f"{self.storm.minutes:g} min")
        if self.suspects:
            parts.append(f"suspect node{'s' if len(self.suspects) > 1 else ''} "
                         f"{', '.join(self.suspects)} (in every failure of the last "
                         f"{len(self.suspect_rounds)} rounds)")
        if self.no_progress_rounds:
            parts.append(f"the last {len(self.no_progress_rounds)} rounds ended without "
                         "progress")
        return "; ".join(parts)


def progressed(newest: str | None, round_: int, started_ms: int, grace_ms: int) -> bool:
    """Whether round ``round_`` (begun at server ms ``started_ms``) made progress, from the
    job's ``progress:newest`` value ``"<round> <ms>"`` (stall.py): progress of this round
    later than ``grace_ms`` after its start (the start itself counts as progress there)."""
    parts = (newest or "").split(" ")
    if len(parts) != 2 or not all(p.isdigit() and len(p) < 19 for p in parts):
        return False
    return int(parts[0]) == round_ and int(parts[1]) > started_ms + grace_ms


def step_fields(round_: int) -> list[str]:
    """The fields of ``JobKeys.metrics_steps`` the claimer of round ``round_``'s restart reads
    (one HMGET): ``base`` and the newest :data:`STEP_ROUNDS` rounds up to ``round_``."""
    return ["base", *(str(r) for r in range(max(0, round_ - STEP_ROUNDS + 1), round_ + 1))]


def decode_steps(round_: int, values: Sequence[Any]) -> tuple[dict[int, int], int | None]:
    """The reply to the HMGET of :func:`step_fields`: ``({round: highest step}, base)``.
    Hostile input: a value that is not a decimal step below :data:`MAX_STEP` is left out."""
    fields = step_fields(round_)
    if not isinstance(values, (list, tuple)) or len(values) != len(fields):
        return {}, None
    highs: dict[int, int] = {}
    base = None
    for name, raw in zip(fields, values):
        text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
        if not isinstance(text, str) or not text.isdigit() or len(text) > 16:
            continue
        value = int(text)
        if value >= MAX_STEP:
            continue
        if name == "base":
            base = value
        else:
            highs[int(name)] = value
    return highs, base


def step_progress(round_: int, highs: Mapping[int, int],
                  base: int | None = None) -> tuple[bool | None, int | None]:
    """Whether round ``round_`` progressed by steps, and the highest step it reached:
    ``highs`` maps rounds to the highest step any rank named in them, ``base`` is the highest
    of the rounds folded away (all earlier). Progress: the round's highest step is above every
    earlier round's (a round that printed no step made none). ``(None, None)`` when no round
    up to ``round_`` printed a step: the caller falls back to :func:`progressed`."""
    reached = highs.get(round_)
    earlier = [v for r, v in highs.items() if r < round_]
    if base is not None:
        earlier.append(base)
    before = max(earlier, default=None)
    if reached is None and before is None:
        return None, None
    return reached is not None and (before is None or reached > before), reached


def merge_steps(*sources: Mapping[int, int]) -> dict[int, int]:
    """Rounds' highest steps from several sources (Redis, this agent's own), the highest
    of each round."""
    out: dict[int, int] = {}
    for source in sources:
        for r, v in source.items():
            if v > out.get(r, -1):
                out[r] = v
    return out


def analyse(history: Sequence[RoundEnd], now_ms: int, s: PatternSettings) -> Patterns:
    """The patterns in ``history`` (newest first, as Redis's list holds it). O(len(history)):
    bounded by ``HISTORY_CAP``, never by the job's size."""
    storm = None
    if s.storm_restarts > 0:
        since = now_ms - int(s.storm_minutes * 60_000)
        recent = [e for e in history if e.ms >= since]
        if len(recent) >= s.storm_restarts:
            storm = Storm(len(recent), s.storm_minutes, tuple(e.round for e in recent))
    suspects: tuple[str, ...] = ()
    suspect_rounds: tuple[int, ...] = ()
    k = s.suspect_rounds
    if k > 0 and len(history) >= k:
        last = history[:k]
        common = set(last[0].nodes)
        for e in last[1:]:
            common &= set(e.nodes)
        if common:
            suspects, suspect_rounds = tuple(sorted(common)), tuple(e.round for e in last)
    stuck: tuple[int, ...] = ()
    n = s.no_progress_rounds
    if n > 0 and len(history) >= n and all(e.progressed is False for e in history[:n]):
        stuck = tuple(e.round for e in history[:n])
    return Patterns(storm, suspects, suspect_rounds, stuck)


def may_exclude(group_world_size: int, min_nodes: int, already: int) -> bool:
    """Whether the job can leave one more node out: the round had more nodes than the
    minimum, counting those excluded already in this decision."""
    return group_world_size - already - 1 >= min_nodes


# -- flags ---------------------------------------------------------------------------------

def add_arguments(add: Any) -> None:
    """The agent's flags for restart patterns (``add`` is the parser's ``add_argument``)."""
    add("--restart-storm", dest="restart_storm", default="5/30", metavar="N/MIN",
        help="a `restart_storm` event (and a console banner) when N restarts come within MIN "
        "minutes (default 5/30; 0 switches it off)")
    add("--on-restart-storm", dest="on_restart_storm", default="observe",
        choices=STORM_POLICIES,
        help="observe (the event only, the default) or stop: the job fails at once, every "
        f"agent exiting {DO_NOT_REQUEUE} (do not requeue)")
    add("--suspect-rounds", dest="suspect_rounds", default="3", metavar="K",
        help="a `suspect_node` event when one node was in every failure of K consecutive "
        "restarts: its worker failed first, or it was lost (default 3; 0: off)")
    add("--no-progress-rounds", dest="no_progress_rounds", default="3", metavar="K",
        help="a `no_progress` event when K consecutive rounds ended before making progress: "
        "where the workers print their steps, the job's highest step did not rise in the "
        "round; otherwise no output or CPU as --stall-timeout counts it (needs stall "
        "detection); default 3; 0: off")
    add("--exclude-suspect-nodes", dest="exclude_suspect_nodes", action="store_true",
        help="a suspect node leaves the job (exit status "
        f"{DO_NOT_REQUEUE}) while the others re-form without it, when the job has nodes to "
        "spare (more than the minimum of --nnodes)")


def settings_from(ns: argparse.Namespace) -> PatternSettings:
    """The settings from parsed flags; ``ValueError`` with one clear sentence otherwise."""
    text = str(ns.restart_storm).strip()
    if text == "0":
        storm_n, storm_min = 0, 30.0
    else:
        n, sep, m = text.partition("/")
        try:
            storm_n, storm_min = int(n), float(m)
        except ValueError:
            storm_n, storm_min = -1, 0.0
        if not sep or not 1 <= storm_n <= HISTORY_CAP or not 0 < storm_min <= 100_000:
            raise ValueError(f"--restart-storm {text!r}: give N/MIN, N restarts (1 to "
                             f"{HISTORY_CAP}) within MIN minutes, e.g. 5/30; or 0 (off)")
    counts = {}
    for flag, value in (("--suspect-rounds", ns.suspect_rounds),
                        ("--no-progress-rounds", ns.no_progress_rounds)):
        try:
            counts[flag] = int(value)
        except (TypeError, ValueError):
            counts[flag] = -1
        if not 0 <= counts[flag] <= HISTORY_CAP:
            raise ValueError(f"{flag} {value!r}: give a number of rounds from 0 (off) to "
                             f"{HISTORY_CAP}")
    return PatternSettings(storm_n, storm_min, counts["--suspect-rounds"],
                           counts["--no-progress-rounds"], bool(ns.exclude_suspect_nodes),
                           ns.on_restart_storm)
