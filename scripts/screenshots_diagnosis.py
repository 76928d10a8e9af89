"""SVG screenshots of issue 22's views, each of a real run (a real redis-server, real agents,
real gloo workers, the real ConsoleApp driven by Pilot):

    screenshots/collectives.svg  `d` on examples/collective_hang.py (4 ranks, 2 agents): one
                                 Python stack group, the collectives naming rank 1 above it
    screenshots/straggler.svg    examples/straggler.py (4 ranks, 2 agents, rank 3 at 1.6x,
                                 --straggler-interval 5): rank 3 `slow`, the timeline entry

    python scripts/screenshots_diagnosis.py
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from screenshots import OUT, ROOT, SIZE, until

from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.supervision.hosting.standalone import RedisServer
from elastic_console.tui.app import ConsoleApp


def agents(url: str, job: str, tmp: str, script: str, env: dict[str, str],
           flags: list[str]) -> list[subprocess.Popen]:
    return [subprocess.Popen(
        [sys.executable, "-m", "elastic_agent.supervision.cli", "--redis", url, "--job-id", job,
         "--nnodes", "2", "--nproc-per-node", "2", "--log-dir", os.path.join(tmp, job), *flags,
         str(ROOT / "examples" / script)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, **env}) for _ in range(2)]


async def shoot_collectives(url: str, job: str) -> None:
    from elastic_console.tui.widgets.stacks import StacksScreen

    app = ConsoleApp(job, endpoint=parse_endpoint(url), cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        view = app.view
        await until(pilot, lambda: len(view.ranks) == 4 and view.lines_total >= 4, 180,
                    "4 ranks at the last all_reduce")
        await pilot.pause(1.0)
        await pilot.press("d")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen), 10, "the stacks")
        screen = app.screen
        await until(pilot, lambda: screen.result is not None and screen.collective_lines, 60,
                    "the stacks and the collectives")
        await pilot.press("enter")
        await pilot.pause(0.5)
        app.save_screenshot("collectives.svg", str(OUT))


async def shoot_straggler(url: str, job: str) -> None:
    app = ConsoleApp(job, endpoint=parse_endpoint(url), cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: any(e.kind == "straggler" for e in app.timeline.entries),
                    120, "the straggler event")
        await pilot.pause(1.5)
        app.save_screenshot("straggler.svg", str(OUT))


def run(url: str, tmp: str, job: str, script: str, env: dict[str, str], flags: list[str],
        shoot) -> None:  # type: ignore[no-untyped-def]
    procs = agents(url, job, tmp, script, env, flags)
    try:
        asyncio.run(shoot(url, job))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)


def main() -> int:
    OUT.mkdir(exist_ok=True)
    stamp = int(time.time()) % 100000
    with RedisServer() as server, tempfile.TemporaryDirectory() as tmp:
        run(server.url, tmp, f"chang-{stamp}", "collective_hang.py", {"ODD_RANK": "1"}, [],
            shoot_collectives)
        run(server.url, tmp, f"slow-{stamp}", "straggler.py",
            {"SLOW_RANK": "3", "SECONDS": "300"}, ["--straggler-interval", "5"],
            shoot_straggler)
    for name in ("collectives", "straggler"):
        print(OUT / f"{name}.svg")
    return 0


if __name__ == "__main__":
    sys.exit(main())
