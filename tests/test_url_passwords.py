"""A raw password in a Redis URL: whatever its characters, the host connected to is the URL's
host, never a piece of the password; a URL that cannot be read is one error line (exit 2); and
no message or display shows the password or any piece of it.

Parsing is checked against redis-py's own reading of the parsed URL (what ``from_url``
connects to); the commands run for real, against real redis-servers: one that holds the
password, and a decoy at the address a misreading would take from the password.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_agent.coordination.transport import endpoints
from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.transport.endpoints import (
    EndpointError,
    parse_endpoint,
    redact,
    redact_endpoint,
)
from elastic_agent.supervision.hosting.standalone import RedisServer
from tests.agents import Agent

CONSOLE = [sys.executable, "-m", "elastic_console.cli"]
AGENT = [sys.executable, "-m", "elastic_agent.supervision.cli"]

# Letters that no message, scheme, host or option name of the tools holds four in a row of,
# with the characters that end a URL's parts early: any window of 4 of a password made of
# them, with one of the letters in it, that shows up in a text is a leak, not a coincidence.
# (A window of punctuation alone is not: "://:" is in every "redis://:***@host" there is.)
LETTERS = "QXZJKVW"
SPECIALS = "@?#/:&=[]!$;,+ "


def windows(password: str, size: int = 4) -> set[str]:
    every = {password[i:i + size] for i in range(len(password) - size + 1)} or {password}
    return {w for w in every if any(c in LETTERS for c in w)}


def assert_no_piece(text: str, password: str, what: str) -> None:
    for piece in windows(password):
        assert piece not in text, f"{what} shows {piece!r} of the password:\n{text}"


@st.composite
def passwords(draw: st.DrawFn) -> str:
    """Passwords of LETTERS and SPECIALS; half of them hold "@" followed, later, by one of
    "?", "/", "#": what cuts a URL short for urlsplit and once made a host of a piece."""
    chars = st.sampled_from(LETTERS + SPECIALS)
    word = st.text(st.sampled_from(LETTERS), min_size=1, max_size=6)
    head = draw(st.text(chars, min_size=0, max_size=10))
    if draw(st.booleans()):
        head += "@" + draw(word) + draw(st.sampled_from("?/#")) + draw(word)
    tail = draw(st.text(chars, min_size=0, max_size=8))
    password = draw(word) + head + tail
    return password if len(password) >= 4 else password + "QXZJ"


HOSTS = [("127.0.0.1", "127.0.0.1"), ("db.example.org", "db.example.org"), ("[::1]", "::1"),
         ("redis-7", "redis-7")]


@pytest.fixture
def fresh_memory() -> Iterator[None]:
    """No password remembered from other tests: only the structural rules may hide one."""
    saved = endpoints._known_passwords
    endpoints._known_passwords = ()
    yield
    endpoints._known_passwords = saved


def test_any_password_parses_to_the_real_host_and_never_shows(fresh_memory: None):
    seen: Counter[str] = Counter()

    @settings(max_examples=400, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(password=passwords(), host=st.sampled_from(HOSTS),
           port=st.integers(1, 65535), user=st.sampled_from(["alice", ""]),
           scheme=st.sampled_from(["redis://", "rediss://", "redis+cluster://",
                                   "redis+sentinel://"]),
           db=st.sampled_from(["", "/3", "/0?db=2"]))
    def check(password: str, host: tuple[str, str], port: int, user: str, scheme: str,
              db: str) -> None:
        endpoints._known_passwords = ()
        written, real = host
        sentinel = scheme == "redis+sentinel://"
        path = ("/mymaster" + db.replace("/0", "").replace("/3", "")) if sentinel else db
        url = f"{scheme}{user}:{password}@{written}:{port}{path}"
        raw_at_then_cut = any(c in password.partition("@")[2] for c in "?/#")
        assert_no_piece(redact_endpoint(url), password, "redact_endpoint")
        assert_no_piece(redact(f"cannot use {url} now"), password, "redact")
        try:
            ep = parse_endpoint(url)
        except EndpointError as exc:
            seen["refused"] += 1
            assert_no_piece(str(exc), password, "the parse error")
            return
        seen["parsed"] += 1
        seen["parsed, '@' then '?', '/' or '#' in the password"] += raw_at_then_cut
        if sentinel:
            hosts, _, _ = endpoints._sentinel_tail(
                endpoints._split_scheme(ep.url)[1].rpartition("@")[2], "", False)
            assert hosts == [(real, port)], (url, ep.url)
            got_password = endpoints._url_credentials(ep.url)[1]
            from urllib.parse import unquote
            assert unquote(got_password or "") == password, (url, ep.url)
        else:
            meaning = endpoints._meaning(ep.url)
            assert (meaning["host"], meaning["port"]) == (real, port), (url, meaning)
            assert meaning["password"] == password, (url, meaning)
        for shown in (ep.display, str(ep), repr(ep)):
            assert_no_piece(shown, password, "the endpoint's display")

    check()
    # The interesting branch must be reached, not only the easy one.
    assert seen["parsed, '@' then '?', '/' or '#' in the password"] >= 100, seen
    assert seen["parsed"] >= 250, seen


@pytest.mark.parametrize("url, host, port, password", [
    # The inputs: the userinfo runs to the last "@".
    ("redis://alice:Tr0ub@dor?horsebatterySTAPLE@127.0.0.1:1/0?db=0", "127.0.0.1", 1,
     "Tr0ub@dor?horsebatterySTAPLE"),
    ("redis://u:pa@wo?rdSECRET@127.0.0.1:1", "127.0.0.1", 1, "pa@wo?rdSECRET"),
    ("redis://u:pa@wo/rdSECRET@127.0.0.1:1/2", "127.0.0.1", 1, "pa@wo/rdSECRET"),
    ("rediss://u:pa@wo?ssl_cert_reqs=none@127.0.0.1:1", "127.0.0.1", 1,
     "pa@wo?ssl_cert_reqs=none"),
])
def test_a_raw_password_never_gives_the_host(url: str, host: str, port: int, password: str):
    ep = parse_endpoint(url)
    meaning = endpoints._meaning(ep.url)
    assert (meaning["host"], meaning["port"], meaning["password"]) == (host, port, password)
    assert_no_piece(ep.display, password, "the display")


@pytest.mark.parametrize("url, said, secret", [
    ("redis://127.0.0.1:1/?x=1", "the query option 'x' is not one", ""),
    ("redis://127.0.0.1:1/0?db=1&retry_on_error=x", "'retry_on_error' is not one", ""),
    ("redis://127.0.0.1:1?protocol=3", "'protocol' is not one", ""),
    ("redis://127.0.0.1:1?db=x", "'db' has no valid value", ""),
    ("redis://127.0.0.1:1?ssl_ca_certs=/ca.pem", "'ssl_ca_certs' needs TLS", ""),
    ("rediss://127.0.0.1:1?ssl_cert_reqs=maybe", "'ssl_cert_reqs' has no valid value", ""),
    ("unix:///tmp/r.sock?x=1", "the query option 'x' is not one", ""),
    # A query option made of a password's tail is never named.
    ("redis://u:pa@wo?rdSECRET=QX@", "a query option is not one", "rdSECRET"),
    # Two readings, two servers: neither is connected to.
    ("redis://u:pa@woRD?password=ZZ@127.0.0.1:1", "reads two ways", "woRD"),
    ("redis+sentinel://u:pa@woRD/svc?sentinel_password=ZZ@127.0.0.1:26379/mymaster",
     "reads two ways", "woRD"),
    ("redis+sentinel://127.0.0.1/svc?x=1", "the query option 'x' is not one", ""),
])
def test_an_unreadable_url_is_one_clear_error(url: str, said: str, secret: str):
    with pytest.raises(EndpointError) as info:
        parse_endpoint(url)
    message = str(info.value)
    assert message.startswith("invalid Redis endpoint") and said in message, message
    assert "\n" not in message
    if secret:
        assert secret not in message and secret not in redact(message), message


# -- the commands, for real ----------------------------------------------------------------

def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ELASTIC_REDIS_URL", "REDISCLI_AUTH", "ELASTIC_REDIS_PASSWORD_FILE")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def decoy() -> Iterator[RedisServer]:
    """A server without a password at the address a misreading takes from the password."""
    srv = RedisServer().start()
    yield srv
    srv.cleanup()


@pytest.fixture(scope="module")
def guarded(decoy: RedisServer) -> Iterator[tuple[RedisServer, str]]:
    """A server whose password names the decoy: ``Q@127.0.0.1:DECOY?XZ``."""
    srv = RedisServer().start()
    password = f"Q@127.0.0.1:{decoy.port}?XZ"
    r = make_client(srv.url)
    r.config_set("requirepass", password)
    r.close()
    yield srv, password
    srv.cleanup()


def connections_to(server: RedisServer) -> int:
    r = redis.Redis(host=server.host, port=server.port)
    try:
        return int(r.info("stats")["total_connections_received"])
    finally:
        r.close()


def test_the_console_and_the_agent_reach_the_real_host_not_the_passwords(
        decoy: RedisServer, guarded: tuple[RedisServer, str], tmp_path: Path):
    server, password = guarded
    url = f"redis://default:{password}@127.0.0.1:{server.port}"
    before = connections_to(decoy)
    p = subprocess.run([*CONSOLE, "--redis", url, "ls"], capture_output=True, text=True,
                       timeout=60, env=clean_env(), stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([*CONSOLE, "ls"], capture_output=True, text=True, timeout=60,
                       env=clean_env(ELASTIC_REDIS_URL=url), stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    job_id = f"url-{uuid.uuid4().hex[:8]}"
    agent = Agent(["--redis", url, "--job-id", job_id, "--nproc-per-node", "1",
                   "--local-addr", "127.0.0.1", "-m", "platform"], tmp_path, "agent",
                  env=clean_env())
    assert agent.wait(120) == 0, agent.output
    # The password's pieces that are not also the real host's address.
    for piece in (password, "Q@", "?XZ", str(decoy.port)):
        assert piece not in agent.output, agent.output
    r = make_client(parse_endpoint(url))
    try:
        assert r.exists(f"elastic:{{{job_id}}}:meta"), "the job ran on the real server"
    finally:
        r.close()
    # One connection is this check's own.
    assert connections_to(decoy) == before + 1, "something connected to the password's host"


SUBCOMMANDS = [[], ["ls"], ["status", "j"], ["logs", "j"], ["events", "j"], ["restart", "j"],
               ["stop", "j"], ["stacks", "j"], ["rm", "j"], ["attach", "j"],
               ["serve", "j"]]
BAD_URLS = ["redis://127.0.0.1:1/?x=1",
            "redis://alice:Tr0ub@dorQX?horsebatterySTAPLE=1@",
            "redis://u:paQXZ@woRDQ?password=ZZVW@127.0.0.1:1"]


def one_error_line(stderr: str, prog: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: invalid Redis endpoint"), \
        stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("sub", SUBCOMMANDS, ids=lambda s: s[0] if s else "default")
def test_every_console_subcommand_refuses_a_bad_url_in_one_line(sub: list[str]):
    for url in BAD_URLS:
        for how in ("flag", "env"):
            args = [*CONSOLE, *(["--redis", url] if how == "flag" else []), *sub]
            env = clean_env(**({"ELASTIC_REDIS_URL": url} if how == "env" else {}))
            p = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env,
                               stdin=subprocess.DEVNULL)
            assert p.returncode == 2, (url, how, p.stderr)
            one_error_line(p.stderr, "elastic-console")
            for secret in ("horsebattery", "STAPLE", "woRD", "paQXZ", "ZZVW"):
                assert secret not in p.stdout + p.stderr, (url, p.stderr)


@pytest.mark.parametrize("url", BAD_URLS)
def test_the_agent_refuses_a_bad_url_in_one_line(url: str, tmp_path: Path):
    for how in ("flag", "env"):
        args = [*AGENT, *(["--redis", url] if how == "flag" else []), "--job-id", "j",
                "--nproc-per-node", "1", "-m", "platform"]
        env = clean_env(**({"ELASTIC_REDIS_URL": url} if how == "env" else {}))
        p = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env,
                           stdin=subprocess.DEVNULL, cwd=tmp_path)
        assert p.returncode == 2, (url, how, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "invalid Redis endpoint" in lines[0], p.stderr
        for secret in ("horsebattery", "STAPLE", "woRD", "paQXZ", "ZZVW"):
            assert secret not in p.stdout + p.stderr, (url, p.stderr)
