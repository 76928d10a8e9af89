"""Test fixtures: a real redis-server per test session (never a fake), fresh job ids."""

from __future__ import annotations

import importlib
import itertools
import os
import shutil
import uuid
from collections.abc import Iterator
from types import ModuleType
from typing import NoReturn

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


# -- what the suite needs ---------------------------------------------------------------------

#: ``1``: a test whose module or program is missing skips instead of failing, on a machine
#: that cannot have it. Never set in CI (.ci/run): there the suite declares what it needs,
#: and a test that vanished with its tool would let the suite pass without it.
ALLOW_MISSING = "ELASTIC_TESTS_ALLOW_MISSING"


def missing(what: str, how: str) -> NoReturn:
    """Fail (skip only under ``ELASTIC_TESTS_ALLOW_MISSING=1``): ``what`` is missing, and
    ``how`` gets it."""
    if os.environ.get(ALLOW_MISSING) == "1":
        pytest.skip(f"{what} is missing ({ALLOW_MISSING}=1)")
    pytest.fail(f"{what} is missing: {how} (or set {ALLOW_MISSING}=1 where it cannot be had, "
                "to skip the tests that need it)", pytrace=False)


def require(module: str) -> ModuleType:
    """The module a test needs (``torch``, one of its submodules), imported; its absence
    fails the test (see :func:`missing`) instead of skipping it, as importorskip would."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        why = str(exc)
    missing(f"the Python module {module} ({why})",
            "`make test` installs torch with the test extras (pip install torch, "
            "then pip install -e '.[test]')")


def require_program(name: str) -> str:
    """The path of a program a test runs (``taskset``, ``setpriv``, ``pgrep``); its absence
    fails the test (see :func:`missing`)."""
    path = shutil.which(name)
    if path is None:
        missing(f"the program {name}",
                "`make test` installs it (scripts/ensure-tools.sh, as root)")
    return path
