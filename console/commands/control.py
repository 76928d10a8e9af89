"""`restart`, `stop` and `rm`: the subcommands that change a job. restart and stop send one
command to every agent, after a confirmation (or ``--yes``), and wait for each agent's ack;
rm removes a finished or lost job's records now (a running one with ``--force``, once a stop
command has stopped every agent).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from elastic_agent.coordination.transport.endpoints import Endpoint
from elastic_agent.coordination.wire.command_records import CommandType

from ..job.client import Ack
from .common import EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, PROG, CliError, _fail, _job, _load_view, _open, _out

__all__ = ["command", "rm"]


# -- restart / stop -----------------------------------------------------------------------

def _confirm(question: str, assume_yes: bool) -> None:
    if assume_yes:
        return
    if not sys.stdin.isatty():
        raise CliError("refusing to act without confirmation: stdin is not a terminal "
                       "(pass --yes to confirm)", EXIT_USAGE)
    sys.stderr.write(question + " [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        raise CliError("cancelled; nothing was sent", EXIT_RUNTIME)


async def command(ep: Endpoint, args: argparse.Namespace) -> int:
    job = _job(args)
    kind = CommandType.RESTART if args.command == "restart" else CommandType.STOP
    client = await _open(ep, job)
    try:
        view = await _load_view(client, resources=False)
        if view.is_final:
            raise CliError(f"job '{job}' has already {view.state}: there is nothing to {kind}")
        expected = view.active_nodes()
        if not expected:
            raise CliError(f"no agent of job '{job}' is running to receive a {kind} command")
        ok, why = await client.can_write()
        if not ok:
            raise CliError(why)
        question = (f"Restart the worker group of job {job}?" if kind == CommandType.RESTART
                    else f"Stop job {job} (every worker on every node)?")
        _confirm(question, args.yes)
        cid = await client.send_command(kind)
        n = len(expected)
        _out(f"{kind} command {cid} sent to job {job}; waiting for {n} agent"
             f"{'' if n == 1 else 's'} to answer")
        sys.stdout.flush()

        def show(ack: Ack) -> None:
            reason = f": {ack.reason}" if ack.reason else ""
            _out(f"  {ack.status} by {ack.host} ({ack.node}){reason}")
            sys.stdout.flush()

        acks = await client.wait_acks(cid, expected_nodes=n, timeout=args.timeout, on_ack=show)
    finally:
        await client.close()
    by_node = {a.node: a for a in acks}
    missing = [f"{host} ({node})" for node, host in expected.items() if node not in by_node]
    refused = [a for a in acks if a.node in expected and a.status != "accepted"]
    if missing:
        return _fail(f"no answer within {args.timeout:g} s from: {', '.join(missing)}",
                     EXIT_RUNTIME)
    if refused:
        return _fail(f"{len(refused)} of {n} agents did not accept the {kind} command",
                     EXIT_RUNTIME)
    _out(f"all {n} agent{'' if n == 1 else 's'} accepted the {kind} command")
    return EXIT_OK


# -- rm -----------------------------------------------------------------------------------

async def rm(ep: Endpoint, args: argparse.Namespace) -> int:
    """Remove a job's records now. A finished or lost job goes at once; a running one only
    with --force, once a stop command has stopped every agent (they would write the job
    back otherwise), within --timeout."""
    job = _job(args)
    client = await _open(ep, job)
    try:
        view = await _load_view(client, resources=False)
        running = not view.is_final and view.state != "lost"
        if running:
            expected = view.active_nodes()
            if not args.force:
                raise CliError(f"job '{job}' is {view.state} ({len(expected)} agent"
                               f"{'' if len(expected) == 1 else 's'}): stop it first, or "
                               f"'{PROG} rm --force {job}' stops and removes it")
            ok, why = await client.can_write()
            if not ok:
                raise CliError(why)
            cid = await client.send_command(CommandType.STOP)
            _out(f"stop command {cid} sent to job {job}; waiting up to {args.timeout:g} s for "
                 "its agents to stop")
            sys.stdout.flush()
            deadline = time.monotonic() + args.timeout
            while await client.live_agents():
                if time.monotonic() >= deadline:
                    raise CliError(f"the agents of job '{job}' did not stop within "
                                   f"{args.timeout:g} s; nothing was removed (see "
                                   f"{PROG} status {job})")
                # An agent's heartbeat is a score in a sorted set: nothing signals it leaving.
                await asyncio.sleep(0.2)
        n = await client.remove()
    finally:
        await client.close()
    _out(f"removed job {job} ({n} key{'' if n == 1 else 's'})")
    return EXIT_OK
