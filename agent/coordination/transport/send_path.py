"""A cheaper write path for redis-py's asyncio connections.

redis-py (5 to 8) sends every command under ``asyncio.wait_for(..., socket_timeout)``. On
Python 3.11 that creates a task per command and costs two more turns of the event loop: about
10 us of a command's 55-60 us of client CPU here (``bench/fleet.py`` packs 2,048 agents into
one process and pays it on every command; an agent pays it on every log batch).

:func:`lean` derives a connection class that writes the command to the transport at once and
waits (``drain``, under the socket timeout) only when the transport holds bytes the kernel has
not taken: the case the timeout exists for (a peer that stopped reading). Everything else is
redis-py's: a connection that is not connected, or whose transport is closing, takes redis-py's
own path, and a failed write disconnects and raises what redis-py raises. A connection lost
after a write that the kernel took is found by the read that follows, as it is when the loss
comes a moment later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import redis

_LEAN: dict[type, type] = {}
_timeout = getattr(asyncio, "timeout", None)


class _LeanSend:
    """Mixed in ahead of a redis-py asyncio connection class (see the module)."""

    _writer: Any
    socket_timeout: float | None

    async def send_packed_command(self, command: bytes | str | Iterable[bytes],
                                  check_health: bool = True) -> None:
        writer = self._writer
        transport = writer.transport if writer is not None else None
        if transport is None or transport.is_closing() or not self.is_connected:  # type: ignore[attr-defined]
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
            return
        if check_health:
            await self.check_health()  # type: ignore[attr-defined]
        if isinstance(command, str):
            command = command.encode()
        if isinstance(command, bytes):
            command = [command]
        try:
            writer.writelines(command)
            if transport.get_write_buffer_size():
                if _timeout is None:  # Python 3.10
                    await asyncio.wait_for(writer.drain(), self.socket_timeout)
                else:
                    async with _timeout(self.socket_timeout):
                        await writer.drain()
        except asyncio.TimeoutError:
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise redis.TimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise redis.ConnectionError(f"Error while writing to socket: {exc}") from exc
        except BaseException:
            # Part of the command may be written: the connection cannot be used again.
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise


def lean(cls: type) -> type:
    """``cls`` with the write path above (one class per ``cls``; ``cls`` if it already is)."""
    if issubclass(cls, _LeanSend):
        return cls
    derived = _LEAN.get(cls)
    if derived is None:
        derived = _LEAN[cls] = type(f"Lean{cls.__name__}", (_LeanSend, cls), {})
    return derived


def use_lean_connections(pool: Any) -> None:
    """Make the connections ``pool`` creates from now on lean (plain, SSL, Unix, Sentinel)."""
    pool.connection_class = lean(pool.connection_class)
