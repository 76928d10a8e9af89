"""Test fixtures: a real redis-server per test session (never a fake), fresh job ids."""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator

import pytest
import redis

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.supervision.hosting.standalone import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = make_client(redis_url)
    yield client
    client.close()


_counter = itertools.count()


@pytest.fixture
def job_id() -> str:
    return f"t{os.getpid()}-{next(_counter)}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own, for tests that kill or restart it."""
    server = RedisServer().start()
    yield server
    server.cleanup()
