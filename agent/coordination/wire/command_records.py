"""The records of a job's command stream (``JobKeys.commands``): what a console asks the agents.

Every agent reads every command and acks it with a ``command_ack`` event; a malformed
command is acked as rejected, so its decoder returns the reason instead of ``None``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .protocol import (
    MAX_NAME_CHARS,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    ProtocolError,
    _str,
    _strs,
    decode_json,
    is_rank,
    is_request_id,
    record_version,
)

#: The largest command args a reader decodes, and the longest command id it takes.
MAX_COMMAND_ARGS_BYTES = 16 * 1024
MAX_COMMAND_ID_CHARS = 128


class CommandType:
    STOP = "stop"  # graceful, job-wide
    RESTART = "restart"  # the whole worker group, job-wide, not counted against max restarts
    SIGNAL = "signal"  # args: {"rank": R, "signal": one of SIGNALS}
    # args: {"rank": R} optional; read-only: every agent publishes its ranks' Python stacks on
    # JobKeys.stacks (request = the command id), then acks "done"
    STACKS = "stacks"
    # args: {"rank": R} optional; read-only: every agent publishes its ranks' flight recorder
    # traces on JobKeys.collectives (request = the command id), then acks "done" (issue 22)
    COLLECTIVES = "collectives"

    ALL = frozenset({STOP, RESTART, SIGNAL, STACKS, COLLECTIVES})
    #: The signals a ``signal`` command may send (an allow-list: no SIGSTOP, no SIGUSR1 that a
    #: worker may use for its own purposes).
    SIGNALS = frozenset({"SIGTERM", "SIGKILL", "SIGINT"})


@dataclass(frozen=True)
class Command:
    """A command on the job's command stream. Every agent acks it with a ``command_ack``."""

    id: str
    type: str
    issuer: str
    target: str = "job"
    args: dict[str, Any] = field(default_factory=dict)
    entry_id: str = ""


def encode_command(command: Command) -> dict[str, str]:
    return {
        "v": str(PROTOCOL_VERSION),
        "id": command.id,
        "type": command.type,
        "issuer": command.issuer,
        "target": command.target,
        "args": json.dumps(command.args, separators=(",", ":")),
    }


def decode_command(entry_id: str | bytes, fields: Mapping[Any, Any]) -> Command | str:
    """Decode a command; for a malformed one return the reason (a string) instead.

    Agents ack a malformed command as rejected, so the reason must be reportable; it quotes
    nothing of the record but its type and field names (the ack is shown to people).
    A rank is checked against the job's world by the agent, which knows it.
    """
    try:
        f = _strs(fields)
    except (TypeError, AttributeError):
        return "command is not a map of strings"
    command_id = f.get("id", "")
    if not command_id:
        return "command has no id"
    if len(command_id) > MAX_COMMAND_ID_CHARS:
        return f"command id is longer than {MAX_COMMAND_ID_CHARS} characters"
    if record_version(f) is None:
        return f"unsupported protocol version (this agent speaks {sorted(SUPPORTED_VERSIONS)})"
    command_type = f.get("type", "")
    if command_type not in CommandType.ALL:
        return f"unknown command type (known: {', '.join(sorted(CommandType.ALL))})"
    issuer, target = f.get("issuer", "?"), f.get("target", "job")
    if len(issuer) > MAX_NAME_CHARS or len(target) > MAX_NAME_CHARS:
        return f"command issuer or target is longer than {MAX_NAME_CHARS} characters"
    try:
        args = decode_json(f.get("args", "{}"), "command args", MAX_COMMAND_ARGS_BYTES)
    except ProtocolError as exc:
        return str(exc)
    if not isinstance(args, dict):
        return "command args are not an object"
    if command_type == CommandType.SIGNAL:
        if not is_rank(args.get("rank")):
            return "signal needs args.rank, a non-negative integer"
        sig = args.get("signal", "SIGTERM")
        # type first: a list or an object is unhashable, and ``in`` a frozenset would raise
        if type(sig) is not str or sig not in CommandType.SIGNALS:
            return f"signal must be one of {', '.join(sorted(CommandType.SIGNALS))}"
    if command_type in (CommandType.STACKS, CommandType.COLLECTIVES):
        if args.get("rank") is not None and not is_rank(args.get("rank")):
            return f"{command_type}: args.rank must be a non-negative integer when given"
        if not is_request_id(command_id):
            return f"{command_type}: the command id must be letters, digits, '.', '_', ':' or '-'"
    return Command(id=command_id, type=command_type, issuer=issuer, target=target, args=args,
                   entry_id=_str(entry_id))
