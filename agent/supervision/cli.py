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

from ..coordination.connection import RedisUnavailableError, connect, parse_endpoint
from ..coordination.rendezvous import RendezvousConnectionError, RendezvousError
from .config import AgentConfig, UsageError, parse_args
from .standalone import RedisServer, RedisServerNotFoundError, standalone_port


def _fail(message: str, code: int) -> int:
    print(f"elastic-agent: error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("ELASTIC_LOG_LEVEL", "WARNING"),
                        format="[elastic-agent] %(levelname)s %(name)s: %(message)s")
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

    try:
        connect(cfg.endpoint).close()
    except RedisUnavailableError as exc:
        return _fail(str(exc), 1)
    try:
        return asyncio.run(ElasticAgent(cfg).run())
    except RendezvousConnectionError as exc:
        return _fail(str(exc), 1)
    except RendezvousError as exc:
        return _fail(str(exc), 1)
    except RedisUnavailableError as exc:
        return _fail(str(exc), 1)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
