"""`elastic-agent`: torchrun's command line, Redis-coordinated.

    elastic-agent --redis host --job-id job-42 --nnodes 2:4 --nproc-per-node 8 train.py
    elastic-agent --standalone --nproc-per-node 4 train.py
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys

from ..coordination.connection import (
    RedisUnavailableError,
    argv_without_passwords,
    connect,
    parse_endpoint,
    redact,
)
from ..coordination.protocol import ProtocolError
from ..coordination.rendezvous import RendezvousConnectionError, RendezvousError
from ..coordination.text import terminal_line, terminal_lines
from .config import AgentConfig, UsageError, parse_args
from .standalone import RedisServer, RedisServerNotFoundError, standalone_port


def _fail(message: str, code: int) -> int:
    # Errors quote what Redis held (member names, job state): one policy for all output.
    # redact: the last guard, should a message ever quote a URL or a password in any form.
    print(terminal_line(f"elastic-agent: error: {redact(message)}", False), file=sys.stderr,
          flush=True)
    return code


class _SafeFormatter(logging.Formatter):
    """Log records quote records from Redis and worker text: escape them like any output."""

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(terminal_lines(redact(super().format(record)), False))


# Options whose value is a Redis endpoint, possibly with a password that ps must not show.
_ENDPOINT_FLAGS = ("--redis", "--rdzv-endpoint", "--rdzv_endpoint")


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # first, before anything else runs: may re-exec without the password
        argv = argv_without_passwords(_ENDPOINT_FLAGS)
    handler = logging.StreamHandler()
    handler.setFormatter(_SafeFormatter("[elastic-agent] %(levelname)s %(name)s: %(message)s"))
    level = os.environ.get("ELASTIC_LOG_LEVEL", "WARNING").upper()
    if not isinstance(logging.getLevelName(level), int):
        return _fail(f"ELASTIC_LOG_LEVEL={level!r} is not a level: use DEBUG, INFO, WARNING or ERROR", 2)
    logging.basicConfig(level=level, handlers=[handler])
    try:
        cfg = parse_args(argv)
    except UsageError as exc:
        return _fail(str(exc), 2)
    server: RedisServer | None = None
    try:
        if cfg.standalone:
            try:
                server = RedisServer(port=standalone_port()).start()
            except (RedisServerNotFoundError, RuntimeError) as exc:
                return _fail(str(exc), 1)
            cfg = dataclasses.replace(cfg, endpoint=parse_endpoint(server.url))
            print(f"[elastic-agent] standalone Redis on {server.url}; watch this job with:\n"
                  f"    elastic-console attach {cfg.job_id} --redis {server.url}",
                  file=sys.stderr, flush=True)
        return _run(cfg)
    finally:
        if server is not None:
            server.cleanup()


def _run(cfg: AgentConfig) -> int:
    from .elastic_agent import ElasticAgent  # after argument checks: keep --help fast
    from .workers import WorkerStartError

    try:
        connect(cfg.endpoint).close()
    except RedisUnavailableError as exc:
        return _fail(str(exc), 1)
    if cfg.log_dir_generated:
        print(f"[elastic-agent] per-rank logs in {cfg.log_dir}", file=sys.stderr, flush=True)
    try:
        return asyncio.run(ElasticAgent(cfg).run())
    except WorkerStartError as exc:
        return _fail(str(exc), 1)
    except RendezvousConnectionError as exc:
        return _fail(str(exc), 1)
    except (RendezvousError, ProtocolError) as exc:
        return _fail(str(exc), 1)
    except RedisUnavailableError as exc:
        return _fail(str(exc), 1)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
