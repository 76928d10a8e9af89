"""--standalone's embedded Redis when its port is taken between the check and the bind."""

from __future__ import annotations

import socket

import pytest

from elastic_agent.supervision import standalone


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
