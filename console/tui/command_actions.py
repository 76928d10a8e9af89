"""The console's commands: whether each can be sent now, the confirm dialogs, sending one and
following its acks (the ConsoleApp's mixin: the app is ``self``).

k9s's rule: nothing destructive without a confirmation, and a key that cannot act now is
shown dimmed and says why when pressed. Every command names the agents expected to ack it;
the dialog follows the acks as they come and ends with one sentence about the outcome.
"""

from __future__ import annotations

from typing import Any

from textual import work

from elastic_agent.coordination.transport.connection import RedisUnavailableError
from elastic_agent.coordination.wire.command_records import CommandType

from ..job.client import Ack
from ..job.model import FINAL_STATES, RUNNING
from .messages import AckArrived, CommandFinished, CommandSent
from .widgets.dialogs import CommandDialog

#: Actions that send a command, and the verb each is worded with.
VERBS = {"restart": "restart", "stop": "stop", "kill_rank": "signal"}


class CommandActions:
    """The command half of ConsoleApp: ``block_reason``, ``check_action``, the ``restart``,
    ``stop`` and ``kill_rank`` actions and the messages of a command in flight.

    What it uses of the app: ``client`` (None until attached), ``view``, ``job_id``, ``loaded``,
    ``read_only_flag``, ``write_denied``, ``ack_timeout``, ``selected_rank``, ``_dialogs``
    (token -> the dialog following that command), ``_blocks`` (the last reasons shown), and
    App's ``notify``, ``post_message``, ``push_screen``, ``refresh_bindings``."""

    @work(group="commands", exit_on_error=False)
    async def _send(self, token: int, kind: str, args: dict[str, Any], target: str,
                    expected: dict[str, str]) -> None:
        client = self.client
        if client is None:
            self.post_message(CommandFinished(token, "", kind, [], expected, 0.0,
                                              error="this console is not connected to Redis"))
            return
        try:
            cid = await client.send_command(kind, args, target=target)
        except (RedisUnavailableError, ValueError) as exc:
            self.post_message(CommandFinished(token, "", kind, [], expected, 0.0, error=str(exc)))
            return
        self.post_message(CommandSent(token, cid, kind, expected))

        def on_ack(ack: Ack) -> None:
            self.post_message(AckArrived(token, cid, ack))

        try:
            acks = await client.wait_acks(cid, expected_nodes=len(expected),
                                          timeout=self.ack_timeout, on_ack=on_ack)
        except RedisUnavailableError as exc:
            self.post_message(CommandFinished(token, cid, kind, [], expected, self.ack_timeout,
                                              error=f"sent, but its acks cannot be read: {exc}"))
            return
        answered = {a.node for a in acks}
        missing = {n: h for n, h in expected.items() if n not in answered}
        self.post_message(CommandFinished(token, cid, kind, acks, missing, self.ack_timeout))

    def on_command_sent(self, message: CommandSent) -> None:
        dialog = self._live_dialog(message.token)
        if dialog is not None:
            dialog.sent(message.command_id, message.kind, message.expected, self.ack_timeout)
        n = len(message.expected)
        self.view.add_note(self.now_ms(), "command",
                           f"{message.kind} command {message.command_id} sent from this console "
                           f"to {n} agent{'' if n == 1 else 's'}")

    def on_ack_arrived(self, message: AckArrived) -> None:
        dialog = self._live_dialog(message.token)
        if dialog is not None:
            dialog.add_ack(message.ack)

    def on_command_finished(self, message: CommandFinished) -> None:
        summary, ok = _summary(message)
        dialog = self._live_dialog(message.token)
        self._dialogs.pop(message.token, None)
        if dialog is not None:
            dialog.finish(summary, ok)
        if not ok:
            self.view.add_note(self.now_ms(), "command", summary)
        self.notify(summary, title=f"{message.kind} command", markup=False,
                    severity="information" if ok else "error")

    def _live_dialog(self, token: int) -> CommandDialog | None:
        dialog = self._dialogs.get(token)
        return dialog if dialog is not None and dialog in self.screen_stack else None

    def _read_only_reason(self) -> str:
        if self.read_only_flag:
            return "read-only (--read-only): this console never sends commands"
        if self.write_denied:
            return f"read-only: {self.write_denied}"
        return ""

    def block_reason(self, action: str) -> str:
        """Why ``action`` (restart, stop, kill_rank) cannot be used now; ``""`` if it can."""
        why = self._read_only_reason()
        if why:
            return why
        view = self.view
        verb = VERBS.get(action, action)
        if not self.loaded:
            return "the job's state is still being read"
        if view.state in FINAL_STATES:
            return f"job {self.job_id} has already {view.state}: there is nothing to {verb}"
        if not self._any_active_node():
            return f"no agent of job {self.job_id} is running to receive a {verb} command"
        return ""

    def _any_active_node(self) -> bool:
        """Is any agent there to receive a command? Asked for each command on every refresh."""
        return self.view.active_node_count() > 0

    def _refresh_blocks(self, force: bool = False) -> None:
        blocks = tuple(self.block_reason(a) for a in VERBS)
        if force or blocks != self._blocks:
            self._blocks = blocks
            self.refresh_bindings()  # the footer shows the commands enabled or dimmed

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in VERBS:
            return None if self.block_reason(action) else True  # None: shown, dimmed
        if action == "disabled":
            return bool(parameters) and bool(self.block_reason(str(parameters[0])))
        return True

    def action_disabled(self, action: str) -> None:
        self._explain(self.block_reason(action))

    def _explain(self, why: str) -> None:
        self.notify(why, title="Command disabled", severity="warning", markup=False)

    def action_restart(self) -> None:
        if why := self.block_reason("restart"):
            self._explain(why)
            return
        expected = self.view.active_nodes()
        n = len(expected)
        self._confirm(
            "Restart the worker group?",
            f"Every worker of job {self.job_id} on {n} node{'' if n == 1 else 's'} "
            f"({_hosts(expected)}) is stopped and started again. A restart command does not "
            "count against --max-restarts.",
            "Restart", CommandType.RESTART, {}, "job", expected)

    def action_stop(self) -> None:
        if why := self.block_reason("stop"):
            self._explain(why)
            return
        expected = self.view.active_nodes()
        self._confirm(
            "Stop the job?",
            f"Every worker of job {self.job_id} on every node ({_hosts(expected)}) is ended "
            "(SIGTERM, then SIGKILL after the shutdown timeout) and the agents exit with "
            "status 143. The job cannot be resumed from here. The console stays attached.",
            "Stop job", CommandType.STOP, {}, "job", expected)

    def action_kill_rank(self) -> None:
        if why := self.block_reason("kill_rank"):
            self._explain(why)
            return
        rank = self.selected_rank
        rs = self.view.ranks.get(rank) if rank is not None else None
        if rank is None or rs is None:
            self.notify("no rank selected: pick one in the rank table", markup=False,
                        severity="warning")
            return
        if rs.state != RUNNING:
            self.notify(f"rank {rank} is {rs.state}, not running: there is nothing to signal",
                        markup=False, severity="warning")
            return
        self._confirm(
            f"Send SIGTERM to rank {rank}?",
            f"Rank {rank} (pid {rs.pid if rs.pid is not None else '?'} on {rs.host or '?'}) gets "
            "SIGTERM. Unless it handles the signal it exits, the agents treat that as a failure "
            "and restart the worker group, spending a restart.",
            "Send SIGTERM", CommandType.SIGNAL, {"rank": rank, "signal": "SIGTERM"}, str(rank),
            self.view.active_nodes())

    def _confirm(self, title: str, body: str, label: str, kind: str, args: dict[str, Any],
                 target: str, expected: dict[str, str]) -> None:
        def confirmed(dialog: CommandDialog) -> None:
            token = id(dialog)
            self._dialogs[token] = dialog
            self._send(token, kind, args, target, dict(expected))

        self.push_screen(CommandDialog(title, body, label, confirmed))


def _hosts(nodes: dict[str, str]) -> str:
    hosts = sorted(set(nodes.values()))
    if len(hosts) > 6:
        return ", ".join(hosts[:6]) + f" and {len(hosts) - 6} more"
    return ", ".join(hosts) or "none"


def _summary(m: CommandFinished) -> tuple[str, bool]:
    """One sentence about a command's outcome, and whether it went well."""
    if m.error:
        what = f"the {m.kind} command" + (f" {m.command_id}" if m.command_id else "")
        return f"{what} failed: {m.error}", False
    refused = [a for a in m.acks if a.status != "accepted"]
    parts = []
    if m.missing:
        who = ", ".join(f"{h} ({n})" for n, h in sorted(m.missing.items()))
        parts.append(f"no answer within {m.timeout:g} s from: {who}")
    if refused:
        who = ", ".join(f"{a.host} ({a.reason or a.status})" for a in refused)
        parts.append(f"not accepted by: {who}")
    if parts:
        return f"{m.kind} command {m.command_id}: " + "; ".join(parts), False
    n = len(m.acks)
    return f"{m.kind} command {m.command_id} accepted by {n}/{n} agent{'' if n == 1 else 's'}", True
