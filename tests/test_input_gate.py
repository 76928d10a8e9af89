"""InputGate: background work waits while a key is handled, never longer than its bound."""

from __future__ import annotations

import asyncio
import time

from elastic_console.tui.input_gate import InputGate
from tests.waiting import wait_until_async


def test_an_open_gate_does_not_wait_or_yield() -> None:
    async def main() -> None:
        gate = InputGate()
        other_ran = False

        async def other() -> None:
            nonlocal other_ran
            other_ran = True

        task = asyncio.create_task(other())
        await gate.pause()
        assert not other_ran and gate.is_open and gate.waits == 0  # no loop turn taken
        await task

    asyncio.run(main())


def test_a_closed_gate_holds_pause_until_open() -> None:
    async def main() -> None:
        gate = InputGate(hold_max_s=10)
        gate.close()
        assert not gate.is_open and gate.holds == 1
        waiter = asyncio.create_task(gate.pause())
        await wait_until_async(lambda: gate.waits == 1, 5, "the pause to wait")
        await asyncio.sleep(0.05)  # a while held: it must not return on its own
        assert not waiter.done()  # held
        gate.open()
        await asyncio.wait_for(waiter, 1)
        assert gate.is_open and gate.waits == 1

    asyncio.run(main())


def test_a_key_that_never_settles_holds_for_hold_max_s_only() -> None:
    async def main() -> None:
        gate = InputGate(hold_max_s=0.1)
        gate.close()
        t0 = time.perf_counter()
        await asyncio.wait_for(gate.pause(), 2)  # a gate that held on would hang here
        assert time.perf_counter() - t0 >= 0.08
        assert gate.is_open  # and it stays open: the next pause does not wait
        await gate.pause()
        assert gate.waits == 1

    asyncio.run(main())


def test_the_deadline_opens_the_gate_for_is_open_too() -> None:
    now = [100.0]
    gate = InputGate(hold_max_s=0.1, clock=lambda: now[0])
    gate.close()
    assert not gate.is_open
    now[0] += 0.1
    assert gate.is_open  # readers polling is_open go on without awaiting pause()
