"""Messages the console's workers post to the app.

Workers (see :mod:`elastic_console.tui.app`) do the I/O through the JobClient and fold what
they read into the JobView themselves (same event loop: no locks). The UI redraws from the
JobView on a timer, so records are never messages: a message is posted only for a discrete
happening the UI must react to at once (a banner, a dialog line, a screen switch).

Every string in a message that came from Redis or the job is already sanitized; widgets still
build Rich ``Text`` from it, never markup.
"""

from __future__ import annotations

from textual.message import Message

from ..job.client import Ack, JobSummary
from ..job.stack_view import StacksResult

__all__ = [
    "AckArrived",
    "CommandFinished",
    "CommandSent",
    "ConnectionChanged",
    "HistoryLoaded",
    "JobAppeared",
    "JobMissing",
    "JobsListed",
    "ReaderFailed",
    "StacksFetched",
    "StacksProgress",
    "WriteAccess",
]


class ConnectionChanged(Message):
    """The reader lost Redis (``error`` says why, one sentence) or reached it again."""

    def __init__(self, connected: bool, error: str = "") -> None:
        super().__init__()
        self.connected = connected
        self.error = error


class ReaderFailed(Message):
    """The reader hit a refusal that waiting does not cure (e.g. NOPERM); it retries slowly."""

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class HistoryLoaded(Message):
    """What Redis still kept of the job was folded in; live records follow."""

    def __init__(self, events: int, lines: int) -> None:
        super().__init__()
        self.events = events
        self.lines = lines


class WriteAccess(Message):
    """Whether this console may send commands (``reason`` when not)."""

    def __init__(self, allowed: bool, reason: str = "") -> None:
        super().__init__()
        self.allowed = allowed
        self.reason = reason


class JobAppeared(Message):
    """The job a waiting screen waited for exists now (or the user picked another one)."""

    def __init__(self, job_id: str) -> None:
        super().__init__()
        self.job_id = job_id


class JobMissing(Message):
    """The job attached to does not exist (yet): the app shows the waiting screen."""

    def __init__(self, job_id: str) -> None:
        super().__init__()
        self.job_id = job_id


class JobsListed(Message):
    """The jobs on the server, newest first (for the waiting screen)."""

    # A newer listing supersedes a queued older one.
    def can_replace(self, message: Message) -> bool:
        return isinstance(message, JobsListed)

    def __init__(self, jobs: list[JobSummary], error: str = "") -> None:
        super().__init__()
        self.jobs = jobs
        self.error = error


class CommandSent(Message):
    """A command is on the command stream; ``expected`` (node -> host) should ack it.

    ``token`` names the request (the dialog that asked for it): the command id is not known
    before the command is sent.
    """

    def __init__(self, token: int, command_id: str, kind: str, expected: dict[str, str]) -> None:
        super().__init__()
        self.token = token
        self.command_id = command_id
        self.kind = kind
        self.expected = expected


class AckArrived(Message):
    """One agent answered a command."""

    def __init__(self, token: int, command_id: str, ack: Ack) -> None:
        super().__init__()
        self.token = token
        self.command_id = command_id
        self.ack = ack


class CommandFinished(Message):
    """Every expected agent answered, or the wait timed out, or sending failed (``error``).

    ``command_id`` is empty when the command could not even be sent.
    """

    def __init__(self, token: int, command_id: str, kind: str, acks: list[Ack],
                 missing: dict[str, str], timeout: float, error: str = "") -> None:
        super().__init__()
        self.token = token
        self.command_id = command_id
        self.kind = kind
        self.acks = acks
        self.missing = missing
        self.timeout = timeout
        self.error = error


class StacksProgress(Message):
    """Stack replies so far: ``answered`` of ``expected`` ranks (the stacks screen's worker)."""

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, StacksProgress)

    def __init__(self, answered: int, expected: int) -> None:
        super().__init__()
        self.answered = answered
        self.expected = expected


class StacksFetched(Message):
    """Every rank answered or the wait ended: the grouped stacks, or ``error`` (one line)."""

    def __init__(self, result: StacksResult | None, error: str = "") -> None:
        super().__init__()
        self.result = result
        self.error = error
