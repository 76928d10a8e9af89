"""A worker stuck in a C call that holds the GIL (libc ``sleep`` through ``ctypes.PyDLL``,
which keeps the GIL, as a wedged extension would); a second thread can never run meanwhile.
Prints "stuck" first so a test knows it is there."""

import ctypes
import sys
import threading


def never_runs() -> None:
    threading.Event().wait(600)


def held_in_c() -> None:
    ctypes.PyDLL(None).sleep(int(sys.argv[1]) if len(sys.argv) > 1 else 60)


threading.Thread(target=never_runs, daemon=True).start()
print("stuck", flush=True)
held_in_c()
