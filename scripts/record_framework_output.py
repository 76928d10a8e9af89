"""Record what real training frameworks print, as the agent reads it: the fixtures of the
metric parser's tests (tests/fixtures/frameworks/).

Each case runs one worker of an example (examples/) with the environment a launcher gives
rank 0 of a one-rank job, its stdout and stderr on pipes (or, with ``tty``, each on a pty as
under a terminal), and writes every chunk read, in order, with its stream and time::

    {"t": 0.123, "s": "out"|"err", "d": "<the bytes, latin-1 decoded>"}

plus the framework's own record of its steps and losses (the example's ``--history-out``) as
the case's ``.history.json``: the truth the tests hold the parser to. Regenerate with
(it needs transformers and lightning installed)::

    python scripts/record_framework_output.py [CASE ...]
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import selectors
import struct
import subprocess
import sys
import tempfile
import termios
import time
import tty
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "frameworks"

#: name -> (argv after the interpreter, worker streams on ptys)
CASES: dict[str, tuple[list[str], bool]] = {
    "hf_trainer": (["examples/hf_trainer.py", "--steps", "20", "--logging-steps", "5"], False),
    "hf_trainer_tty": (["examples/hf_trainer.py", "--steps", "20", "--logging-steps", "5"], True),
    "lightning_tqdm": (["examples/lightning_train.py", "--epochs", "2", "--batches", "10",
                        "--bar", "tqdm"], False),
    "lightning_rich_tty": (["examples/lightning_train.py", "--epochs", "2", "--batches", "10",
                            "--bar", "rich", "--step-sleep", "0.05"], True),
    "ddp_train": (["examples/train.py", "--steps", "12"], False),
}


def _env(port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
               GROUP_WORLD_SIZE="1", ROLE_RANK="0", ROLE_WORLD_SIZE="1", ROLE_NAME="default",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="fixture",
               TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
               PYTHONUNBUFFERED="1", COLUMNS="100", LINES="30")
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record(name: str, argv: list[str], on_tty: bool) -> None:
    history = Path(tempfile.mkdtemp()) / "history.json"
    extra = [] if argv[0] == "examples/train.py" else ["--history-out", str(history)]
    fds: dict[int, str] = {}
    if on_tty:
        out_master, out_slave = pty.openpty()
        err_master, err_slave = pty.openpty()
        for fd in (out_slave, err_slave):
            tty.setraw(fd)  # what the agent's ptys do: bytes pass unchanged
            # and a window size: tqdm and Rich size their bars from it (0 columns: no bar)
            fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        proc = subprocess.Popen([sys.executable, "-u", *argv, *extra], cwd=ROOT,
                                env=_env(_free_port()), stdout=out_slave, stderr=err_slave,
                                stdin=subprocess.DEVNULL)
        os.close(out_slave)
        os.close(err_slave)
        fds = {out_master: "out", err_master: "err"}
    else:
        proc = subprocess.Popen([sys.executable, "-u", *argv, *extra], cwd=ROOT,
                                env=_env(_free_port()), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        assert proc.stdout is not None and proc.stderr is not None
        fds = {proc.stdout.fileno(): "out", proc.stderr.fileno(): "err"}
    sel = selectors.DefaultSelector()
    for fd in fds:
        sel.register(fd, selectors.EVENT_READ)
    start = time.monotonic()
    chunks: list[dict[str, object]] = []
    open_fds = set(fds)
    while open_fds:
        for key, _ in sel.select():
            try:
                data = os.read(key.fd, 65536)
            except OSError:  # a pty's master reads EIO once the worker closed its end
                data = b""
            if not data:
                sel.unregister(key.fd)
                open_fds.discard(key.fd)
                continue
            chunks.append({"t": round(time.monotonic() - start, 4), "s": fds[key.fd],
                           "d": data.decode("latin-1")})
    code = proc.wait()
    if code != 0:
        raise SystemExit(f"{name}: the worker exited {code}")
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / f"{name}.jsonl", "w") as f:
        for c in chunks:
            f.write(json.dumps(c) + "\n")
    if history.exists():
        (OUT / f"{name}.history.json").write_text(history.read_text())
    print(f"{name}: {len(chunks)} chunks")


def main(argv: list[str]) -> int:
    for name in argv or list(CASES):
        args, on_tty = CASES[name]
        record(name, args, on_tty)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
