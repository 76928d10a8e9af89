"""Where each stream of each worker goes: torchrun's settings, or a --logs-specs plugin's plan.

torchrun's ``-r/--redirects`` and ``-t/--tee`` (a :class:`Std` for all local ranks, or one
per rank), ``--local-ranks-filter`` and the line prefix template are parsed here and held,
with the pipeline's bounds, in a :class:`LogConfig`. With a --logs-specs plugin its plan
decides instead, read as torch's ``PContext`` reads a ``LogsDest``
(:func:`plugin_destinations`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntFlag
from pathlib import Path
from string import Template
from typing import Any

from elastic_agent.coordination.wire import keyspace

#: Longest line shipped to Redis; the rest of a longer line is replaced by a marker.
DEFAULT_MAX_LINE_BYTES = 16 * 1024
#: A log entry stops growing past this many bytes (keeps entries and replays reasonable).
DEFAULT_MAX_ENTRY_BYTES = 256 * 1024


class Std(IntFlag):
    """Which of a worker's streams a setting applies to (torchrun's ``Std``)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR


StdSpec = Std | Mapping[int, Std]

_VALUE_RE = re.compile(r"[0-3]")
_MAPPING_RE = re.compile(r"\d+:[0-3](,\d+:[0-3])*")


def parse_std_spec(spec: str) -> Std | dict[int, Std]:
    """Parse torchrun's ``-r``/``-t`` value: ``"3"`` -> ``Std.ALL``, ``"0:3,1:1"`` -> a map.

    Values: 0 none, 1 stdout, 2 stderr, 3 both; a map gives a value per local rank (ranks
    not named get 0). Raises ValueError naming the accepted forms on anything else.
    """
    s = str(spec).strip().replace(" ", "")
    if _VALUE_RE.fullmatch(s):
        return Std(int(s))
    if _MAPPING_RE.fullmatch(s):
        out: dict[int, Std] = {}
        for item in s.split(","):
            rank, value = item.split(":")
            if int(rank) in out:
                raise ValueError(f"invalid stream spec {spec!r}: local rank {rank} is given twice")
            out[int(rank)] = Std(int(value))
        return out
    raise ValueError(
        f"invalid stream spec {spec!r}: expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both), "
        "or a per-local-rank map such as 0:3,1:1"
    )


def std_for(spec: StdSpec, local_rank: int) -> Std:
    """The setting of one local rank (a map gives ``NONE`` to ranks it does not name)."""
    if isinstance(spec, Mapping):
        return Std(spec.get(local_rank, Std.NONE))
    return Std(spec)


def parse_local_ranks_filter(value: str | None) -> frozenset[int] | None:
    """``"0,2"`` -> ``{0, 2}``; empty or None -> None (all ranks). Raises ValueError."""
    if value is None or not str(value).strip():
        return None
    try:
        return frozenset(int(v) for v in str(value).split(","))
    except ValueError:
        raise ValueError(
            f"invalid local ranks filter {value!r}: expected a comma-separated list of "
            "integers, e.g. 0,1,2"
        ) from None


def line_prefix(template: str | None, role: str, rank: int, local_rank: int) -> str:
    """The prefix of teed lines, as torchrun builds it.

    With a template (torchrun's ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``) ``${role_name}``,
    ``${rank}`` (global) and ``${local_rank}`` are substituted; without, torchrun's TailLog
    default ``[{role}{local_rank}]:`` (the local rank, not the global one).
    """
    if template:
        return Template(template).safe_substitute(role_name=role, rank=rank,
                                                  local_rank=local_rank)
    return f"[{role}{local_rank}]:"


@dataclass(frozen=True)
class LogConfig:
    """How a node's worker output is shown and shipped (torchrun's -r, -t, filter, prefix)."""

    redirects: StdSpec = Std.NONE
    tee: StdSpec = Std.NONE
    local_ranks_filter: frozenset[int] | None = None
    log_line_prefix_template: str | None = None
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    maxlen: int = keyspace.LOGS_MAXLEN
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES
    #: torchrun's --duplicate-std{out,err}-filters: ``log_records.STDOUT``/``STDERR`` -> strings;
    #: a teed line holding any of them also goes to the attempt's ``filtered_std*.log``.
    duplicate_filters: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_line_bytes < 16:
            raise ValueError("max_line_bytes must be at least 16")


@dataclass(frozen=True)
class StreamDestination:
    """Where one stream of one worker goes when a --logs-specs plugin decides it: ``file``
    (None: no file), the agent's terminal or not, with the tee prefix or not."""

    file: Path | None
    terminal: bool
    prefixed: bool
    filtered: Path | None = None  # the duplicate filters' file (torch's filtered_std*.log)


@dataclass(frozen=True)
class RankDestinations:
    stdout: StreamDestination
    stderr: StreamDestination


def plugin_destinations(plan: Any, local_rank: int) -> RankDestinations:
    """One local rank's destinations from a plugin's plan (``torch_compat.LogPlan``), read
    as torch's ``PContext`` reads a ``LogsDest``: ``""`` is the agent's own stream, shown
    unprefixed and kept in no file; a path is the file; a teed rank is also shown, with the
    prefix. Redis gets every line whatever the plugin says."""

    def one(paths: dict[int, str], tees: dict[int, str], filtered: str) -> StreamDestination:
        path = paths.get(local_rank, "")
        teed = local_rank in tees
        return StreamDestination(file=Path(path) if path else None,
                                 terminal=not path or teed, prefixed=teed,
                                 filtered=Path(filtered) if filtered and teed else None)

    return RankDestinations(one(plan.stdouts, plan.tee_stdouts, plan.filtered_stdout),
                            one(plan.stderrs, plan.tee_stderrs, plan.filtered_stderr))
