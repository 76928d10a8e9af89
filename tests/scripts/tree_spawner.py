"""A worker that leaves a process tree behind it, the kinds a job leaves in real life.

Each rank starts:
  - ``child``: ``sleep 777`` in the worker's own session and group (a plain subprocess);
  - ``session``: ``sleep 778`` in a session of its own (``start_new_session``, as ``setsid``);
  - ``daemon``: a classic double-forked daemon: new session, stdio on /dev/null, an empty
    environment (nothing in it names the job), SIGTERM ignored, ``sleep 779``.
It writes their pids to ``--pid-dir/<RANK>.json`` (atomically), prints "ready" and sleeps.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--pid-dir", required=True)
args = p.parse_args()
rank = os.environ["RANK"]
sleep = shutil.which("sleep") or "/bin/sleep"
sh = shutil.which("sh") or "/bin/sh"

child = subprocess.Popen([sleep, "777"])
session = subprocess.Popen([sleep, "778"], start_new_session=True)

pid_r, pid_w = os.pipe()
middle = os.fork()
if middle == 0:
    os.close(pid_r)
    os.setsid()
    daemon = os.fork()
    if daemon == 0:
        os.close(pid_w)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        # `trap "" TERM` ignores SIGTERM, and an ignored signal stays ignored across exec.
        os.execve(sh, [sh, "-c", f'trap "" TERM; exec {sleep} 779'], {})
    os.write(pid_w, str(daemon).encode())
    os._exit(0)
os.close(pid_w)
with os.fdopen(pid_r, "rb") as f:
    daemon_pid = int(f.read())
os.waitpid(middle, 0)

pids = {"worker": os.getpid(), "child": child.pid, "session": session.pid, "daemon": daemon_pid}
tmp = os.path.join(args.pid_dir, f".{rank}.json.tmp")
with open(tmp, "w") as f:
    json.dump(pids, f)
os.rename(tmp, os.path.join(args.pid_dir, f"{rank}.json"))
print(f"ready rank={rank} {json.dumps(pids)}", flush=True)
sys.stdout.flush()
while True:
    time.sleep(60)
