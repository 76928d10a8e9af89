"""A worker for the launcher parity tests (tests/test_launcher_parity.py): it writes what the
launcher gave it to OUT_DIR/<restart>_<rank>.json, then does what its options ask.

    launcher_report.py OUT_DIR [--fail-restarts N] [--exit CODE] [--wait-signal]

--fail-restarts N: the last rank exits with CODE (default 3) while the restart count is below N
(N = -1: always). --wait-signal: wait for SIGTERM, note it in OUT_DIR/<rank>.term, exit 0.
Standard library only, so both launchers start it in milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

SEEN = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
        "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "LAUNCHER_PARENT_SENTINEL")


def option(name: str, default: str | None = None) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main() -> int:
    out = sys.argv[1]
    rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    report = {k: os.environ.get(k) for k in SEEN}
    report |= {"argv": sys.argv, "name": __name__, "cwd": os.getcwd(), "pid": os.getpid()}
    # Written whole under a temporary name, then renamed: a reader never sees half a report.
    tmp = os.path.join(out, f".{restart}_{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.rename(tmp, os.path.join(out, f"{restart}_{rank}.json"))
    print(f"creating report of rank {rank}", flush=True)

    fail_below = int(option("--fail-restarts", "0") or 0)
    world = int(os.environ["WORLD_SIZE"])
    if int(rank) == world - 1 and (fail_below < 0 or int(restart) < fail_below):
        # Fail only once every rank of this attempt has reported: a launcher that stops the
        # group at once would otherwise make the set of reports a race. Files give no event
        # to wait on, hence the poll.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(out, f"{restart}_{r}.json")) for r in range(world)):
            time.sleep(0.02)
        print(f"rank {rank} fails on purpose", file=sys.stderr, flush=True)
        return int(option("--exit", "3") or 3)

    if "--wait-signal" in sys.argv:
        def on_term(signum: int, frame: object) -> None:
            with open(os.path.join(out, f"{rank}.term"), "w") as f:
                f.write(signal.Signals(signum).name)
            os._exit(0)

        signal.signal(signal.SIGTERM, on_term)
        open(os.path.join(out, f"{rank}.ready"), "w").close()
        time.sleep(120)  # the test's signal ends this; the launcher kills it after a hang
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
