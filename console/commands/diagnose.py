"""`stacks` and `collectives`: per-rank requests. Every agent of a running job is asked for
its ranks' Python stacks or their flight recorders' newest collectives, and the answers are
printed grouped (console/job/stack_view.py, collective_view.py). Read-only: no confirmation.
redis and the views are imported when the subcommand runs.
"""

from __future__ import annotations

import argparse
import json

from elastic_agent.coordination.transport.endpoints import Endpoint
from elastic_agent.coordination.wire.text import sanitize

from .common import EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, CliError, _fail, _job, _open, _out, _write

__all__ = ["collectives", "stacks"]


async def _ready_for_request(ep: Endpoint, args: argparse.Namespace, job: str) -> None:
    """Refuse, with one line, a per-rank request (``stacks``, ``collectives``) that no worker
    can answer: the job ended, no round completed, or ``--rank`` is not in it."""
    import redis

    from elastic_agent.coordination.wire.protocol import ProtocolError
    from elastic_agent.coordination.wire.stack_replies import check_request_size

    from ..job.stack_view import job_round

    client = await _open(ep, job)
    try:
        final = (await client.meta()).get("final_state")
        if final:
            raise CliError(f"job '{job}' has already {sanitize(final)}: no worker to ask")
        info = await job_round(ep, job)
    except (redis.RedisError, OSError) as exc:
        raise CliError(f"cannot read job '{job}': {sanitize(str(exc))}") from None
    except ProtocolError as exc:
        raise CliError(f"job '{job}' has an unreadable round record ({sanitize(str(exc))}): "
                       "its rendezvous key was written by something other than its agents; "
                       "nothing was asked") from None
    finally:
        await client.close()
    if info is None or not info.total_workers:
        raise CliError(f"job '{job}' has no running workers (no rendezvous round completed)")
    if args.rank is not None and args.rank >= info.total_workers:
        raise CliError(f"rank {args.rank} is not in job '{job}' (world size "
                       f"{info.total_workers})", EXIT_USAGE)
    try:
        check_request_size(info, args.rank)
    except ProtocolError as exc:
        raise CliError(f"job '{job}': {exc}") from None


async def stacks(ep: Endpoint, args: argparse.Namespace) -> int:
    """Ask every agent of the job for its ranks' Python stacks (read-only: no confirmation)."""
    import redis

    from ..job.stack_view import fetch_stacks, result_json, result_lines

    job = _job(args)
    await _ready_for_request(ep, args, job)
    try:
        result = await fetch_stacks(ep, job, rank=args.rank, timeout=args.timeout)
    except (redis.RedisError, OSError) as exc:
        raise CliError(f"cannot ask job '{job}' for stacks on {ep.display}: "
                       f"{sanitize(str(exc))}") from None
    if args.json:
        _out(json.dumps(result_json(result, job)))
    else:
        _write(result_lines(result, job))
    if not any(s.threads for s in result.stacks):
        return _fail(f"no rank of job '{job}' answered with stacks", EXIT_RUNTIME)
    return EXIT_OK


async def collectives(ep: Endpoint, args: argparse.Namespace) -> int:
    """Ask every agent for its ranks' flight recorder traces (read-only: no confirmation)."""
    import redis

    from ..job.collective_view import fetch_collectives, result_json, result_lines

    job = _job(args)
    await _ready_for_request(ep, args, job)
    try:
        result = await fetch_collectives(ep, job, rank=args.rank, timeout=args.timeout)
    except (redis.RedisError, OSError) as exc:
        raise CliError(f"cannot ask job '{job}' for collectives on {ep.display}: "
                       f"{sanitize(str(exc))}") from None
    if args.json:
        _out(json.dumps(result_json(result, job)))
    else:
        _write(result_lines(result, job))
    if not result.analysis["answered"]:
        return _fail(f"no rank of job '{job}' answered with a collective trace (is "
                     "--flight-recorder 0, or torch.distributed not started yet?)", EXIT_RUNTIME)
    return EXIT_OK
