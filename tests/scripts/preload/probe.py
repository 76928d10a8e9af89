"""Reports what a worker sees (for tests/test_preload.py), then ends as argv[1] says:
an exit code, ``raise`` (an uncaught exception) or ``record`` (an error file, as @record)."""
import json
import os
import signal
import sys
import threading
import time

report = {
    "name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0],
    "cwd": os.getcwd(), "env": dict(os.environ), "flags": repr(sys.flags),
    "signals": {s: str(signal.getsignal(getattr(signal, s))) for s in (
        "SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGCHLD", "SIGPIPE", "SIGXFSZ", "SIGUSR1")},
    "own_group": os.getpgrp() == os.getpid(), "own_session": os.getsid(0) == os.getpid(),
    "threads": threading.active_count(), "stdout": type(sys.stdout.buffer).__name__,
    "spec": repr(__spec__), "package": repr(__package__), "loader": type(__loader__).__name__,
    "main_is_me": sys.modules["__main__"].__dict__ is globals(),
    "stdin": os.readlink("/proc/self/fd/0"), "fds": sorted(os.listdir("/proc/self/fd")),
    "c_env_rank": os.getenv("RANK"),
}
#: Not compared: proves which path started the worker (a preloaded module is already there).
print(json.dumps({"forked": "preload_marker" in sys.modules}), file=sys.stderr)
print(json.dumps(report, sort_keys=True))
how = sys.argv[1] if len(sys.argv) > 1 else "0"
if how == "raise":
    raise ValueError("boom")
if how == "record":
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
        json.dump({"message": {"message": "ValueError: recorded", "extraInfo": {
            "py_callstack": "", "timestamp": str(int(time.time()))}}}, f)
    sys.exit(1)
if how == "sleep":
    time.sleep(60)
sys.exit(int(how))
