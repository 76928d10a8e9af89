"""--standalone's embedded Redis when its port is taken between the check and the bind."""

from __future__ import annotations

import socket

import pytest

from elastic_agent.supervision.hosting import standalone


def test_a_port_taken_after_the_check_moves_the_server_to_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    # The race: the check saw the port free, someone bound it before redis-server did.
    monkeypatch.setattr(standalone, "port_is_free", lambda port: True)
    try:
        server = standalone.start_standalone(preferred=taken)
        try:
            assert server.port != taken and server._answers()
        finally:
            server.cleanup()
    finally:
        squatter.close()


def test_the_server_stops_in_a_process_with_a_thousand_descriptors_open():
    """The stop waits for the exit on a pidfd; in a process with more than 1,023 descriptors
    open (a bench's thousands of connections) select() refused it with a ValueError."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.fail(f"this machine allows {hard} descriptors; the test needs 1,200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while len(held) < 1100:
            held.append(socket.socket())
        server = standalone.RedisServer().start()
        proc = server.proc
        server.stop()
        assert proc is not None and proc.returncode is not None
        server.cleanup()
    finally:
        for s in held:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
