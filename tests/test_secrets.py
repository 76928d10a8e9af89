"""Secrets never shown: a Redis password, whatever its characters, in no message, output, log,
event, screen or process title.

Real processes against a real redis-server that has ``requirepass`` set: ``elastic-agent`` runs
a short job whose workers reach Redis with the password it handed them; ``elastic-console``
reads that job back. Every text they produce (and every record of the job in Redis) is searched
for the password, its percent-encoded spellings and pieces of it, so a partial redaction fails
too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from elastic_agent.coordination.ports import free_port
from elastic_agent.coordination.transport import endpoints
from elastic_agent.coordination.transport.connection import RedisUnavailableError, explain_error, make_client
from elastic_agent.coordination.transport.endpoints import (
    Endpoint,
    EndpointError,
    parse_endpoint,
    redact,
    redact_endpoint,
    with_outside_password,
)
from elastic_agent.coordination.wire.event_records import EventType, decode_event
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.supervision.config import UsageError, parse_args
from elastic_agent.supervision.hosting.standalone import RedisServer
from elastic_console.tui.app import ConsoleApp
from tests.agents import ROOT, SCRIPTS, Agent, wait_until
from tests.waiting import wait_until_async

# "@", ":", a space, "/" and "#": each breaks a naive parser or redactor in its own way.
PASSWORD = "Zq@7 x:K/#9v"
WRONG = "Wrong@pa ss:/#Qj"
ENCODED = quote(PASSWORD, safe="")
# Pieces too: a redaction that stops early or starts late must fail. None of them can occur in
# the tools' own words, job ids, temporary names (lowercase) or numbers; the machine's paths,
# which may, are taken out first (HOST_PATHS).
LEAKS = [PASSWORD, ENCODED, quote(PASSWORD), "Zq", "7 x", "x:K", "#9v", "%2F%23", WRONG,
         quote(WRONG, safe=""), "Wrong", "Qj"]
CONSOLE = [sys.executable, "-m", "elastic_console.cli"]


#: The machine's paths the tools print (the checkout, the venv's python): not the tools' words,
#: and mixed case where the checkout is a `mktemp -d` (CI's once was /tmp/tmp.Qjma1iBTFZ).
#: Taken out before the pieces are looked for; a piece printed next to one is still found.
HOST_PATHS = sorted({str(ROOT), sys.executable, os.path.realpath(sys.executable), sys.prefix},
                    key=len, reverse=True)


def assert_clean(text: str, what: str = "output") -> None:
    scrubbed = text
    for path in HOST_PATHS:
        scrubbed = scrubbed.replace(path, "<path>")
    for leak in LEAKS:
        assert leak not in scrubbed, f"{what} shows {leak!r}:\n{text}"


def url(port: int, password: str = PASSWORD, user: str = "default") -> str:
    return f"redis://{user}:{password}@127.0.0.1:{port}"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ELASTIC_REDIS_URL", "REDISCLI_AUTH", "ELASTIC_REDIS_PASSWORD_FILE")}
    return {**env, **extra}


def run_console(*args: str, env: dict[str, str] | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CONSOLE, *args], capture_output=True, text=True, timeout=timeout,
                          env=env or clean_env(), stdin=subprocess.DEVNULL)


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """A redis-server that takes only PASSWORD (set after start: a space in it would not
    survive redis-server's own command line)."""
    srv = RedisServer().start()
    r = make_client(srv.url)
    r.config_set("requirepass", PASSWORD)
    r.close()
    yield srv
    srv.cleanup()


@pytest.fixture(scope="module")
def port(server: RedisServer) -> int:
    return server.port


@pytest.fixture(scope="module")
def r(port: int) -> Iterator[redis.Redis]:
    client = make_client(parse_endpoint(url(port, ENCODED)))
    yield client
    client.close()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A worker that proves it reached the agent's Redis through ELASTIC_REDIS_URL and that
    the agent's password did not come with it (docs/SECURITY.md: workers get no credential
    of the agent's)."""
    path = tmp_path_factory.mktemp("secrets") / "reach_redis.py"
    path.write_text(
        "import os\n"
        "import redis\n"
        "assert not {'REDISCLI_AUTH', 'ELASTIC_REDIS_PASSWORD_FILE'} & set(os.environ)\n"
        "try:\n"
        "    redis.Redis.from_url(os.environ['ELASTIC_REDIS_URL']).ping()\n"
        "    raise SystemExit('the worker reached redis with a password of the agent')\n"
        "except redis.AuthenticationError:\n"
        "    pass\n"
        "print(f\"rank {os.environ['RANK']} reached redis\", flush=True)\n")
    return path


def agent_args(endpoint_args: list[str], job_id: str, script: Path, *rest: str) -> list[str]:
    return [*endpoint_args, "--job-id", job_id, "--local-addr", "127.0.0.1",
            "--nproc-per-node", "2", "--shutdown-timeout", "5", str(script), *rest]


def job_records(r: redis.Redis, job_id: str) -> str:
    """Every value of every key of the job (its log streams too), as one text."""
    out = []
    keys = [*r.scan_iter(match=f"elastic:{{{job_id}}}:*", count=1000),
            *r.scan_iter(match=f"elastic:log:{{{job_id}/*", count=1000)]
    for key in keys:
        kind = r.type(key).decode()
        if kind == "stream":
            out += [repr(fields) for _, fields in r.xrange(key)]
        elif kind == "hash":
            out.append(repr(r.hgetall(key)))
        elif kind == "string":
            out.append(repr(r.get(key)))
        elif kind == "zset":
            out.append(repr(r.zrange(key, 0, -1, withscores=True)))
        elif kind == "set":
            out.append(repr(r.smembers(key)))
        elif kind == "list":
            out.append(repr(r.lrange(key, 0, -1)))
    return "\n".join(out)


@pytest.fixture(scope="module")
def finished_job(port: int, r: redis.Redis, worker: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> str:
    """A short real job, the password given raw (unencoded) in ``--redis``."""
    job_id = f"sec-{uuid.uuid4().hex[:8]}"
    agent = Agent(agent_args(["--redis", url(port)], job_id, worker),
                  tmp_path_factory.mktemp("job"), "agent", env=clean_env())
    code = agent.wait(120)
    out = agent.output
    assert code == 0, out
    assert "rank 0 reached redis" in out and "rank 1 reached redis" in out, out
    assert "default:***@127.0.0.1" in out, "the agent names its endpoint, redacted"
    assert_clean(out, "the agent's output")
    return job_id


# -- parsing and redaction --------------------------------------------------------------------


@pytest.mark.parametrize("value", [
    f"default:{PASSWORD}@127.0.0.1:6379",      # scheme-less: was echoed whole
    f"default:{ENCODED}@127.0.0.1:6379",
    f":{PASSWORD}@127.0.0.1",
    f"default:{PASSWORD}",                    # the host forgotten
    f"redis://default:{PASSWORD}@127.0.0.1:99999",
    f"redis://default:{ENCODED}@127.0.0.1:99999",
    f"redis://default:{PASSWORD}@127.0.0.1:6379/x",
    f"redis://default:{PASSWORD}",
    f"redis://default:{ENCODED}",
    f"redis://:{PASSWORD}@[::1:6379",
    f"http://default:{PASSWORD}@127.0.0.1:6379",
    f"redis://127.0.0.1:6379/0/x?password={PASSWORD}",
])
def test_parse_errors_never_show_the_password(value: str):
    with pytest.raises(EndpointError) as info:
        parse_endpoint(value)
    message = str(info.value)
    assert message.startswith("invalid Redis endpoint"), message
    assert_clean(message, "the parse error")
    assert_clean(redact_endpoint(value), "redact_endpoint")


@pytest.mark.parametrize("value, shown", [
    # The userinfo ends at the LAST "@": after a first one, "9v" would read as a host.
    ("redis://u:Zq@9v/Qj@127.0.0.1:6379", "redis://u:***@127.0.0.1:6379"),
    ("redis://Zq@9v/Qj@127.0.0.1:6379/1", "redis://***@127.0.0.1:6379/1"),
    ("u:Zq@9v@127.0.0.1", "u:***@127.0.0.1"),
    ("redis://default:Zq", "redis://default:***"),
    # "password=" before the last "@": a query password holding "@", or a userinfo password
    # holding "?password=" (then "127.0.0.1:6379/0" is a piece of it): both are hidden.
    ("redis://127.0.0.1:6379/0?password=Zq@9v&db=1", "redis://127.0.0.1:***"),
    ("redis://u:Zq@9v?password=Qj@127.0.0.1:6379", "redis://u:***"),
    ("unix://:Zq@9v@/tmp/redis.sock?db=1", "unix://:***@/tmp/redis.sock?db=1"),
    ("redis://[::1]:6379/2", "redis://[::1]:6379/2"),
])
def test_redact_endpoint_exactly(value: str, shown: str):
    assert redact_endpoint(value) == shown
    assert redact_endpoint(shown) == shown, "redacting twice changes nothing"


def test_a_raw_or_encoded_password_connects_and_is_never_displayed(port: int):
    for value in (url(port), url(port, ENCODED), f"redis://:{PASSWORD}@127.0.0.1:{port}/0"):
        ep = parse_endpoint(value)
        for shown in (ep.display, str(ep), repr(ep), f"{ep}"):
            assert_clean(shown, "an endpoint's display")
        assert "***@127.0.0.1" in ep.display
        client = make_client(ep)
        try:
            assert client.ping()
        finally:
            client.close()


@pytest.mark.parametrize("template, structural", [
    ("cannot reach redis://default:{pw}@127.0.0.1:6379 now", True),
    ("cannot reach redis://default:{pw}@127.0.0.1:6379: Error 111; try user@host", True),
    ("see redis://127.0.0.1:6379/0?password={pw}&db=2 and more", True),
    ("unix://:{pw}@/tmp/redis.sock", True),
    # No host after the password: in prose, what follows its "@" may be a host and words;
    # only a password the process knows is hidden there (parse errors use redact_endpoint).
    ("redis://u:{pw}", False),
])
def test_redact_fails_closed_in_free_text(template: str, structural: bool, port: int):
    parse_endpoint(url(port))  # the process now knows PASSWORD: the last line of defence
    # WRONG was never given to this process: only the structural rules can hide it.
    unknown = (WRONG, quote(WRONG, safe="")) if structural else ()
    for pw in (PASSWORD, ENCODED, *unknown):
        assert_clean(redact(template.format(pw=pw)), "redact")


def test_a_password_known_to_the_process_is_masked_anywhere(port: int):
    parse_endpoint(url(port))
    assert_clean(redact(f"an unforeseen message quoting {PASSWORD} and {ENCODED}"))


def test_explain_error_never_shows_the_password():
    exc = redis.ConnectionError(f"Error connecting to {url(1)}: refused")
    err = explain_error(exc, url(1))
    assert isinstance(err, RedisUnavailableError)
    assert_clean(str(err), "explain_error")


def test_outside_password_order_and_file_errors(tmp_path: Path):
    plain = parse_endpoint("redis://alice@127.0.0.1:1")
    pw_file = tmp_path / "pw"
    pw_file.write_text(PASSWORD + "\n")
    other = tmp_path / "other"
    other.write_text("from-the-env-file\n")
    env = {"REDISCLI_AUTH": "from-rediscli-auth", "ELASTIC_REDIS_PASSWORD_FILE": str(other)}

    def password(ep: Endpoint) -> str:
        return redis.connection.parse_url(ep.url)["password"]

    # The flag's file beats the environment's file, which beats REDISCLI_AUTH.
    assert password(with_outside_password(plain, str(pw_file), env)) == PASSWORD
    assert password(with_outside_password(plain, None, env)) == "from-the-env-file"
    assert password(with_outside_password(plain, None, {"REDISCLI_AUTH": PASSWORD})) == PASSWORD
    # A password in the URL wins over all of them.
    in_url = parse_endpoint(url(1, "in-the-url"))
    assert with_outside_password(in_url, str(pw_file), env) == in_url
    ep = with_outside_password(plain, str(pw_file), env)
    assert redis.connection.parse_url(ep.url)["username"] == "alice"
    assert_clean(ep.display)
    # Errors about the file name it, never what it holds.
    bad = tmp_path / "bad"
    for content in (b"", PASSWORD.encode() + b"\xff\n", PASSWORD.encode() * 1000):
        bad.write_bytes(content)
        with pytest.raises(EndpointError) as info:
            with_outside_password(plain, str(bad), {})
        assert str(bad) in str(info.value)
        assert_clean(str(info.value), "a password-file error")
    with pytest.raises(EndpointError, match="cannot read"):
        with_outside_password(plain, str(tmp_path / "missing"), {})


def test_agent_config_takes_the_password_from_outside_argv(tmp_path: Path, worker: Path):
    pw_file = tmp_path / "pw"
    pw_file.write_text(PASSWORD)
    for argv, env in (
        (["--redis", "127.0.0.1:1"], {"REDISCLI_AUTH": PASSWORD}),
        (["--redis", "127.0.0.1:1", "--redis-password-file", str(pw_file)], {}),
        (["--rdzv-endpoint", "127.0.0.1:1"], {"ELASTIC_REDIS_PASSWORD_FILE": str(pw_file)}),
    ):
        cfg = parse_args([*argv, str(worker)], environ=env)
        assert redis.connection.parse_url(cfg.endpoint.url)["password"] == PASSWORD
        assert_clean(repr(cfg), "the agent's config")
    with pytest.raises(UsageError) as info:
        parse_args(["--redis", f"default:{PASSWORD}@127.0.0.1:1", str(worker)], environ={})
    assert_clean(str(info.value))


def test_argv_restore_takes_back_only_what_it_hid(monkeypatch: pytest.MonkeyPatch):
    hidden = redact_endpoint(url(1))
    monkeypatch.setattr(sys, "argv", ["prog", "--redis", hidden, "ls"])
    payload = f'[[1, "{hidden}", "{url(1)}"]]'
    monkeypatch.setenv(endpoints._ARGV_ENV, payload)
    assert endpoints.argv_without_passwords(["--redis"]) == ["--redis", url(1), "ls"]
    assert endpoints._ARGV_ENV not in os.environ, "the private variable goes no further"
    # A stale or foreign variable does not rewrite an argument it did not hide.
    monkeypatch.setattr(sys, "argv", ["prog", "--redis", "127.0.0.1:1", "ls"])
    monkeypatch.setenv(endpoints._ARGV_ENV, payload)
    assert endpoints.argv_without_passwords(["--redis"]) == ["--redis", "127.0.0.1:1", "ls"]
    monkeypatch.setenv(endpoints._ARGV_ENV, "[" * 100_000)
    assert endpoints.argv_without_passwords(["--redis"]) == ["--redis", "127.0.0.1:1", "ls"]


# -- the agent ----------------------------------------------------------------------------------


def test_agent_output_and_the_jobs_records_never_show_the_password(finished_job: str,
                                                                   r: redis.Redis):
    records = job_records(r, finished_job)
    assert "reached redis" in records, "the job's logs are in Redis"
    assert_clean(records, "the job's records in Redis")


def test_agent_with_rediscli_auth_and_with_a_password_file(port: int, worker: Path,
                                                          tmp_path: Path):
    pw_file = tmp_path / "pw"
    pw_file.write_text(PASSWORD + "\n")
    for name, args, env in (
        ("env", ["--redis", f"127.0.0.1:{port}"], clean_env(REDISCLI_AUTH=PASSWORD)),
        ("file", ["--redis", f"redis://127.0.0.1:{port}", "--redis-password-file", str(pw_file)],
         clean_env()),
    ):
        job_id = f"sec-{name}-{uuid.uuid4().hex[:6]}"
        agent = Agent(agent_args(args, job_id, worker), tmp_path, name, env=env)
        assert agent.wait(120) == 0, agent.output
        assert "rank 1 reached redis" in agent.output
        assert_clean(agent.output, "the agent's output")


@pytest.mark.parametrize("args, code", [
    (["--redis", f"default:{PASSWORD}@127.0.0.1:6379"], 2),
    (["--redis", f"redis://default:{PASSWORD}@127.0.0.1:6379/x"], 2),
    (["--redis=redis://default:{WRONG}@127.0.0.1:{PORT}"], 1),
    (["--rdzv-endpoint", "redis://default:{WRONG}@127.0.0.1:{PORT}"], 1),
    (["--redis", "redis://default:{PASSWORD}@127.0.0.1:{CLOSED}"], 1),
])
def test_agent_errors_never_show_the_password(args: list[str], code: int, port: int,
                                              worker: Path, tmp_path: Path):
    args = [a.format(WRONG=WRONG, PORT=port, PASSWORD=PASSWORD, CLOSED=free_port())
            for a in args]
    agent = Agent(agent_args(args, f"sec-{uuid.uuid4().hex[:8]}", worker), tmp_path, "agent",
                  env=clean_env())
    assert agent.wait(60) == code, agent.output
    assert "elastic-agent: error:" in agent.output
    assert_clean(agent.output, "the agent's error")


def test_a_running_agent_and_console_show_no_password_in_their_command_line(
        port: int, r: redis.Redis, tmp_path: Path):
    job_id = f"sec-ps-{uuid.uuid4().hex[:6]}"
    agent = Agent(agent_args([f"--redis={url(port)}"], job_id, SCRIPTS / "sleeper.py",
                             "--seconds", "60"), tmp_path, "agent", env=clean_env())
    follower = None
    try:
        def started() -> bool:
            evs = (decode_event(i, f) for i, f in r.xrange(JobKeys(job_id).events))
            return any(e is not None and e.type == EventType.WORKERS_STARTED for e in evs)

        wait_until(started, 60, "the workers")
        title = cmdline(agent.pid)
        assert "--redis=redis://default:***@127.0.0.1" in title, title
        assert_clean(title, "the agent's /proc/PID/cmdline")
        for child in agent.descendants():
            assert_clean(" ".join(child.cmdline()), "a worker's command line")
            assert endpoints._ARGV_ENV not in child.environ()

        out = tmp_path / "follow.out"
        with open(out, "wb") as f:
            follower = subprocess.Popen([*CONSOLE, "--redis", url(port), "logs", job_id, "-f"],
                                        stdout=f, stderr=subprocess.STDOUT, env=clean_env(),
                                        stdin=subprocess.DEVNULL)
        wait_until(lambda: "tick" in out.read_text(errors="replace"), 30, "followed lines")
        title = cmdline(follower.pid)
        assert "--redis redis://default:***@127.0.0.1" in title, title
        assert_clean(title, "the console's /proc/PID/cmdline")
        follower.send_signal(signal.SIGINT)
        assert follower.wait(30) == 0
        assert_clean(out.read_text(errors="replace"), "the console's output")
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
            follower.wait()
        agent.kill()
        agent.wait(30)
    assert_clean(agent.output, "the agent's output")


# -- the console --------------------------------------------------------------------------------


CONSOLE_COMMANDS = [["ls"], ["status", "{job}"], ["status", "{job}", "--json"],
                    ["logs", "{job}"], ["events", "{job}"]]


@pytest.mark.parametrize("form", ["raw", "encoded", "rediscli_auth", "password_file"])
def test_console_commands_never_show_the_password(form: str, finished_job: str, port: int,
                                                  tmp_path: Path):
    env = clean_env()
    endpoint = {"raw": url(port), "encoded": url(port, ENCODED)}.get(form,
                                                                    f"127.0.0.1:{port}")
    extra: list[str] = []
    if form == "rediscli_auth":
        env["REDISCLI_AUTH"] = PASSWORD
    elif form == "password_file":
        (tmp_path / "pw").write_text(PASSWORD + "\n")
        extra = ["--redis-password-file", str(tmp_path / "pw")]
    for command in CONSOLE_COMMANDS:
        args = [a.format(job=finished_job) for a in command]
        p = run_console("--redis", endpoint, *extra, *args, env=env)
        assert p.returncode == 0, (args, p.stderr)
        assert_clean(p.stdout + p.stderr, f"elastic-console {' '.join(args)}")
        expected = {"ls": finished_job, "status": "***@127.0.0.1", "logs": "reached redis",
                    "events": "workers_started"}[args[0]]
        assert expected in p.stdout, (args, p.stdout)


@pytest.mark.parametrize("args, code", [
    (["--redis", f"default:{PASSWORD}@127.0.0.1:6379", "ls"], 2),
    (["--redis", f"redis://default:{PASSWORD}@127.0.0.1:99999", "ls"], 2),
    (["--redis", "redis://default:{WRONG}@127.0.0.1:{PORT}", "ls"], 1),
    (["--redis", "redis://default:{PASSWORD}@127.0.0.1:{PORT}", "status", "no-such-job"], 1),
    (["--redis", "redis://default:{PASSWORD}@127.0.0.1:{PORT}", "events", "no-such-job"], 1),
    (["--redis", "redis://default:{PASSWORD}@127.0.0.1:{CLOSED}", "logs", "job"], 1),
    (["ls", "--redis", "redis://:{WRONG}@127.0.0.1:{PORT}"], 1),
])
def test_console_errors_never_show_the_password(args: list[str], code: int, port: int):
    args = [a.format(WRONG=WRONG, PORT=port, PASSWORD=PASSWORD, CLOSED=free_port())
            for a in args]
    p = run_console(*args)
    assert p.returncode == code, p.stderr
    assert p.stderr.startswith("elastic-console: error: ") and "Traceback" not in p.stderr
    assert_clean(p.stdout + p.stderr, "the console's error")


def test_console_says_when_the_server_wants_a_password(port: int):
    p = run_console("--redis", f"127.0.0.1:{port}", "ls")
    assert p.returncode == 1 and "REDISCLI_AUTH" in p.stderr, p.stderr


def test_the_attached_console_shows_no_password(finished_job: str, port: int):
    app = ConsoleApp(finished_job, endpoint=parse_endpoint(url(port)), cursor_blink=False)

    def screen_text() -> str:
        return "\n".join(strip.text for strip in app.screen._compositor.render_strips())

    async def main() -> str:
        async with app.run_test(size=(120, 34)) as pilot:
            await pilot.pause()
            await wait_until_async(lambda: app.loaded and "***@127.0.0.1" in screen_text(),
                                   20, "the header naming the endpoint")
            return screen_text()

    text = asyncio.run(asyncio.wait_for(main(), 60))
    assert_clean(text, "the console's screen")
